"""The package uses no private name of an OpenTelemetry package: such a name (`opentelemetry._logs`,
`opentelemetry.sdk._logs`, an exporter's `_log_exporter` module, a `_` attribute) may change or go
in any release, however old or new within the versions pyproject.toml allows.

Every .py file of the package (otel_straggler/, and processors/, installed as
otel_straggler.processors) is parsed with `ast`; a name is private when it starts with one
underscore and is not a dunder. It fails on:
  - `import opentelemetry.x._y` (any private part of the module path, with or without `as`);
  - `from opentelemetry.x._y import z` and `from opentelemetry.x import _y`;
  - `importlib.import_module("opentelemetry.x._y")` / `__import__(...)` with such a literal path;
  - a private attribute reached from a name an opentelemetry import bound, anywhere in the file:
    `opentelemetry._logs.X`, `trace._TRACER_PROVIDER`, `TracerProvider._x`, `getattr(sdk, "_x")`.
It does not follow values: a private attribute of an object made from such a name
(`provider = TracerProvider(); provider._x`) or passed around is not seen, nor a path built at
run time.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("otel_straggler", "processors")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def otel_module(path: str) -> bool:
    return path == "opentelemetry" or path.startswith("opentelemetry.")


def private_part(path: str) -> str | None:
    return next((part for part in path.split(".") if private(part)), None)


def offences_in(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    found: list[tuple[int, str]] = []
    bound: set[str] = set()  # names an opentelemetry import binds in this file

    def note(node: ast.AST, what: str) -> None:
        found.append((node.lineno, f"{filename}:{node.lineno}: {what}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if otel_module(alias.name):
                    bound.add(alias.asname or alias.name.split(".")[0])
                    if private_part(alias.name):
                        note(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and otel_module(node.module):
            if private_part(node.module):
                note(node, f"from {node.module} import ...")
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if private(alias.name):
                    note(node, f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in ("import_module", "__import__") and otel_module(node.args[0].value) \
                    and private_part(node.args[0].value):
                note(node, f"{called}({node.args[0].value!r})")

    def root(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and root(node.value) in bound:
            note(node, f"{ast.unparse(node)}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr") \
                and len(node.args) >= 2 and root(node.args[0]) in bound and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and private(node.args[1].value):
            note(node, f"{ast.unparse(node)}")
    return [what for _, what in sorted(found, key=lambda item: item[0])]


def offences(repo: Path) -> list[str]:
    found = []
    for directory in PACKAGE_DIRS:
        for path in sorted((repo / directory).rglob("*.py")):
            found += offences_in(path.read_text(encoding="utf-8"), str(path.relative_to(repo)))
    return found


def test_the_package_imports_no_private_opentelemetry_name():
    checked = [path for directory in PACKAGE_DIRS for path in (REPO / directory).rglob("*.py")]
    assert len(checked) > 50  # the package was found
    assert offences(REPO) == []


def test_the_check_catches_each_form():
    source = '''
import opentelemetry._logs
import opentelemetry.sdk._logs.export as export
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.sdk import _logs
from opentelemetry import trace, context as ctx
from opentelemetry.sdk.trace import TracerProvider
import opentelemetry.sdk.resources
import importlib

def later():
    from opentelemetry.sdk.metrics import export as metric_export
    return metric_export._private_reader

trace._TRACER_PROVIDER
ctx._RUNTIME_CONTEXT.attach
TracerProvider._sampler
opentelemetry.sdk.resources._DEFAULT_RESOURCE
getattr(trace, "_PROXY_TRACER_PROVIDER")
importlib.import_module("opentelemetry.exporter.otlp.proto.http._log_exporter")
'''
    found = [line.split(": ", 1)[1] for line in offences_in(source, "example.py")]
    assert found == [
        "import opentelemetry._logs",
        "import opentelemetry.sdk._logs.export",
        "from opentelemetry.exporter.otlp.proto.grpc._log_exporter import ...",
        "from opentelemetry.sdk import _logs",
        "metric_export._private_reader",
        "trace._TRACER_PROVIDER",
        "ctx._RUNTIME_CONTEXT",
        "TracerProvider._sampler",
        "opentelemetry.sdk.resources._DEFAULT_RESOURCE",
        "getattr(trace, '_PROXY_TRACER_PROVIDER')",
        "import_module('opentelemetry.exporter.otlp.proto.http._log_exporter')",
    ]


def test_public_names_and_other_packages_private_names_pass():
    source = '''
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.proto.logs.v1 import logs_pb2
import grpc
from . import _local
from otel_straggler.detector import _ingest
SpanExporter.__init__
grpc._channel
logs_pb2.LogRecord.DESCRIPTOR
def method(self):
    return self._sender
'''
    assert offences_in(source, "example.py") == []


def sdk_private_fields() -> set[str]:
    """The private fields of the SDK objects the rank side handles (a span, a provider, a
    resource), from live instances of the installed SDK."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.trace import SpanContext

    objects = (ReadableSpan("s", SpanContext(1, 2, False)), TracerProvider(), Resource.create({}))
    return {name for item in objects for name in vars(item) if private(name)}


def field_reads_in(source: str, filename: str, fields: set[str]) -> list[str]:
    """`x._field` where `_field` is a private field of an SDK object and `x` is not the class's own
    `self`/`cls`: the values the import check above does not follow."""
    return [f"{filename}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.Attribute) and node.attr in fields
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_the_package_reads_no_private_field_of_an_sdk_object():
    fields = sdk_private_fields()
    assert {"_attributes", "_context", "_active_span_processor"} <= fields  # the SDK's objects were read
    found = []
    for directory in PACKAGE_DIRS:
        for path in sorted((REPO / directory).rglob("*.py")):
            found += field_reads_in(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)), fields)
    assert found == []


def test_the_field_check_catches_a_span_read_through_a_variable():
    source = "def write(span):\n    return span._attributes, span.attributes, self_like._context\n"
    found = [line.split(": ", 1)[1] for line in field_reads_in(source, "example.py", {"_attributes", "_context"})]
    assert found == ["span._attributes", "self_like._context"]
