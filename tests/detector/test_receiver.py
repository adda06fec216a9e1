"""The OTLP receivers over real sockets, with the OTel SDK's own exporters as clients where they can
say what is being tested, and raw requests where the SDK would never send such a thing."""
from __future__ import annotations

import gzip
import http.client
import json
import logging
import socket
import threading
import time
import urllib.request

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector import receiver_http
from otel_straggler.detector.receiver import load_token

from otel_straggler.testing.otlp_spans import otlp_json, request_bytes, running_service, service_config, stage_spans

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def grpc_exporter(port: int, **options) -> GrpcSpanExporter:
    options.setdefault("insecure", True)
    return GrpcSpanExporter(endpoint=f"127.0.0.1:{port}", timeout=10, **options)


def http_exporter(port: int, scheme: str = "http", **options) -> HttpSpanExporter:
    return HttpSpanExporter(endpoint=f"{scheme}://127.0.0.1:{port}/v1/traces", timeout=10, **options)


def post(port: int, body: bytes, content_type: str = "application/x-protobuf", path: str = "/v1/traces",
         method: str = "POST", headers: dict | None = None) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": content_type, **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def raw_grpc_export(port: int, payload: bytes, metadata=()) -> ExportTraceServiceResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        export = channel.unary_unary(EXPORT_METHOD, request_serializer=None,
                                     response_deserializer=ExportTraceServiceResponse.FromString)
        return export(payload, timeout=10, metadata=metadata)


def accepted(service, expected: int = None) -> int:
    """Spans accepted once the queue is empty and, given `expected`, that many are (within 5 s): the
    queue is empty while the engine thread still ingests the batch it took last."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        status = service.status()
        if not status["queue"]["pending_spans"] and (expected is None or status["spans"]["accepted"] >= expected):
            break
        time.sleep(0.01)
    return service.status()["spans"]["accepted"]


def with_one_malformed(spans):
    """The spans plus one stage span without training.seq."""
    model = spans[0]
    attributes = {key: value for key, value in model.attributes.items() if key != contract.SEQ}
    return spans + [ReadableSpan(name=model.name, context=model.context, resource=model.resource,
                                 attributes=attributes, start_time=model.start_time, end_time=model.end_time)]


# ---------------------------------------------------------------- accepted traffic

def test_the_sdk_exporters_deliver_over_grpc_and_http_with_and_without_gzip(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        grpc_port, http_port = service.bound_ports
        assert grpc_exporter(grpc_port).export(stage_spans(0, 4)) is SpanExportResult.SUCCESS
        assert grpc_exporter(grpc_port, compression=grpc.Compression.Gzip).export(stage_spans(1, 4)) is SpanExportResult.SUCCESS
        assert http_exporter(http_port).export(stage_spans(2, 4)) is SpanExportResult.SUCCESS
        assert http_exporter(http_port, compression=HttpCompression.Gzip).export(stage_spans(3, 4)) is SpanExportResult.SUCCESS
        assert http_exporter(http_port, compression=HttpCompression.Deflate).export(stage_spans(4, 4)) is SpanExportResult.SUCCESS
        assert accepted(service, 20) == 20
        assert service.status()["requests"] == {"ok": 5}


def test_http_json_with_gzip_is_accepted_and_answered_in_json(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        body = gzip.compress(json.dumps(otlp_json(stage_spans(0, 3))).encode())
        status, headers, answer = post(service.bound_ports[1], body, "application/json", headers={"Content-Encoding": "gzip"})
        assert (status, headers["content-type"], json.loads(answer)) == (200, "application/json", {})
        assert accepted(service, 3) == 3


def test_duplicates_are_counted_not_accepted_twice(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        spans = stage_spans(0, 4)
        exporter = grpc_exporter(service.bound_ports[0])
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        accepted(service)
        assert (service.status()["spans"]["accepted"], service.status()["spans"]["duplicate"]) == (4, 4)


def test_heartbeats_arrive_on_both_receivers_in_every_encoding(tmp_path):
    from otel_straggler.testing.otlp_spans import heartbeat_span

    beat = [heartbeat_span(3, 1_700_000_000_000_000_000, local_rank=3)]
    with running_service(service_config(tmp_path)) as service:
        assert grpc_exporter(service.bound_ports[0]).export(beat) is SpanExportResult.SUCCESS
        assert post(service.bound_ports[1], request_bytes(beat))[0] == 200
        assert post(service.bound_ports[1], json.dumps(otlp_json(beat)).encode(), "application/json")[0] == 200
        deadline = time.monotonic() + 10
        while service.status()["spans"]["heartbeats"] < 3 or service.status()["engine"]["heartbeats"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status = service.status()
    assert status["spans"]["heartbeats"] == 3 and status["spans"]["malformed"] == 0
    assert status["engine"]["heartbeats"] == 1  # the same sample three times: the engine keeps it once


# ---------------------------------------------------------------- malformed and partial

def test_a_malformed_protobuf_is_400_with_a_status_over_http_and_invalid_argument_over_grpc(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        grpc_port, http_port = service.bound_ports
        status, headers, answer = post(http_port, b"\xff\xff\xff")
        assert status == 400 and headers["content-type"] == "application/x-protobuf"
        rpc_status = status_pb2.Status.FromString(answer)
        assert rpc_status.code == code_pb2.INVALID_ARGUMENT and "ExportTraceServiceRequest" in rpc_status.message
        status, _, answer = post(http_port, b"{not json", "application/json")
        assert status == 400 and json.loads(answer)["code"] == code_pb2.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as refused:
            raw_grpc_export(grpc_port, b"\xff\xff\xff")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert service.status()["requests"] == {"malformed": 3}


def test_rejected_spans_are_reported_as_partial_success(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        grpc_port, http_port = service.bound_ports
        response = raw_grpc_export(grpc_port, request_bytes(with_one_malformed(stage_spans(0, 2))))
        assert response.partial_success.rejected_spans == 1 and contract.SEQ in response.partial_success.error_message
        status, _, answer = post(http_port, request_bytes(with_one_malformed(stage_spans(1, 2))))
        assert status == 200 and ExportTraceServiceResponse.FromString(answer).partial_success.rejected_spans == 1
        body = json.dumps(otlp_json(with_one_malformed(stage_spans(2, 2)))).encode()
        status, _, answer = post(http_port, body, "application/json")
        assert status == 200 and json.loads(answer)["partialSuccess"]["rejectedSpans"] == "1"
        assert accepted(service, 6) == 6
        assert service.status()["spans"]["malformed"] == 3


def test_answers_with_a_body_on_a_kept_alive_connection_come_without_a_delayed_ack_stall(tmp_path):
    """A response written in two pieces (headers, then a body: here a partial success) with
    Nagle's algorithm on waits for the client's delayed ACK of the first, 40 ms on Linux, on
    every request of a kept-alive connection: 20 would take 0.8 s at least."""
    bodies = [request_bytes(with_one_malformed(stage_spans(rank=0, count=40, first_seq=40 * request)))
              for request in range(20)]
    with running_service(service_config(tmp_path)) as service:
        connection = http.client.HTTPConnection("127.0.0.1", service.bound_ports[1], timeout=10)
        try:
            started = time.monotonic()
            for body in bodies:
                connection.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
                response = connection.getresponse()
                assert response.status == 200 and response.read()  # a body: the partial success
            elapsed = time.monotonic() - started
        finally:
            connection.close()
    assert elapsed < 0.5, f"20 requests took {elapsed:.2f} s"


# ---------------------------------------------------------------- bounds and refusals

def test_requests_over_the_size_bound_are_refused(tmp_path):
    with running_service(service_config(tmp_path, max_request_bytes=4096)) as service:
        grpc_port, http_port = service.bound_ports
        big = request_bytes(stage_spans(0, 40))
        assert len(big) > 4096
        assert post(http_port, big)[0] == 413
        bomb = gzip.compress(b"\x00" * 100_000)  # 100 kB of zeros in a few hundred bytes
        assert len(bomb) < 4096
        assert post(http_port, bomb, headers={"Content-Encoding": "gzip"})[0] == 413
        with pytest.raises(grpc.RpcError) as refused:
            raw_grpc_export(grpc_port, big)  # far over the bound: refused by gRPC itself, not counted
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        just_over = next(body for body in (request_bytes(stage_spans(0, count)) for count in range(1, 40))
                         if len(body) > 4096)
        assert len(just_over) <= 4096 * 1.25
        with pytest.raises(grpc.RpcError) as refused:
            raw_grpc_export(grpc_port, just_over)  # over the bound: refused and counted as over HTTP
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert service.status()["requests"] == {"too_large": 3}


def test_wrong_paths_methods_types_and_encodings_get_their_http_codes(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        port = service.bound_ports[1]
        body = request_bytes(stage_spans(0, 1))
        assert post(port, body, path="/v1/profiles")[0] == 404
        assert post(port, b"", method="GET")[0] == 405
        assert post(port, body, content_type="text/plain")[0] == 415
        assert post(port, body, headers={"Content-Encoding": "br"})[0] == 415
        assert post(port, b"\x1f\x8b\x08\x00garbage", headers={"Content-Encoding": "gzip"})[0] == 400
        assert post(port, gzip.compress(body)[:-9], headers={"Content-Encoding": "gzip"})[0] == 400  # truncated
        assert post(port, body)[0] == 200


class GatedEngine(Engine):
    """The real engine behind a gate: ingest_many waits until the test opens it."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def ingest_many(self, observations):
        self.entered.set()
        self.gate.wait(30)
        return super().ingest_many(observations)


def _fill_the_queue(service, engine) -> None:
    http_port = service.bound_ports[1]
    # first request: taken by the engine thread, which then waits at the gate
    assert post(http_port, request_bytes(stage_spans(0, 2)))[0] == 200
    assert engine.entered.wait(5)
    # second request: waits in the queue, which holds one
    assert post(http_port, request_bytes(stage_spans(1, 2)))[0] == 200


def test_a_full_queue_answers_retry_later_and_counts_the_spans_dropped(tmp_path):
    config = service_config(tmp_path, max_pending_requests=1)
    engine = GatedEngine(config)
    with running_service(config, engine=engine) as service:
        grpc_port, http_port = service.bound_ports
        _fill_the_queue(service, engine)
        status, headers, answer = post(http_port, request_bytes(stage_spans(2, 2)))
        assert (status, headers["retry-after"]) == (503, "1")
        assert status_pb2.Status.FromString(answer).code == code_pb2.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as refused:
            raw_grpc_export(grpc_port, request_bytes(stage_spans(3, 2)))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(refused.value.trailing_metadata())
        retry = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
        assert retry.retry_delay.seconds == 1
        detail = status_pb2.Status.FromString(trailers["grpc-status-details-bin"]).details[0]
        assert detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
        engine.gate.set()
        assert accepted(service, 4) == 4
        assert service.status()["requests"]["overloaded"] == 2


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_exporters_retry_an_overloaded_detector_and_get_through(tmp_path, protocol):
    config = service_config(tmp_path, max_pending_requests=1)
    engine = GatedEngine(config)
    with running_service(config, engine=engine) as service:
        _fill_the_queue(service, engine)
        exporter = grpc_exporter(service.bound_ports[0]) if protocol == "grpc" else http_exporter(service.bound_ports[1])
        results = []
        client = threading.Thread(target=lambda: results.append(exporter.export(stage_spans(5, 3))))
        client.start()
        deadline = time.monotonic() + 5
        while not service.status()["requests"].get("overloaded") and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.gate.set()  # the detector recovers; the exporter's retry after Retry-After/RetryInfo succeeds
        client.join(20)
        assert results == [SpanExportResult.SUCCESS]
        assert service.status()["requests"]["overloaded"] >= 1
        assert accepted(service, 7) == 7


def test_beyond_the_bound_a_new_connection_takes_the_place_of_the_one_waiting_longest(tmp_path):
    with running_service(service_config(tmp_path, max_http_connections=1)) as service:
        port = service.bound_ports[1]
        body = request_bytes(stage_spans(0, 1))
        kept_alive = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        kept_alive.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
        assert kept_alive.getresponse().read() is not None  # served, now idle, waiting for its next request
        assert post(port, body)[0] == 200  # the newcomer is served in its place at once
        with pytest.raises((OSError, http.client.HTTPException)):  # the idle one was closed for it
            kept_alive.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
            kept_alive.getresponse()
        kept_alive.close()
        assert service.status()["errors"]["http_evicted_waiting"] >= 1


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_idle_kept_alive_connection_is_closed_at_the_head_timeout_without_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(receiver_http, "HEAD_TIMEOUT_S", 0.5)
    with running_service(service_config(tmp_path)) as service:
        port = service.bound_ports[1]
        kept_alive = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        kept_alive.request("POST", "/v1/traces", body=request_bytes(stage_spans(0, 1)),
                           headers={"Content-Type": "application/x-protobuf"})
        assert kept_alive.getresponse().read() is not None
        wait_until(lambda: not service._http._connections)  # closed by the detector
        kept_alive.close()
        assert "http_request_deadline" not in service.status()["errors"]


def dribbling(port: int, head: bytes, stop: threading.Event, every_s: float = 0.2) -> threading.Thread:
    """A client that sends `head`, then one byte every `every_s` until `stop` or the server cuts it."""
    def dribble() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.sendall(head)
            try:
                while not stop.wait(every_s):
                    slow.sendall(b"x")
            except OSError:
                pass

    thread = threading.Thread(target=dribble)
    thread.start()
    return thread


def test_a_client_dribbling_its_body_is_cut_at_its_deadline_and_others_get_503_meanwhile(tmp_path, monkeypatch):
    """A body must come at MIN_BODY_BYTES_PER_S after BODY_GRACE_S: a byte every 0.2 s does not. While
    it is read, the connection is busy: the one slot there is answers a newcomer 503 at once."""
    monkeypatch.setattr(receiver_http, "BODY_GRACE_S", 1.0)
    with running_service(service_config(tmp_path, max_http_connections=1)) as service:
        port = service.bound_ports[1]
        body = request_bytes(stage_spans(0, 1))
        stop = threading.Event()
        started = time.monotonic()
        dribbler = dribbling(port, b"POST /v1/traces HTTP/1.1\r\nHost: d\r\nContent-Type: application/x-protobuf\r\n"
                                   b"Content-Length: 1000\r\n\r\n", stop)
        wait_until(lambda: any(connection.waiting_since is None  # its head read: busy with its body
                               for connection in list(service._http._connections.values())))
        assert post(port, body)[0] == 503
        deadline = time.monotonic() + 10
        while not _posted(port, body):  # taken back at the deadline (1 s)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert time.monotonic() - started < 5
        stop.set()
        dribbler.join(5)
        assert service.status()["errors"].get("http_request_deadline") == 1


def test_a_refused_client_reads_its_503_even_while_sending_a_large_body(tmp_path, monkeypatch):
    """The 503 for a newcomer when every connection is busy is answered before its body is read:
    the server reads and drops what the client is still sending before it closes, since a close
    with unread bytes resets the connection, and the reset can destroy the answer unread."""
    monkeypatch.setattr(receiver_http, "BODY_GRACE_S", 5.0)
    with running_service(service_config(tmp_path, max_http_connections=1)) as service:
        port = service.bound_ports[1]
        stop = threading.Event()
        dribbler = dribbling(port, b"POST /v1/traces HTTP/1.1\r\nHost: d\r\nContent-Type: application/x-protobuf\r\n"
                                   b"Content-Length: 1000\r\n\r\n", stop)
        wait_until(lambda: any(connection.waiting_since is None
                               for connection in list(service._http._connections.values())))
        large = request_bytes(stage_spans(0, 1)) + b"\0" * (512 * 1024)  # far over a socket's buffers
        assert [post(port, large)[0] for _ in range(3)] == [503, 503, 503]
        stop.set()
        dribbler.join(5)


def test_slow_heads_neither_hold_a_slot_nor_last_past_the_head_timeout(tmp_path, monkeypatch):
    """Slowloris: connections sending their head a byte at a time are waiting, so a newcomer takes
    the place of one at once, and each is closed HEAD_TIMEOUT_S after it opened."""
    monkeypatch.setattr(receiver_http, "HEAD_TIMEOUT_S", 3.0)
    with running_service(service_config(tmp_path, max_http_connections=4)) as service:
        port = service.bound_ports[1]
        body = request_bytes(stage_spans(0, 1))
        stop = threading.Event()
        dribblers = [dribbling(port, b"POST /v1/traces HTTP/1.1\r\nX-Slow: ", stop) for _ in range(4)]
        wait_until(lambda: len(service._http._connections) == 4)  # every place taken by a slow head
        served = time.monotonic()
        assert post(port, body)[0] == 200
        assert time.monotonic() - served < 1.5  # at once, not when a head timeout frees a place

        def closed() -> int:
            errors = service.status()["errors"]
            return errors.get("http_evicted_waiting", 0) + errors.get("http_request_deadline", 0)
        wait_until(lambda: closed() == 4)  # one for the newcomer, three at the head timeout
        stop.set()
        for dribbler in dribblers:
            dribbler.join(5)


def raw_request(port: int, data: bytes) -> bytes:
    """Sends `data` as is and returns all the server answers before it closes (or 5 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(data)
        answer = b""
        try:
            while chunk := connection.recv(65536):
                answer += chunk
        except socket.timeout:
            pass
        return answer


@pytest.mark.parametrize("head, status", [
    (b"Content-Length: 3\r\nContent-Length: 4\r\n", 400),  # two different lengths
    (b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", 400),  # both framings: smuggling
    (b"Content-Length: +3\r\n", 400),
    (b"Content-Length: 1_2\r\n", 400),
    (b"Content-Length: 3\r\nno colon here\r\n", 400),
], ids=["two-lengths", "length-and-chunked", "plus-sign", "underscore", "line-without-colon"])
def test_ambiguous_framing_is_refused_with_a_status_line_and_the_connection_closed(tmp_path, head, status):
    with running_service(service_config(tmp_path)) as service:
        port = service.bound_ports[1]
        answer = raw_request(port, b"POST /v1/traces HTTP/1.1\r\nHost: d\r\nContent-Type: application/x-protobuf\r\n"
                             + head + b"\r\nabc")
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:80]
        assert service.status()["spans"].get("accepted", 0) == 0


def test_other_methods_get_405_and_a_garbage_request_line_a_400_with_its_status_line(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        port = service.bound_ports[1]
        for method in ("HEAD", "OPTIONS", "GET", "PUT"):
            answer = raw_request(port, f"{method} /v1/traces HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 405 ") and b"\r\nallow: post\r\n" in answer.lower()
        assert raw_request(port, b"HELLO THERE\r\n\r\n").startswith(b"HTTP/1.1 400 ")


def test_a_gzip_body_of_many_empty_members_is_refused_cheaply(tmp_path):
    empty_member = gzip.compress(b"")
    body = empty_member * (1024 * 1024 // len(empty_member))  # 1 MiB of empty members
    with running_service(service_config(tmp_path)) as service:
        port = service.bound_ports[1]
        started = time.process_time()
        status, _, answer = post(port, body, headers={"Content-Encoding": "gzip"})
        assert status == 400 and b"members" in status_pb2.Status.FromString(answer).message.encode()
        assert time.process_time() - started < 0.5  # this process's CPU, the detector's included
        # two members of real spans are fine (a body a proxy appended to)
        two = gzip.compress(request_bytes(stage_spans(0, 1))) + gzip.compress(request_bytes(stage_spans(1, 1)))
        assert post(port, two, headers={"Content-Encoding": "gzip"})[0] == 200


def test_grpc_streams_that_never_send_their_message_hold_nothing_others_need(tmp_path, monkeypatch):
    """Calls that open a stream and never send (as four slow HTTP/2 streams did, when each held one of
    four worker threads): more of them than max_grpc_calls, and exports still get through at once; the
    slow ones end UNAVAILABLE (their place taken) or DEADLINE_EXCEEDED (RECEIVE_TIMEOUT_S)."""
    from otel_straggler.detector import receiver_grpc

    monkeypatch.setattr(receiver_grpc, "RECEIVE_TIMEOUT_S", 2.0)
    with running_service(service_config(tmp_path, max_grpc_calls=4)) as service:
        port = service.bound_ports[0]
        never = threading.Event()

        def silent_messages():
            never.wait(10)
            return
            yield  # a generator that yields nothing, late

        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        slow_call = channel.stream_unary(EXPORT_METHOD, request_serializer=None,
                                         response_deserializer=ExportTraceServiceResponse.FromString)
        slow = [slow_call.future(silent_messages(), timeout=15) for _ in range(8)]
        time.sleep(0.5)
        started = time.monotonic()
        for rank in range(3):
            assert grpc_exporter(port).export(stage_spans(rank, 2)) is SpanExportResult.SUCCESS
        assert time.monotonic() - started < 2.0
        codes = {future.exception(timeout=10).code() for future in slow}
        never.set()
        channel.close()
        assert codes <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
        assert accepted(service, 6) == 6
        errors = service.status()["errors"]
        assert errors.get("grpc_evicted_waiting", 0) + errors.get("grpc_request_deadline", 0) >= 8


def _posted(port: int, body: bytes) -> bool:
    try:
        return post(port, body)[0] == 200
    except (OSError, http.client.HTTPException):  # refused while the thread was still finishing
        return False


# ---------------------------------------------------------------- auth and TLS

@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o600, False)])
def test_a_token_file_every_user_can_read_is_warned_about(tmp_path, caplog, mode, warned):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(mode)
    assert load_token(DetectorConfig(auth_token_file=str(token_file))) == "s3cret-token"
    said = [record.getMessage() for record in caplog.records if "readable by every user" in record.getMessage()]
    assert bool(said) == warned
    assert all("s3cret" not in message for message in said)


def test_a_wrong_or_missing_bearer_token_is_refused_and_the_right_one_accepted(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with running_service(service_config(tmp_path, auth_token_file=str(token_file))) as service:
        grpc_port, http_port = service.bound_ports
        body = request_bytes(stage_spans(0, 2))
        assert post(http_port, body)[0] == 401
        status, headers, _ = post(http_port, body, headers={"Authorization": "Bearer wrong"})
        assert (status, headers["www-authenticate"]) == (401, "Bearer")
        assert post(http_port, body, headers={"Authorization": "Basic s3cret-token"})[0] == 401
        assert grpc_exporter(grpc_port, headers={"authorization": "Bearer wrong"}).export(
            stage_spans(1, 2)) is SpanExportResult.FAILURE
        assert accepted(service) == 0
        assert http_exporter(http_port, headers={"Authorization": "Bearer s3cret-token"}).export(
            stage_spans(2, 2)) is SpanExportResult.SUCCESS
        assert grpc_exporter(grpc_port, headers={"authorization": "bearer s3cret-token"}).export(
            stage_spans(3, 2)) is SpanExportResult.SUCCESS
        assert accepted(service, 4) == 4
        assert service.status()["requests"] == {"unauthenticated": 4, "ok": 2}


def test_tls_serves_both_protocols(tmp_path, monkeypatch):
    from pipeline.otlp_sink import make_self_signed_certificate

    # requests lets these env vars override the exporter's own certificate_file
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)

    cert, key = make_self_signed_certificate(tmp_path / "tls", name="detector")
    with running_service(service_config(tmp_path, tls_cert_file=str(cert), tls_key_file=str(key))) as service:
        grpc_port, http_port = service.bound_ports
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        assert grpc_exporter(grpc_port, insecure=False, credentials=credentials).export(
            stage_spans(0, 2)) is SpanExportResult.SUCCESS
        assert http_exporter(http_port, scheme="https", certificate_file=str(cert)).export(
            stage_spans(1, 2)) is SpanExportResult.SUCCESS
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            post(http_port, request_bytes(stage_spans(2, 2)))  # plain HTTP to a TLS port
        assert accepted(service, 4) == 4


def test_the_metrics_port_takes_the_otlp_ports_tls_and_token(tmp_path, monkeypatch):
    """A detector that guards its OTLP ports with TLS and a token does not leave /metrics open."""
    import ssl
    import urllib.error
    import urllib.request

    from pipeline.otlp_sink import make_self_signed_certificate

    cert, key = make_self_signed_certificate(tmp_path / "tls", name="detector")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    config = service_config(tmp_path, tls_cert_file=str(cert), tls_key_file=str(key), auth_token_file=str(token_file),
                            prometheus_port=0)
    with running_service(config) as service:
        url = f"https://127.0.0.1:{service.prometheus_port}/metrics"
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10, context=context)
        assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
        request = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret-token"})
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            assert response.status == 200 and b"straggler_detector_spans_total" in response.read()
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP: no answer
            urllib.request.urlopen(url.replace("https:", "http:"), timeout=10)
        assert service.status()["errors"]["prometheus_unauthenticated"] == 1


def without_job_id(spans):
    """The spans as a rank that found no job id sends them."""
    from opentelemetry.sdk.resources import Resource

    resource = Resource({key: value for key, value in spans[0].resource.attributes.items() if key != contract.JOB_ID})
    return [ReadableSpan(name=span.name, context=span.context, resource=resource, attributes=span.attributes,
                         start_time=span.start_time, end_time=span.end_time) for span in spans]


def test_spans_without_a_job_id_are_counted_by_kind_in_status_and_metrics_and_logged_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "otel_straggler.detector.rejections")
    with running_service(service_config(tmp_path, prometheus_port=0)) as service:
        for _ in range(2):
            status, _, answer = post(service.bound_ports[1], request_bytes(without_job_id(stage_spans(0, 5))))
            assert status == 200 and ExportTraceServiceResponse.FromString(answer).partial_success.rejected_spans == 5
        status_file = tmp_path / "evidence" / "status.json"
        deadline = time.monotonic() + 10
        while json.loads(status_file.read_text() if status_file.exists() else "{}").get("rejections") != {
                "missing_job_id": 10}:
            assert time.monotonic() < deadline, "status.json never counted the rejections"
            time.sleep(0.02)
        assert service.status()["spans"]["malformed"] == 10
        with urllib.request.urlopen(f"http://127.0.0.1:{service.prometheus_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    assert 'straggler_detector_rejections_total{reason="missing_job_id"} 10' in text
    assert 'straggler_detector_spans_total{outcome="malformed"} 10' in text
    (line,) = [record.getMessage() for record in caplog.records if record.name == "otel_straggler.detector.rejections"]
    assert line.startswith("5 span(s) rejected as malformed (missing_job_id)") and "rank 0, host 'node-0'" in line
