"""The rank's OTLP exporters (otlp_exporters): retries by the OTLP rules within the deadline, the
delay a receiver asks for honoured, and a failing endpoint told in one log line."""
from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler.instrumentation.exporting import span_exporter
from otel_straggler.instrumentation.otlp_exporters import EXPORT_METHOD

from test_http_transport import Http11Receiver, serving


class ScriptedTraceService:
    """TraceService/Export answering with the scripted errors first, then OK."""

    def __init__(self, errors: list) -> None:
        self.errors = list(errors)  # (StatusCode, retry delay in s or None)
        self.requests: list[bytes] = []
        self.times: list[float] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
            "Export": grpc.unary_unary_rpc_method_handler(self.export, request_deserializer=None,
                                                          response_serializer=None)})
        self.server.add_generic_rpc_handlers((handler,))
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def export(self, request: bytes, context) -> bytes:
        self.requests.append(request)
        self.times.append(time.monotonic())
        if self.errors:
            code, delay_s = self.errors.pop(0)
            if delay_s is not None:
                info = RetryInfo(retry_delay=Duration(seconds=int(delay_s), nanos=int(delay_s % 1 * 1e9)))
                context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
            context.abort(code, "scripted")
        return trace_service_pb2.ExportTraceServiceResponse().SerializeToString()


@pytest.fixture
def scripted():
    services = []

    def make(errors):
        services.append(ScriptedTraceService(errors))
        return services[-1]

    yield make
    for service in services:
        service.server.stop(0)


def spans(exporter, count: int = 2) -> list:
    tracer = TracerProvider().get_tracer("test")
    items = []
    for index in range(count):
        span = tracer.start_span(f"span-{index}")
        span.end()
        items.append(exporter.prewrite(span))
    return items


def names(request: bytes) -> list[str]:
    parsed = trace_service_pb2.ExportTraceServiceRequest.FromString(request)
    return [span.name for resource in parsed.resource_spans for scope in resource.scope_spans for span in scope.spans]


def test_grpc_retries_unavailable_and_a_throttle_with_retry_info(scripted):
    service = scripted([(grpc.StatusCode.UNAVAILABLE, None), (grpc.StatusCode.RESOURCE_EXHAUSTED, 0.05)])
    exporter = span_exporter(service.endpoint, "grpc")
    try:
        assert exporter.export(spans(exporter)) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert len(service.requests) == 3 and names(service.requests[-1]) == ["span-0", "span-1"]
    assert 0.7 < service.times[1] - service.times[0] < 1.5  # the first backoff: 1 s, +-20%
    assert 0.04 < service.times[2] - service.times[1] < 0.5  # as RetryInfo asked


def test_grpc_does_not_retry_a_throttle_without_retry_info_nor_a_rejection(scripted):
    service = scripted([(grpc.StatusCode.RESOURCE_EXHAUSTED, None), (grpc.StatusCode.INVALID_ARGUMENT, None)])
    exporter = span_exporter(service.endpoint, "grpc")
    try:
        assert exporter.export(spans(exporter)) == SpanExportResult.FAILURE
        assert exporter.export(spans(exporter)) == SpanExportResult.FAILURE
        assert exporter.export(spans(exporter)) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert len(service.requests) == 3


def test_http_retries_503_after_the_retry_after_it_gives():
    with serving(Http11Receiver()) as receiver:
        receiver.responses = [(503, [("Retry-After", "1")]), (429, [])]
        exporter = span_exporter(receiver.endpoint, "http/protobuf")
        try:
            started = time.monotonic()
            assert exporter.export(spans(exporter)) == SpanExportResult.SUCCESS
            # 1 s as told, then the first backoff (0.8-1.2 s) after the 429 without Retry-After
            assert 1.7 < time.monotonic() - started < 3.5
        finally:
            exporter.shutdown()
        assert receiver.span_names() == ["span-0", "span-1"] * 3  # the same request each time


def test_a_retry_the_deadline_leaves_no_room_for_is_not_made():
    with serving(Http11Receiver()) as receiver:
        receiver.responses = [(503, [("Retry-After", "30")])]
        exporter = span_exporter(receiver.endpoint, "http/protobuf")
        try:
            started = time.monotonic()
            assert exporter.export_within(spans(exporter), time.monotonic() + 2.0) == SpanExportResult.FAILURE
            assert time.monotonic() - started < 0.5
        finally:
            exporter.shutdown()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_unreachable_endpoint_fails_by_the_deadline_with_one_log_line(unreachable_endpoint, protocol, caplog):
    endpoint = unreachable_endpoint if protocol == "grpc" else f"http://{unreachable_endpoint}"
    exporter = span_exporter(endpoint, protocol)
    caplog.set_level(logging.DEBUG, logger="otel_straggler")
    try:
        for _ in range(3):
            started = time.monotonic()
            assert exporter.export_within(spans(exporter), time.monotonic() + 0.6) == SpanExportResult.FAILURE
            assert time.monotonic() - started < 1.2
    finally:
        exporter.shutdown()
    records = [record for record in caplog.records if record.name.startswith("otel_straggler")]
    assert len(records) == 1  # the first failure of the run; the rest are counted
    message = records[0].getMessage()
    assert "\n" not in message and records[0].exc_info is None
    assert unreachable_endpoint in message and "failed:" in message and "export_failed" in message


def test_the_grpc_request_is_sent_on_the_export_method(scripted):
    assert EXPORT_METHOD == "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    service = scripted([])
    exporter = span_exporter(service.endpoint, "grpc")
    try:
        assert exporter.export(spans(exporter, 3)) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert names(service.requests[0]) == ["span-0", "span-1", "span-2"]


@pytest.mark.parametrize("protocol, endpoint, variable", [
    ("http/protobuf", None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://collector/v1/traces"}),
    ("http/protobuf", "http://collector:port", {}),
    ("grpc", None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector:4317"}),
    ("grpc", "http://", {}),
])
def test_a_malformed_endpoint_fails_in_one_line_naming_where_it_came_from(protocol, endpoint, variable):
    from otel_straggler.settings import ConfigError

    with pytest.raises(ConfigError) as raised:
        span_exporter(endpoint, protocol, variable)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(next(iter(variable)) if variable else "endpoint")


def test_an_export_is_sent_with_instrumentation_suppressed(scripted):
    """Under opentelemetry-instrument a grpc or requests instrumentor would make each of our sends a
    span, exported in turn: the send runs under the instrumentation package's public switch."""
    from opentelemetry.instrumentation.utils import is_instrumentation_enabled

    service = scripted([])
    exporter = span_exporter(service.endpoint, "grpc")
    seen = []
    send = exporter._send
    exporter._send = lambda body, timeout_s: (seen.append(is_instrumentation_enabled()), send(body, timeout_s))[1]
    try:
        assert exporter.export(spans(exporter)) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert seen == [False] and is_instrumentation_enabled()
