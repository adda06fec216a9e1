"""decode.py: OTLP protobuf and JSON -> Observations, what is ignored, what is malformed."""
from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given, settings, strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from otel_straggler import contract
from otel_straggler.detector import decode
from otel_straggler.detector.decode import DEFAULT_COHORT, MalformedPayload, ProtobufDecoder, decode_json
from otel_straggler.detector.observation import Observation

from otel_straggler.testing.otlp_spans import otlp_json, rank_resource, readable_span, request_bytes

END = 1_700_000_000_000_000_000


def observation(**changes) -> Observation:
    values = dict(job_id="job-7", epoch=2, cohort="tp1-pp0", rank=5, stage="forward-compute", step=41, seq=410,
                  host_ms=31.25, device_ms=30.5, collective=False, tokens=4096, samples=8, end_unix_nano=END)
    values.update(changes)
    return Observation(**values)


def decode_both(spans) -> tuple:
    """The same spans through the protobuf and the JSON path."""
    from_protobuf = ProtobufDecoder().decode(request_bytes(spans))
    from_json = decode_json(json.dumps(otlp_json(spans)).encode())
    return from_protobuf, from_json


def one_span(attributes: dict, resource_attributes: dict | None = None, name: str = "forward-compute"):
    from opentelemetry.sdk.resources import Resource

    resource = Resource(resource_attributes if resource_attributes is not None
                        else {contract.JOB_ID: "job-7", contract.RANK: 5})
    return readable_span(observation(), resource, name=name, attributes=attributes)


def stage_attributes(**changes) -> dict:
    attributes = {contract.STAGE: "forward-compute", contract.STEP: 41, contract.SEQ: 410,
                  contract.TIMING: "host_only", contract.COLLECTIVE: False}
    attributes.update(changes)
    return {key: value for key, value in attributes.items() if value is not None}


def test_a_stage_span_decodes_to_its_observation_from_protobuf_and_json():
    expected = [observation(), observation(stage="all-grads-sync", seq=411, collective=True, device_ms=None,
                                           tokens=None, samples=None, end_unix_nano=END + 9_000_000)]
    resource = rank_resource("job-7", 5, "tp1-pp0", 2)
    spans = [readable_span(item, resource) for item in expected]
    for batch in decode_both(spans):
        assert (batch.ignored, batch.malformed) == (0, 0)
        assert len(batch.observations) == 2
        for got, want in zip(batch.observations, expected):
            assert got.host_ms == pytest.approx(want.host_ms, abs=1e-6)  # via integer ns start/end
            assert got == want._replace(host_ms=got.host_ms)


def test_spans_that_are_not_stage_spans_are_ignored_and_counted():
    spans = [one_span({"http.method": "GET"}, {contract.SERVICE_NAME: "web"}, name="GET /"),
             one_span({contract.STEP: 41}, name=contract.STEP_SPAN_NAME),
             one_span(stage_attributes())]
    for batch in decode_both(spans):
        assert (len(batch.observations), batch.ignored, batch.malformed) == (1, 2, 0)


@pytest.mark.parametrize("attributes, resource, complaint, kind", [
    (stage_attributes(**{contract.SEQ: None}), None, contract.SEQ, "missing_seq"),
    (stage_attributes(**{contract.STEP: None}), None, contract.STEP, "missing_step"),
    (stage_attributes(**{contract.STEP: True}), None, contract.STEP, "bad_step"),  # a bool is not a step
    (stage_attributes(**{contract.SEQ: -1}), None, contract.SEQ, "bad_seq"),
    (stage_attributes(**{contract.STEP: 4.0}), None, contract.STEP, "bad_step"),
    (stage_attributes(**{contract.STAGE: ""}), None, contract.STAGE, "bad_stage"),
    (stage_attributes(), {contract.JOB_ID: "job-7"}, contract.RANK, "missing_rank"),
    (stage_attributes(), {contract.JOB_ID: "job-7", contract.RANK: "5"}, contract.RANK, "bad_rank"),
    (stage_attributes(), {contract.JOB_ID: "job-7", contract.RANK: -1}, contract.RANK, "bad_rank"),
    (stage_attributes(), {contract.RANK: 5}, contract.JOB_ID, "missing_job_id"),
    (stage_attributes(), {contract.JOB_ID: "", contract.RANK: 5}, contract.JOB_ID, "missing_job_id"),
    (stage_attributes(), {contract.JOB_ID: 7, contract.RANK: 5}, contract.JOB_ID, "bad_job_id"),
    (stage_attributes(), {contract.JOB_ID: "job-7", contract.RANK: 5, contract.TOPOLOGY_EPOCH: "two"},
     contract.TOPOLOGY_EPOCH, "bad_epoch"),
    (stage_attributes(), {contract.JOB_ID: "job-7", contract.RANK: 5, contract.COHORT: 3}, contract.COHORT, "bad_cohort"),
])
def test_a_stage_span_missing_or_mistyping_a_required_field_is_malformed_with_its_kind(attributes, resource,
                                                                                       complaint, kind):
    spans = [one_span(attributes, resource), one_span(stage_attributes())]
    reference = ProtobufDecoder().decode_in_python(request_bytes(spans))
    for batch in (*decode_both(spans), reference):
        assert (len(batch.observations), batch.malformed) == (1, 1)
        assert complaint in batch.first_error
        assert batch.rejections == {kind: 1}
        assert kind in decode.REJECTION_KINDS


def test_a_rejected_span_keeps_an_example_with_what_is_known_of_its_sender():
    resource = {contract.RANK: 3, contract.HOST_NAME: "node-0"}
    spans = [one_span(stage_attributes(), resource, name="forward-compute") for _ in range(5)]
    for batch in decode_both(spans):
        assert batch.rejections == {"missing_job_id": 5}
        (example,) = batch.first_rejected.values()
        assert example.rejection is decode.MISSING_JOB_ID
        assert (example.span_name, example.job_id, example.rank, example.host) == ("forward-compute", None, 3, "node-0")


def test_a_span_ending_before_it_starts_is_malformed():
    span = one_span(stage_attributes())
    span._start_time, span._end_time = END, END - 1
    for batch in decode_both([span]):
        assert batch.malformed == 1 and "end before start" in batch.first_error
        assert batch.rejections == {"bad_timestamps": 1}


def test_identity_attributes_on_the_span_are_used_when_the_resource_has_none():
    attributes = stage_attributes(**{contract.JOB_ID: "job-9", contract.RANK: 12, contract.COHORT: "pp1",
                                     contract.TOPOLOGY_EPOCH: 3})
    for batch in decode_both([one_span(attributes, {contract.SERVICE_NAME: "training"})]):
        (got,) = batch.observations
        assert (got.job_id, got.rank, got.cohort, got.epoch) == ("job-9", 12, "pp1", 3)


def test_the_resource_wins_over_the_span_and_missing_cohort_and_epoch_get_defaults():
    attributes = stage_attributes(**{contract.JOB_ID: "other", contract.RANK: 99})
    for batch in decode_both([one_span(attributes, {contract.JOB_ID: "job-7", contract.RANK: 5})]):
        (got,) = batch.observations
        assert (got.job_id, got.rank, got.cohort, got.epoch) == ("job-7", 5, DEFAULT_COHORT, 0)


@pytest.mark.parametrize("reported, expected", [
    (0, None), (-4096, None), (math.nan, None), (math.inf, None), ("4096", None), (None, None),
    (4096, 4096), (4096.0, 4096), (0.5, None),
])
def test_workload_values_that_are_not_positive_numbers_degrade_to_not_reported(reported, expected):
    attributes = stage_attributes(**{contract.WORKLOAD_TOKENS: reported, contract.WORKLOAD_SAMPLES: reported})
    for batch in decode_both([one_span(attributes)]):
        (got,) = batch.observations
        assert (got.tokens, got.samples) == (expected, expected)


@pytest.mark.parametrize("timing, reported, expected", [
    ("device", 12.5, 12.5), ("device", 12, 12.0), ("host_only", 12.5, None), ("device_unavailable", 12.5, None),
    ("device", math.nan, None), ("device", -1.0, None), ("device", None, None), ("device", "12.5", None),
])
def test_device_duration_is_kept_only_when_timing_is_device_and_it_is_a_valid_number(timing, reported, expected):
    attributes = stage_attributes(**{contract.TIMING: timing, contract.DEVICE_DURATION_MS: reported})
    for batch in decode_both([one_span(attributes)]):
        (got,) = batch.observations
        assert got.device_ms == expected


def test_collective_is_true_only_for_a_true_bool():
    for value, expected in ((True, True), (False, False), ("true", False), (1, False)):
        for batch in decode_both([one_span(stage_attributes(**{contract.COLLECTIVE: value}))]):
            assert batch.observations[0].collective is expected


def test_otlp_json_with_int64_strings_enum_names_and_hex_ids_decodes():
    line = {"resourceSpans": [{
        "resource": {"attributes": [{"key": contract.JOB_ID, "value": {"stringValue": "job-7"}},
                                    {"key": contract.RANK, "value": {"intValue": "5"}}]},
        "scopeSpans": [{"scope": {"name": "x"}, "spans": [{
            "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "forward",
            "kind": "SPAN_KIND_INTERNAL", "startTimeUnixNano": str(END - 2_000_000), "endTimeUnixNano": END,
            "attributes": [{"key": contract.STAGE, "value": {"stringValue": "forward"}},
                           {"key": contract.STEP, "value": {"intValue": 3}},
                           {"key": contract.SEQ, "value": {"intValue": "30"}},
                           {"key": contract.TIMING, "value": {"stringValue": "device"}},
                           {"key": contract.DEVICE_DURATION_MS, "value": {"doubleValue": "NaN"}},
                           {"key": contract.WORKLOAD_TOKENS, "value": {"intValue": "-3"}}],
        }]}],
    }]}
    (got,) = decode_json(json.dumps(line).encode()).observations
    assert (got.rank, got.step, got.seq, got.host_ms, got.device_ms, got.tokens) == (5, 3, 30, 2.0, None, None)


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a" + b"\xff" * 11,  # bad tag, truncated, a varint over 10 bytes
])
def test_a_protobuf_payload_that_does_not_parse_raises(payload):
    with pytest.raises(MalformedPayload):
        ProtobufDecoder().decode(payload)


@pytest.mark.parametrize("payload", [
    b"not json", b"[1, 2]", b'{"resourceSpans": 3}', b'{"resourceSpans": [{"scopeSpans": {}}]}',
    b"\xff\xfe", b"[" * 100_000,
])
def test_a_json_payload_that_is_not_an_otlp_request_raises(payload):
    with pytest.raises(MalformedPayload):
        decode_json(payload)


def test_a_json_span_with_bad_attributes_is_malformed_and_its_neighbours_count():
    good = otlp_json([one_span(stage_attributes())])
    bad = json.loads(json.dumps(good))
    bad["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = {"not": "a list"}
    good["resourceSpans"] += bad["resourceSpans"]
    batch = decode_json(json.dumps(good).encode())
    assert (len(batch.observations), batch.malformed) == (1, 1)
    assert batch.rejections == {"bad_attributes": 1}


def test_an_empty_request_is_valid_and_empty():
    batch = ProtobufDecoder().decode(b"")
    assert batch.span_count == 0
    assert decode_json(b"{}").span_count == 0


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _request_with_raw_attribute(key: str, raw_value: bytes) -> bytes:
    """A serialized request whose one span carries `key` with hand-made AnyValue bytes (the message
    API would re-encode them canonically, so the span is assembled at the wire level)."""
    request = ExportTraceServiceRequest.FromString(request_bytes([one_span(stage_attributes(**{key: None}))]))
    resource_spans = request.resource_spans[0]
    span = resource_spans.scope_spans[0].spans[0].SerializeToString()
    span += _length_delimited(9, _length_delimited(1, key.encode()) + _length_delimited(2, raw_value))
    body = _length_delimited(1, resource_spans.resource.SerializeToString()) + _length_delimited(2, _length_delimited(2, span))
    return _length_delimited(1, body)


@pytest.mark.parametrize("raw, expected", [
    (b"\x18\x2a", 42),                               # canonical
    (b"\x18\xaa\x80\x80\x00", 42),                   # over-long varint: still 42
    (b"\x18\x2a\x7a\x00", 42),                       # an unknown field (15) after the value
    (b"\x0a\x01x\x18\x2a", 42),                      # two oneof members: the last one wins
    (b"\x18\x07\x18\x2a", 42),                       # the same member twice: the last one wins
    (AnyValue(int_value=2**40).SerializeToString(), 2**40),
])
def test_sequence_numbers_decode_the_same_whatever_the_encoding(raw, expected):
    batch = ProtobufDecoder().decode(_request_with_raw_attribute(contract.SEQ, raw))
    assert [o.seq for o in batch.observations] == [expected]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(-2**63, 2**63 - 1).map(lambda v: AnyValue(int_value=v)),
                 st.integers(0, 2**28).map(lambda v: AnyValue(int_value=v)),  # 1-4 byte varints: unrolled
                 st.floats(allow_nan=False).map(lambda v: AnyValue(double_value=v)),
                 st.text(max_size=5).map(lambda v: AnyValue(string_value=v)),
                 st.booleans().map(lambda v: AnyValue(bool_value=v))),
       st.binary(max_size=4))
def test_the_fast_value_paths_agree_with_the_generic_decoder(value, suffix):
    raw = value.SerializeToString()
    for candidate in (raw, raw + suffix, suffix):
        generic = decode._any_value(candidate)
        assert _same(decode._int_any_value(candidate), generic)
        if value.WhichOneof("value") == "double_value" or not candidate.startswith(b"\x21"):
            assert _same(decode._double_any_value(candidate), generic)


def _same(a, b) -> bool:
    return a is b or a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_the_value_cache_stays_bounded():
    decoder = ProtobufDecoder()
    resource = rank_resource("job-7", 5)
    for chunk in range(3):
        spans = [readable_span(observation(stage=f"stage-{chunk}-{index}", seq=index), resource)
                 for index in range(decode._VALUE_CACHE_ENTRIES // 2)]
        assert len(decoder.decode(request_bytes(spans)).observations) == len(spans)
        assert len(decoder._value_cache) <= decode._VALUE_CACHE_ENTRIES


def test_double_fast_path_reads_little_endian_fixed64():
    raw = b"\x21" + struct.pack("<d", 12.5)
    assert decode._double_any_value(raw) == 12.5 == decode._any_value(raw)
