"""OTLP/HTTP trace receiver: POST /v1/traces, protobuf or JSON, optionally gzip/deflate, optional TLS.

Status codes follow the OTLP/HTTP spec: 200 (with partial success when spans were rejected), 400
malformed or a corrupt compressed body (a google.rpc.Status body in the request's encoding), 401
without the right bearer token, 413 over the size bound, 415 unknown content type or encoding, 503
with Retry-After when the queue is full (exporters retry 503), 404 for any other path. Connections
(`max_http_connections`), idle reads and each request's time are bounded by http_server.
"""
from __future__ import annotations

import ssl
import threading
import zlib
from typing import Optional

from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from otel_straggler.detector.decode import MalformedPayload
from otel_straggler.detector.http_server import BoundedHTTPServer, BoundedRequestHandler
from otel_straggler.detector.receiver import RETRY_AFTER_S, ExportOutcome, OtlpIntake, Result

TRACES_PATH = "/v1/traces"
# accepted and dropped (receiver.OTHER_SIGNALS), answered with their empty responses
OTHER_SIGNAL_RESPONSES = {"/v1/metrics": ExportMetricsServiceResponse, "/v1/logs": ExportLogsServiceResponse}
PROTOBUF = "application/x-protobuf"
JSON = "application/json"

_HTTP_STATUS = {
    Result.OK: 200, Result.PARTIAL: 200, Result.MALFORMED: 400, Result.OVERLOADED: 503,
    Result.UNAUTHENTICATED: 401, Result.TOO_LARGE: 413, Result.UNSUPPORTED: 415,
}
_RPC_CODE = {
    Result.MALFORMED: code_pb2.INVALID_ARGUMENT, Result.OVERLOADED: code_pb2.UNAVAILABLE,
    Result.UNAUTHENTICATED: code_pb2.UNAUTHENTICATED, Result.TOO_LARGE: code_pb2.RESOURCE_EXHAUSTED,
    Result.UNSUPPORTED: code_pb2.INVALID_ARGUMENT,
}


class _TooLarge(Exception):
    pass


class _UnsupportedEncoding(Exception):
    pass


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undoes Content-Encoding gzip or deflate, refusing output over `limit` bytes before producing
    it all (a small gzip bomb costs at most `limit` bytes of memory)."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _UnsupportedEncoding(f"unsupported Content-Encoding {encoding!r} (gzip, deflate or none)")
    output = bytearray()
    remaining = body
    while remaining:  # gzip allows several members back to back
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # detects the gzip or zlib header
        try:
            output += inflater.decompress(remaining, limit + 1 - len(output))
        except zlib.error as error:
            raise MalformedPayload(f"corrupt {encoding} body: {error}") from None
        if len(output) > limit:
            raise _TooLarge(f"decompressed body over {limit} bytes")
        if not inflater.eof:
            raise MalformedPayload(f"truncated {encoding} body")
        remaining = inflater.unused_data
    return bytes(output)


class _Handler(BoundedRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as OTLP exporters expect
    server: "_Server"

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.body_read = False
        path = self.path.split("?", 1)[0]
        if path != TRACES_PATH and path not in OTHER_SIGNAL_RESPONSES:
            self._no_such_endpoint()
            return
        intake = self.server.intake
        content_type = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        is_json = content_type == JSON
        if not intake.authorized(self.headers.get("Authorization")):
            self._fail(ExportOutcome(Result.UNAUTHENTICATED, "missing or wrong bearer token"), is_json,
                       {"WWW-Authenticate": "Bearer"})
            return
        if content_type not in (PROTOBUF, JSON):
            intake.refused(Result.UNSUPPORTED)
            self._fail(ExportOutcome(Result.UNSUPPORTED, f"unsupported Content-Type {content_type!r}"), is_json)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            intake.refused(Result.MALFORMED)
            self._fail(ExportOutcome(Result.MALFORMED, "a valid Content-Length is required"), is_json)
            return
        if length > intake.max_request_bytes:
            intake.refused(Result.TOO_LARGE)
            self._fail(ExportOutcome(Result.TOO_LARGE, f"request over {intake.max_request_bytes} bytes"), is_json)
            return
        body = self.rfile.read(length)
        self.body_read = True
        if len(body) < length:
            self.close_connection = True
            return  # the client went away mid-body
        try:
            body = decompress(body, self.headers.get("Content-Encoding", "").strip().lower(), intake.max_request_bytes)
        except _TooLarge as error:
            intake.refused(Result.TOO_LARGE)
            self._fail(ExportOutcome(Result.TOO_LARGE, str(error)), is_json)
            return
        except _UnsupportedEncoding as error:
            intake.refused(Result.UNSUPPORTED)
            self._fail(ExportOutcome(Result.UNSUPPORTED, str(error)), is_json)
            return
        except MalformedPayload as error:
            intake.refused(Result.MALFORMED)
            self._fail(ExportOutcome(Result.MALFORMED, str(error)), is_json)
            return
        if path in OTHER_SIGNAL_RESPONSES:
            intake.other_signal()
            self._reply(200, *_encode(OTHER_SIGNAL_RESPONSES[path](), is_json))
            return
        outcome = intake.export(body, is_json)
        if outcome.result in (Result.OK, Result.PARTIAL):
            response = ExportTraceServiceResponse()
            if outcome.rejected_spans:
                response.partial_success.rejected_spans = outcome.rejected_spans
                response.partial_success.error_message = outcome.message
            self._reply(200, *_encode(response, is_json))
        else:
            extra = {"Retry-After": str(RETRY_AFTER_S)} if outcome.result is Result.OVERLOADED else {}
            self._fail(outcome, is_json, extra)

    def do_GET(self) -> None:  # noqa: N802
        self._no_such_endpoint()

    do_PUT = do_DELETE = do_PATCH = do_GET

    def _no_such_endpoint(self) -> None:
        self.close_connection = True  # whatever body came with it is not read
        path = self.path.split("?", 1)[0]
        if path == TRACES_PATH or path in OTHER_SIGNAL_RESPONSES:
            self._reply(405, b"", "text/plain", {"Allow": "POST"})
        else:
            self._reply(404, b"", "text/plain")

    def _fail(self, outcome: ExportOutcome, is_json: bool, headers: Optional[dict] = None) -> None:
        if not self.body_read:
            self.close_connection = True  # an unread body would be taken for the next request
        status = status_pb2.Status(code=_RPC_CODE[outcome.result], message=outcome.message)
        self._reply(_HTTP_STATUS[outcome.result], *_encode(status, is_json), headers)

    def _reply(self, code: int, body: bytes, content_type: str, headers: Optional[dict] = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


def _encode(message, is_json: bool) -> tuple[bytes, str]:
    if is_json:
        return json_format.MessageToJson(message, indent=None).encode(), JSON
    return message.SerializeToString(), PROTOBUF


class _Server(BoundedHTTPServer):
    def __init__(self, address: tuple[str, int], intake: OtlpIntake, ssl_context: Optional[ssl.SSLContext],
                 max_connections: int) -> None:
        self.intake = intake
        self._ssl_context = ssl_context
        super().__init__(address, _Handler, max_connections, self._count)

    def _count(self, event: str) -> None:
        if event == "refused":
            self.intake.refused(Result.OVERLOADED)
        elif event == "connection_error":
            self.intake.counters.add_error("http_connection")
        else:
            self.intake.counters.add_error(f"http_{event}")

    def get_request(self):
        connection, client = super().get_request()
        if self._ssl_context is not None:
            # the handshake runs on the connection's own thread (first read), not on the accept loop
            connection = self._ssl_context.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
        return connection, client


class OtlpHttpReceiver:
    def __init__(self, intake: OtlpIntake, address: str, port: int, max_connections: int,
                 ssl_context: Optional[ssl.SSLContext] = None) -> None:
        self._server = _Server((address, port), intake, ssl_context, max_connections)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="straggler-otlp-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops accepting; requests already being served finish on their own threads."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context
