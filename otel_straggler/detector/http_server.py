"""A threading HTTP server that its clients cannot exhaust: the Prometheus endpoint's (a few
scrapers; the OTLP/HTTP receiver runs on the intake loop instead, receiver_http.py).

At most `max_connections` connections are served at once, a thread each; one more gets a 503 at
once rather than a thread. Each read waits IDLE_CONNECTION_TIMEOUT_S at most, and each request,
however slowly its bytes come (each within that timeout), has REQUEST_DEADLINE_S from the wait for
its request line to its reply: past it the connection is shut, which ends the blocked read on its
thread. What is refused, cut or broken is reported through `on_event` ("refused", "request_deadline",
"connection_error").
"""
from __future__ import annotations

import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from otel_straggler.detector.receiver import RETRY_AFTER_S

IDLE_CONNECTION_TIMEOUT_S = 15  # longer than an SDK exporter's 5 s between exports, so its connection is reused
# The idle timeout bounds each read, not a client that sends a byte every few seconds, which would
# hold a connection slot (and its thread) for ever. A 16 MiB request needs about 0.3 MB/s to arrive in time.
REQUEST_DEADLINE_S = 60.0

_REFUSED_CONNECTION = (
    f"HTTP/1.1 503 Service Unavailable\r\nRetry-After: {RETRY_AFTER_S}\r\n"
    "Content-Length: 0\r\nConnection: close\r\n\r\n"
).encode()


class BoundedRequestHandler(BaseHTTPRequestHandler):
    timeout = IDLE_CONNECTION_TIMEOUT_S
    # A response goes out in two writes (headers, then body); with Nagle's algorithm the body
    # waits for the client's delayed ACK of the headers, 40 ms on Linux, on every answer with a
    # body on a kept-alive connection.
    disable_nagle_algorithm = True
    server: "BoundedHTTPServer"

    def handle_one_request(self) -> None:
        self.server.request_began(self.connection)
        try:
            super().handle_one_request()
        finally:
            self.server.request_ended(self.connection)

    def log_message(self, format: str, *args) -> None:  # one line per request would flood stderr
        pass


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # the kernel's queue of connections not accepted yet (socketserver's default is 5): many
    # exporters connecting at once would otherwise wait out a SYN retry (1 s) each beyond it
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BoundedRequestHandler], max_connections: int,
                 on_event: Callable[[str], None], ssl_context: Optional[ssl.SSLContext] = None) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._ssl_context = ssl_context
        self._connections = threading.BoundedSemaphore(max_connections)
        self._on_event = on_event
        self._deadlines: dict[socket.socket, float] = {}  # connection -> when its current request must be done
        self._deadlines_lock = threading.Lock()
        super().__init__(address, handler)

    def get_request(self):
        connection, client = super().get_request()
        if self._ssl_context is not None:
            # the handshake runs on the connection's own thread (first read), not on the accept loop
            connection = self._ssl_context.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
        return connection, client

    def process_request(self, request, client_address) -> None:
        if not self._connections.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connections.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    def request_began(self, connection: socket.socket) -> None:
        with self._deadlines_lock:
            self._deadlines[connection] = time.monotonic() + REQUEST_DEADLINE_S

    def request_ended(self, connection: socket.socket) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(connection, None)

    def service_actions(self) -> None:
        """Run by serve_forever between polls (every 0.5 s): shuts connections past their deadline."""
        now = time.monotonic()
        with self._deadlines_lock:  # held while shutting, so a request just begun is never the one shut
            overdue = [connection for connection, deadline in self._deadlines.items() if deadline <= now]
            for connection in overdue:
                del self._deadlines[connection]
                # counted before the peer can see its connection end: whoever reads the counters
                # after that sees this one
                self._on_event("request_deadline")
                try:
                    socket.socket.shutdown(connection, socket.SHUT_RDWR)  # the plain socket's, under TLS too
                except OSError:
                    pass

    def handle_error(self, request, client_address) -> None:
        # TLS handshakes that fail, peers that reset: counted, not printed as tracebacks
        self._on_event("connection_error")

    def _refuse(self, connection) -> None:
        self._on_event("refused")
        try:
            if not isinstance(connection, ssl.SSLSocket):  # a TLS peer could not read a plain reply
                connection.settimeout(0.5)
                connection.sendall(_REFUSED_CONNECTION)
        except OSError:
            pass
        self.shutdown_request(connection)
