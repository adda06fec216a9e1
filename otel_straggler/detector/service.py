"""The detector service: OTLP in, verdicts out. `otel-straggler detect` runs one; the demo embeds one.

    service = DetectorService(config)
    service.add_verdict_listener(print)       # optional: called on the engine thread per Verdict
    service.start()                           # binds the ports; bound_ports tells which
    ...
    service.stop(timeout_s=10)                # judges every open window, flushes the evidence

Threads: receivers (gRPC workers, one per HTTP connection) decode and queue; one engine thread
ingests, closes windows by the wall clock and calls the listeners; one emitter thread writes
verdicts.jsonl, status.json and the OTel metrics and events; one more writes windows.jsonl
(window_record.py). See driver.py and emit.py.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Callable, Optional, TypeVar

from otel_straggler.detector.config import ConfigError, DetectorConfig
from otel_straggler.detector.emit import VerdictEmitter, status_record
from otel_straggler.detector.evidence import EvidenceFiles, carried_counters
from otel_straggler.detector.inherited_alerts import read_open_alerts
from otel_straggler.detector.intake_loop import IntakeLoop
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.driver import EngineDriver, IntakeCounters, SpanPipeline
from otel_straggler.detector.engine_interface import DetectorEngine
from otel_straggler.detector.receiver import OtlpIntake, load_token
from otel_straggler.detector.receiver_grpc import OtlpGrpcReceiver
from otel_straggler.detector.receiver_http import OtlpHttpReceiver, server_ssl_context
from otel_straggler.detector.telemetry import DetectorTelemetry
from otel_straggler.detector.telemetry_prometheus import PrometheusEndpoint
from otel_straggler.detector.window_record import WindowRecord, detector_engine

_log = logging.getLogger(__name__)
VerdictListener = Callable[[Verdict], None]


_Listener = TypeVar("_Listener")


def _listening(flag: str, address: str, port: int, make: Callable[[], _Listener]) -> _Listener:
    """A listener made by `make`; a socket error names the flag and the address: a ConfigError for
    an address that does not resolve (a bad value), else an OSError (the port in use, say)."""
    try:
        return make()
    except OSError as error:
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        reason = error.strerror or str(error)
        if isinstance(error, socket.gaierror):
            raise ConfigError(f"--listen-address: cannot listen on {target}: {reason}") from None
        if error.errno == errno.EADDRNOTAVAIL:  # an address this machine does not have
            flag = "--listen-address"
        raise OSError(f"{flag}: cannot listen on {target}: {reason}") from None


class DetectorService:
    def __init__(self, config: DetectorConfig, engine: Optional[DetectorEngine] = None) -> None:
        """`engine` defaults to a new Engine(config) that records the windows it judges in
        windows.jsonl (window_record.py); pass one only to wrap a custom engine (it records none)."""
        self.window_record: Optional[WindowRecord] = None
        if engine is None:
            self.window_record = WindowRecord.from_config(config)
            engine = detector_engine(config, self.window_record)
        self.config = config
        self._listeners: list[VerdictListener] = []
        self._counters = IntakeCounters()
        self._telemetry: Optional[DetectorTelemetry] = None
        self._driver = EngineDriver(engine, self._counters, self._deliver, self._record_ingest_lag)
        self._pipeline = SpanPipeline(self._driver, config)
        self._emitter: Optional[VerdictEmitter] = None
        self._grpc: Optional[OtlpGrpcReceiver] = None
        self._http: Optional[OtlpHttpReceiver] = None
        self._intake_loop: Optional[IntakeLoop] = None
        self._prometheus: Optional[PrometheusEndpoint] = None
        self._started_unix_nano: Optional[int] = None
        self._carried: dict = {}  # what earlier processes counted in this evidence directory
        self._state = "new"
        self._state_lock = threading.Lock()

    # ---------------------------------------------------------------- public API

    def add_verdict_listener(self, listener: VerdictListener) -> None:
        """`listener(verdict)` is called on the engine thread for every verdict, before it is written
        to the evidence file. Keep it quick; an exception is caught and counted (errors.listener)."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Binds the receivers and starts the threads. Raises ConfigError for a bad token, cert or
        OTLP exporter setting, OSError when a port cannot be bound; nothing is left running then."""
        with self._state_lock:
            if self._state != "new":
                raise RuntimeError(f"DetectorService.start() on a {self._state} service")
            self._state = "starting"
        try:
            self._start()
        except BaseException:
            self._stop_parts(timeout_s=1.0)
            self._state = "stopped"
            raise
        self._state = "running"

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stops intake, lets the engine judge every open window (drain), flushes the evidence and
        the OTel exporters. True when all of that finished within timeout_s."""
        with self._state_lock:
            if self._state != "running":
                return self._state in ("stopped", "new")
            self._state = "stopping"
        finished = self._stop_parts(timeout_s)
        self._state = "stopped"
        return finished

    @property
    def bound_ports(self) -> tuple[int, int]:
        """(gRPC port, HTTP port) actually bound; useful with port 0."""
        if self._grpc is None or self._http is None:
            raise RuntimeError("the service is not started")
        return self._grpc.port, self._http.port

    @property
    def prometheus_port(self) -> Optional[int]:
        return self._prometheus.port if self._prometheus is not None else None

    def status(self) -> dict:
        """Everything status.json holds: counters of every outcome and loss, engine stats, ports."""
        record = {
            "state": self._state,
            "time_unix_nano": time.time_ns(),
            "started_unix_nano": self._started_unix_nano,
            "ports": {"grpc": self._grpc and self._grpc.port, "http": self._http and self._http.port,
                      "prometheus": self.prometheus_port},
            "queue": {"pending_spans": self._pipeline.pending_spans},
        }
        if self._emitter is not None:
            record.update(status_record(self._driver, self._emitter, self._telemetry, self._carried))
            # the counters above count since counting_since_unix_nano, over `processes` processes
            record["history"] = {"processes": self._carried.get("processes", 0) + 1,
                                 "counting_since_unix_nano": self._carried.get("counting_since_unix_nano",
                                                                               self._started_unix_nano)}
        if self.window_record is not None:
            record["windows"] = self.window_record.counts()
        return record

    def rank_state(self):
        """The engine's rank_state(), read under the engine's lock (safe from any thread)."""
        return self._driver.rank_state()

    def count_error(self, kind: str, count: int = 1) -> None:
        """Counts an error survived around the service (status.json `errors`), such as a console
        line that could not be written; safe from any thread."""
        self._counters.add_error(kind, count)

    def __enter__(self) -> "DetectorService":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ---------------------------------------------------------------- internals

    def _start(self) -> None:
        config = self.config
        token = load_token(config)
        ssl_context, key_and_cert = None, None
        if config.tls_cert_file:
            try:
                ssl_context = server_ssl_context(config.tls_cert_file, config.tls_key_file)
                with open(config.tls_key_file, "rb") as key, open(config.tls_cert_file, "rb") as cert:
                    key_and_cert = (key.read(), cert.read())
            except (OSError, ValueError) as error:
                raise ConfigError(f"--tls-cert-file/--tls-key-file: cannot load: {error}") from None
        self._telemetry = telemetry = DetectorTelemetry(
            config, self.status, self.rank_state, export_otlp=config.export_metrics,
            hang_states=self._driver.hang_state, job_slowdown_states=self._driver.job_slowdown_state)
        evidence = EvidenceFiles(config.evidence_dir, config.max_evidence_bytes)
        # a restart in the same evidence directory carries on: its counters, and the alerts left open
        self._carried = carried_counters(evidence.status_path)
        open_alerts, unreadable = read_open_alerts(evidence.verdicts_path)
        self._driver.engine.inherit_alerts(open_alerts)
        if unreadable:
            self._counters.add_error("evidence_unreadable_lines", unreadable)
        self._emitter = VerdictEmitter(evidence, config.flush_interval_s, self.status, self._telemetry)
        intake = OtlpIntake(self._pipeline, token, config.max_request_bytes)
        address = config.listen_address
        self._intake_loop = intake_loop = IntakeLoop(config.receiver_threads)
        intake_loop.start()
        self._grpc = _listening("--grpc-port", address, config.grpc_port, lambda: OtlpGrpcReceiver(
            intake, intake_loop, address, config.grpc_port, config.max_grpc_calls, key_and_cert))
        self._http = _listening("--http-port", address, config.http_port, lambda: OtlpHttpReceiver(
            intake, intake_loop, address, config.http_port, config.max_http_connections, ssl_context))
        scrape_reader = telemetry.scrape_reader
        if scrape_reader is not None:
            # the OTLP ports' TLS and token guard this one too
            self._prometheus = _listening(
                "--prometheus-port", address, config.prometheus_port, lambda: PrometheusEndpoint(
                    scrape_reader, address, config.prometheus_port,
                    lambda event: intake.counters.add_error(f"prometheus_{event}"), ssl_context, token))
        self._started_unix_nano = time.time_ns()
        self._emitter.start()
        if self.window_record is not None:
            self.window_record.start()
        self._pipeline.start()
        self._grpc.start()
        self._http.start()
        if self._prometheus is not None:
            self._prometheus.start()

    def _stop_parts(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self._http is not None:
            self._http.stop()
        if self._grpc is not None:
            self._grpc.stop(grace_s=min(1.0, left()))
        if self._intake_loop is not None:
            self._intake_loop.stop(min(5.0, left()))
        finished = self._pipeline.stop(left())
        if self.window_record is not None:  # before the emitter, whose last status.json counts its windows
            finished = self.window_record.stop(left()) and finished
        if self._emitter is not None:
            finished = self._emitter.stop(left()) and finished
        if self._telemetry is not None:
            self._telemetry.shutdown(min(5.0, left()))
        if self._prometheus is not None:
            self._prometheus.stop()
        return finished

    def _deliver(self, verdicts: list[Verdict]) -> None:
        for listener in self._listeners:
            for verdict in verdicts:
                try:
                    listener(verdict)
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the detector
                    self._counters.add_error("listener")
                    _log.debug("verdict listener failed", exc_info=True)
        if self._emitter is not None:
            self._emitter.submit(verdicts)

    def _record_ingest_lag(self, seconds: float) -> None:
        if self._telemetry is not None:
            self._telemetry.record_ingest_lag(seconds)
