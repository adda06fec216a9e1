"""Our OTLP exporters, gRPC and HTTP, on public API only, for two signals: the rank's spans
(GrpcSpanExporter, HttpSpanExporter: the SDK's SpanExporter, encoding with span_encoding.SpanEncoder,
the C writer where built) and the detector's verdict events as log records (GrpcSender, HttpSender
for LOGS, given requests the caller encoded: detector/event_export.py). Both send through a
transport of ours (a grpc channel's raw unary call taking the encoded bytes; http.client over one
kept-alive connection, or a requests Session where a proxy, credentials or a credential provider
need one).

They read the same OTEL_EXPORTER_OTLP_[<SIGNAL>_]* variables as the SDK's exporters (endpoint,
headers, certificate, client key and certificate, compression, timeout, insecure; the signal's
variable first), checked beforehand by otlp_environ.check_exporter_environ. An export retries
what OTLP calls retryable (gRPC: UNAVAILABLE and the like, RESOURCE_EXHAUSTED only with RetryInfo;
HTTP: 429, 502, 503, 504 and a connection that could not be made), after the delay the receiver
gives (RetryInfo, Retry-After) or an exponential backoff with jitter, and never past its deadline:
the exporter's timeout, or the earlier one `export_within` is given (the batching processor's
export timeout or shutdown deadline). A run of failed exports logs one line, and one more when
exports work again.
"""
from __future__ import annotations

import email.utils
import gzip
import logging
import os
import random
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence
from urllib.parse import urlsplit

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

try:  # where an instrumentor could see our own sends (opentelemetry-instrument with grpc or requests
    # instrumentation): its public switch keeps them from becoming spans, each exported in turn
    from opentelemetry.instrumentation.utils import suppress_instrumentation
except ImportError:  # no instrumentation package, so no instrumentor either
    @contextmanager
    def suppress_instrumentation() -> Iterator[None]:
        yield

from otel_straggler.instrumentation.span_encoding import SpanEncoder
from otel_straggler.settings import ConfigError

_logger = logging.getLogger("otel_straggler")


@dataclass(frozen=True)
class Signal:
    """What differs between the signals we export: where it goes, and what its failure line says."""

    name: str  # traces, logs: OTEL_EXPORTER_OTLP_<NAME>_* and OTEL_EXPORTER_OTLP_<NAME>_ENDPOINT
    grpc_method: str
    http_path: str  # appended to OTEL_EXPORTER_OTLP_ENDPOINT (not to the signal's own endpoint)
    item: str  # what one export carries, for the log line: span, event
    lost_in: str  # where the items a failed export loses are counted, for the log line

    @property
    def variable(self) -> str:
        return self.name.upper()


TRACES = Signal("traces", "/opentelemetry.proto.collector.trace.v1.TraceService/Export", "/v1/traces",
                "span", "status()['lost']['export_failed']")
LOGS = Signal("logs", "/opentelemetry.proto.collector.logs.v1.LogsService/Export", "/v1/logs",
              "event", "status.json events_dropped.export_failed")
EXPORT_METHOD = TRACES.grpc_method
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_REQUEST_SIZE = 64 * 1024 * 1024  # the SDK's HTTP exporter's
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 32.0
RETRYABLE_HTTP = frozenset((429, 502, 503, 504))


def credential_provider_variables(signal: Signal) -> tuple[str, str]:
    """The general one first, as the SDK's HTTP exporters read them."""
    return ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
            f"OTEL_PYTHON_EXPORTER_OTLP_HTTP_{signal.variable}_CREDENTIAL_PROVIDER")


CREDENTIAL_PROVIDER_VARIABLES = credential_provider_variables(TRACES)


def setting(environ: Mapping[str, str], name: str, signal: Signal = TRACES) -> Optional[str]:
    """OTEL_EXPORTER_OTLP_<SIGNAL>_<name>, else OTEL_EXPORTER_OTLP_<name>; blank is unset."""
    for variable in (f"OTEL_EXPORTER_OTLP_{signal.variable}_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
        value = environ.get(variable, "").strip()
        if value:
            return value
    return None


def parse_headers(value: Optional[str]) -> list[tuple[str, str]]:
    """OTEL_EXPORTER_OTLP_HEADERS: comma-separated key=value, percent-encoded (W3C baggage form),
    keys lower-cased; malformed items are skipped, as the SDK's liberal parsing does."""
    from urllib.parse import unquote

    headers = []
    for item in (value or "").split(","):
        key, equals, text = item.partition("=")
        key, text = unquote(key).strip().lower(), unquote(text).strip()
        if equals and key:
            headers.append((key, text))
    return headers


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as file:
        return file.read()


class _Backoff:
    """Delays between tries: what the receiver asked for, else 1, 2, 4 ... s with +-20% jitter."""

    def __init__(self) -> None:
        self.tries = 0

    def next(self, asked_s: Optional[float]) -> float:
        delay = asked_s if asked_s is not None else min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** self.tries)
        self.tries += 1
        return max(0.0, delay if asked_s is not None else delay * random.uniform(0.8, 1.2))


class OtlpSender:
    """What both protocols and both signals share: the retry loop, the failure log, shutdown. It
    sends an encoded export request (`send`); encoding is the signal's."""

    protocol = ""

    def __init__(self, signal: Signal, endpoint: str, timeout_s: float) -> None:
        self.signal = signal
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._stopping = threading.Event()
        self._failing = False  # logged already: the current run of failed exports

    def deadline(self, given: Optional[float] = None) -> float:
        """`given` (time.monotonic()) or the exporter's timeout from now, whichever is first."""
        limit = time.monotonic() + self.timeout_s
        return limit if given is None else min(given, limit)

    def send(self, body: bytes, count: int, deadline: float) -> bool:
        """Sends the encoded request (`count` items) by `deadline` (time.monotonic()), retrying what
        OTLP says to retry; False when it was not delivered."""
        if self._stopping.is_set():
            return False
        backoff = _Backoff()
        item = self.signal.item
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self._failed(count, "no time left to send (export deadline)")
            with suppress_instrumentation():
                retry, asked_s, error = self._send(body, left)
            if error is None:
                if self._failing:
                    self._failing = False
                    _logger.warning("otel-straggler: %s export to %s works again", item, self.endpoint)
                return True
            if not self._failing:
                self._failing = True  # one line for a run of failures, at its first error
                _logger.warning("otel-straggler: %s export to %s (%s) failed: %s; %s, %ss lost counted in "
                                "%s (not logged again until exports work)",
                                item, self.endpoint, self.protocol, error,
                                "retried within the export's deadline" if retry else "not retried",
                                item, self.signal.lost_in)
            if not retry:
                return False
            delay = backoff.next(asked_s)
            if delay > deadline - time.monotonic():
                return False  # the next try would be past the deadline
            if self._stopping.wait(delay):
                return False  # shutting down

    def _failed(self, count: int, why: str) -> bool:
        if not self._failing:
            self._failing = True
            _logger.warning("otel-straggler: %s export to %s (%s) failed: %s; %d %ss lost, counted in "
                            "%s (not logged again until exports work)",
                            self.signal.item, self.endpoint, self.protocol, why, count, self.signal.item,
                            self.signal.lost_in)
        return False

    def _send(self, body: bytes, timeout_s: float) -> tuple[bool, Optional[float], Optional[str]]:
        """One try: (retryable, the delay the receiver asked for, the error or None)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stops: a send waiting to retry gives up at once, and the connection is closed."""
        self._stopping.set()
        self._close()

    def _close(self) -> None:
        pass


class _SpanExporting(OtlpSender, SpanExporter):
    """The span side of a sender: the SDK's SpanExporter, encoding with span_encoding.SpanEncoder."""

    def _start_encoding(self) -> None:
        self.encoder = SpanEncoder()
        self.prewrite = self.encoder.prewrite
        self.prewrite_many = self.encoder.prewrite_many

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return self.export_within(spans, None)

    def export_within(self, spans: Sequence[Any], deadline: Optional[float]) -> SpanExportResult:
        """Export by `deadline` (time.monotonic()) or the exporter's timeout, whichever is first."""
        if self._stopping.is_set():
            return SpanExportResult.FAILURE
        deadline = self.deadline(deadline)
        try:
            body = self.encoder.encode(spans)
        except Exception:
            _logger.exception("otel-straggler: could not encode %d spans", len(spans))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS if self.send(body, len(spans), deadline) else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class GrpcSender(OtlpSender):
    """OTLP/gRPC: the signal's Export method as a raw unary call taking the encoded request, so the
    bytes are neither parsed into a message nor serialized again."""

    protocol = "grpc"
    RETRYABLE = ("CANCELLED", "DEADLINE_EXCEEDED", "ABORTED", "OUT_OF_RANGE", "UNAVAILABLE", "DATA_LOSS")

    def __init__(self, signal: Signal, endpoint: Optional[str] = None,
                 environ: Mapping[str, str] = os.environ) -> None:
        import grpc

        self._grpc = grpc
        source = "endpoint" if endpoint else _endpoint_variable(environ, signal)
        given = endpoint or setting(environ, "ENDPOINT", signal) or "http://localhost:4317"
        try:
            parts = urlsplit(given if "://" in given else f"//{given}")
            parts.port  # noqa: B018 (raises on a port that is not a number)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("", "http", "https") or not parts.hostname:
            raise ConfigError(f"{source}: expected host:port or an http:// or https:// URL for OTLP/gRPC, "
                              f"got {given!r}")
        target = parts.netloc
        insecure_variable = setting(environ, "INSECURE", signal)
        if parts.scheme == "https":
            insecure = False
        elif endpoint is not None:
            insecure = True  # an explicit endpoint without https://, as configure() always took it
        elif insecure_variable is not None:
            insecure = insecure_variable.lower() == "true"
        else:
            insecure = parts.scheme == "http"
        timeout = setting(environ, "TIMEOUT", signal)
        super().__init__(signal, target, float(timeout) if timeout else DEFAULT_TIMEOUT_S)
        self.metadata = tuple(parse_headers(setting(environ, "HEADERS", signal)))
        compression = (setting(environ, "COMPRESSION", signal) or "").lower()
        self._compression = grpc.Compression.Gzip if compression == "gzip" else grpc.Compression.NoCompression
        self._credentials = None if insecure else grpc.ssl_channel_credentials(
            root_certificates=_read(setting(environ, "CERTIFICATE", signal)),
            private_key=_read(setting(environ, "CLIENT_KEY", signal)),
            certificate_chain=_read(setting(environ, "CLIENT_CERTIFICATE", signal)))
        self._options = (("grpc.primary_user_agent", "otel-straggler"),)
        self._lock = threading.Lock()
        self._channel = None
        self._call: Callable[..., Any]  # the signal's Export method on the current channel, set by _connect
        self._connect()

    def _connect(self) -> None:
        grpc = self._grpc
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            if self._credentials is None:
                channel = grpc.insecure_channel(self.endpoint, options=self._options, compression=self._compression)
            else:
                channel = grpc.secure_channel(self.endpoint, self._credentials, options=self._options,
                                              compression=self._compression)
            self._channel = channel
            # request_serializer None: the request is sent as the bytes given; the answer is not read
            self._call = channel.unary_unary(self.signal.grpc_method, request_serializer=None,
                                             response_deserializer=None)

    def _send(self, body: bytes, timeout_s: float) -> tuple[bool, Optional[float], Optional[str]]:
        grpc = self._grpc
        try:
            self._call(body, timeout=timeout_s, metadata=self.metadata)
            return False, None, None
        except grpc.RpcError as error:
            code = error.code() if callable(getattr(error, "code", None)) else None
            name = getattr(code, "name", str(code))
            asked_s = _retry_info_s(error)
            message = f"{name}: {error.details() if callable(getattr(error, 'details', None)) else error}"
            if name == "UNAVAILABLE" and not self._stopping.is_set():
                # a fresh channel reconnects at once, where the old one may be in its reconnect backoff
                self._connect()
            if name == "RESOURCE_EXHAUSTED":
                return asked_s is not None, asked_s, message
            return name in self.RETRYABLE, asked_s, message
        except Exception as error:  # a closed channel (shutdown meanwhile), anything unexpected
            return False, None, f"{type(error).__name__}: {error}"

    def _close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()


def _retry_info_s(error: Any) -> Optional[float]:
    """The delay of a google.rpc.RetryInfo in the error's trailing metadata, if any."""
    try:
        trailing = dict(error.trailing_metadata() or ())
        raw = trailing.get("google.rpc.retryinfo-bin")
        if raw is None:
            return None
        from google.rpc.error_details_pb2 import RetryInfo

        info = RetryInfo.FromString(raw)
        return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    except Exception:
        return None


class HttpSender(OtlpSender):
    """OTLP/HTTP (protobuf) over one kept-alive connection (http_transport), or a requests
    Session where requests would do what http.client does not (a proxy, credentials in the URL or
    a netrc file) or a credential provider gives one."""

    protocol = "http/protobuf"

    def __init__(self, signal: Signal, endpoint: Optional[str] = None, environ: Mapping[str, str] = os.environ,
                 max_request_size: Optional[int] = None) -> None:
        from otel_straggler.instrumentation import http_transport

        url = endpoint or _http_url(environ, signal)
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (raises on a port that is not a number)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            source = "endpoint" if endpoint else _endpoint_variable(environ, signal)
            raise ConfigError(f"{source}: expected an http:// or https:// URL for OTLP/HTTP, got {url!r}")
        timeout = setting(environ, "TIMEOUT", signal)
        super().__init__(signal, url, float(timeout) if timeout else DEFAULT_TIMEOUT_S)
        self.max_request_size = DEFAULT_MAX_REQUEST_SIZE if max_request_size is None else max_request_size
        self.compression = (setting(environ, "COMPRESSION", signal) or "none").lower()
        self.headers = {"Content-Type": "application/x-protobuf", "User-Agent": "otel-straggler"}
        self.headers.update(parse_headers(setting(environ, "HEADERS", signal)))
        if self.compression in ("gzip", "deflate"):
            self.headers["Content-Encoding"] = self.compression
        certificate = setting(environ, "CERTIFICATE", signal)
        verify: Any = certificate if certificate else True
        client_certificate = setting(environ, "CLIENT_CERTIFICATE", signal)
        client_key = setting(environ, "CLIENT_KEY", signal)
        cert: Any = (client_certificate, client_key) if client_certificate and client_key else client_certificate
        session = _credential_provider_session(environ, signal)
        if session is not None or not http_transport.usable_for(url):
            self.transport: Any = http_transport.SessionTransport(session, verify=verify, cert=cert)
        else:
            self.transport = http_transport.KeptAliveHTTPTransport(verify=verify, cert=cert)

    def _send(self, body: bytes, timeout_s: float) -> tuple[bool, Optional[float], Optional[str]]:
        if 0 < self.max_request_size < len(body):  # 0 or less: no limit, as in the SDK
            return False, None, (f"{len(body)} bytes encoded, over the exporter's max_request_size of "
                                 f"{self.max_request_size}: dropped unsent")
        if self.compression == "gzip":
            body = gzip.compress(body)
        elif self.compression == "deflate":
            body = zlib.compress(body)
        answer = self.transport.request("POST", self.endpoint, headers=self.headers, timeout=timeout_s, data=body)
        if answer.error is not None:
            error = f"{type(answer.error).__name__}: {answer.error}"
            return self.transport.is_connection_error(answer.error), None, error
        if 200 <= answer.status_code < 300:
            return False, None, None
        message = f"HTTP {answer.status_code} {answer.reason or ''}".rstrip()
        if answer.status_code in RETRYABLE_HTTP:
            return True, _retry_after_s(answer.headers.get("retry-after")), message
        return False, None, message

    def _close(self) -> None:
        self.transport.close()


class GrpcSpanExporter(GrpcSender, _SpanExporting):
    """The rank's spans over OTLP/gRPC (TraceService/Export)."""

    def __init__(self, endpoint: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> None:
        super().__init__(TRACES, endpoint, environ)
        self._start_encoding()


class HttpSpanExporter(HttpSender, _SpanExporting):
    """The rank's spans over OTLP/HTTP (POST .../v1/traces)."""

    def __init__(self, endpoint: Optional[str] = None, environ: Mapping[str, str] = os.environ,
                 max_request_size: Optional[int] = None) -> None:
        super().__init__(TRACES, endpoint, environ, max_request_size)
        self._start_encoding()


def sender(signal: Signal, protocol: str, environ: Mapping[str, str] = os.environ) -> OtlpSender:
    """The signal's sender for `protocol` (grpc, http/protobuf), configured by the environment
    alone (check it first: otlp_environ.check_exporter_environ)."""
    return GrpcSender(signal, None, environ) if protocol == "grpc" else HttpSender(signal, None, environ)


def _endpoint_variable(environ: Mapping[str, str], signal: Signal = TRACES) -> str:
    for variable in (f"OTEL_EXPORTER_OTLP_{signal.variable}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if environ.get(variable, "").strip():
            return variable
    return "the default endpoint"


def _http_url(environ: Mapping[str, str], signal: Signal = TRACES) -> str:
    """OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT as it is, else OTEL_EXPORTER_OTLP_ENDPOINT + the
    signal's path (/v1/traces, /v1/logs)."""
    own = environ.get(f"OTEL_EXPORTER_OTLP_{signal.variable}_ENDPOINT", "").strip()
    if own:
        return own
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "http://localhost:4318"
    return base.rstrip("/") + signal.http_path


def _retry_after_s(value: Optional[str]) -> Optional[float]:
    """Retry-After: seconds, or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except Exception:
        return None


def _credential_provider_session(environ: Mapping[str, str], signal: Signal = TRACES) -> Any:
    """The requests Session a credential provider (an `opentelemetry_otlp_credential_provider`
    entry point named by the variable) makes, as the SDK's HTTP exporter loads it."""
    name = next((environ[variable].strip() for variable in credential_provider_variables(signal)
                 if environ.get(variable, "").strip()), None)
    if name is None:
        return None
    from importlib.metadata import entry_points

    found = list(entry_points(group="opentelemetry_otlp_credential_provider", name=name))
    if not found:
        raise RuntimeError(f"no opentelemetry_otlp_credential_provider entry point named {name!r}")
    return found[0].load()()
