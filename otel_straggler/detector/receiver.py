"""What both OTLP receivers do with a trace export, independent of the wire.

Authenticate, refuse early when the engine's queue is full (a request that would be refused is not
worth decoding), decode, queue, and say what happened in OTLP terms. receiver_grpc.py and
receiver_http.py only translate the outcome into status codes, headers and bodies.
"""
from __future__ import annotations

import enum
import hmac
import logging
import os
import stat
from dataclasses import dataclass
from typing import Optional

from otel_straggler.detector.config import ConfigError, DetectorConfig
from otel_straggler.detector.decode import MalformedPayload, ProtobufDecoder, decode_json
from otel_straggler.detector.driver import SpanPipeline

_log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what an overloaded detector tells exporters to wait before retrying

# Ranks exporting straight to the detector (no collector) send their own metrics too; the
# detector accepts and drops them, counted, so their exporters neither fail nor retry.
OTHER_SIGNALS = ("metrics", "logs")


class Result(enum.Enum):
    """Request results, also the `result` attribute of straggler.detector.requests."""

    OK = "ok"
    PARTIAL = "partial"  # some spans rejected as malformed
    MALFORMED = "malformed"
    OVERLOADED = "overloaded"
    UNAUTHENTICATED = "unauthenticated"
    TOO_LARGE = "too_large"
    UNSUPPORTED = "unsupported"  # content type or encoding
    OTHER_SIGNAL = "other_signal"  # metrics or logs: accepted and dropped, see OTHER_SIGNALS


@dataclass(frozen=True)
class ExportOutcome:
    result: Result
    message: str = ""
    rejected_spans: int = 0  # OTLP partial success


def load_token(config: DetectorConfig) -> Optional[str]:
    """The bearer token clients must present, or None when auth is off."""
    if config.auth_token_file and config.auth_token:
        raise ConfigError("--auth-token-file and --auth-token: give one of them")
    if config.auth_token_file:
        try:
            with open(config.auth_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as error:
            raise ConfigError(f"--auth-token-file: cannot read {config.auth_token_file!r}: {error.strerror}") from None
        if not token:
            raise ConfigError(f"--auth-token-file: {config.auth_token_file!r} is empty")
        _warn_if_others_can_read(config.auth_token_file)
        return token
    return config.auth_token.strip() or None


def _warn_if_others_can_read(path: str) -> None:
    """A token file any local user can read gives any of them the right to send: said, not refused
    (a mounted Kubernetes secret is often 0644 inside a container of one user)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & stat.S_IROTH:
        _log.warning("--auth-token-file %r is readable by every user (mode %o): any local user can send "
                     "spans with it; chmod 600 it", path, stat.S_IMODE(mode))


def bearer_matches(expected: bytes, authorization: Optional[str]) -> bool:
    """Whether an `authorization` header/metadata value is `Bearer <token>` for `expected` (the
    whole `Bearer <token>` bytes): the scheme case-insensitive (RFC 7235), the token compared in
    constant time."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    return hmac.compare_digest(f"Bearer {credentials.strip()}".encode(), expected) and scheme.lower() == "bearer"


class OtlpIntake:
    """Shared by the receivers' threads; its parts are thread-safe."""

    def __init__(self, pipeline: SpanPipeline, token: Optional[str], max_request_bytes: int) -> None:
        self._pipeline = pipeline
        self.counters = pipeline.driver.counters
        self._expected = None if token is None else f"Bearer {token}".encode()
        self.max_request_bytes = max_request_bytes
        self._decoder = ProtobufDecoder()
        self._logged_decode_error = False

    def authorized(self, authorization: Optional[str]) -> bool:
        """Checks an `authorization` header/metadata value in constant time; counts refusals."""
        if self._expected is None:
            return True
        ok = bearer_matches(self._expected, authorization)
        if not ok:
            self.refused(Result.UNAUTHENTICATED)
        return ok

    def refused(self, result: Result) -> None:
        """Counts a request turned away before export() (by the wire layer or by authorized())."""
        self.counters.add_request(result.value)

    def other_signal(self) -> ExportOutcome:
        """A metrics or logs export: nothing here reads it."""
        return self._done(Result.OTHER_SIGNAL)

    def export(self, payload: bytes, is_json: bool) -> ExportOutcome:
        if not self._pipeline.has_room():
            return self._done(Result.OVERLOADED, "detector queue full, retry later")
        try:
            batch = decode_json(payload) if is_json else self._decoder.decode(payload)
        except MalformedPayload as error:
            return self._done(Result.MALFORMED, str(error))
        except Exception as error:  # a decoder bug: the payload still could not be read
            return self._undecodable(error)
        if not self._pipeline.submit(batch):
            return self._done(Result.OVERLOADED, "detector queue full, retry later")
        if batch.malformed:
            return self._done(Result.PARTIAL, f"{batch.malformed} span(s) rejected, first: {batch.first_error}",
                              batch.malformed)
        return self._done(Result.OK)

    def _undecodable(self, error: Exception) -> ExportOutcome:
        """Answers a payload the decoder failed on unexpectedly as malformed, and counts it as an error:
        a dropped connection (HTTP) or UNKNOWN (gRPC) would tell the sender nothing and count nothing."""
        self.counters.add_error("decode")
        if not self._logged_decode_error:  # once: one bad sender would otherwise flood the log
            self._logged_decode_error = True
            _log.exception("decoding a trace export failed; counted as errors[decode] (logged once)")
        return self._done(Result.MALFORMED, f"cannot decode the request ({type(error).__name__})")

    def _done(self, result: Result, message: str = "", rejected_spans: int = 0) -> ExportOutcome:
        self.counters.add_request(result.value)
        return ExportOutcome(result, message, rejected_spans)
