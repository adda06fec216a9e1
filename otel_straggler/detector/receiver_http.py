"""OTLP/HTTP trace receiver: POST /v1/traces, protobuf or JSON, optionally gzip/deflate, optional TLS.

Status codes follow the OTLP/HTTP spec: 200 (with partial success when spans were rejected), 400
malformed or a corrupt compressed body (a google.rpc.Status body in the request's encoding), 401
without the right bearer token, 413 over the size bound, 415 unknown content type or encoding, 503
with Retry-After when the queue is full (exporters retry 503), 404 for any other path, 405 (with
`Allow: POST`) for another method on an OTLP path.

HTTP/1.1 itself is h11's (a strict RFC 9112 parser, the one httpx and uvicorn use): a request line
or header line it cannot parse, conflicting or non-numeric Content-Length headers, and (here) a
Content-Length beside Transfer-Encoding are a 400 with the connection closed, as the RFC asks of a
server that could otherwise be led into request smuggling behind a proxy. Connections live on the
intake loop (intake_loop.py), a coroutine each, so a slow client holds no thread:
- a request's head must be complete within HEAD_TIMEOUT_S of the connection opening or of the
  previous answer, and its body must arrive at MIN_BODY_BYTES_PER_S after BODY_GRACE_S; past
  either the connection is closed (`errors.http_request_deadline`; a kept-alive connection that
  sent nothing of a next request is just closed);
- at most `max_http_connections` at once: a new one beyond takes the place of the connection that
  has waited longest for its next request (idle keep-alive or dribbling its head,
  `errors.http_evicted_waiting`), and gets a 503 only when every connection is busy with a request;
- decompression is bounded in output (max_request_bytes) and in gzip members (MAX_GZIP_MEMBERS).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import zlib
from typing import Optional

import h11
from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from otel_straggler.detector.decode import MalformedPayload
from otel_straggler.detector.intake_loop import IntakeLoop
from otel_straggler.detector.receiver import RETRY_AFTER_S, ExportOutcome, OtlpIntake, Result

_log = logging.getLogger(__name__)
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


MAX_GZIP_MEMBERS = 16  # exporters send one; each further member costs a copy of the rest of the body


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undoes Content-Encoding gzip or deflate, refusing output over `limit` bytes before producing
    it all (a small gzip bomb costs at most `limit` bytes of memory) and more than MAX_GZIP_MEMBERS
    members back to back (a body of thousands of empty members cost seconds of CPU a MiB)."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _UnsupportedEncoding(f"unsupported Content-Encoding {encoding!r} (gzip, deflate or none)")
    output = bytearray()
    remaining = body
    members = 0
    while remaining:  # gzip allows several members back to back
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise MalformedPayload(f"{encoding} body of more than {MAX_GZIP_MEMBERS} members")
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


HEAD_TIMEOUT_S = 15.0  # longer than an SDK exporter's 5 s between exports, so its connection is reused
BODY_GRACE_S = 5.0
MIN_BODY_BYTES_PER_S = 128 * 1024  # a 16 MiB body has 2 min
MAX_HEAD_BYTES = 64 * 1024  # request line and headers
WRITE_TIMEOUT_S = 10.0  # a client that does not read its answer
READ_CHUNK = 256 * 1024
# a refused connection's request is read and dropped before the close, so that its client reads the
# 503: closing with bytes unread resets the connection, and a reset can destroy the answer first
REFUSED_LINGER_S = 0.5
REFUSED_LINGER_BYTES = 1024 * 1024
MAX_LINGERING = 64  # refused connections lingering at once; more are closed at once

_REFUSED = (f"HTTP/1.1 503 Service Unavailable\r\nRetry-After: {RETRY_AFTER_S}\r\n"
            "Content-Length: 0\r\nConnection: close\r\n\r\n").encode()


class _Deadline(Exception):
    pass


class _Connection:
    __slots__ = ("writer", "task", "waiting_since")

    def __init__(self, writer: asyncio.StreamWriter, now: float) -> None:
        self.writer = writer
        self.task: Optional[asyncio.Task] = None
        self.waiting_since: Optional[float] = now  # waiting for a request's head since; None: busy


class OtlpHttpReceiver:
    def __init__(self, intake: OtlpIntake, loop: IntakeLoop, address: str, port: int, max_connections: int,
                 ssl_context: Optional[ssl.SSLContext] = None) -> None:
        self._intake = intake
        self._loop = loop
        self._max_connections = max_connections
        self._connections: dict[asyncio.StreamWriter, _Connection] = {}
        self._logged_internal = False
        self._lingering = 0
        listening = _bound(address, port)
        self._server: asyncio.base_events.Server = loop.call(asyncio.start_server(
            self._serve, sock=listening, ssl=ssl_context,
            ssl_handshake_timeout=HEAD_TIMEOUT_S if ssl_context else None, start_serving=False, limit=READ_CHUNK))
        self.port: int = self._server.sockets[0].getsockname()[1]

    def start(self) -> None:
        self._loop.call(self._server.start_serving())

    def stop(self) -> None:
        """Stops accepting and closes every connection (a request being handled is cut)."""
        async def close() -> None:
            self._server.close()
            for connection in list(self._connections.values()):
                connection.writer.close()
            await self._server.wait_closed()
        try:
            self._loop.call(close(), timeout_s=5.0)
        except Exception:  # noqa: BLE001 - stopping: whatever is left goes with the loop
            pass

    # ---------------------------------------------------------------- connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            await self._close_refused(reader, writer)
            return
        connection = self._connections[writer]
        connection.task = asyncio.current_task()
        try:
            await self._requests(reader, writer, connection)
        except _Deadline:
            self._intake.counters.add_error("http_request_deadline")
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
            self._intake.counters.add_error("http_connection")
        except asyncio.CancelledError:
            pass  # evicted for a newcomer, or the receiver stopping
        except Exception:  # noqa: BLE001 - a bug here must cost one connection, not the receiver
            self._intake.counters.add_error("http_internal")
            if not self._logged_internal:
                self._logged_internal = True
                _log.exception("serving an OTLP/HTTP connection failed; counted as errors[http_internal] (logged once)")
        finally:
            self._connections.pop(writer, None)
            writer.close()

    async def _close_refused(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Closes a connection refused with 503 once its client has sent what it was sending (at most
        REFUSED_LINGER_BYTES, for at most REFUSED_LINGER_S), so the answer is not lost to a reset."""
        if self._lingering >= MAX_LINGERING:
            writer.close()
            return
        self._lingering += 1
        try:
            if writer.can_write_eof():
                writer.write_eof()  # the answer is complete: the client sees the end after it
            until = self._loop.loop.time() + REFUSED_LINGER_S
            left = REFUSED_LINGER_BYTES
            while left > 0:
                chunk = await asyncio.wait_for(reader.read(min(left, READ_CHUNK)),
                                               max(0.0, until - self._loop.loop.time()))
                if not chunk:
                    break
                left -= len(chunk)
        except (asyncio.TimeoutError, ConnectionError, OSError, ssl.SSLError):
            pass  # gone, or slower than the linger: closed either way
        finally:
            self._lingering -= 1
            writer.close()

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        now = self._loop.loop.time()
        if len(self._connections) >= self._max_connections:
            waiting = [(c.waiting_since, c) for c in self._connections.values() if c.waiting_since is not None]
            if not waiting:
                self._intake.refused(Result.OVERLOADED)
                writer.write(_REFUSED)
                return False
            _, longest = min(waiting, key=lambda pair: pair[0])
            self._connections.pop(longest.writer, None)
            longest.writer.close()
            if longest.task is not None:
                longest.task.cancel()
            self._intake.counters.add_error("http_evicted_waiting")
        self._connections[writer] = _Connection(writer, now)
        return True

    async def _requests(self, reader, writer, connection: _Connection) -> None:
        clock = self._loop.loop.time
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        while True:
            connection.waiting_since = clock()
            try:
                request = await _next_event(http, reader, clock() + HEAD_TIMEOUT_S)
            except _Deadline:
                if http.their_state is h11.IDLE and not http.trailing_data[0]:
                    return  # a kept-alive connection idle for the timeout: closed, nothing wrong
                raise
            except h11.RemoteProtocolError as error:
                if reader.at_eof():  # the client went away in the middle of its head
                    raise ConnectionResetError("closed mid-request") from None
                await _send_raw(writer, error.error_status_hint, str(error))
                self._intake.refused(Result.MALFORMED)
                return
            if isinstance(request, h11.ConnectionClosed):
                return
            connection.waiting_since = None
            status, body, content_type, headers = await self._answer(http, reader, writer, request)
            response_headers = [("Content-Type", content_type), ("Content-Length", str(len(body))),
                                *headers.items()]
            close = http.their_state is not h11.DONE  # the body was not read: the connection cannot go on
            if close:
                response_headers.append(("Connection", "close"))
            data = http.send(h11.Response(status_code=status, headers=response_headers))
            data += http.send(h11.Data(data=body)) + http.send(h11.EndOfMessage())
            writer.write(data)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
            if close or http.our_state is h11.MUST_CLOSE:
                return
            http.start_next_cycle()

    # ---------------------------------------------------------------- requests

    async def _answer(self, http: h11.Connection, reader, writer, request: h11.Request):
        """(status, body, content type, extra headers) for one request; reads its body only when
        it is to be decoded."""
        path = request.target.decode("latin-1").split("?", 1)[0]
        headers = _Headers(request.headers)
        content_type = headers.get("content-type").split(";", 1)[0].strip().lower()
        is_json = content_type == JSON
        intake = self._intake
        if path != TRACES_PATH and path not in OTHER_SIGNAL_RESPONSES:
            return 404, b"", "text/plain", {}
        if request.method != b"POST":
            return 405, b"", "text/plain", {"Allow": "POST"}
        if headers.get("transfer-encoding") and headers.get("content-length"):
            intake.refused(Result.MALFORMED)
            return _failure(ExportOutcome(Result.MALFORMED, "Content-Length and Transfer-Encoding together"), is_json)
        if not intake.authorized(headers.get("authorization") or None):
            return _failure(ExportOutcome(Result.UNAUTHENTICATED, "missing or wrong bearer token"), is_json,
                            {"WWW-Authenticate": "Bearer"})
        if content_type not in (PROTOBUF, JSON):
            intake.refused(Result.UNSUPPORTED)
            return _failure(ExportOutcome(Result.UNSUPPORTED, f"unsupported Content-Type {content_type!r}"), is_json)
        length = headers.first("content-length")
        if length and int(length) > intake.max_request_bytes:  # h11 checked that it is digits, and one value
            intake.refused(Result.TOO_LARGE)
            return _failure(ExportOutcome(Result.TOO_LARGE, f"request over {intake.max_request_bytes} bytes"), is_json)
        expected = int(length) if length else intake.max_request_bytes
        if http.they_are_waiting_for_100_continue:  # curl, for a body over 1 KiB
            writer.write(http.send(h11.InformationalResponse(status_code=100, headers=[])))
        body = await _read_body(http, reader, intake.max_request_bytes,
                                self._loop.loop.time() + BODY_GRACE_S + expected / MIN_BODY_BYTES_PER_S)
        if body is None:
            intake.refused(Result.TOO_LARGE)
            return _failure(ExportOutcome(Result.TOO_LARGE, f"request over {intake.max_request_bytes} bytes"), is_json)
        encoding = headers.get("content-encoding").strip().lower()
        return await self._loop.work(self._decode_and_export, path, body, encoding, is_json)

    def _decode_and_export(self, path: str, body: bytes, encoding: str, is_json: bool):
        """On a worker thread: decompress, decode, queue; the answer."""
        intake = self._intake
        try:
            body = decompress(body, encoding, intake.max_request_bytes)
        except _TooLarge as error:
            intake.refused(Result.TOO_LARGE)
            return _failure(ExportOutcome(Result.TOO_LARGE, str(error)), is_json)
        except _UnsupportedEncoding as error:
            intake.refused(Result.UNSUPPORTED)
            return _failure(ExportOutcome(Result.UNSUPPORTED, str(error)), is_json)
        except MalformedPayload as error:
            intake.refused(Result.MALFORMED)
            return _failure(ExportOutcome(Result.MALFORMED, str(error)), is_json)
        if path in OTHER_SIGNAL_RESPONSES:
            intake.other_signal()
            return (200, *_encode(OTHER_SIGNAL_RESPONSES[path](), is_json), {})
        outcome = intake.export(body, is_json)
        if outcome.result in (Result.OK, Result.PARTIAL):
            response = ExportTraceServiceResponse()
            if outcome.rejected_spans:
                response.partial_success.rejected_spans = outcome.rejected_spans
                response.partial_success.error_message = outcome.message
            return (200, *_encode(response, is_json), {})
        extra = {"Retry-After": str(RETRY_AFTER_S)} if outcome.result is Result.OVERLOADED else {}
        return _failure(outcome, is_json, extra)


class _Headers:
    """A request's headers by lower-case name; a name given twice (not Content-Length, which h11
    checks) reads as its values joined by commas, as RFC 9110 combines them."""

    def __init__(self, headers) -> None:
        self._values: dict[str, list[str]] = {}
        for name, value in headers:
            self._values.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))

    def get(self, name: str) -> str:
        return ", ".join(self._values.get(name, ()))

    def first(self, name: str) -> str:
        values = self._values.get(name)
        return values[0] if values else ""


def _bound(address: str, port: int) -> socket.socket:
    """A listening socket; bound here rather than by asyncio or socket.create_server, which wrap the
    OS's error message in their own."""
    listening = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((address, port))
        listening.listen(128)
    except BaseException:
        listening.close()
        raise
    return listening


async def _next_event(http: h11.Connection, reader: asyncio.StreamReader, deadline: float):
    """The next h11 event, reading as needed until `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    while True:
        event = http.next_event()
        if event is not h11.NEED_DATA:
            return event
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _Deadline
        try:
            data = await asyncio.wait_for(reader.read(READ_CHUNK), remaining)
        except asyncio.TimeoutError:
            raise _Deadline from None
        http.receive_data(data)  # b"": the peer closed


async def _read_body(http: h11.Connection, reader, limit: int, deadline: float) -> Optional[bytes]:
    """The request's body, read by `deadline`; None past `limit` bytes (the rest is not read)."""
    chunks, size = [], 0
    while True:
        event = await _next_event(http, reader, deadline)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > limit:
                return None
            chunks.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:  # the peer closed mid-body
            raise ConnectionResetError("connection closed mid-body")


async def _send_raw(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    """An answer to a request h11 could not parse, with its status line, then the connection closes."""
    body = message.encode("utf-8", "replace")[:1024]
    reason = {400: "Bad Request", 413: "Content Too Large", 431: "Request Header Fields Too Large"}.get(status, "Error")
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + body)
    try:
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass


def _failure(outcome: ExportOutcome, is_json: bool, headers: Optional[dict] = None):
    status = status_pb2.Status(code=_RPC_CODE[outcome.result], message=outcome.message)
    return (_HTTP_STATUS[outcome.result], *_encode(status, is_json), headers or {})


def _encode(message, is_json: bool) -> tuple[bytes, str]:
    if is_json:
        return json_format.MessageToJson(message, indent=None).encode(), JSON
    return message.SerializeToString(), PROTOBUF


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context
