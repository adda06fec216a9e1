"""Input no honest exporter sends: numbers beyond what protobuf can carry, strings that are not UTF-8,
nesting deep enough to exhaust the stack, large attribute values. Each costs only the span, request or
line it came in, counted, and leaves nothing behind; the rest of the request or file still counts."""
from __future__ import annotations

import gc
import json
import tracemalloc

import grpc
import pytest
from google.rpc import code_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_straggler import contract
from otel_straggler.detector import receiver
from otel_straggler.detector.decode import ProtobufDecoder, decode_json
from otel_straggler.detector.replay import replay

from otel_straggler.testing.otlp_spans import json_line, request_bytes, running_service, service_config, stage_spans
from .test_receiver import accepted, post, raw_grpc_export

END = 1_700_000_000_000_000_000
HUGE = "1" + "0" * 400  # far beyond any protobuf integer


def attribute(key: str, value) -> dict:
    """An OTLP/JSON KeyValue; `value` is a Python value or an AnyValue already in JSON."""
    if isinstance(value, dict):
        return {"key": key, "value": value}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": value}}


def json_span(seq: int, start=str(END - 10_000_000), end=str(END), attributes: dict | None = None) -> dict:
    """A valid stage span of rank 0 in OTLP/JSON; `attributes` replace or add attributes by key."""
    values = {contract.STAGE: "forward-compute", contract.STEP: seq, contract.SEQ: seq, contract.RANK: 0,
              **(attributes or {})}
    return {"name": "forward-compute", "startTimeUnixNano": start, "endTimeUnixNano": end,
            "attributes": [attribute(key, value) for key, value in values.items()]}


def json_request(*spans: dict, job_id: str = "job-1") -> dict:
    return {"resourceSpans": [{"resource": {"attributes": [attribute(contract.JOB_ID, job_id)]},
                               "scopeSpans": [{"spans": list(spans)}]}]}


def decoded(request: dict):
    return decode_json(json.dumps(request).encode())


# ---------------------------------------------------------------- integers beyond the protobuf types

@pytest.mark.parametrize("bad_span", [
    json_span(2, end=HUGE),
    json_span(2, start=HUGE, end=HUGE),
    json_span(2, end=str(1 << 64)),  # fixed64 ends at 2**64 - 1
    json_span(2, start="1", end=int(HUGE)),  # a plain JSON number
    json_span(2, attributes={contract.STEP: {"intValue": HUGE}}),
    json_span(2, attributes={contract.STEP: {"intValue": str(1 << 63)}}),  # int64 ends at 2**63 - 1
    json_span(2, attributes={contract.SEQ: {"intValue": HUGE}}),
    json_span(2, attributes={contract.RANK: {"intValue": HUGE}}),
    json_span(2, attributes={contract.RANK: {"intValue": int(HUGE)}}),
], ids=["end", "start-and-end", "end-2**64", "end-as-number", "step", "step-2**63", "seq", "rank",
        "rank-as-number"])
def test_json_ints_beyond_their_protobuf_type_reject_only_their_span(bad_span):
    batch = decoded(json_request(json_span(1), bad_span))
    assert batch.malformed == 1
    assert [observation.seq for observation in batch.observations] == [1]


def test_json_ints_at_the_ends_of_their_protobuf_type_are_accepted():
    batch = decoded(json_request(json_span((1 << 63) - 1, start="1", end=str((1 << 64) - 1))))
    assert batch.malformed == 0
    assert [(o.seq, o.end_unix_nano) for o in batch.observations] == [((1 << 63) - 1, (1 << 64) - 1)]


@pytest.mark.parametrize("duration", [{"intValue": HUGE}, {"doubleValue": int(HUGE)}], ids=["int", "double"])
def test_a_device_duration_beyond_its_type_is_not_reported_like_any_invalid_one(duration):
    span = json_span(1, attributes={contract.TIMING: contract.TIMING_DEVICE, contract.DEVICE_DURATION_MS: duration})
    batch = decoded(json_request(span))
    assert batch.malformed == 0
    assert [(o.seq, o.device_ms) for o in batch.observations] == [(1, None)]


def test_over_http_an_out_of_range_time_is_a_rejected_span_and_the_rest_is_accepted(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        body = json.dumps(json_request(json_span(1), json_span(2, end=HUGE))).encode()
        status, _, answer = post(service.bound_ports[1], body, "application/json")
        assert status == 200 and json.loads(answer)["partialSuccess"]["rejectedSpans"] == "1"
        assert accepted(service) == 1
        assert service.status()["requests"] == {"partial": 1}


def test_an_unexpected_decoder_failure_is_answered_as_malformed_and_counted(tmp_path, monkeypatch):
    def fail(*_):
        raise OverflowError("a decoder bug")

    monkeypatch.setattr(receiver, "decode_json", fail)
    monkeypatch.setattr(ProtobufDecoder, "decode", fail)
    with running_service(service_config(tmp_path)) as service:
        grpc_port, http_port = service.bound_ports
        status, _, answer = post(http_port, json.dumps(json_request(json_span(1))).encode(), "application/json")
        assert status == 400 and json.loads(answer)["code"] == code_pb2.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as refused:
            raw_grpc_export(grpc_port, request_bytes(stage_spans(0, 1)))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert service.status()["requests"] == {"malformed": 2}
        assert service.status()["errors"] == {"decode": 2}


# ---------------------------------------------------------------- strings that are not UTF-8

@pytest.mark.parametrize("key", [contract.STAGE, contract.COHORT])
def test_json_strings_with_a_lone_surrogate_reject_their_span(key):
    bad = json_span(2, attributes={key: "bad\ud800value"})  # json.dumps writes it as the escape \ud800
    batch = decoded(json_request(json_span(1), bad))
    assert batch.malformed == 1
    assert [observation.seq for observation in batch.observations] == [1]


def test_a_job_id_with_a_lone_surrogate_rejects_the_spans_of_its_resource():
    batch = decoded(json_request(json_span(1), json_span(2), job_id="bad\ud800job"))
    assert (batch.malformed, batch.observations) == (2, [])
    assert contract.JOB_ID in batch.first_error


def test_json_strings_holding_utf8_encoded_surrogates_reject_their_span():
    body = json.dumps(json_request(json_span(1), json_span(2, attributes={contract.STAGE: "STAGE"}))).encode()
    body = body.replace(b'"STAGE"', b'"bad\xed\xa0\x80stage"')  # a surrogate encoded as if it were UTF-8
    batch = decode_json(body)
    assert batch.malformed == 1
    assert [observation.seq for observation in batch.observations] == [1]


def test_json_strings_with_valid_non_ascii_text_are_accepted():
    batch = decoded(json_request(json_span(1, attributes={contract.STAGE: "vorwärts-✓"}), job_id="jöb-1"))
    assert [(o.job_id, o.stage) for o in batch.observations] == [("jöb-1", "vorwärts-✓")]


# ---------------------------------------------------------------- nesting

def test_replay_counts_a_line_nested_too_deep_as_malformed_and_goes_on(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json_line(stage_spans(0, 2)) + "[" * 100_000 + "\n" + json_line(stage_spans(1, 2)))
    summary = replay([str(path)], service_config(tmp_path))
    assert summary.lines == 3
    assert summary.status["requests"] == {"ok": 2, "malformed": 1}
    assert summary.status["spans"]["accepted"] == 4


# ---------------------------------------------------------------- large values

def rejected_request(stage: str) -> bytes:
    """One stage span without step or seq: decoded, then rejected as malformed."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    pair = resource_spans.resource.attributes.add()
    pair.key, pair.value.string_value = contract.JOB_ID, "job-1"
    span = resource_spans.scope_spans.add().spans.add()
    span.name, span.start_time_unix_nano, span.end_time_unix_nano = "s", END - 1, END
    pair = span.attributes.add()
    pair.key, pair.value.string_value = contract.STAGE, stage
    return request.SerializeToString()


def test_the_decoder_does_not_keep_large_attribute_values():
    decoder = ProtobufDecoder()
    assert decoder.decode(rejected_request("warm-up")).malformed == 1
    gc.collect()
    tracemalloc.start()
    try:
        for index in range(64):
            assert decoder.decode(rejected_request(f"{index:04d}" + "x" * (256 << 10))).malformed == 1
        gc.collect()
        retained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert retained < 1 << 20  # kept, each value and its raw bytes would be 32 MiB
