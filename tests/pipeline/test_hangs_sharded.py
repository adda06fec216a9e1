"""A job's hang when its cohorts live on different detector shards.

The gateway routes by (job, cohort), heartbeats with their rank's cohort, so each shard judges the
hang over the cohorts it holds (docs/detection.md, Hangs): the shard that holds the culprit's cohort
names it; a shard whose ranks all wait says `all_ranks_waiting` for the job. Two real detector
services stand behind the real gateway.
"""
from __future__ import annotations

import time
import uuid

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.service import DetectorService

from otel_straggler.testing import services
from .telemetry import STAGES, Rank, step_trace_id

pytestmark = pytest.mark.services

COHORTS = 12  # all on one shard by chance: 2 * 2**-12
RANKS_PER_COHORT = 3
CULPRIT = 0  # rank 0, in cohort tp0, never reaches the all-reduce of the last step
HANG_TIMEOUT_S = 6.0
SCOPE = InstrumentationScope("otel_straggler")


def span(rank: Rank, name: str, start: int, end: int, attributes: dict, span_id: int) -> ReadableSpan:
    context = SpanContext(step_trace_id(rank.job_id, attributes.get(contract.STEP, 0)), span_id, is_remote=False,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(name=name, context=context, resource=rank.resource(), attributes=attributes,
                        start_time=start, end_time=end, instrumentation_scope=SCOPE)


def step_spans(rank: Rank, step: int, start: int, seq: int, last: bool) -> list[ReadableSpan]:
    if last and rank.rank == CULPRIT:
        return []  # the culprit never leaves its forward-compute
    spans, t = [], start
    for index, (name, group, collective) in enumerate(STAGES):
        if last and collective:
            break  # the others are inside it, waiting
        spans.append(span(rank, name, t, t + 2_000_000, {
            contract.STAGE: name, contract.STAGE_GROUP: group, contract.STEP: step, contract.SEQ: seq + index,
            contract.TIMING: contract.TIMING_HOST_ONLY, contract.COLLECTIVE: collective}, seq + index + 1))
        t += 2_000_000
    return spans


def heartbeat(rank: Rank, now: int, since: int, step: int, span_id: int) -> ReadableSpan:
    stage = "forward-compute" if rank.rank == CULPRIT else STAGES[-1][0]
    return span(rank, contract.HEARTBEAT_SPAN_NAME, now, now, {
        contract.STEP: step, contract.SEQ: 0, contract.HEARTBEAT_OPEN_STAGES: (stage,),
        contract.HEARTBEAT_OPEN_SINCE: (since,)}, span_id)


def test_each_shard_judges_the_hang_of_the_cohorts_it_holds(start_collector, tmp_path):
    shards, verdicts = [], []
    for index in range(2):
        service = DetectorService(DetectorConfig(
            grpc_port=0, http_port=0, evidence_dir=str(tmp_path / f"shard-{index}"), export_metrics=False,
            window_steps=5, min_cohort_size=2, hang_timeout_s=HANG_TIMEOUT_S, max_export_lag_s=1.0))
        service.add_verdict_listener(lambda verdict, index=index: verdicts.append((index, verdict)))
        service.start()
        shards.append(service)
    try:
        gateway = start_collector([services.CONFIG_DIR / "gateway.yaml"], name="gateway", env={
            "DETECTOR_ENDPOINTS": "[" + ", ".join(f"{services.LOOPBACK}:{shard.bound_ports[0]}"
                                                  for shard in shards) + "]"})
        exporter = OTLPSpanExporter(endpoint=gateway.grpc_endpoint, insecure=True, timeout=10)
        job_id = f"sharded-hang-{uuid.uuid4().hex[:8]}"
        ranks = [Rank(job_id, cohort * RANKS_PER_COHORT + i, COHORTS * RANKS_PER_COHORT, f"tp{cohort}")
                 for cohort in range(COHORTS) for i in range(RANKS_PER_COHORT)]
        steps = 20
        start = time.time_ns() - steps * 10_000_000
        sent = 0
        for step in range(steps):
            for rank in ranks:
                spans = step_spans(rank, step, start + step * 10_000_000, step * len(STAGES), step == steps - 1)
                assert exporter.export(spans) is SpanExportResult.SUCCESS
                sent += len(spans)
        # every span delivered before the stall begins, and each shard holds cohorts of the job
        services.wait_until(lambda: sum(shard.status()["spans"]["accepted"] for shard in shards) >= sent, 30,
                            what=f"{sent} spans accepted by the shards")
        assert all(shard.status()["engine"]["cohorts"] for shard in shards), "one shard holds every cohort"
        stalled_since = time.time_ns()
        deadline = time.monotonic() + HANG_TIMEOUT_S + 20
        while time.monotonic() < deadline and len({index for index, v in verdicts
                                                   if v.verdict == contract.VERDICT_HANG}) < 2:
            now = time.time_ns()
            assert exporter.export([heartbeat(rank, now, stalled_since, steps - 1, 10**6 + rank.rank)
                                    for rank in ranks]) is SpanExportResult.SUCCESS
            time.sleep(1.0)
        time.sleep(2.0)
        exporter.shutdown()
        cohorts_held = [shard.status()["engine"]["cohorts"] for shard in shards]
    finally:
        for shard in shards:
            shard.stop(timeout_s=10.0)
    hangs = [(index, v.rank, v.reason, v.stage) for index, v in verdicts if v.verdict == contract.VERDICT_HANG]
    culprit_shard = next(index for index, v in verdicts if v.verdict == contract.VERDICT_HANG and v.rank == CULPRIT)
    other = 1 - culprit_shard
    assert sorted(hangs) == sorted([
        (culprit_shard, CULPRIT, contract.HANG_NEVER_ENTERED_COLLECTIVE, "forward-compute"),
        (other, None, contract.HANG_ALL_RANKS_WAITING, STAGES[-1][0])]), (hangs, "cohorts held", cohorts_held)
    job_level = next(v for index, v in verdicts if index == other and v.verdict == contract.VERDICT_HANG)
    # the other shard's waiting ranks are its own cohorts' ranks, none of the culprit's cohort
    assert job_level.reference_ranks and all(rank >= RANKS_PER_COHORT for rank in job_level.reference_ranks)
