"""Send contract-shaped telemetry with the stock OpenTelemetry Python SDK and OTLP exporters.

Spans look like a rank's (CONTRACT §1-2: resource attributes, a `train.step` span per step with
stage spans under it, one trace id per (job, step) shared by all ranks); metrics and events look
like the detector's (CONTRACT §3). The pipeline tests use them where the real trainer and
detector are not needed.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

EXPORT_TIMEOUT_S = 10


def step_trace_id(job_id: str, step: int) -> int:
    """One trace id per (job, step), the same on every rank (how the instrumentation derives
    it does not matter here, only that ranks agree)."""
    return int.from_bytes(hashlib.sha256(f"{job_id}/{step}".encode()).digest()[:16], "big") or 1


class _StepTraceIds(RandomIdGenerator):
    def __init__(self) -> None:
        self.trace_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id


def rank_place(rank: int) -> dict:
    """Where the tests' ranks run: 8 to a node. The ranks' resource and the detector-shaped
    metrics both say so (host.name, training.local_rank)."""
    return {"host.name": f"node-{rank // 8}", "training.local_rank": rank % 8}


@dataclass(frozen=True)
class Rank:
    job_id: str
    rank: int
    world_size: int
    cohort: str
    service_name: str = "training"

    def resource(self) -> Resource:
        return Resource.create({
            "service.name": self.service_name,
            "training.job.id": self.job_id,
            "training.rank": self.rank,
            "training.world_size": self.world_size,
            **rank_place(self.rank),
            "training.cohort": self.cohort,
            "training.topology.epoch": 0,
        })


STAGES = (("forward-compute", "forward", False), ("backward-compute", "backward", False),
          ("grads-all-reduce", "communication", True))


def send_rank_steps(endpoint: str, rank: Rank, steps: range, stage_ms: float = 2.0) -> int:
    """Exports `train.step` + stage spans for each step, one OTLP request per span (as a rank's
    own exporter would: only its resource). Returns the number of spans sent."""
    ids = _StepTraceIds()
    provider = TracerProvider(resource=rank.resource(), id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S)))
    tracer = provider.get_tracer("otel_straggler.tests")
    sent = 0
    seq = 0
    try:
        for step in steps:
            ids.trace_id = step_trace_id(rank.job_id, step)
            t = time.time_ns()
            with tracer.start_as_current_span("train.step", start_time=t, attributes={"training.step": step},
                                              end_on_exit=False) as step_span:
                for name, group, collective in STAGES:
                    end = t + int(stage_ms * 1e6)
                    span = tracer.start_span(name, start_time=t, attributes={
                        "training.stage": name, "training.stage.group": group, "training.step": step,
                        "training.seq": seq, "training.stage.timing": "host_only",
                        "training.stage.timing_reason": "no_cuda", "training.stage.collective": collective,
                    })
                    span.end(end_time=end)
                    t, seq, sent = end, seq + 1, sent + 1
                step_span.end(end_time=t)
            sent += 1
    finally:
        provider.shutdown()
    return sent


def _detector_meter(endpoint: str, instance: str) -> tuple[MeterProvider, object]:
    """A meter on a detector shard's resource, exporting only when flushed."""
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S),
        export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create(
        {"service.name": "otel-straggler-detector", "service.instance.id": instance}))
    return provider, provider.get_meter("otel_straggler.detector")


def _flush(provider: MeterProvider) -> None:
    try:
        provider.force_flush(EXPORT_TIMEOUT_S * 1000)
    finally:
        provider.shutdown()


def send_detector_metrics(endpoint: str, job_id: str, slow_rank: int, ranks: range, cohort: str = "tp0-pp0",
                          stage: str = "forward-compute", instance: str = "shard-test") -> None:
    """One export of the four CONTRACT §3b metrics, as the detector would report a straggler, and
    the alert's evidence in words (straggler.alert.evidence) for the slow rank.

    Units matter for the Prometheus names: the gauges carry none (unit "1" would add `_ratio`),
    the counters carry annotations ({verdict}, {span}), which the translation drops.
    """
    provider, meter = _detector_meter(endpoint, instance)
    slowdown = meter.create_gauge("straggler.rank.slowdown", description="window median over reference")
    alert = meter.create_gauge("straggler.alert.active", description="1 while a straggler alert is active")
    evidence = meter.create_gauge("straggler.alert.evidence", description="1 while a straggler alert is active")
    verdicts = meter.create_counter("straggler.verdicts", unit="{verdict}", description="verdicts emitted")
    intake = meter.create_counter("straggler.detector.spans", unit="{span}", description="detector intake")
    windows = meter.create_counter("straggler.detector.windows.closed", description="windows judged")
    lag = meter.create_histogram("straggler.detector.ingest.lag", unit="s", description="ingest lag")
    for rank in ranks:
        labels = {"training.job.id": job_id, "training.cohort": cohort, "training.stage": stage, "training.rank": rank,
                  **rank_place(rank)}
        slow = rank == slow_rank
        slowdown.set(1.3 if slow else 1.0, labels)
        alert.set(1 if slow else 0, labels)
        if slow:
            evidence.set(1, {**labels, "suspect": "gpu_throttled",
                             "gpu": "SM clock 1410 MHz vs 1980 MHz at its peers; hw_thermal throttling; 89 °C",
                             "next_step": "Check the node's cooling and power, then dcgmi diag -r 3 on its GPU."})
        verdict = ("straggler", "slow_vs_peers") if slow else ("uncertain", "within_tolerance")
        verdicts.add(1, {"verdict": verdict[0], "reason": verdict[1], "training.stage": stage,
                         "training.rank": rank, "training.job.id": job_id, **rank_place(rank)})
    intake.add(len(ranks) * 30, {"outcome": "accepted"})
    intake.add(1, {"outcome": "malformed"})
    windows.add(len(ranks))
    for seconds in (0.05, 0.2, 1.5):
        lag.record(seconds)
    _flush(provider)


def send_hang_metrics(endpoint: str, job_id: str, culprit: int, stage: str = "batch-generator",
                      reason: str = "never_entered_collective", instance: str = "shard-test") -> None:
    """One export of `straggler.job.hang` (CONTRACT §3b) and its verdict count, as the detector
    would report a hang with one culprit."""
    provider, meter = _detector_meter(endpoint, instance)
    hang = meter.create_gauge("straggler.job.hang", description="1 while a hang is declared")
    verdicts = meter.create_counter("straggler.verdicts", unit="{verdict}", description="verdicts emitted")
    labels = {"training.job.id": job_id, "training.rank": culprit, "training.stage": stage, **rank_place(culprit)}
    hang.set(1, {**labels, "reason": reason})
    verdicts.add(1, {**labels, "verdict": "hang", "reason": reason})
    _flush(provider)


def send_job_slowdown_metrics(endpoint: str, job_id: str, cohort: str, ratio: float,
                              instance: str = "shard-test") -> None:
    """One export of `straggler.job.slowdown` (CONTRACT §3b): a cohort's latest window over its own
    baseline, as the detector reports it once a baseline exists."""
    provider, meter = _detector_meter(endpoint, instance)
    slowdown = meter.create_gauge("straggler.job.slowdown", description="latest window over the cohort's baseline")
    slowdown.set(ratio, {"training.job.id": job_id, "training.cohort": cohort})
    _flush(provider)


def send_verdict_event(endpoint: str, job_id: str, rank: int) -> None:
    """One `straggler.verdict` log event with evidence-file fields as attributes (CONTRACT §3c)."""
    provider = LoggerProvider(resource=Resource.create({"service.name": "otel-straggler-detector"}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(
        OTLPLogExporter(endpoint=endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S)))
    logger = provider.get_logger("otel_straggler.detector")
    logger.emit(
        timestamp=time.time_ns(), event_name="straggler.verdict", body="straggler",
        attributes={"job_id": job_id, "cohort": "tp0-pp0", "stage": "forward-compute", "rank": rank,
                    "window": 4, "verdict": "straggler", "reason": "slow_vs_peers", "slowdown": 1.3})
    provider.shutdown()
