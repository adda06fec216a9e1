"""The rank's OTLP/HTTP span export: our encoding over one kept-alive connection
(KeptAliveHTTPTransport) with retries, headers and compression from the environment; a requests
Session (SessionTransport) where a proxy, credentials or a credential provider need one."""
from __future__ import annotations

import contextlib
import gzip
import http.server
import os
import shutil
import ssl
import subprocess
import threading
import time
from typing import Any, Optional

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler.instrumentation import http_transport
from otel_straggler.instrumentation.http_transport import SessionTransport
from otel_straggler.instrumentation.exporting import span_exporter

PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                   "NO_PROXY", "no_proxy")


class Http11Receiver(http.server.ThreadingHTTPServer):
    """OTLP/HTTP traces over HTTP/1.1: keeps connections open unless told to drop each one
    after its response without saying so (as a server timing out an idle connection does)."""
    daemon_threads = True

    def __init__(self, tls: Optional[ssl.SSLContext] = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.requests: list[tuple[tuple, dict, bytes]] = []  # (client address, headers, body)
        self.drop_after_response = False
        self.responses: list[tuple[int, list]] = []  # given before 200s: (status, [(header, value)])
        self.answer_after_s = 0.0
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.server_address[1]}"

    def span_names(self) -> list[str]:
        names = []
        for _, headers, body in self.requests:
            if headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            names += [span.name for resource in request.resource_spans for scope in resource.scope_spans
                      for span in scope.spans]
        return names

    def connections(self) -> int:
        return len({address for address, _, _ in self.requests})


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append((self.client_address, {k.lower(): v for k, v in self.headers.items()}, body))
        status, headers = self.server.responses.pop(0) if self.server.responses else (200, [])
        payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString() if status == 200 else b"no"
        time.sleep(self.server.answer_after_s)
        self.send_response(status)
        for key, value in [("Content-Type", "application/x-protobuf"), *headers]:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        if self.server.drop_after_response:
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(server: Http11Receiver):
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def no_proxy_or_netrc(monkeypatch, tmp_path):
    """Whatever this machine's user has configured: no proxy, no netrc (each keeps the SDK's transport)."""
    for variable in PROXY_VARIABLES + ("NETRC",):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.fixture
def receiver():
    with serving(Http11Receiver()) as server:
        yield server


def export_batches(exporter, batches: int, per_batch: int = 3) -> list[SpanExportResult]:
    tracer = TracerProvider().get_tracer("test")
    results = []
    for batch in range(batches):
        items = []
        for index in range(per_batch):
            span = tracer.start_span(f"span-{batch}-{index}")
            span.end()
            items.append(exporter.prewrite(span))
        results.append(exporter.export(items))
    return results


def test_spans_go_out_encoded_by_us_over_one_kept_alive_connection(receiver):
    exporter = span_exporter(receiver.endpoint, "http/protobuf")
    try:
        assert isinstance(exporter.transport, http_transport.KeptAliveHTTPTransport)
        assert export_batches(exporter, 4) == [SpanExportResult.SUCCESS] * 4
    finally:
        exporter.shutdown()
    assert receiver.span_names() == [f"span-{batch}-{index}" for batch in range(4) for index in range(3)]
    assert receiver.connections() == 1
    assert all(headers["content-type"] == "application/x-protobuf" for _, headers, _ in receiver.requests)


def test_a_connection_the_server_dropped_is_made_again_and_nothing_is_lost(receiver):
    receiver.drop_after_response = True
    exporter = span_exporter(receiver.endpoint, "http/protobuf")
    try:
        assert export_batches(exporter, 3) == [SpanExportResult.SUCCESS] * 3
    finally:
        exporter.shutdown()
    assert len(receiver.span_names()) == 9
    assert receiver.connections() == 3


def test_headers_and_compression_from_the_environment_apply(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=team-a")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    exporter = span_exporter(receiver.endpoint, "http/protobuf")
    try:
        assert export_batches(exporter, 1) == [SpanExportResult.SUCCESS]
    finally:
        exporter.shutdown()
    (_, headers, _), = receiver.requests
    assert (headers["x-tenant"], headers["content-encoding"]) == ("team-a", "gzip")
    assert len(receiver.span_names()) == 3


def test_a_rejected_request_fails_at_once_and_a_throttled_one_is_retried_when_told(receiver):
    receiver.responses = [(400, []), (503, [("Retry-After", "0")])]
    exporter = span_exporter(receiver.endpoint, "http/protobuf")
    try:
        assert export_batches(exporter, 1) == [SpanExportResult.FAILURE]  # 400: not retried
        started = time.monotonic()
        assert export_batches(exporter, 1) == [SpanExportResult.SUCCESS]
        # sent again as told (Retry-After: 0), not after the backoff of about a second
        assert time.monotonic() - started < 0.5
    finally:
        exporter.shutdown()
    assert len(receiver.requests) == 3
    assert receiver.span_names()[-3:] == ["span-0-0", "span-0-1", "span-0-2"]  # the second batch, taken


def test_a_proxy_sends_through_a_requests_session(receiver, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    behind_proxy = span_exporter(receiver.endpoint, "http/protobuf")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    bypassing = span_exporter(receiver.endpoint, "http/protobuf")
    monkeypatch.delenv("HTTP_PROXY")
    monkeypatch.delenv("NO_PROXY")
    monkeypatch.setenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER", "")  # set but blank: not used
    blank_provider = span_exporter(receiver.endpoint, "http/protobuf")
    try:
        assert isinstance(behind_proxy.transport, SessionTransport)
        assert isinstance(bypassing.transport, http_transport.KeptAliveHTTPTransport)
        assert isinstance(blank_provider.transport, http_transport.KeptAliveHTTPTransport)
        # the encoding is ours either way
        assert behind_proxy.prewrite is not None
    finally:
        for exporter in (behind_proxy, bypassing, blank_provider):
            exporter.shutdown()


@pytest.mark.parametrize("url, usable", [("http://collector:4318/v1/traces", True),
                                         ("https://collector/v1/traces", True),
                                         ("ftp://collector/v1/traces", False), ("not a url", False)])
def test_which_endpoints_the_kept_alive_transport_takes(url, usable):
    assert http_transport.usable_for(url) is usable


def test_a_netrc_file_needs_a_requests_session(tmp_path):
    assert http_transport.usable_for("http://collector:4318/v1/traces")
    (tmp_path / ".netrc").write_text("machine collector login user password token\n")  # HOME is tmp_path
    assert not http_transport.usable_for("http://collector:4318/v1/traces")


def test_an_oversized_batch_is_dropped_unsent_and_a_limit_of_0_is_no_limit(receiver):
    exporter = span_exporter(receiver.endpoint, "http/protobuf")
    try:
        exporter.max_request_size = 100  # three spans encode to more
        assert export_batches(exporter, 1) == [SpanExportResult.FAILURE]
        assert receiver.requests == []
        exporter.max_request_size = 0
        assert export_batches(exporter, 1) == [SpanExportResult.SUCCESS]
    finally:
        exporter.shutdown()


def test_a_forked_child_exports_on_its_own_connection(receiver):
    exporter = span_exporter(receiver.endpoint, "http/protobuf")
    try:
        assert export_batches(exporter, 1) == [SpanExportResult.SUCCESS]  # the parent's connection is made
        child = os.fork()
        if child == 0:
            code = 0 if export_batches(exporter, 1) == [SpanExportResult.SUCCESS] else 1
            os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert export_batches(exporter, 1) == [SpanExportResult.SUCCESS]  # the parent's is untouched
    finally:
        exporter.shutdown()
    assert len(receiver.span_names()) == 9 and receiver.connections() == 2


def test_an_unreachable_endpoint_is_a_connection_error_and_the_transport_recovers(receiver, unreachable_endpoint):
    transport = http_transport.KeptAliveHTTPTransport()
    try:
        failed = transport.request("POST", f"http://{unreachable_endpoint}/v1/traces", data=b"", timeout=2.0)
        assert failed.status_code is None and transport.is_connection_error(failed.error)
        body = trace_service_pb2.ExportTraceServiceRequest().SerializeToString()
        answered = transport.request("POST", f"{receiver.endpoint}/v1/traces", data=body, timeout=2.0,
                                     headers={"Content-Type": "application/x-protobuf"})
        assert answered.status_code == 200 and answered.headers["CONTENT-TYPE"] == "application/x-protobuf"
    finally:
        transport.close()


@pytest.fixture
def tls_receiver(tmp_path):
    """A receiver behind TLS with a throwaway certificate for 127.0.0.1 (its own CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (scripts/services.sh build installs it)")
    cert, key = tmp_path / "receiver.crt", tmp_path / "receiver.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=receiver", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with serving(Http11Receiver(tls=context)) as server:
        server.certificate = str(cert)
        yield server


def test_https_verifies_the_receiver_against_the_configured_certificate(tls_receiver, monkeypatch):
    unverified = span_exporter(tls_receiver.endpoint, "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", tls_receiver.certificate)
    trusted = span_exporter(tls_receiver.endpoint, "http/protobuf")
    try:
        assert isinstance(trusted.transport, http_transport.KeptAliveHTTPTransport)
        assert export_batches(trusted, 2) == [SpanExportResult.SUCCESS] * 2
        # a certificate no CA it trusts has signed: refused, not retried as a connection error
        started = time.monotonic()
        assert export_batches(unverified, 1) == [SpanExportResult.FAILURE]
        assert time.monotonic() - started < 5.0  # a connection error would be retried for the 10 s timeout
    finally:
        trusted.shutdown()
        unverified.shutdown()
    assert len(tls_receiver.span_names()) == 6


def test_only_verify_given_trusts_the_bundle_requests_would(tls_receiver, monkeypatch):
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", tls_receiver.certificate)
    exporter = span_exporter(tls_receiver.endpoint, "http/protobuf")
    try:
        assert export_batches(exporter, 1) == [SpanExportResult.SUCCESS]
    finally:
        exporter.shutdown()


def test_repeated_response_headers_are_joined_and_read_in_any_case(receiver):
    receiver.responses = [(200, [("X-Seen", "a"), ("x-seen", "b")])]
    transport = http_transport.KeptAliveHTTPTransport()
    try:
        result = transport.request("POST", f"{receiver.endpoint}/v1/traces", data=b"", timeout=2.0)
    finally:
        transport.close()
    assert result.status_code == 200 and result.headers.get("X-SEEN") == "a, b"


def test_close_does_not_wait_for_a_request_in_flight(receiver):
    receiver.answer_after_s = 1.5
    transport = http_transport.KeptAliveHTTPTransport()
    answered = []
    sender = threading.Thread(target=lambda: answered.append(
        transport.request("POST", f"{receiver.endpoint}/v1/traces", data=b"", timeout=5.0)))
    sender.start()
    time.sleep(0.3)  # the request is on its way
    started = time.monotonic()
    transport.close()
    assert time.monotonic() - started < 0.2
    sender.join(5.0)
    # the request in flight still ends normally; its connection is not kept
    assert answered[0].status_code == 200 and transport._connection is None


def test_credentials_in_the_endpoint_need_a_requests_session(receiver):
    assert not http_transport.usable_for("http://user:token@127.0.0.1:4318/v1/traces")
    exporter = span_exporter(receiver.endpoint.replace("http://", "http://user:token@"), "http/protobuf")
    try:
        assert isinstance(exporter.transport, SessionTransport)
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("response, body, kept", [
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n3;x=y\r\ncde\r\n0\r\nTrailer: t\r\n\r\n",
     b"abcde", True),
    (b"HTTP/1.1 503 Busy\r\nRetry-After: 2\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", b"", False),
    (b"HTTP/1.0 200 OK\r\n\r\nto the close", b"to the close", False),
])
def test_the_response_parser_reads_each_framing(response, body, kept):
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def answer_once():
        connection, _ = listener.accept()
        with connection:
            request = b""
            while b"\r\n\r\n" not in request:
                request += connection.recv(65536)
            head, _, rest = request.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += connection.recv(65536)
            received.append((head, rest))
            connection.sendall(response)
            if not kept:
                connection.shutdown(socket.SHUT_WR)
            time.sleep(0.2)

    server = threading.Thread(target=answer_once, daemon=True)
    server.start()
    transport = http_transport.KeptAliveHTTPTransport()
    try:
        result = transport.request("POST", f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces",
                                   headers={"Content-Type": "application/x-protobuf"}, timeout=5.0, data=b"payload")
        assert result.error is None, result.error
        assert result.body == body and (transport._connection is not None) is kept
        head, sent = received[0]
        assert sent == b"payload" and head.startswith(b"POST /v1/traces HTTP/1.1\r\n")
        assert b"content-type: application/x-protobuf" in head.lower()
    finally:
        transport.close()
        server.join(5)
        listener.close()
