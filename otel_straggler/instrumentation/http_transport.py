"""One kept-alive HTTP/1.1 connection for the rank's OTLP/HTTP span export, in the SDK's
transport interface (`BaseHTTPTransport`): the SDK's exporter keeps its retries, backoff,
headers, compression and timeouts, and sends through this instead of a requests Session.

Why: an export every half second, from a rank whose cores are all busy training, costs the
Session's machinery about four times what http.client's request costs (docs/overhead.md, "Export
over OTLP/HTTP"), and unlike OTLP/gRPC it runs no threads of its own. Where requests would do
something this does not (a proxy from the environment, a credential provider's session), the
exporter keeps the SDK's transport (`usable_for`)."""
from __future__ import annotations

import http.client
import os
import socket
import ssl
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union
from urllib.parse import urlsplit

from opentelemetry.exporter.http.transport._base import BaseHTTPResult, BaseHTTPTransport

# what failed before any response: the SDK retries these at once, then with backoff
_CONNECTION_ERRORS = (ConnectionError, http.client.HTTPException, socket.gaierror, ssl.SSLError)


def usable_for(url: str) -> bool:
    """Whether this transport reaches `url` as requests would: http or https, no proxy."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        proxies = urllib.request.getproxies()  # requests reads the same variables
        return not (proxies.get(parts.scheme) or proxies.get("all")) or bool(urllib.request.proxy_bypass(parts.hostname))
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
class KeptAliveResult(BaseHTTPResult):
    body: bytes = b""
    response_headers: Mapping[str, str] = field(default_factory=dict)

    def content(self) -> bytes:
        return self.body

    def headers(self) -> Mapping[str, str]:
        return self.response_headers


class _Headers(dict):
    """Response headers, case-insensitive as the interface asks (keys stored lower-case)."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())


class KeptAliveHTTPTransport(BaseHTTPTransport):
    """Requests over one connection to one origin, made on first use and again after any error
    or a response that closes it. Requests are serialized (the batch worker exports, and a flush
    may export from another thread)."""

    def __init__(self, verify: Union[bool, str] = True, cert: Union[str, tuple[str, str], None] = None) -> None:
        self._verify = verify
        self._cert = cert
        self._lock = threading.Lock()
        self._connection: Optional[http.client.HTTPConnection] = None
        self._origin: Optional[tuple[str, str, Optional[int]]] = None

    def request(self, method: str, url: str, *, headers: Optional[dict[str, str]] = None,
                timeout: Optional[float] = None, data: Optional[bytes] = None) -> BaseHTTPResult:
        with self._lock:
            try:
                parts = urlsplit(url)
                connection = self._connection_to(parts.scheme, parts.hostname or "", parts.port, timeout)
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                connection.request(method, path, body=data, headers=headers or {})
                response = connection.getresponse()
                body = response.read()
                if response.will_close:
                    self._drop()
                headers_received = _Headers()
                for key, value in response.getheaders():  # repeated headers joined, as the interface asks
                    key = key.lower()
                    headers_received[key] = f"{headers_received[key]}, {value}" if key in headers_received else value
                return KeptAliveResult(status_code=response.status, reason=response.reason, body=body,
                                       response_headers=headers_received)
            except Exception as error:
                self._drop()  # whatever state it is in, the next request starts afresh
                return KeptAliveResult(error=error)

    def _connection_to(self, scheme: str, host: str, port: Optional[int],
                       timeout: Optional[float]) -> http.client.HTTPConnection:
        if self._connection is None or self._origin != (scheme, host, port):
            self._drop()
            if scheme == "https":
                self._connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls())
            elif scheme == "http":
                self._connection = http.client.HTTPConnection(host, port, timeout=timeout)
            else:
                raise ValueError(f"OTLP/HTTP endpoint scheme must be http or https, got {scheme!r}")
            self._origin = (scheme, host, port)
        self._connection.timeout = timeout  # for a connection made now
        if self._connection.sock is not None:
            self._connection.sock.settimeout(timeout)  # and for one kept from before
        return self._connection

    def _tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self._verify if isinstance(self._verify, str) else _requests_ca_bundle())
        if self._verify is False:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
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
        # a certificate that does not verify will not verify on a retry either
        return isinstance(exception, _CONNECTION_ERRORS) and not isinstance(exception, ssl.SSLCertVerificationError)

    def close(self) -> None:
        with self._lock:
            self._drop()
