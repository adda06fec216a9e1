"""The gateway's load_balancing exporter keeps every cohort whole on one detector shard.

Two fake shards stand behind a real gateway. Ranks of many cohorts send steps whose spans share
one trace id per step across all ranks (as the instrumentation does), directly or through a node
agent; each (job, cohort) must land on exactly one shard, each span exactly once.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from otel_straggler.testing import services
from .telemetry import Rank, send_rank_steps

pytestmark = pytest.mark.services

COHORTS = 12          # with two shards, all cohorts on one shard by chance: 2 * 2**-12
RANKS_PER_COHORT = 2
STEPS = range(2)
DEADLINE_S = 60


def _send_job(endpoint: str, job_id: str) -> int:
    ranks = [Rank(job_id, cohort * RANKS_PER_COHORT + i, COHORTS * RANKS_PER_COHORT, f"tp{cohort}-pp0")
             for cohort in range(COHORTS) for i in range(RANKS_PER_COHORT)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return sum(pool.map(lambda rank: send_rank_steps(endpoint, rank, STEPS, stage_ms=1.0), ranks))


@pytest.mark.parametrize("path", ["direct", "via_agent"])
def test_each_cohort_reaches_exactly_one_shard(path, start_collector, otlp_sink_factory):
    shards = [otlp_sink_factory(), otlp_sink_factory()]
    gateway = start_collector([services.CONFIG_DIR / "gateway.yaml"], name="gateway", env={
        "DETECTOR_ENDPOINTS": "[" + ", ".join(shard.endpoint for shard in shards) + "]"})
    entry = gateway
    if path == "via_agent":
        entry = start_collector([services.CONFIG_DIR / "agent.yaml"], name="agent",
                                env={"OTELCOL_GATEWAY_ENDPOINT": gateway.grpc_endpoint})
    job_id = f"routing-{uuid.uuid4().hex[:8]}"
    sent = _send_job(entry.grpc_endpoint, job_id)

    def all_received():
        total = sum(len(shard.spans()) for shard in shards)
        return total >= sent

    try:
        services.wait_until(all_received, DEADLINE_S, what=f"{sent} spans at the shards")
    except TimeoutError:
        pytest.fail(f"spans missing\n--- gateway log ---\n{gateway.log_tail()}")

    cohort_shards = defaultdict(set)
    seen = Counter()
    for index, shard in enumerate(shards):
        for resource, span in shard.spans():
            assert resource["training.job.id"] == job_id
            cohort_shards[resource["training.cohort"]].add(index)
            seen[(resource["training.rank"], span.span_id)] += 1
    assert len(cohort_shards) == COHORTS
    split = {cohort: sorted(owners) for cohort, owners in cohort_shards.items() if len(owners) != 1}
    assert not split, f"cohorts split across shards: {split}"
    assert sum(seen.values()) == sent and max(seen.values()) == 1, "every span exactly once"
    assert {owner for owners in cohort_shards.values() for owner in owners} == {0, 1}, "both shards own cohorts"
