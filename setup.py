"""Only the optional C extensions live here; everything else is in pyproject.toml.

otel_straggler/detector/_otlp_scan.c is the detector's fast path for reading OTLP/protobuf,
otel_straggler/instrumentation/_otlp_write.c the rank's for writing it, and
otel_straggler/instrumentation/_hot_path.c the training thread's stage()/step(). All are
optional: without a C compiler the build skips them and the same work is done in Python.
"""
from setuptools import Extension, setup

RECORD_HEADER = "otel_straggler/detector/observation_record.h"  # the record both detector extensions share

setup(ext_modules=[
    Extension("otel_straggler.detector._otlp_scan", ["otel_straggler/detector/_otlp_scan.c"],
              depends=[RECORD_HEADER], extra_compile_args=["-O2"], optional=True),
    Extension("otel_straggler.detector._ingest", ["otel_straggler/detector/_ingest.c"],
              depends=[RECORD_HEADER], extra_compile_args=["-O2"], optional=True),
    Extension("otel_straggler.instrumentation._otlp_write", ["otel_straggler/instrumentation/_otlp_write.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("otel_straggler.instrumentation._hot_path", ["otel_straggler/instrumentation/_hot_path.c"],
              extra_compile_args=["-O2"], optional=True),
])
