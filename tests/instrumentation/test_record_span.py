"""RecordSpan, the span builder's lazily built ReadableSpan: what any reader of it sees (its public
properties, to_json, the SDK's own BatchSpanProcessor and OTLP exporters sending it to a real
receiver) is what it sees of the same span made by ReadableSpan(...); our encoder writes it as it
writes that span; and the rank's export (encoding a request, sending it) lets other threads run."""
from __future__ import annotations

import socket
import sys
import threading
import time

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_straggler.instrumentation import span_encoding
from otel_straggler.instrumentation.otlp_exporters import GrpcSpanExporter, HttpSpanExporter
from otel_straggler.instrumentation.record_span import SAMPLED, RecordSpan
from otel_straggler.instrumentation.span_builder import ProcessorSpans
from otel_straggler.instrumentation.span_encoding import SpanEncoder

RESOURCE = Resource.create({"service.name": "record-span", "training.job.id": "j", "training.rank": 3})
SCOPE = InstrumentationScope("otel_straggler")
TRACE_ID, SPAN_ID, PARENT_ID = 0x1234_5678_9ABC_DEF0_0FED_CBA9_8765_4321, 0xA1B2_C3D4_E5F6_0718, 0x0102_0304_0506_0708
STAGE = {"training.stage": "forward-compute", "training.stage.group": "forward", "training.seq": 17,
         "training.stage.collective": False, "training.step": 3, "training.stage.device_duration_ms": 12.5}


class Kept(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list = []

    def on_end(self, span) -> None:
        self.spans.append(span)


def both(name: str, parent_span_id, attributes, start_ns: int = 1_700_000_000_000_000_000,
         end_ns: int = 1_700_000_000_004_000_000, span_id: int = SPAN_ID) -> tuple[RecordSpan, ReadableSpan]:
    """The same span as a RecordSpan and as ReadableSpan(...) makes it."""
    record = RecordSpan(name, TRACE_ID, span_id, parent_span_id, attributes, start_ns, end_ns, RESOURCE, SCOPE)
    plain = ReadableSpan(
        name=name, context=trace_api.SpanContext(TRACE_ID, span_id, is_remote=False, trace_flags=SAMPLED),
        parent=None if parent_span_id is None else trace_api.SpanContext(TRACE_ID, parent_span_id, is_remote=False,
                                                                          trace_flags=SAMPLED),
        resource=RESOURCE, attributes=attributes, start_time=start_ns, end_time=end_ns, instrumentation_scope=SCOPE)
    return record, plain


CASES = {
    "stage": ("forward-compute", PARENT_ID, dict(STAGE)),
    "root": ("train.step", None, {"training.step": 3, "training.workload.samples": 256}),
    "no attributes": ("train.heartbeat", None, {}),
    "bounded": ("odd", PARENT_ID, BoundedAttributes(maxlen=2, attributes={"a": 1, "b": "x", "c": True},
                                                    immutable=False)),
    "array value": ("train.heartbeat", None, {"training.heartbeat.open_stages": ("forward", "backward")}),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_public_property_is_what_a_readable_span_of_the_same_span_gives(case: str) -> None:
    record, plain = both(*CASES[case])
    assert isinstance(record, ReadableSpan)
    for name in ("name", "context", "parent", "kind", "start_time", "end_time", "resource", "instrumentation_scope",
                 "dropped_attributes", "dropped_events", "dropped_links", "events", "links"):
        assert getattr(record, name) == getattr(plain, name), name
    assert record.get_span_context() == plain.get_span_context()
    assert dict(record.attributes) == dict(plain.attributes)
    assert (record.status.status_code, record.status.description) == (plain.status.status_code,
                                                                       plain.status.description)
    assert record.to_json() == plain.to_json()  # ReadableSpan's own method, reading its own fields
    assert record.to_json() == plain.to_json()  # and again, once they are there


def test_attributes_read_through_the_property_cannot_be_changed() -> None:
    record, _ = both(*CASES["stage"])
    with pytest.raises(TypeError):
        record.attributes["training.step"] = 4  # type: ignore[index]


@pytest.mark.parametrize("writer", ["c", "python"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_our_encoder_writes_a_record_span_as_the_sdks_encoder_writes_the_span(case: str, writer: str,
                                                                            monkeypatch) -> None:
    if writer == "python":
        monkeypatch.setattr(span_encoding, "_write_span", None)
        monkeypatch.setattr(span_encoding, "_join", b"".join)
    elif not span_encoding.writer_built():
        pytest.skip("the C writer is not built here")
    record, plain = both(*CASES[case])
    encoder = SpanEncoder()
    ours = encoder.encode([encoder.prewrite(record), record])
    assert ours == SpanEncoder().encode([plain, plain])
    decoded = ExportTraceServiceRequest()
    decoded.ParseFromString(ours)
    assert decoded == encode_spans([plain, plain])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_sdks_own_batch_processor_and_otlp_exporter_send_the_span_builders_spans_as_they_are(
        protocol: str, request) -> None:
    """A user's processor on the rank's chain: the SDK's BatchSpanProcessor with its OTLPSpanExporter,
    to a real receiver, which decodes what it got."""
    receiver = request.getfixturevalue(f"{protocol}_receiver")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")
    processor = BatchSpanProcessor(exporter)
    kept = Kept()
    for chain in (processor, kept):
        builder_spans = ProcessorSpans(chain, RESOURCE, "otel_straggler")
        builder_spans.emit("forward-compute", TRACE_ID, SPAN_ID, PARENT_ID, dict(STAGE), 10, 20, None)
        builder_spans.emit("train.step", TRACE_ID, PARENT_ID, None, {"training.step": 3}, 5, 25, None)
    assert all(type(span) is RecordSpan for span in kept.spans)
    assert processor.force_flush(10_000)
    processor.shutdown()
    received = [span.span for span in receiver.spans()]
    plain = [both(span.name, span.parent and span.parent.span_id, dict(span.attributes), span.start_time,
                  span.end_time, span.context.span_id)[1] for span in kept.spans]
    expected = list(encode_spans(plain).resource_spans[0].scope_spans[0].spans)
    assert received == expected
    assert received[0].parent_span_id == PARENT_ID.to_bytes(8, "big") and not received[1].parent_span_id
    assert {item.key for item in received[0].attributes} == set(STAGE)


def test_the_c_join_is_bytes_join() -> None:
    if not span_encoding.writer_built():
        pytest.skip("the C writer is not built here")
    from otel_straggler.instrumentation import _otlp_write

    for parts in ([], [b""], [b"a", b"", b"bc"], [bytes([n % 251]) * n for n in range(0, 3000, 7)]):
        assert _otlp_write.join(list(parts)) == b"".join(parts)
    with pytest.raises(TypeError):
        _otlp_write.join([b"a", "b"])
    with pytest.raises(TypeError):
        _otlp_write.join((b"a",))


def another_thread_ran_during(call) -> bool:
    """Whether a thread waiting for the GIL got it while `call` ran in this one. The switch interval
    is set longer than the call, so this thread gives the GIL up within it only where `call`
    releases it; otherwise the other thread runs once this one waits for it, after the call."""
    ready, go, ran_at = threading.Event(), threading.Event(), []

    def waiter() -> None:
        ready.set()
        go.wait()
        ran_at.append(time.perf_counter())

    previous = sys.getswitchinterval()
    other = threading.Thread(target=waiter, daemon=True)
    other.start()
    ready.wait()
    sys.setswitchinterval(5.0)
    try:
        go.set()  # the waiter wakes, and waits for the GIL
        call()
        ended_at = time.perf_counter()
    finally:
        sys.setswitchinterval(previous)
        other.join()
    return ran_at[0] < ended_at


def test_joining_a_large_request_lets_other_threads_run() -> None:
    if not span_encoding.writer_built():
        pytest.skip("the C writer is not built here")
    from otel_straggler.instrumentation import _otlp_write

    parts = [bytes(1_000_000)] * 200  # 200 MB: tens of ms of copying
    assert another_thread_ran_during(lambda: _otlp_write.join(parts))
    assert not another_thread_ran_during(lambda: bytes(200_000_000))  # the measure: a call that holds the GIL


@pytest.mark.parametrize("exporter_type", [GrpcSpanExporter, HttpSpanExporter], ids=lambda kind: kind.__name__)
def test_sending_lets_other_threads_run(exporter_type) -> None:
    """An export waiting for a receiver that never answers waits without the GIL."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel's backlog) and never answers
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    exporter = exporter_type(endpoint if exporter_type is GrpcSpanExporter else f"{endpoint}/v1/traces")
    try:
        # one try of 0.4 s: the backoff before a second (>= 0.8 s) would pass the deadline
        sent = []
        assert another_thread_ran_during(lambda: sent.append(exporter.send(bytes(1000), 1, time.monotonic() + 0.4)))
        assert sent == [False]
    finally:
        exporter.shutdown()
        silent.close()
