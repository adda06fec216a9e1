"""The standard OTEL_EXPORTER_OTLP_* variables the SDK's exporters read themselves, checked before an
exporter is made, so that a bad value is one line naming the variable at start-up: for some the
SDK's exporter raises a traceback (gRPC: timeout, compression), for others it logs one and carries
on without the file (gRPC: certificates) or quietly falls back to a default (HTTP). The rank's
exporters and the detector's are checked alike.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

from otel_straggler.settings import ConfigError

PROTOCOLS = ("grpc", "http/protobuf")
# OTEL_EXPORTER_OTLP_[<SIGNAL>_]COMPRESSION values each protocol's exporter takes ("none" is not
# one for gRPC: its exporter raises on it)
COMPRESSIONS = {"grpc": ("gzip",), "http/protobuf": ("none", "gzip", "deflate")}


def resolve_protocol(explicit: Optional[str], environ: Mapping[str, str], signal: str) -> str:
    """The OTLP protocol of a signal (traces, metrics, logs): an explicit value (configure()'s
    `protocol`), else the signal's variable, else the general one, else grpc; a bad value names
    where it came from."""
    signal_variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    for source, protocol in (("protocol", explicit), (signal_variable, environ.get(signal_variable)),
                             ("OTEL_EXPORTER_OTLP_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL"))):
        if protocol:
            if protocol.strip() not in PROTOCOLS:
                raise ConfigError(f"{source}: must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
            return protocol.strip()
    return "grpc"


def _exporter_variables(signal: str, setting: str, environ: Mapping[str, str],
                        blank_too: bool = False) -> Iterable[tuple[str, str]]:
    """(name, value) of the general and the per-signal variable of an exporter setting, where set
    (`blank_too`: set to nothing as well, which the SDK's exporters fail on for some settings)."""
    for variable in (f"OTEL_EXPORTER_OTLP_{setting}", f"OTEL_EXPORTER_OTLP_{signal.upper()}_{setting}"):
        if variable not in environ:
            continue
        value = environ[variable].strip()
        if value or blank_too:
            yield variable, value


def check_exporter_environ(signal: str, protocol: str, environ: Mapping[str, str]) -> None:
    """Raises ConfigError for the first bad timeout, compression or certificate variable of
    `signal` (traces, metrics, logs) over `protocol` (grpc, http/protobuf)."""
    for variable, value in _exporter_variables(signal, "TIMEOUT", environ, blank_too=True):
        try:
            valid = 0 < float(value) < math.inf
        except ValueError:
            valid = False
        if not valid:
            raise ConfigError(f"{variable}: expected a number of seconds > 0, got {value!r}")
    for variable, value in _exporter_variables(signal, "COMPRESSION", environ, blank_too=True):
        if value.lower() not in COMPRESSIONS[protocol]:
            raise ConfigError(f"{variable}: expected {' or '.join(COMPRESSIONS[protocol])} (protocol {protocol}), "
                              f"got {value!r}")
    for setting in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        for variable, path in _exporter_variables(signal, setting, environ):
            try:
                with open(path, "rb"):
                    pass
            except OSError as error:
                raise ConfigError(f"{variable}: cannot read {path!r}: {error.strerror}") from None
