"""Hostile and malformed payloads, a bounded number of generated cases each: the decoders either
decode or refuse with MalformedPayload, the receivers answer with an OTLP status code (never a crash
or an internal error), every request is counted, and the service keeps serving."""
from __future__ import annotations

import gzip
import json
import random

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from otel_straggler.detector.decode import MalformedPayload, ProtobufDecoder, decode_json

from otel_straggler.testing.otlp_spans import otlp_json, request_bytes, running_service, service_config, stage_spans
from .test_receiver import post, raw_grpc_export

VALID = request_bytes(stage_spans(0, 3) + stage_spans(1, 2))
VALID_JSON = json.dumps(otlp_json(stage_spans(0, 3))).encode()
EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FEWER_EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def mutations(valid: bytes):
    """Truncations, flipped bytes, insertions and deletions of a valid payload."""
    positions = st.integers(0, len(valid))
    return st.one_of(
        positions.map(lambda cut: valid[:cut]),
        st.tuples(positions, st.integers(0, 255)).map(lambda p: valid[:p[0]] + bytes([p[1]]) + valid[p[0] + 1:]),
        st.tuples(positions, st.binary(min_size=1, max_size=12)).map(lambda p: valid[:p[0]] + p[1] + valid[p[0]:]),
        st.tuples(positions, st.integers(1, 40)).map(lambda p: valid[:p[0]] + valid[p[0] + p[1]:]),
    )


HUGE_VARINTS = [
    b"\x0a" + b"\xff" * 9 + b"\x01",                      # length 2^64-1
    b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",      # 10-byte length, over int64
    b"\x0a\xff\xff\xff\xff\x0f" + b"\x00" * 16,           # 4 GiB claimed, 16 bytes there
]


def decodes_or_refuses(decode, payload: bytes) -> None:
    try:
        batch = decode(payload)
    except MalformedPayload as error:
        assert str(error) and "\n" not in str(error)
        return
    assert batch.span_count == len(batch.observations) + batch.ignored + batch.malformed


@EXAMPLES
@given(st.one_of(st.binary(max_size=600), mutations(VALID), st.sampled_from(HUGE_VARINTS)))
def test_the_protobuf_decoder_decodes_or_refuses_anything(payload):
    decodes_or_refuses(ProtobufDecoder().decode, payload)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["resourceSpans", "scopeSpans", "spans", "resource", "attributes", "key", "value",
                         "intValue", "stringValue", "doubleValue", "boolValue", "startTimeUnixNano",
                         "endTimeUnixNano", "name"]) | st.text(max_size=5), children, max_size=5),
    max_leaves=30)


def _spliced(document: dict, rng_seed: int) -> bytes:
    """The valid JSON request with one value somewhere inside replaced by garbage of another type."""
    rng = random.Random(rng_seed)
    garbage = rng.choice([None, 7, -1, 1.5, "x", [], {}, [1, "a"], {"intValue": "zz"}, "NaN", 2**70])

    def visit(node):
        containers = [node]
        while containers:
            current = containers.pop()
            keys = list(current.keys()) if isinstance(current, dict) else list(range(len(current)))
            if keys and rng.random() < 0.3:
                current[rng.choice(keys)] = garbage
                return
            containers += [current[key] for key in keys if isinstance(current[key], (dict, list))]

    visit(document)
    return json.dumps(document).encode()


@EXAMPLES
@given(st.one_of(
    json_values.map(lambda value: json.dumps(value).encode()),
    st.integers(0, 2**32).map(lambda seed: _spliced(json.loads(VALID_JSON), seed)),
    mutations(VALID_JSON),
    st.binary(max_size=200),
))
def test_the_json_decoder_decodes_or_refuses_anything(payload):
    decodes_or_refuses(decode_json, payload)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    config = service_config(tmp_path_factory.mktemp("fuzz"), max_request_bytes=64 * 1024)
    with running_service(config) as running:
        yield running


def _requests_counted(service) -> int:
    return sum(service.status()["requests"].values())


@FEWER_EXAMPLES
@given(body=st.one_of(st.binary(max_size=400), mutations(VALID), mutations(VALID_JSON)),
       content_type=st.sampled_from(["application/x-protobuf", "application/json"]),
       gzipped=st.booleans())
def test_http_answers_every_hostile_body_with_an_otlp_status_and_counts_it(service, body, content_type, gzipped):
    before = _requests_counted(service)
    headers = {"Content-Encoding": "gzip"} if gzipped else {}
    status, _, _ = post(service.bound_ports[1], gzip.compress(body) if gzipped else body, content_type, headers=headers)
    assert status in (200, 400)
    assert _requests_counted(service) == before + 1


@FEWER_EXAMPLES
@given(body=st.one_of(st.binary(max_size=400), mutations(VALID), st.sampled_from(HUGE_VARINTS)))
def test_grpc_answers_every_hostile_body_with_ok_or_invalid_argument(service, body):
    try:
        raw_grpc_export(service.bound_ports[0], body)
    except grpc.RpcError as error:
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error  # never UNKNOWN: no handler crash


def test_gzip_bombs_and_deep_json_within_the_bound_are_refused_cleanly(service):
    port = service.bound_ports[1]
    bomb = gzip.compress(b"\x0a" * (10 * 1024 * 1024))  # 10 MiB inflated, ~10 kB on the wire
    assert post(port, bomb, headers={"Content-Encoding": "gzip"})[0] == 413
    nested = gzip.compress(b"[" * 30_000 + b"]" * 30_000)
    assert post(port, nested, "application/json", headers={"Content-Encoding": "gzip"})[0] == 400
    members = gzip.compress(VALID) + gzip.compress(b"")  # two gzip members back to back are one body
    assert post(port, members, headers={"Content-Encoding": "gzip"})[0] == 200
    assert post(port, VALID)[0] == 200  # and the service still serves
