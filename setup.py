"""Only the optional C extension lives here; everything else is in pyproject.toml.

otel_straggler/detector/_otlp_scan.c is the detector's fast path for OTLP/protobuf. It is
optional: without a C compiler the build skips it and the detector decodes in Python.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("otel_straggler.detector._otlp_scan", ["otel_straggler/detector/_otlp_scan.c"],
                             extra_compile_args=["-O2"], optional=True)])
