"""The rank's OTLP/HTTP transports (otlp_exporters.HttpSpanExporter sends through one): one
kept-alive HTTP/1.1 connection over http.client, or a requests Session where one is needed.

Why: a rank exports every half second, and on a rank whose cores are all busy each export's CPU
is taken from training. Paced so, an export of 40 spans cost 638 µs of CPU this way, 1,624 through
a requests Session and 1,946 over gRPC, whose threads also run between exports
(`python benchmarks/export_transport.py`; docs/overhead.md, "Where the cost is"). Where
requests would do something this does not (a proxy from the environment, credentials in the URL
or a netrc file, a credential provider's session), the exporter sends through a requests Session
(SessionTransport; `usable_for` decides)."""
from __future__ import annotations

import http.client
import os
import ssl
import threading
import urllib.request
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union
from urllib.parse import urlsplit



def usable_for(url: str) -> bool:
    """Whether this transport reaches `url` as requests would: http or https, no proxy, and no
    credentials requests would add (in the URL, or from a netrc file)."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
            return False
        if os.environ.get("NETRC") or os.path.exists(os.path.expanduser("~/.netrc")):
            return False
        proxies = urllib.request.getproxies()  # requests reads the same variables
        proxied = proxies.get(parts.scheme) or proxies.get("all")
        return not proxied or bool(urllib.request.proxy_bypass(parts.hostname))
    except Exception:
        return False


def _requests_ca_bundle() -> Optional[str]:
    """The CA bundle a requests Session verifies against when told only to verify: its
    environment variables', else certifi's (None: the system's, where certifi is missing)."""
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if bundle:
        return bundle
    try:
        import certifi
    except ImportError:
        return None
    return certifi.where()


@dataclass(frozen=True)
class HTTPResult:
    """A response (status_code, reason, body, headers; case-insensitive), or the error that
    kept one from coming (error; status_code None)."""
    status_code: Optional[int] = None
    reason: Optional[str] = None
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    error: Optional[Exception] = None


class _Headers(dict):
    """Response headers, case-insensitive as the interface asks (keys stored lower-case)."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())


class ConnectFailed(ConnectionError):
    """The connection could not be made (refused, unreachable, timed out, TLS handshake): nothing
    was sent, so the request can be tried again."""


class _ClosedUnanswered(ConnectionResetError):
    """The server closed the connection before any byte of a response."""


class _Reader:
    """Buffered reads from a socket, for the response parser."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def line(self) -> Optional[bytes]:
        """The next line without its CRLF; None at the close before any byte of it."""
        while b"\r\n" not in self.buffer:
            if len(self.buffer) > 65536:
                raise http.client.LineTooLong("header line")
            if not self._more():
                if self.buffer:
                    raise ConnectionResetError("the connection was closed within a line")
                return None
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def exactly(self, count: int) -> bytes:
        while len(self.buffer) < count:
            if not self._more():
                raise http.client.IncompleteRead(self.buffer, count - len(self.buffer))
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size_line = self.line()
            if size_line is None:
                raise http.client.IncompleteRead(b"".join(parts))
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while self.line():  # trailers, up to the empty line
                    pass
                return b"".join(parts)
            parts.append(self.exactly(size))
            self.exactly(2)  # the chunk's CRLF

    def to_close(self) -> bytes:
        while self._more():
            pass
        data, self.buffer = self.buffer, b""
        return data


class KeptAliveHTTPTransport:
    """Requests over one connection to one origin, made on first use and again after any error
    or a response that closes it. Requests are serialized (the batch worker exports, and a flush
    may export from another thread); close() never waits for one in flight."""

    def __init__(self, verify: Union[bool, str] = True, cert: Union[str, tuple[str, str], None] = None) -> None:
        self._verify = verify
        self._cert = cert
        self._lock = threading.Lock()
        self._connection: Optional[http.client.HTTPConnection] = None
        self._origin: Optional[tuple[str, str, int]] = None
        self._closing = False
        _LIVE_TRANSPORTS.add(self)

    def request(self, method: str, url: str, *, headers: Optional[dict[str, str]] = None,
                timeout: Optional[float] = None, data: Optional[bytes] = None) -> HTTPResult:
        with self._lock:
            try:
                parts = urlsplit(url)
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                kept = self._connection is not None
                connection = self._connection_to(parts, timeout)
                try:
                    status, reason, headers_received, body, will_close = self._exchange(
                        connection, method, parts, path, headers or {}, data or b"")
                except _ClosedUnanswered:
                    if not kept:
                        raise
                    # a kept connection the server had closed while idle: the request was not taken,
                    # send it once more on a new one, as requests does
                    self._drop()
                    connection = self._connection_to(parts, timeout)
                    status, reason, headers_received, body, will_close = self._exchange(
                        connection, method, parts, path, headers or {}, data or b"")
                if will_close:
                    self._drop()
                return HTTPResult(status_code=status, reason=reason, body=body, headers=headers_received)
            except Exception as error:
                self._drop()  # whatever state it is in, the next request starts afresh
                return HTTPResult(error=error)
            finally:
                if self._closing:  # close() came while this request held the lock
                    self._drop()

    @staticmethod
    def _exchange(connection: http.client.HTTPConnection, method: str, parts, path: str, headers: Mapping[str, str],
                  data: bytes) -> tuple[int, str, "_Headers", bytes, bool]:
        """One request and its response over the connection's socket: the request written in one
        send, the response read with a minimal HTTP/1.1 parser (status line, headers, a body by
        Content-Length, chunked or to the close). http.client's own request and response objects
        cost about twice the CPU per export (its header parsing goes through the email package)."""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if parts.port:
            host = f"{host}:{parts.port}"
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(data)}"]
        lines += [f"{key}: {value}" for key, value in headers.items() if key.lower() not in ("host", "content-length")]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        sock = connection.sock
        sock.sendall(head + data if len(data) < 65536 else head)
        if len(data) >= 65536:
            sock.sendall(data)
        reader = _Reader(sock)
        while True:
            status_line = reader.line()
            if status_line is None:
                raise _ClosedUnanswered("the connection was closed before a response")
            version, _, rest = status_line.partition(b" ")
            code_text, _, reason = rest.partition(b" ")
            if not version.startswith(b"HTTP/") or not code_text.isdigit():
                raise http.client.BadStatusLine(status_line.decode("latin-1", "replace"))
            status = int(code_text)
            received = _Headers()
            while True:
                line = reader.line()
                if line is None:
                    raise ConnectionResetError("the connection was closed within a response's headers")
                if not line:
                    break
                key, _, value = line.decode("latin-1").partition(":")
                key, value = key.strip().lower(), value.strip()
                received[key] = f"{received[key]}, {value}" if key in received else value
            if 100 <= status < 200:
                continue  # an interim response: the final one follows
            break
        connection_header = received.get("connection", "").lower()
        will_close = "close" in connection_header or (version == b"HTTP/1.0" and "keep-alive" not in connection_header)
        if "chunked" in received.get("transfer-encoding", "").lower():
            body = reader.chunked()
        elif "content-length" in received:
            body = reader.exactly(int(received["content-length"]))
        elif status in (204, 304):
            body = b""
        else:
            body, will_close = reader.to_close(), True
        return status, reason.decode("latin-1"), received, body, will_close

    def _connection_to(self, parts, timeout: Optional[float]) -> http.client.HTTPConnection:
        scheme, host = parts.scheme, parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)  # given, so an IPv6 host is not read as host:port
        if self._connection is None or self._origin != (scheme, host, port):
            self._drop()
            connection: http.client.HTTPConnection
            if scheme == "https":
                connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls())
            elif scheme == "http":
                connection = http.client.HTTPConnection(host, port, timeout=timeout)
            else:
                raise ValueError(f"OTLP/HTTP endpoint scheme must be http or https, got {scheme!r}")
            try:
                connection.connect()
            except OSError as error:  # refused, unreachable, timed out, handshake (a certificate too)
                connection.close()
                if isinstance(error, ssl.SSLCertVerificationError):
                    raise  # will not verify on a retry either
                raise ConnectFailed(f"{type(error).__name__}: {error}") from error
            self._connection, self._origin = connection, (scheme, host, port)
        self._connection.sock.settimeout(timeout)  # a kept connection gets this request's timeout
        return self._connection

    def _tls(self) -> ssl.SSLContext:
        if self._verify is False:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            bundle = self._verify if isinstance(self._verify, str) else _requests_ca_bundle()
            folder = bundle is not None and os.path.isdir(bundle)  # requests takes a folder of CAs too
            context = ssl.create_default_context(cafile=None if folder else bundle, capath=bundle if folder else None)
        if isinstance(self._cert, tuple):
            context.load_cert_chain(self._cert[0], self._cert[1])
        elif self._cert:
            context.load_cert_chain(self._cert)
        return context

    def _drop(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:
                pass
        self._connection = None

    def is_connection_error(self, exception: Optional[Exception]) -> bool:
        # Nothing sent (ConnectFailed) or a kept connection the server had closed: worth sending
        # again. Unlike the SDK's requests transport, a timeout waiting for the answer is not (the
        # request may have been taken, and the SDK's timeout is the time its deadline leaves),
        # nor is a certificate that does not verify.
        return isinstance(exception, (ConnectionError, http.client.BadStatusLine))

    def close(self) -> None:
        self._closing = True  # a request in flight drops the connection when it ends
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's lock may be held by a thread that does not exist here,
        and the connection is the parent's socket, left for the parent to close."""
        self._lock = threading.Lock()
        self._connection = None


class SessionTransport:
    """Requests through a requests Session: the credential provider's, else one of its own
    (which applies the proxy variables and netrc credentials as requests does)."""

    def __init__(self, session: Any = None, verify: Union[bool, str] = True,
                 cert: Union[str, tuple[str, str], None] = None) -> None:
        import requests

        self._requests = requests
        self.session = session if session is not None else requests.Session()
        self._verify, self._cert = verify, cert

    def request(self, method: str, url: str, *, headers: Optional[dict[str, str]] = None,
                timeout: Optional[float] = None, data: Optional[bytes] = None) -> HTTPResult:
        try:
            response = self.session.request(method, url, headers=headers, timeout=timeout, data=data,
                                            verify=self._verify, cert=self._cert)
            return HTTPResult(status_code=response.status_code, reason=response.reason, body=response.content,
                              headers=_Headers((key.lower(), value) for key, value in response.headers.items()))
        except Exception as error:
            return HTTPResult(error=error)

    def is_connection_error(self, exception: Optional[Exception]) -> bool:
        return isinstance(exception, self._requests.exceptions.ConnectionError) and not isinstance(
            exception, self._requests.exceptions.SSLError)

    def close(self) -> None:
        self.session.close()


_LIVE_TRANSPORTS: "weakref.WeakSet[KeptAliveHTTPTransport]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for transport in list(_LIVE_TRANSPORTS):
        transport._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
