"""The rank side's OTLP encoder (span_encoding.SpanEncoder) writes the same request as the OTel
SDK's encoder for any batch of spans: same resources, scopes and spans, every field and
attribute alike, whether the spans come as ReadableSpans or prewritten while queued."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace as trace_api
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TraceState

from otel_straggler.instrumentation import span_encoding
from otel_straggler.instrumentation.span_encoding import SpanEncoder

if not span_encoding.writer_built() and os.environ.get("CI") == "true":  # CI builds the extension
    pytest.fail("otel_straggler.instrumentation._otlp_write is not built", pytrace=False)
needs_writer = pytest.mark.skipif(not span_encoding.writer_built(),
                                  reason="the optional C extension is not built here (no C compiler?)")

# The encoder groups spans by resource and scope object, the SDK by their values: the pool
# holds distinct values, as a rank's own provider does (one resource, one scope).
RESOURCES = [Resource.create({"training.job.id": "job", "training.rank": rank, "service.name": "trainer"})
             for rank in range(2)] + [Resource({"k": "v"}, schema_url="https://opentelemetry.io/schemas/1.21.0")]
SCOPES = [InstrumentationScope("otel_straggler"), InstrumentationScope("user", "1.2", "https://example.com/schema"),
          None]

ids = st.integers(min_value=1, max_value=(1 << 64) - 1)
scalars = st.one_of(
    st.text(max_size=12), st.booleans(), st.floats(allow_nan=False),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.integers(min_value=1 << 63, max_value=1 << 70),  # beyond int64: the SDK drops the attribute
)
# arrays as the SDK keeps them (tuples), as a heartbeat's open stages and their start times, and as
# lists (a ReadableSpan made directly may hold one)
arrays = st.one_of(st.lists(st.integers(min_value=0, max_value=9), max_size=3), st.lists(st.text(max_size=6), max_size=3),
                   st.lists(st.integers(min_value=1, max_value=(1 << 63) - 1), max_size=3), st.lists(scalars, max_size=3))
attribute_values = st.one_of(scalars, arrays.map(tuple), arrays)
attributes = st.dictionaries(st.sampled_from(["training.stage", "training.step", "training.seq", "a", "b", "é"]),
                             attribute_values, max_size=6)
times = st.one_of(st.none(), st.integers(min_value=1, max_value=(1 << 63) - 1))


@st.composite
def spans(draw) -> ReadableSpan:
    trace_id = draw(st.integers(min_value=1, max_value=(1 << 128) - 1))
    trace_state = TraceState([("vendor", "x")]) if draw(st.booleans()) else None
    parent = None
    if draw(st.booleans()):
        parent = trace_api.SpanContext(trace_id, draw(ids), is_remote=draw(st.booleans()))
    return ReadableSpan(
        name=draw(st.text(max_size=20)),
        context=trace_api.SpanContext(trace_id, draw(ids), is_remote=False,
                                      trace_flags=trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED),
                                      trace_state=trace_state),
        parent=parent,
        resource=draw(st.sampled_from(RESOURCES)),
        attributes=draw(attributes),
        events=(Event("e", {"n": 1}, timestamp=5),) if draw(st.integers(0, 9)) == 0 else (),
        links=(Link(trace_api.SpanContext(1, 2, False)),) if draw(st.integers(0, 9)) == 0 else (),
        kind=draw(st.sampled_from(list(SpanKind))),
        status=draw(st.sampled_from([Status(StatusCode.UNSET), Status(StatusCode.OK),
                                     Status(StatusCode.ERROR, "failed")])),
        start_time=draw(times),
        end_time=draw(times),
        instrumentation_scope=draw(st.sampled_from(SCOPES)),
    )


def decoded(payload: bytes) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(payload)


@settings(max_examples=300, deadline=None)
@given(st.lists(spans(), max_size=12), st.data())
def test_same_request_as_the_sdk_encoder(batch: list[ReadableSpan], data) -> None:
    encoder = SpanEncoder()
    assert decoded(encoder.encode(batch)) == encode_spans(batch)
    # some spans prewritten while queued, the others encoded at export: the same request
    prewritten = [encoder.prewrite(span) if data.draw(st.booleans()) else span for span in batch]
    assert decoded(encoder.encode(prewritten)) == encode_spans(batch)


def test_spans_ended_by_the_sdk_are_encoded_alike() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCES[0])
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("otel_straggler")
    with tracer.start_as_current_span("train.step", attributes={"training.step": 3}):
        with tracer.start_as_current_span("forward-compute", attributes={"training.stage": "forward-compute",
                                                                         "training.stage.collective": False,
                                                                         "sizes": [1, 2]}) as span:
            span.add_event("marker", {"at": 1.5})
    finished = exporter.get_finished_spans()
    assert decoded(SpanEncoder().encode(finished)) == encode_spans(finished)


def test_prewritten_spans_are_tuples_of_atoms_the_collector_stops_tracking() -> None:
    import gc

    span = ReadableSpan("forward-compute", trace_api.SpanContext(1, 2, False), resource=RESOURCES[0],
                        attributes={"training.step": 1}, instrumentation_scope=SCOPES[0])
    item = SpanEncoder().prewrite(span)
    gc.collect()  # untracks tuples holding only untracked objects
    assert isinstance(item, tuple) and not gc.is_tracked(item)


# -- the C writer (_otlp_write) against the Python writer ------------------------------------

class Text(str):
    def encode(self, *args):  # a subclass may encode itself otherwise: the C writer declines it
        return b"other"


class Number(int):
    pass


odd_values = st.one_of(
    scalars, st.sampled_from(["\ud800", "é€😀", "", Text("x"), Number(5), float("nan"), float("-inf"), -0.0,
                              1 << 63, -(1 << 63), -1, (1 << 63) - 1]),
)
odd_times = st.one_of(times, st.sampled_from([0, -1, 1 << 64, (1 << 64) - 1, 1.5, Number(7)]))


@st.composite
def plain_spans(draw) -> ReadableSpan:
    """ReadableSpans as the span builder makes them (plain tuples and dicts), with odd values."""
    trace_id = draw(st.one_of(st.integers(min_value=0, max_value=(1 << 128) - 1),
                              st.sampled_from([-1, 1 << 128, Number(3)])))
    parent = None
    if draw(st.booleans()):
        parent = trace_api.SpanContext(trace_id, draw(ids), is_remote=draw(st.booleans()))
    return ReadableSpan(
        name=draw(st.one_of(st.text(max_size=20), st.sampled_from(["\udfff", Text("n")]))),
        context=trace_api.SpanContext(trace_id, draw(st.one_of(ids, st.just(0))), is_remote=False,
                                      trace_flags=trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)),
        parent=parent,
        resource=RESOURCES[0],
        attributes=draw(st.one_of(st.none(), st.dictionaries(st.one_of(st.text(max_size=8), st.just("\ud800")),
                                                             odd_values, max_size=8))),
        kind=draw(st.sampled_from(list(SpanKind))),
        status=draw(st.sampled_from([Status(StatusCode.UNSET), Status(StatusCode.OK), Status(StatusCode.ERROR)])),
        start_time=draw(odd_times),
        end_time=draw(odd_times),
        instrumentation_scope=SCOPES[0],
    )


def python_written(span: ReadableSpan):
    try:
        return span_encoding._field(b"\x12", SpanEncoder()._span_fields(span))
    except Exception:
        return None


@needs_writer
@settings(max_examples=1000, deadline=None)
@given(plain_spans())
def test_where_the_c_writer_answers_it_writes_what_the_python_writer_writes(span: ReadableSpan) -> None:
    written = span_encoding._write_plain_span(span)
    if written is not None:
        assert written == python_written(span)


@needs_writer
@settings(max_examples=300, deadline=None)
@given(spans())
def test_the_c_writer_answers_for_every_plain_span_of_ordinary_values(span: ReadableSpan) -> None:
    ordinary = not (span.events or span.links or span.context.trace_state or span.status.description
                    or any(type(value) is int and value >= 1 << 63 for value in span.attributes.values())
                    or any(type(value) in (tuple, list) for value in span.attributes.values()))
    if ordinary:
        assert span_encoding._write_plain_span(span) == python_written(span)
    else:
        assert span_encoding._write_plain_span(span) is None


def plain_span(name="forward-compute", trace_id=5, span_id=6, start_time=10, end_time=20, **attributes) -> ReadableSpan:
    return ReadableSpan(name, trace_api.SpanContext(trace_id, span_id, False), resource=RESOURCES[0],
                        attributes=attributes, start_time=start_time, end_time=end_time,
                        instrumentation_scope=SCOPES[0])


@needs_writer
@pytest.mark.parametrize("odd", [
    {"name": "\udfff"}, {"name": Text("n")}, {"start_time": -1}, {"end_time": 1 << 64}, {"start_time": 1.5},
    {"end_time": Number(7)}, {"trace_id": -1}, {"trace_id": 1 << 128}, {"trace_id": Number(3)}, {"span_id": 1 << 64},
    {"value": 1 << 63}, {"value": -(1 << 63) - 1}, {"value": "\ud800"}, {"value": Text("x")}, {"value": Number(5)},
    {"value": (1, 2)}, {"\ud800": 1},
], ids=repr)
def test_the_c_writer_declines_what_only_python_decides(odd: dict) -> None:
    fields = {key: value for key, value in odd.items()
              if key in ("name", "trace_id", "span_id", "start_time", "end_time")}
    attributes = {key: value for key, value in odd.items() if key not in fields}
    assert span_encoding._write_plain_span(plain_span(**fields, **attributes)) is None


@needs_writer
def test_the_span_builders_spans_take_the_c_writer() -> None:
    """Spans as the rank's own provider makes them (ProcessorSpans), with and without a parent."""
    from opentelemetry.sdk.trace import SpanProcessor

    from otel_straggler.instrumentation.span_builder import ProcessorSpans

    class Keep(SpanProcessor):
        def __init__(self) -> None:
            self.spans = []

        def on_end(self, span) -> None:
            self.spans.append(span)

    kept = Keep()
    builder_spans = ProcessorSpans(kept, RESOURCES[0], "otel_straggler")
    attributes = {"training.stage": "forward-compute", "training.step": 3, "training.seq": 17,
                  "training.stage.collective": False, "training.device.duration_ms": 12.5}
    builder_spans.emit("forward-compute", 5, 6, 7, dict(attributes), 10, 20, None)
    builder_spans.emit("train.step", 5, 7, None, {"training.step": 3}, 5, 25, None)
    for span in kept.spans:
        assert span_encoding._write_plain_span(span) is not None
        assert span_encoding._write_plain_span(span) == python_written(span)


@needs_writer
def test_spans_larger_than_the_writers_stack_buffer_are_written_alike() -> None:
    long_name = "stage-" + "x" * 3000
    span = plain_span(long_name, **{f"key.{index}": "é" * index for index in range(0, 400, 7)},
                      **{"big": "v" * 20000, "number": -5, "ratio": 0.25})
    written = span_encoding._write_plain_span(span)
    assert written is not None and len(written) > 40000
    assert written == python_written(span)


@needs_writer
def test_the_c_writer_declines_attributes_that_are_not_a_dict() -> None:
    from types import MappingProxyType

    from otel_straggler.instrumentation import _otlp_write

    fields = (5, 6, None, False, "forward-compute", 1, 10, 20)
    assert _otlp_write.span(*fields, {"training.step": 1}, 0) is not None
    assert _otlp_write.span(*fields, MappingProxyType({"training.step": 1}), 0) is None


@st.composite
def record_spans(draw) -> ReadableSpan:
    """A RecordSpan as the span builder makes it (of the rank's one resource and scope, mostly),
    with ordinary or odd attribute values."""
    from otel_straggler.instrumentation.record_span import RecordSpan

    trace_id = draw(st.integers(min_value=1, max_value=(1 << 128) - 1))
    values = draw(attributes)
    return RecordSpan(draw(st.text(max_size=20)), trace_id, draw(ids), draw(st.one_of(st.none(), ids)),
                      values if draw(st.booleans()) else None, draw(times), draw(times),
                      draw(st.sampled_from(RESOURCES[:1] * 3 + RESOURCES[1:])), draw(st.sampled_from(SCOPES)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(record_spans(), spans()), max_size=12), st.lists(record_spans(), max_size=3),
       st.booleans())
def test_spans_prewritten_together_are_those_prewritten_one_by_one(batch: list[ReadableSpan], before,
                                                                   c_writer: bool) -> None:
    """prewrite_many (the C writer's record_spans for the span builder's spans, where built) gives
    what prewrite gives span by span, and the request from it is the SDK's."""
    if not c_writer or not span_encoding.writer_built():
        saved = span_encoding._write_span
        span_encoding._write_span = None
    try:
        encoder, alone = SpanEncoder(), SpanEncoder()
        for span in before:  # the encoder has seen a group (its resource and scope) already, or not
            encoder.prewrite(span)
            alone.prewrite(span)
        together = encoder.prewrite_many(list(batch))
        assert together == [alone.prewrite(span) for span in batch]
        assert decoded(encoder.encode(together)) == encode_spans(batch)
    finally:
        if not c_writer or not span_encoding.writer_built():
            span_encoding._write_span = saved
