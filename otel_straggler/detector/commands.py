"""`otel-straggler detect` and `otel-straggler replay`: flags, start-up errors, signals, exit codes.

Every setting is a flag and an OTEL_STRAGGLER_* env var (config.SETTINGS). A bad value (a listen
address that does not resolve too), token file, certificate or OTEL_EXPORTER_OTLP_* variable is one
line on stderr and exit code 2; a port that cannot be bound (named by its flag) or a file that cannot
be read is one line and exit code 1. While it runs, `detect` prints a line per alert, recovery, hang,
job slowdown and silent rank and a periodic status line on stderr (console.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from otel_straggler.cli import UsageError
from otel_straggler.detector import config as detector_config
from otel_straggler.detector import decode
from otel_straggler.detector.allocator import keep_freed_memory
from otel_straggler.detector.config import ConfigError, DetectorConfig

SHUTDOWN_TIMEOUT_S = 30.0  # for the engine to judge open windows and the evidence to be flushed
CONSOLE_STOP_TIMEOUT_S = 5.0  # for the last verdict lines to be written (a stderr that blocks gets no more)
# Settings that only the live service uses; replay takes every other one (engine rules, evidence).
_SERVICE_ONLY = {
    "listen_address", "grpc_port", "http_port", "max_request_bytes", "max_pending_requests", "max_pending_spans",
    "receiver_threads", "max_http_connections", "max_grpc_calls", "auth_token_file", "auth_token", "tls_cert_file",
    "tls_key_file", "prometheus_port",
    "console_verdicts", "console_status_interval_s",
}


def _load(args: argparse.Namespace) -> DetectorConfig:
    try:
        return detector_config.load(args)
    except ConfigError as error:
        raise UsageError(str(error)) from None


def _log_to_stderr(command: str) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"otel-straggler {command}: %(levelname)s %(name)s: %(message)s")


def add_detect_arguments(parser: argparse.ArgumentParser) -> None:
    detector_config.add_arguments(parser)


def run_detect(args: argparse.Namespace) -> int:
    from otel_straggler.detector.service import DetectorService

    config = _load(args)
    _log_to_stderr("detect")
    allocator = keep_freed_memory()  # this process is the detector's own (an embedding one keeps its allocator)
    stop_requested = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stop_requested.set())
    service = DetectorService(config)
    console = _console(service, config)
    try:
        service.start()
    except ConfigError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        print(f"otel-straggler detect: {error}", file=sys.stderr)
        return 1
    grpc_port, http_port = service.bound_ports
    prometheus = f", Prometheus :{service.prometheus_port}/metrics" if service.prometheus_port is not None else ""
    decoder = "C scanner" if decode.scanner_built() else "Python only (the C scanner is not built)"
    print(f"otel-straggler detect: OTLP/gRPC {config.listen_address}:{grpc_port}, OTLP/HTTP "
          f"{config.listen_address}:{http_port}{prometheus}, evidence in {os.path.abspath(config.evidence_dir)}, "
          f"protobuf decoding: {decoder}, allocator: {allocator}", flush=True)
    if console is not None:
        console.start()
    while not stop_requested.wait(1.0):
        pass
    finished = service.stop(SHUTDOWN_TIMEOUT_S)
    if console is not None:
        console.stop(CONSOLE_STOP_TIMEOUT_S)  # after the drain: the verdicts it made are printed too
    if not finished:
        print(f"otel-straggler detect: shutdown did not finish within {SHUTDOWN_TIMEOUT_S:g}s", file=sys.stderr)
    return 0 if finished else 1


def _console(service, config: DetectorConfig):
    """The console lines `console_verdicts` and `console_status_interval_s` ask for (None: neither)."""
    from otel_straggler.detector.console import DetectorConsole

    if not config.console_verdicts and config.console_status_interval_s <= 0:
        return None
    console = DetectorConsole(
        sys.stderr, service.status, status_interval_s=config.console_status_interval_s,
        alerts_active=lambda: sum(1 for state in service.rank_state() if state.alert_active),
        count_error=service.count_error)
    if config.console_verdicts:
        service.add_verdict_listener(console.on_verdict)
    return console


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="OTLP JSON-lines files (the collector file exporter's format), .gz too")
    detector_config.add_arguments(parser, {s.name for s in detector_config.SETTINGS} - _SERVICE_ONLY)


def run_replay(args: argparse.Namespace) -> int:
    from otel_straggler.detector.replay import replay

    config = _load(args)
    # replay exports metrics and events only when asked by flag or env, unlike the live service
    asked = args.export_metrics is not None or "OTEL_STRAGGLER_EXPORT_METRICS" in os.environ
    _log_to_stderr("replay")
    keep_freed_memory()
    try:
        summary = replay(args.files, config, export_telemetry=asked and config.export_metrics)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        print(f"otel-straggler replay: {error}", file=sys.stderr)
        return 1
    spans = ", ".join(f"{outcome} {count}" for outcome, count in sorted(summary.status["spans"].items()))
    verdicts = ", ".join(f"{kind} {count}" for kind, count in sorted(summary.status["verdicts"].items())) or "none"
    print(f"otel-straggler replay: {summary.lines} lines; spans: {spans}; verdicts: {verdicts}; "
          f"evidence in {os.path.abspath(config.evidence_dir)}")
    return 0
