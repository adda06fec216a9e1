"""The detector's own OpenTelemetry output: verdict metrics (CONTRACT §3b), one `straggler.verdict`
event per verdict (§3c), and health metrics.

The providers are private to the detector, never installed as the global ones, so a program that
embeds the service keeps its own telemetry untouched. Nothing is exported over OTLP unless an
endpoint is configured by the standard env vars (OTEL_EXPORTER_OTLP_ENDPOINT or the per-signal
OTEL_EXPORTER_OTLP_METRICS_ENDPOINT / OTEL_EXPORTER_OTLP_LOGS_ENDPOINT; protocol from
OTEL_EXPORTER_OTLP[_<SIGNAL>]_PROTOCOL, `grpc` by default as in the Python SDK); the exporters read
headers, TLS, compression and timeout from the same env vars, and a value of those that they would
fail on or ignore is a ConfigError naming the variable at start-up. Export failures are counted.
Metrics go through the SDK's MeterProvider and OTLP metric exporters; the events through our own
OTLP logs export (event_export.py, on the exporters of instrumentation/otlp_exporters.py), which
counts every event it drops, by reason (`events_dropped`).

Gauges and health counters are observed at collection time from callables the service provides, so
there is one source of truth (the engine's state and the intake counters) and no second copy here.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Optional

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource

from otel_straggler import contract
from otel_straggler.detector.config import ConfigError, DetectorConfig
from otel_straggler.detector.event_export import SEVERITY_ERROR, SEVERITY_INFO, SEVERITY_WARN, EventExporter
from otel_straggler.detector.gpu_evidence import describe
from otel_straggler.detector.next_step import next_step, suspect
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.driver import SPAN_OUTCOMES
from otel_straggler.otlp_environ import check_exporter_environ, resolve_protocol

_log = logging.getLogger(__name__)
SCOPE_NAME = "otel_straggler.detector"
DETECTOR_SERVICE_NAME = "otel-straggler-detector"
_WARN_VERDICTS = {contract.VERDICT_STRAGGLER, contract.VERDICT_SILENT}
_ERROR_VERDICTS = {contract.VERDICT_HANG}
# verdicts that start or end what a Prometheus rule pages on (straggler.alert.active, straggler.job.hang,
# the silent count): the metrics are exported right after them instead of at the next period
ALERT_CHANGING_VERDICTS = frozenset({contract.VERDICT_STRAGGLER, contract.VERDICT_RECOVERED,
                                     contract.VERDICT_HANG, contract.VERDICT_SILENT})
# (at most one such extra export every --prompt-export-spacing-s, so a burst of verdicts, a whole
# node's ranks at once, costs one export, not one each)
# exporter batching adds seconds; beyond a window's grace (30 s by default) spans risk being late
_LAG_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def otlp_endpoint_configured(signal: str, environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _otlp_metric_exporter_class(protocol: str) -> type:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        return GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

    return HttpExporter


def _otlp_exporter(signal: str, environ: Mapping[str, str], make: Callable[[str], Any]):
    """What `make(protocol)` makes of the signal's OTLP settings, the settings checked first."""
    protocol = resolve_protocol(None, environ, signal)
    check_exporter_environ(signal, protocol, environ)
    try:
        return make(protocol)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - anything else made of the env vars: still one line
        raise ConfigError(f"OTEL_EXPORTER_OTLP_*: cannot make the {protocol} {signal} exporter: {error}") from None


def _event_sender(protocol: str, environ: Mapping[str, str]):
    """Our OTLP logs sender (LogsService/Export, POST .../v1/logs)."""
    from otel_straggler.instrumentation.otlp_exporters import LOGS, sender

    return sender(LOGS, protocol, environ)


def _counting_failures(exporter_class: type, on_failure: Callable[[], None]) -> type:
    """A subclass of an OTLP exporter that counts failed exports (the SDK only logs them)."""

    class CountingExporter(exporter_class):
        def export(self, *args: Any, **kwargs: Any):
            try:
                result = super().export(*args, **kwargs)
            except Exception:
                on_failure()
                raise
            if result.name != "SUCCESS":
                on_failure()
            return result

    return CountingExporter


def verdict_summary(verdict: Verdict) -> str:
    """One line for people: the event body. A straggler's says what its GPU showed and what to look
    at first."""
    where = f" on {verdict.host}" + (f" (local rank {verdict.local_rank})" if verdict.local_rank is not None else "") \
        if verdict.host is not None else ""
    who = "no single rank" if verdict.rank is None else f"rank {verdict.rank}{where}"
    if verdict.verdict == contract.VERDICT_HANG:
        line = (f"job {verdict.job_id} hung {verdict.stalled_s:.0f} s ago: {who}, {verdict.reason}, "
                f"in {verdict.stage}")
    else:
        line = f"{who} {verdict.verdict} ({verdict.reason}) in {verdict.stage} of job {verdict.job_id}"
    words = describe(verdict.gpu)
    if words:
        line += f"; GPU: {words}"
    if verdict.verdict in (contract.VERDICT_STRAGGLER, contract.VERDICT_HANG) and verdict.rank is not None:
        line += f". Next: {next_step(verdict.to_dict())}"
    return line


def verdict_attributes(verdict: Verdict) -> dict[str, Any]:
    """The evidence-file fields as event attributes; null ones are left out (attributes have no null)
    and objects (gpu, slow_steps) are flattened to `gpu.sm_clock_mhz` and so on. A per-rank
    straggler or hang also carries `suspect` and `next_step` (next_step.py)."""
    record = verdict.to_dict()
    attributes: dict[str, Any] = {}
    for key in contract.VERDICT_FIELDS:
        value = record[key]
        if isinstance(value, dict):
            attributes.update({f"{key}.{name}": item for name, item in value.items() if item is not None})
        elif value is not None:
            attributes[key] = value
    if verdict.verdict in (contract.VERDICT_STRAGGLER, contract.VERDICT_HANG) and verdict.rank is not None:
        attributes["suspect"] = suspect(record) if verdict.verdict == contract.VERDICT_STRAGGLER else verdict.reason
        attributes["next_step"] = next_step(record)
    return attributes


class DetectorTelemetry:
    """Owns the detector's MeterProvider and event export. `health()` returns the status dict of
    the service (see DetectorService.status); `rank_states()` the engine's rank_state() (rows with
    job_id, cohort, stage, rank, slowdown, alert_active)."""

    def __init__(
        self,
        config: DetectorConfig,
        health: Callable[[], dict],
        rank_states: Callable[[], Iterable[Any]],
        export_otlp: bool,
        environ: Mapping[str, str] = os.environ,
        hang_states: Callable[[], Iterable[Any]] = tuple,
        job_slowdown_states: Callable[[], Iterable[Any]] = tuple,
    ) -> None:
        self._health = health
        self._all_rank_states = rank_states
        self._rank_state_snapshot: tuple[list, set] = ([], {"slowdown", "alert_active", "alert_evidence"})
        self._snapshot_lock = threading.Lock()
        self._hang_states = hang_states
        self._job_slowdown_states = job_slowdown_states
        self._lock = threading.Lock()
        self.export_failures: Counter[str] = Counter()
        self.events_dropped: Counter[str] = Counter()  # verdict events not delivered, by reason
        # (job, cohort, stage, rank) -> the straggler alert's evidence attributes, while it is active
        self._alert_evidence: dict[tuple, dict[str, Any]] = {}
        self._max_alert_evidence = config.max_metric_series
        resource = Resource.create({
            "service.name": DETECTOR_SERVICE_NAME,
            # stable across restarts of the same shard, so a restart is not a vanished detector
            "service.instance.id": f"{socket.gethostname()}:{config.grpc_port}",
        })
        readers: list[MetricReader] = []
        self.exporting_metrics = export_otlp and otlp_endpoint_configured("metrics", environ)
        self.exporting_events = export_otlp and otlp_endpoint_configured("logs", environ)
        self._prompt_export: Optional[_PromptExport] = None
        if self.exporting_metrics:
            exporter = _otlp_exporter("metrics", environ, lambda protocol: _counting_failures(
                _otlp_metric_exporter_class(protocol), lambda: self._failed("metrics"))())
            periodic = PeriodicExportingMetricReader(
                exporter, export_interval_millis=config.metric_export_interval_s * 1000)
            readers.append(periodic)
            if config.prompt_export_spacing_s > 0:
                self._prompt_export = _PromptExport(periodic, config.prompt_export_spacing_s)
        self.scrape_reader: Optional[InMemoryMetricReader] = None
        if config.prometheus_port >= 0:
            self.scrape_reader = InMemoryMetricReader()
            readers.append(self.scrape_reader)
        per_rank = (contract.METRIC_RANK_SLOWDOWN, contract.METRIC_ALERT_ACTIVE, contract.METRIC_VERDICTS,
                    contract.METRIC_JOB_HANG, contract.METRIC_JOB_SLOWDOWN, contract.METRIC_ALERT_EVIDENCE)
        self._meter_provider = MeterProvider(
            metric_readers=readers, resource=resource,
            views=[View(instrument_name=name, aggregation_cardinality_limit=config.max_metric_series)
                   for name in per_rank],
        )
        self._events: Optional[EventExporter] = None
        if self.exporting_events:
            sender = _otlp_exporter("logs", environ, lambda protocol: _event_sender(protocol, environ))
            self._events = EventExporter(sender, resource, SCOPE_NAME, self._dropped_events,
                                         lambda: self._failed("logs"))
        self._create_instruments(self._meter_provider.get_meter(SCOPE_NAME))

    def _create_instruments(self, meter) -> None:
        meter.create_observable_gauge(
            contract.METRIC_RANK_SLOWDOWN, [self._observe_slowdown],
            description="latest window median of the rank over the reference (1.10 = 10% slower)")
        meter.create_observable_gauge(
            contract.METRIC_ALERT_ACTIVE, [self._observe_alert_active],
            description="1 while a straggler alert is active for the rank")
        meter.create_observable_gauge(
            contract.METRIC_ALERT_EVIDENCE, [self._observe_alert_evidence],
            description="1 while a straggler alert is active, with its evidence in words: suspect (gpu_errors, "
                        "input_pipeline, gpu_throttled, gpu, host, peer_wait, unknown), gpu, next_step")
        self._verdicts = meter.create_counter(contract.METRIC_VERDICTS, description="verdicts emitted")
        meter.create_observable_gauge(
            contract.METRIC_JOB_HANG, [self._observe_hangs],
            description="1 while a hang is declared for the job, per culprit (training.rank -1: none stands out); "
                        "0 once progress resumed")
        meter.create_observable_gauge(
            contract.METRIC_JOB_SLOWDOWN, [self._observe_job_slowdown],
            description="the cohort's latest window step time (time per token where reported) over its own "
                        "baseline (1.36 = 36% slower)")
        meter.create_observable_counter(
            contract.METRIC_DETECTOR_SPANS, [self._observe_health("spans", "outcome", only=SPAN_OUTCOMES)],
            description="spans reaching the detector, by outcome")
        meter.create_observable_counter(
            "straggler.detector.rejections", [self._observe_health("rejections", "reason")],
            description="malformed spans, by kind of rejection (missing_job_id, bad_rank, ...)")
        meter.create_observable_counter(
            "straggler.detector.spans.ignored", [self._observe_total("spans", "ignored")],
            description="spans without training.stage (not stage spans), ignored")
        meter.create_observable_counter(
            "straggler.detector.heartbeats", [self._observe_total("spans", "heartbeats")],
            description="train.heartbeat spans received")
        meter.create_observable_counter(
            "straggler.detector.requests", [self._observe_health("requests", "result")],
            description="OTLP export requests, by result")
        meter.create_observable_counter(
            "straggler.detector.windows.closed", [self._observe_total("engine", "windows_closed")],
            description="windows judged by the engine")
        meter.create_observable_counter(
            "straggler.detector.evictions", [self._observe_health("engine", "kind", prefix="evictions_")],
            description="engine state evicted to stay within its bounds, by kind")
        meter.create_observable_counter(
            "straggler.detector.errors", [self._observe_health("errors", "kind")],
            description="internal errors survived (engine, verdict listener, telemetry, decoding, HTTP connections), "
                        "by kind")
        meter.create_observable_counter(
            "straggler.detector.verdicts.dropped", [self._observe_health("verdicts_dropped", "reason")],
            description="verdicts not written to verdicts.jsonl, by reason")
        meter.create_observable_counter(
            "straggler.detector.export.failures", [self._observe_export_failures],
            description="failed OTLP exports of the detector's own metrics and events, by signal")
        meter.create_observable_counter(
            "straggler.detector.events.dropped", [self._observe_events_dropped],
            description="verdict events not exported over OTLP, by reason (queue_full, export_failed, "
                        "encode_failed, shutdown)")
        meter.create_observable_gauge(
            "straggler.detector.queue.spans", [self._observe_total("queue", "pending_spans")],
            description="decoded spans waiting for the engine")
        self._ingest_lag = meter.create_histogram(
            "straggler.detector.ingest.lag", unit="s",
            description="age of a batch's last span (now - span end) when the engine ingests it",
            explicit_bucket_boundaries_advisory=_LAG_BUCKETS_S)

    # ---------------------------------------------------------------- recording

    def record_verdicts(self, verdicts: Iterable[Verdict]) -> None:
        alert_changed = False
        for verdict in verdicts:
            self._note_alert_evidence(verdict)
            alert_changed = alert_changed or verdict.verdict in ALERT_CHANGING_VERDICTS
            self._verdicts.add(1, _placed({
                "verdict": verdict.verdict, "reason": verdict.reason, contract.STAGE: verdict.stage,
                contract.RANK: -1 if verdict.rank is None else verdict.rank, contract.JOB_ID: verdict.job_id,
            }, verdict))
            if self._events is not None:
                severity = SEVERITY_ERROR if verdict.verdict in _ERROR_VERDICTS else \
                    SEVERITY_WARN if verdict.verdict in _WARN_VERDICTS else SEVERITY_INFO
                self._events.emit(verdict.time_unix_nano, severity, verdict_summary(verdict),
                                  verdict_attributes(verdict), contract.VERDICT_EVENT_NAME)
        if alert_changed and self._prompt_export is not None:
            self._prompt_export.request()

    def record_ingest_lag(self, seconds: float) -> None:
        self._ingest_lag.record(seconds)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Exports what is pending, then stops the providers."""
        millis = int(timeout_s * 1000)
        if self._prompt_export is not None:
            self._prompt_export.stop(min(1.0, timeout_s))
        if self._events is not None:
            self._events.shutdown(timeout_s)
        self._meter_provider.force_flush(millis)
        self._meter_provider.shutdown(millis)

    # ---------------------------------------------------------------- observation callbacks

    def _failed(self, signal: str) -> None:
        with self._lock:
            self.export_failures[signal] += 1

    def _dropped_events(self, reason: str, count: int) -> None:
        with self._lock:
            self.events_dropped[reason] += count

    def _rank_states(self, consumer: str) -> list:
        """Every rank's state, read once for the three callbacks of one collection (a read takes
        the engine's lock and lists every compared stage and rank): a callback gets the snapshot
        the previous one took unless it used that snapshot already (then this is a new
        collection, and it takes a fresh one)."""
        with self._snapshot_lock:  # not self._lock: the engine's lock is taken inside
            states, consumers = self._rank_state_snapshot
            if consumer in consumers:
                states, consumers = list(self._all_rank_states()), set()
                self._rank_state_snapshot = (states, consumers)
            consumers.add(consumer)
        return states

    def _observe_slowdown(self, options: CallbackOptions) -> Iterable[Observation]:
        for state in self._rank_states("slowdown"):
            if state.slowdown is not None:
                yield Observation(state.slowdown, _rank_attributes(state))

    def _observe_alert_active(self, options: CallbackOptions) -> Iterable[Observation]:
        for state in self._rank_states("alert_active"):
            yield Observation(1 if state.alert_active else 0, _rank_attributes(state))

    def _note_alert_evidence(self, verdict: Verdict) -> None:
        if verdict.rank is None:
            return
        key = (verdict.job_id, verdict.cohort, verdict.stage, verdict.rank)
        with self._lock:
            if verdict.verdict == contract.VERDICT_RECOVERED:
                self._alert_evidence.pop(key, None)
            elif verdict.verdict == contract.VERDICT_STRAGGLER and (
                    key in self._alert_evidence or len(self._alert_evidence) < self._max_alert_evidence):
                record = verdict.to_dict()
                self._alert_evidence[key] = _placed({
                    contract.JOB_ID: verdict.job_id, contract.COHORT: verdict.cohort, contract.STAGE: verdict.stage,
                    contract.RANK: verdict.rank, "suspect": suspect(record), "gpu": describe(verdict.gpu),
                    "next_step": next_step(record)}, verdict)

    def _observe_alert_evidence(self, options: CallbackOptions) -> Iterable[Observation]:
        # only alerts the engine still holds: one that ended without a `recovered` (its job evicted,
        # its rank restarted) is forgotten here
        active = {(state.job_id, state.cohort, state.stage, state.rank)
                  for state in self._rank_states("alert_evidence") if state.alert_active}
        with self._lock:
            for key in [key for key in self._alert_evidence if key not in active]:
                del self._alert_evidence[key]
            held = list(self._alert_evidence.values())
        for attributes in held:
            yield Observation(1, attributes)

    def _observe_hangs(self, options: CallbackOptions) -> Iterable[Observation]:
        for state in self._hang_states():
            yield Observation(1 if state.active else 0, {
                contract.JOB_ID: state.job_id, contract.RANK: state.rank, contract.HOST_NAME: state.host,
                contract.LOCAL_RANK: state.local_rank, contract.STAGE: state.stage, "reason": state.reason})

    def _observe_job_slowdown(self, options: CallbackOptions) -> Iterable[Observation]:
        for state in self._job_slowdown_states():
            yield Observation(state.ratio, {contract.JOB_ID: state.job_id, contract.COHORT: state.cohort})

    def _observe_health(self, section: str, attribute: str, only: Iterable[str] = (), prefix: str = "") -> Callable:
        wanted = set(only)

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for key, value in self._health().get(section, {}).items():
                if (not wanted or key in wanted) and key.startswith(prefix):
                    yield Observation(value, {attribute: key[len(prefix):]})

        return observe

    def _observe_total(self, section: str, key: str) -> Callable:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            value = self._health().get(section, {}).get(key)
            if value is not None:
                yield Observation(value)

        return observe

    def _observe_export_failures(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            failures = dict(self.export_failures)
        for signal, count in failures.items():
            yield Observation(count, {"signal": signal})

    def _observe_events_dropped(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            dropped = dict(self.events_dropped)
        for reason, count in dropped.items():
            yield Observation(count, {"reason": reason})


class _PromptExport:
    """Exports the metrics soon after an alert starts or ends, on a thread of its own, so the page
    does not wait out the rest of the export period (metric_export_interval_s; the periodic export
    goes on as before). Requests coalesce: at most one extra export per `spacing_s`, the one after
    a burst taking everything the burst changed (the gauges are read at collection time)."""

    def __init__(self, reader: MetricReader, spacing_s: float) -> None:
        self._reader = reader
        self._spacing_s = spacing_s
        self._wanted = threading.Event()
        self._stopping = threading.Event()
        self.exports = 0
        self._thread = threading.Thread(target=self._run, name="straggler-prompt-export", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Never blocks: the caller (the verdict writer) goes on at once."""
        self._wanted.set()

    def stop(self, timeout_s: float) -> None:
        self._stopping.set()
        self._wanted.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            if self._stopping.is_set():
                return  # shutdown exports what is left
            self._wanted.clear()
            try:
                self._reader.collect(timeout_millis=10_000)
                self.exports += 1
            except Exception:  # noqa: BLE001 - the periodic export still runs; failures are counted by the exporter
                _log.debug("prompt metric export failed", exc_info=True)
            if self._stopping.wait(self._spacing_s):
                return


def _rank_attributes(state: Any) -> dict[str, Any]:
    return _placed({contract.JOB_ID: state.job_id, contract.COHORT: state.cohort,
                    contract.STAGE: state.stage, contract.RANK: state.rank}, state)


def _placed(attributes: dict[str, Any], where: Any) -> dict[str, Any]:
    """With host.name and training.local_rank (CONTRACT v1.1 §3b) where the rank's resource said."""
    if getattr(where, "host", None) is not None:
        attributes[contract.HOST_NAME] = where.host
    if getattr(where, "local_rank", None) is not None:
        attributes[contract.LOCAL_RANK] = where.local_rank
    if getattr(where, "k8s_node_name", None) is not None:  # v1.2 §5: label k8s_node_name
        attributes[contract.K8S_NODE_NAME] = where.k8s_node_name
    return attributes
