"""The rank side's OTLP encoder (span_encoding.SpanEncoder) writes the same request as the OTel
SDK's encoder for any batch of spans: same resources, scopes and spans, every field and
attribute alike, whether the spans come as ReadableSpans or prewritten while queued."""
from __future__ import annotations

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

from otel_straggler.instrumentation.span_encoding import SpanEncoder

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
attribute_values = st.one_of(scalars, st.lists(st.integers(min_value=0, max_value=9), max_size=3).map(tuple))
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
