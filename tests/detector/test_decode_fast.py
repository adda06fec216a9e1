"""The C fast path (_otlp_scan) against the reference decoder (ProtobufDecoder.decode_in_python):
where the scanner answers, it answers exactly what the reference does; it declines anything the
reference rejects; it never crashes on hostile bytes; and it does answer for what real exporters
send, so the fast path is the one in use."""
from __future__ import annotations

import math
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from otel_straggler import contract
from otel_straggler.detector import decode
from otel_straggler.detector.decode import MalformedPayload, ProtobufDecoder
from otel_straggler.detector.observation import RECORD_FORMAT, ObservationRecords

from otel_straggler.testing.otlp_spans import request_bytes, stage_spans
from .test_fuzz import mutations
# at import, not inside a test: importing it defines @given tests, which a running @given test
# would take for nested ones (hypothesis's nested_given health check)
from .test_ingest_fast import state

try:
    from otel_straggler.detector import _otlp_scan  # noqa: F401
except ImportError:
    _otlp_scan = None

if _otlp_scan is None:
    if os.environ.get("CI") == "true":  # CI builds the extension: its absence there is a failure
        pytest.fail("otel_straggler.detector._otlp_scan is not built", pytrace=False)
    pytest.skip("the optional C extension is not built here (no C compiler?)", allow_module_level=True)

SCAN = decode._scan
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(payload: bytes):
    try:
        return ProtobufDecoder().decode_in_python(payload)
    except MalformedPayload:
        return None


def same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def assert_agrees(payload: bytes) -> bool:
    """True when the scanner answered (and agreed), False when it declined."""
    scanned = SCAN(payload)
    if scanned is None:
        return False
    expected = reference(payload)
    assert expected is not None, "the scanner answered a payload the reference refuses"
    records, _, _, ignored, _, heartbeat_spans = scanned
    # a stage span the reference rejects is declined; heartbeats are decoded in Python either way
    assert expected.malformed <= len(heartbeat_spans), "the scanner answered a payload with rejected stage spans"
    fast = ProtobufDecoder().decode(payload)
    assert isinstance(fast.observations, ObservationRecords)
    assert (fast.heartbeats, fast.placements, fast.malformed, fast.rejections) == \
        (expected.heartbeats, expected.placements, expected.malformed, expected.rejections)
    assert ignored == expected.ignored
    assert len(records) == len(expected.observations) * struct.calcsize(RECORD_FORMAT)
    assert len(fast.observations) == len(expected.observations)
    for index, (got, want) in enumerate(zip(fast.observations, expected.observations, strict=True)):
        assert type(got) is type(want)
        assert all(type(x) is type(y) and same_value(x, y) for x, y in zip(got, want, strict=True)), (got, want)
        assert fast.observations[index] == got == fast.observations[index - len(expected.observations)]
    return True


def test_the_decoder_uses_the_scanner():
    assert SCAN is _otlp_scan.scan


def test_what_the_sdk_exporter_sends_is_scanned():
    payload = request_bytes(stage_spans(0, 5) + stage_spans(1, 3))
    assert assert_agrees(payload)


def test_what_the_rank_side_sends_is_scanned():
    from opentelemetry.sdk.resources import Resource

    from otel_straggler.instrumentation.span_encoding import SpanEncoder

    from otel_straggler.testing.otlp_spans import readable_span
    from .test_decode import observation

    resource = Resource({contract.JOB_ID: "job-7", contract.RANK: 5, contract.COHORT: "tp1-pp0",
                         contract.TOPOLOGY_EPOCH: 2, "service.name": "training"})
    spans = [readable_span(observation(seq=seq, device_ms=None if seq % 2 else 3.5), resource) for seq in range(6)]
    encoder = SpanEncoder()
    payload = encoder.encode([encoder.prewrite(span) for span in spans])
    assert assert_agrees(payload)


# -- generated requests: every value kind in every attribute, identity on the resource or the span

SCALARS = st.one_of(
    st.none(),  # attribute left out
    st.text(max_size=8).map(lambda v: AnyValue(string_value=v)),
    st.sampled_from(["forward-compute", "device", "host_only", ""]).map(lambda v: AnyValue(string_value=v)),
    st.booleans().map(lambda v: AnyValue(bool_value=v)),
    st.integers(-3, 2**31).map(lambda v: AnyValue(int_value=v)),
    st.integers(-2**63, 2**63 - 1).map(lambda v: AnyValue(int_value=v)),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda v: AnyValue(double_value=v)),
    st.just(AnyValue()),  # present, no value
    st.just(AnyValue(bytes_value=b"\x00")),
)
GOOD = {
    contract.STAGE: st.sampled_from(["forward-compute", "all-grads-sync"]).map(lambda v: AnyValue(string_value=v)),
    contract.STEP: st.integers(0, 10**6).map(lambda v: AnyValue(int_value=v)),
    contract.SEQ: st.integers(0, 2**40).map(lambda v: AnyValue(int_value=v)),
    contract.TIMING: st.sampled_from(["device", "host_only"]).map(lambda v: AnyValue(string_value=v)),
    contract.COLLECTIVE: st.booleans().map(lambda v: AnyValue(bool_value=v)),
    contract.WORKLOAD_TOKENS: st.integers(0, 10**6).map(lambda v: AnyValue(int_value=v)),
    contract.WORKLOAD_SAMPLES: st.floats(0, 100).map(lambda v: AnyValue(double_value=v)),
    contract.DEVICE_DURATION_MS: st.floats(0, 100).map(lambda v: AnyValue(double_value=v)),
    contract.JOB_ID: st.sampled_from(["job-1", "job-2"]).map(lambda v: AnyValue(string_value=v)),
    contract.TOPOLOGY_EPOCH: st.integers(0, 3).map(lambda v: AnyValue(int_value=v)),
    contract.COHORT: st.sampled_from(["", "tp0", "tp1"]).map(lambda v: AnyValue(string_value=v)),
    contract.RANK: st.integers(0, 64).map(lambda v: AnyValue(int_value=v)),
}
IDENTITY = (contract.JOB_ID, contract.TOPOLOGY_EPOCH, contract.COHORT, contract.RANK)


def attribute_values(keys) -> st.SearchStrategy:
    """Mostly valid values (so many spans are accepted), sometimes anything at all, sometimes none."""
    return st.fixed_dictionaries({key: st.one_of(GOOD[key], GOOD[key], GOOD[key], SCALARS) for key in keys})


def key_values(values: dict, extra: list) -> list:
    pairs = [KeyValue(key=key, value=value) for key, value in values.items() if value is not None]
    return pairs + [KeyValue(key=key, value=AnyValue(string_value="x")) for key in extra]


EXTRA_KEYS = st.lists(st.sampled_from(["service.name", "héllo", "training.stage", "other"]), max_size=2)


@st.composite
def requests(draw) -> bytes:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        resource_spans = request.resource_spans.add()
        on_resource = draw(st.sets(st.sampled_from(IDENTITY)))
        resource_values = draw(attribute_values(sorted(on_resource)))
        resource_spans.resource.attributes.extend(key_values(resource_values, draw(EXTRA_KEYS)))
        for _ in range(draw(st.integers(1, 2))):
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.name = "otel_straggler"
            for _ in range(draw(st.integers(0, 4))):
                keys = [key for key in GOOD if key not in on_resource or draw(st.booleans())]
                values = draw(attribute_values(keys))
                start = draw(st.one_of(st.just(0), st.integers(1, 2**63)))
                span = Span(name=draw(st.sampled_from(["forward-compute", "ünïcode", ""])),
                            trace_id=b"\x01" * 16, span_id=b"\x02" * 8, kind=Span.SPAN_KIND_INTERNAL,
                            start_time_unix_nano=start,
                            end_time_unix_nano=draw(st.one_of(st.just(start), st.integers(0, 2**64 - 1))))
                span.attributes.extend(key_values(values, draw(EXTRA_KEYS)))
                scope_spans.spans.append(span)
    return request.SerializeToString()


@EXAMPLES
@given(requests())
def test_generated_requests_get_the_reference_answer_or_are_declined(payload):
    assert_agrees(payload)


@EXAMPLES
@given(requests())
def test_scanned_records_ingest_as_their_observations_do(payload):
    """The engine's C loop over the scanner's records (extreme steps, seqs and end times included)
    leaves it as the Python loop over the same Observations does."""
    from otel_straggler.detector.config import DetectorConfig
    from otel_straggler.detector.engine import OUTCOMES, Engine

    observations = ProtobufDecoder().decode(payload).observations
    if not isinstance(observations, ObservationRecords):
        return  # declined: the reference decoder's list, which test_ingest_fast covers
    fast, python = Engine(DetectorConfig()), Engine(DetectorConfig())
    assert fast.ingest_many(observations) == dict(zip(OUTCOMES, python._ingest_rows(list(observations)), strict=True))
    assert state(fast) == state(python)


def test_generated_requests_are_often_scanned():
    """Guards the test above against a scanner that declines everything: of the requests the
    same strategy draws, a share is answered (10-13% of 300 in three runs; the others hold a span
    the reference rejects). Drawn in one Hypothesis run: 300 draws cost what 40 `.example()` calls did."""
    answered: list[bool] = []

    @EXAMPLES
    @given(requests())
    def draw(payload):
        answered.append(assert_agrees(payload))

    draw()
    assert len(answered) >= 100 and sum(answered) >= 0.02 * len(answered), (sum(answered), len(answered))


@EXAMPLES
@given(mutations(request_bytes(stage_spans(0, 3) + stage_spans(1, 2))))
def test_mutated_payloads_never_crash_and_agree_where_answered(payload):
    assert_agrees(payload)


@pytest.mark.parametrize("payload", [
    b"", b"\x0a", b"\x0a\x05\x12\x03\x12\x01", b"\x0a" + b"\xff" * 9 + b"\x01", b"\x0b\x0c",
    b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", bytes(range(256)),
    # tags and lengths longer than 5 bytes: the reference refuses them
    b"\x8a\x80\x80\x80\x80\x00\x00", b"\x0a\x80\x80\x80\x80\x80\x00", b"\x90\x80\x80\x80\x80\x00\x01",
])
def test_odd_bytes_are_declined_or_agree(payload):
    assert_agrees(payload)


@pytest.mark.parametrize("key, raw", [
    (contract.STEP, b"\x98\x80\x80\x80\x80\x00\x05"),        # AnyValue tag padded to 6 bytes
    (contract.STAGE, b"\x0a\x83\x80\x80\x80\x80\x00abc"),    # string length padded to 6 bytes
    (contract.STEP, b"\x98\x80\x80\x80\x00\x05"),            # padded to 5: both accept it
    (contract.JOB_ID, b"\x0a\x01\xff"),                         # invalid UTF-8, on the span
    (contract.STAGE, b"\x0a\x02\xc3\x28"),                     # invalid UTF-8
])
def test_odd_values_are_declined_or_agree(key, raw):
    from .test_decode import _request_with_raw_attribute

    assert_agrees(_request_with_raw_attribute(key, raw))


@pytest.mark.parametrize("key", [
    "x" + contract.SEQ[1:],                            # a wanted key's length and last 8 bytes
    contract.SEQ[:-1] + "x",                           # its length and all but its last byte
    contract.STAGE[:4] + "X" + contract.STAGE[5:],     # one byte of its head
    contract.SEQ + "x",                                # one byte longer
    contract.STEP[-8:],                                # its last 8 bytes alone
])
def test_keys_near_a_wanted_one_are_other_keys(key):
    """The scanner finds a key by its length and last 8 bytes first: a key that shares them is
    still another key, ignored as the reference decoder ignores it."""
    from .test_decode import _request_with_raw_attribute

    payload = _request_with_raw_attribute(key, AnyValue(int_value=2**40).SerializeToString())
    assert assert_agrees(payload)
    assert [(o.step, o.seq) for o in ProtobufDecoder().decode(payload).observations] == \
        [(o.step, o.seq) for o in reference(payload).observations]


def test_every_byte_of_every_wanted_key_counts():
    """A key one byte off a wanted key, at any position (before, inside or after its last 8
    bytes), is another key: ignored as the reference decoder ignores it."""
    from .test_decode import _request_with_raw_attribute

    wanted = {*decode._IDENTITY_KEYS, contract.STAGE, contract.STEP, contract.SEQ, contract.TIMING, contract.COLLECTIVE,
              contract.WORKLOAD_TOKENS, contract.WORKLOAD_SAMPLES, contract.DEVICE_DURATION_MS}
    tried = 0
    for key in sorted(wanted):
        for position in range(len(key)):
            near = key[:position] + ("X" if key[position] != "X" else "Y") + key[position + 1:]
            payload = _request_with_raw_attribute(near, AnyValue(int_value=2**40).SerializeToString())
            assert assert_agrees(payload), near
            tried += 1
    assert tried > 13 * 8


def test_stage_names_alike_in_their_last_bytes_stay_apart():
    """Stage names of one request are told apart by length and last 8 bytes first, then the rest."""
    request = ExportTraceServiceRequest.FromString(request_bytes(stage_spans(0, 3)))
    spans = request.resource_spans[0].scope_spans[0].spans
    for span, name in zip(spans, ["forward-compute", "Xorward-compute", "forwarX-compute"], strict=True):
        for attribute in span.attributes:
            if attribute.key == contract.STAGE:
                attribute.value.string_value = name
    payload = request.SerializeToString()
    assert assert_agrees(payload)
    assert [o.stage for o in ProtobufDecoder().decode(payload).observations] == \
        ["forward-compute", "Xorward-compute", "forwarX-compute"]


def test_a_key_that_is_not_ascii_is_declined():
    """Only wanted keys (all ASCII) skip the check: any other key must be ASCII to be answered."""
    from .test_decode import _request_with_raw_attribute

    payload = _request_with_raw_attribute("training.st\u00e9p", AnyValue(int_value=7).SerializeToString())
    assert reference(payload) is not None and SCAN(payload) is None


def test_a_span_naming_an_identity_key_its_resource_does_not_has_its_own_identity():
    """The scanner reads a resource's identity once for the spans that name none of its keys; a
    span of the same resource that names one the resource does not (an epoch, a restart count)
    has another identity, before and after the others."""
    request = ExportTraceServiceRequest.FromString(request_bytes(stage_spans(0, 5)))
    spans = request.resource_spans[0].scope_spans[0].spans
    spans[1].attributes.append(KeyValue(key=contract.TOPOLOGY_EPOCH, value=AnyValue(int_value=3)))
    spans[3].attributes.append(KeyValue(key=contract.RESTART_COUNT, value=AnyValue(int_value=2)))
    payload = request.SerializeToString()
    assert assert_agrees(payload)
    observations = ProtobufDecoder().decode(payload).observations
    assert [(o.epoch, o.restart) for o in observations] == [(0, 0), (3, 0), (0, 0), (0, 2), (0, 0)]


def test_two_bad_strings_in_one_span_decline_cleanly():
    """The second string is not decoded while the first one's error is pending (a debug
    interpreter aborts on that)."""
    from .test_decode import _length_delimited

    request = ExportTraceServiceRequest.FromString(request_bytes(stage_spans(0, 1)))
    # no resource: the identity comes from the span, two of its strings invalid UTF-8
    span_attributes = b"".join(_length_delimited(9, _length_delimited(1, key.encode()) + _length_delimited(2, raw))
                               for key, raw in ((contract.JOB_ID, b"\x0a\x01\xff"), (contract.COHORT, b"\x0a\x01\xfe"),
                                                (contract.RANK, b"\x18\x00")))
    span = request.resource_spans[0].scope_spans[0].spans[0].SerializeToString() + span_attributes
    body = _length_delimited(2, _length_delimited(2, span))
    payload = _length_delimited(1, body)
    assert SCAN(payload) is None
    assert assert_agrees(payload) is False


def test_a_rejected_span_is_left_to_the_reference_decoder():
    request = ExportTraceServiceRequest.FromString(request_bytes(stage_spans(0, 2)))
    span = request.resource_spans[0].scope_spans[0].spans[1]
    for attribute in span.attributes:
        if attribute.key == contract.STEP:
            attribute.value.int_value = -1
    payload = request.SerializeToString()
    assert SCAN(payload) is None
    batch = ProtobufDecoder().decode(payload)
    assert batch.malformed == 1 and len(batch.observations) == 1 and "training.step" in batch.first_error
    assert batch.rejections == {"bad_step": 1}


def test_a_span_without_a_job_id_is_declined_and_gets_the_reference_kind():
    request = ExportTraceServiceRequest.FromString(request_bytes(stage_spans(0, 2)))
    attributes = request.resource_spans[0].resource.attributes
    kept = [attribute for attribute in attributes if attribute.key != contract.JOB_ID]
    del attributes[:]
    attributes.extend(kept)
    payload = request.SerializeToString()
    assert SCAN(payload) is None
    for batch in (ProtobufDecoder().decode(payload), reference(payload)):
        assert batch.rejections == {"missing_job_id": 2} and batch.observations == []
