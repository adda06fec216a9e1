"""Streams real clusters send, each with its verdicts right: two jobs in one detector, intervals
without device durations, malformed spans among good ones, a whole node slow, a quarter of the
ranks slow, a data loader stall, a device-only slowdown and an elastic re-shard. Synthetic jobs
(otel_straggler/testing/synthetic.py, ~108 ms steps, 10 per window) through the real engine."""
from __future__ import annotations

import math

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine

from otel_straggler.testing.synthetic import Stage, SyntheticJob
from .test_engine_rules import feed, replaced


def stragglers(verdicts, job_id: str = None) -> dict[int, set[str]]:
    """rank -> stages with a `straggler` verdict."""
    found: dict[int, set[str]] = {}
    for verdict in verdicts:
        if verdict.verdict == contract.VERDICT_STRAGGLER and job_id in (None, verdict.job_id):
            found.setdefault(verdict.rank, set()).add(verdict.stage)
    return found


def run(observations, ranks: int, config: DetectorConfig = DetectorConfig()) -> tuple[list, Engine]:
    engine = Engine(config)
    return feed(engine, observations, chunk=ranks * 5), engine


def test_case_two_jobs_interleaved_in_one_detector_are_judged_apart():
    slow = SyntheticJob(ranks=16, seed=1, job_id="job-a").slow(3, 1.3, from_step=40).observations(150)
    healthy = SyntheticJob(ranks=16, seed=2, job_id="job-b").observations(150)
    by_step = sorted(slow + healthy, key=lambda o: o.step)  # stable: each job's own order is kept
    verdicts, engine = run(by_step, 32)
    assert set(stragglers(verdicts, "job-a")) == {3}
    assert stragglers(verdicts, "job-b") == {}
    assert engine.stats()["jobs"] == 2 and engine.stats()["late"] == 0


def test_case_a_fifth_of_intervals_without_device_durations():
    observations = SyntheticJob(ranks=16, seed=3).slow(5, 1.3, from_step=40).observations(150)
    rng = np.random.default_rng(0)
    missing = rng.random(len(observations)) < 0.2
    thinned = [o._replace(device_ms=None) if drop else o for o, drop in zip(observations, missing)]
    verdicts, _ = run(thinned, 16)
    assert set(stragglers(verdicts)) == {5}


def test_case_malformed_spans_mixed_into_good_requests_change_nothing_else():
    observations = SyntheticJob(ranks=16, seed=4).slow(7, 1.3, from_step=40).observations(150)
    clean, _ = run(observations, 16)
    bad_values = (math.nan, -1.0, math.inf, "12", None)
    mixed = []
    for index, observation in enumerate(observations):
        mixed.append(observation)
        if index % 37 == 0:  # a malformed copy with a fresh seq next to a good span
            mixed.append(observation._replace(seq=observation.seq + 10**9, host_ms=bad_values[index % len(bad_values)]))
    verdicts, engine = run(mixed, 16)
    assert engine.stats()["malformed"] == len(mixed) - len(observations) > 0
    assert [(v.verdict, v.rank, v.stage, v.window) for v in verdicts] == \
        [(v.verdict, v.rank, v.stage, v.window) for v in clean]
    assert set(stragglers(verdicts)) == {7}


def test_case_a_whole_node_of_8_ranks_slow_names_those_8_only():
    job = SyntheticJob(ranks=64, seed=5)
    for rank in range(8, 16):
        job.slow(rank, 1.2, from_step=40)
    verdicts, _ = run(job.observations(150), 64)
    assert set(stragglers(verdicts)) == set(range(8, 16))


def test_case_a_quarter_of_all_ranks_slow_names_that_quarter_only():
    job = SyntheticJob(ranks=64, seed=6)
    slow = set(range(0, 64, 4))
    for rank in slow:
        job.slow(rank, 1.2, from_step=40)
    verdicts, _ = run(job.observations(150), 64)
    assert set(stragglers(verdicts)) == slow


def test_case_a_data_loader_stall_of_3_to_36_ms_on_one_rank_is_a_host_stall_in_data_load():
    stages = (Stage("data-load", 3.0, device=False), Stage("forward-compute", 30.0),
              Stage("backward-compute", 60.0), Stage("all-grads-sync", 8.0, collective=True),
              Stage("optimizer", 6.0))
    job = SyntheticJob(ranks=16, stages=stages, seed=7).slow(9, 12.0, stages=("data-load",), from_step=40)
    verdicts, _ = run(job.observations(150), 16)
    found = stragglers(verdicts)
    assert set(found) == {9} and "data-load" in found[9]
    onset = next(v for v in verdicts if v.verdict == contract.VERDICT_STRAGGLER and v.stage == "data-load")
    assert onset.timing == "host" and onset.rank_ms > 30 and onset.reference_ms < 4
    assert onset.window <= 40 // 10 + DetectorConfig().persist_windows


def test_case_a_device_only_slowdown_with_short_host_intervals_is_a_gpu_stream_stall():
    # asynchronous launches: the host intervals of a throttled GPU stay as short as its peers'
    job = SyntheticJob(ranks=16, seed=8).slow(11, 1.4, stages=("forward-compute", "backward-compute"),
                                                from_step=40, on="device")
    verdicts, _ = run(job.observations(150), 16)
    assert set(stragglers(verdicts)) == {11}
    onsets = {v.stage: v for v in verdicts if v.verdict == contract.VERDICT_STRAGGLER}
    assert set(onsets) == {"forward-compute", "backward-compute"}
    for stage in ("forward-compute", "backward-compute"):
        assert (onsets[stage].timing, onsets[stage].attribution) == ("device", contract.ATTRIBUTION_GPU)
        assert 1.3 < onsets[stage].slowdown < 1.5
        # and its peers wait for it at the all-reduce: it arrives last, which follows from it
        assert "all-grads-sync" in onsets[stage].also_slow


def test_case_an_elastic_re_shard_to_fewer_renumbered_ranks_is_judged_in_its_new_epoch():
    # from step 100 the job runs on 12 of its 16 ranks in topology epoch 1, renumbered 0-11; the
    # slow rank 14 becomes rank 10 and is named again there, as rank 10
    observations = SyntheticJob(ranks=16, seed=9).slow(14, 1.3).observations(220)
    kept = [o for o in observations if o.step < 100 or o.rank >= 4]
    resharded = replaced(kept, lambda o: o.step >= 100, lambda o: {"epoch": 1, "rank": o.rank - 4})
    verdicts, engine = run(resharded, 16)
    by_epoch = {(v.rank, v.window >= 10) for v in verdicts if v.verdict == contract.VERDICT_STRAGGLER}
    assert {rank for rank, after in by_epoch if not after} == {14}
    assert {rank for rank, after in by_epoch if after} == {10}
    assert [v for v in verdicts if v.verdict == contract.VERDICT_SILENT] == []
    stats = engine.stats()
    assert stats["late"] == 0 and stats["duplicates"] == 0 and stats["cohorts"] == 2
