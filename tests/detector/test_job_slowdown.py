"""`job_slowdown` (job_baseline.py): the whole job slower than its own baseline, every rank alike.
Synthetic jobs with ~278 ms steps (an all-reduce of 20 ms), 16 ranks, 10 steps per window. Where a
rule is what keeps the verdict from happening, a control run shows that the stream alone would
have given it."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.job_baseline import window_pace
from otel_straggler.contract import REASON_BACK_TO_BASELINE, REASON_SLOWER_THAN_BASELINE

from otel_straggler.testing.synthetic import Stage, SyntheticJob
from .test_engine_rules import feed, replaced

STAGES = (Stage("data-load", 8.0, device=False), Stage("forward-compute", 80.0), Stage("backward-compute", 160.0),
          Stage("all-grads-sync", 20.0, collective=True), Stage("optimizer", 10.0))
RANKS = 16


def job(seed: int = 1) -> SyntheticJob:
    return SyntheticJob(ranks=RANKS, stages=STAGES, seed=seed)


# These jobs' windows last about 3 s, so most tests turn the time floor (job_slowdown_min_s) off to
# see the window rule alone; the floor has its own tests at the end.
WINDOWS_ONLY = DetectorConfig(job_slowdown_min_s=0.0)


def judged(observations, config: DetectorConfig = WINDOWS_ONLY) -> tuple[list, Engine]:
    engine = Engine(config)
    return feed(engine, observations, chunk=RANKS * len(STAGES)), engine


def of(verdicts, kind: str) -> list:
    return [verdict for verdict in verdicts if verdict.verdict == kind]


def test_an_all_reduce_of_20_then_120_ms_from_step_120_is_a_job_slowdown_named_after_it_and_no_straggler():
    verdicts, engine = judged(job().collective_delay(100.0, from_step=120).observations(300))
    slowdowns = of(verdicts, contract.VERDICT_JOB_SLOWDOWN)
    assert [(v.rank, v.stage, v.reason) for v in slowdowns] == [(None, "all-grads-sync", REASON_SLOWER_THAN_BASELINE)]
    verdict = slowdowns[0]
    assert verdict.window == 120 // 10 + DetectorConfig().persist_windows - 1  # the 3rd window over
    assert 1.30 < verdict.slowdown < 1.42 and verdict.reference_ms < verdict.rank_ms  # +100 ms on ~278 ms
    assert of(verdicts, contract.VERDICT_STRAGGLER) == []
    assert [(s.job_id, s.cohort, s.active) for s in engine.job_slowdown_state()] == [("job-1", "tp0-pp0", True)]
    assert engine.job_slowdown_state()[0].ratio > 1.3


def test_the_job_back_at_its_pace_recovers_back_to_baseline():
    verdicts, engine = judged(job().collective_delay(100.0, from_step=120, to_step=199).observations(300))
    assert [(v.verdict, v.reason, v.window) for v in verdicts
            if v.verdict in (contract.VERDICT_JOB_SLOWDOWN, contract.VERDICT_RECOVERED)] == [
        (contract.VERDICT_JOB_SLOWDOWN, REASON_SLOWER_THAN_BASELINE, 14),
        (contract.VERDICT_RECOVERED, REASON_BACK_TO_BASELINE, 20)]
    assert not engine.job_slowdown_state()[0].active


def test_a_drift_of_2_then_4_percent_gives_neither_job_slowdown_nor_straggler():
    drift = job().everyone_slower(1.02, from_step=100, to_step=199).everyone_slower(1.04, from_step=200)
    verdicts, _ = judged(drift.observations(400))
    assert of(verdicts, contract.VERDICT_JOB_SLOWDOWN) == [] and of(verdicts, contract.VERDICT_STRAGGLER) == []


def test_a_software_rollout_slowing_every_rank_by_30_percent_names_the_stage_that_grew_most():
    verdicts, _ = judged(job().everyone_slower(1.3, from_step=120).observations(250))
    assert [v.stage for v in of(verdicts, contract.VERDICT_JOB_SLOWDOWN)] == ["backward-compute"]  # 48 of 77 ms


def test_growth_spread_over_stages_names_none():
    stages = (Stage("forward-compute", 100.0), Stage("backward-compute", 100.0),
              Stage("all-grads-sync", 20.0, collective=True))
    spread = SyntheticJob(ranks=RANKS, stages=stages, seed=2).everyone_slower(1.3, from_step=120)
    verdicts, _ = judged(spread.observations(250))
    assert [v.stage for v in of(verdicts, contract.VERDICT_JOB_SLOWDOWN)] == [contract.WHOLE_STEP_STAGE]


def test_one_straggler_slowing_the_job_is_its_straggler_alert_not_a_job_slowdown():
    verdicts, engine = judged(job().slow(3, 1.5, from_step=120).observations(300))
    assert {v.rank for v in of(verdicts, contract.VERDICT_STRAGGLER)} == {3}
    assert of(verdicts, contract.VERDICT_JOB_SLOWDOWN) == []
    assert engine.job_slowdown_state()[0].ratio > 1.15  # control: the job did get that much slower


def test_time_per_token_where_tokens_are_reported_so_a_bigger_batch_is_no_slowdown():
    # from step 120 every rank takes twice the tokens per step and twice the time
    def doubled(tokens: int):
        bigger = job().everyone_slower(2.0, from_step=120).collective_delay(20.0, from_step=120)
        observations = bigger.observations(250)
        return replaced(observations, lambda o: o.step >= 120, lambda o: {"tokens": 2 * tokens}) if tokens else observations

    with_tokens = [o._replace(tokens=o.tokens or 4096) for o in doubled(4096)]
    verdicts, _ = judged(with_tokens)
    assert of(verdicts, contract.VERDICT_JOB_SLOWDOWN) == []
    verdicts, _ = judged(doubled(0))  # control: without tokens the same steps are a slowdown
    assert len(of(verdicts, contract.VERDICT_JOB_SLOWDOWN)) == 1


def test_an_elastic_re_shard_starts_a_new_baseline():
    # from step 150 the job runs in topology epoch 1 on fewer, renumbered ranks, 30% slower per step
    def resharded(epoch_bump: bool):
        observations = job().everyone_slower(1.3, from_step=150).observations(300)
        kept = [o for o in observations if o.step < 150 or o.rank < 12]
        return replaced(kept, lambda o: o.step >= 150, lambda o: {"epoch": 1}) if epoch_bump else kept

    verdicts, engine = judged(resharded(True))
    assert of(verdicts, contract.VERDICT_JOB_SLOWDOWN) == []
    assert sorted(s.cohort for s in engine.job_slowdown_state()) == ["tp0-pp0", "tp0-pp0"]  # epochs 0 and 1
    verdicts, _ = judged(resharded(False))  # control: in the same epoch it is a slowdown
    assert len(of(verdicts, contract.VERDICT_JOB_SLOWDOWN)) == 1


def test_the_threshold_is_a_setting():
    observations = job().collective_delay(30.0, from_step=120).observations(250)  # +11%
    assert of(judged(observations)[0], contract.VERDICT_JOB_SLOWDOWN) == []
    assert len(of(judged(observations, DetectorConfig(job_slowdown_threshold=0.05, job_slowdown_min_s=0.0))[0],
                  contract.VERDICT_JOB_SLOWDOWN)) == 1


def test_every_rank_slower_for_seconds_as_on_a_busy_host_is_no_job_slowdown():
    # +40% for 3 windows (steps 120-149, about 12 s): over the threshold for persist_windows windows
    burst = job().everyone_slower(1.4, from_step=120, to_step=149).observations(250)
    assert of(judged(burst, DetectorConfig())[0], contract.VERDICT_JOB_SLOWDOWN) == []
    assert len(of(judged(burst)[0], contract.VERDICT_JOB_SLOWDOWN)) == 1  # control: the windows alone would call it


def test_a_slowdown_is_called_once_its_windows_steps_took_the_time_floor():
    verdicts, _ = judged(job().collective_delay(100.0, from_step=120).observations(300), DetectorConfig())
    slowdowns = of(verdicts, contract.VERDICT_JOB_SLOWDOWN)
    # windows of 10 steps of ~378 ms: the 8th window over is the first whose steps add up to 30 s
    assert [v.window for v in slowdowns] == [120 // 10 + 8 - 1]
    assert DetectorConfig().job_slowdown_min_s == 30.0


def test_a_window_closed_with_part_of_its_steps_counts_only_the_time_they_took():
    """window_pace: 4 ranks, steps 100 ms apart, windows of 10 steps; a window that closed after
    5 of them (the job ended, a gap) took half a second, not the window's full second."""
    def pace_of(steps_held: int):
        slot, step = np.meshgrid(np.arange(4), np.arange(steps_held), indexing="ij")
        rows = SimpleNamespace(slot=slot.ravel(), step=step.ravel(), host=np.full(slot.size, 90.0),
                               end_unix_nano=(1_000_000_000 + (step.ravel() + 1) * 100_000_000).astype(np.int64))
        return window_pace(rows, 10, 4, np.full(4, np.nan), np.ones(4, dtype=bool),
                           np.zeros(0, dtype=np.int64), np.zeros(0))
    assert pace_of(10).value == pytest.approx(100.0) and pace_of(10).seconds == pytest.approx(1.0)
    assert pace_of(5).value == pytest.approx(100.0) and pace_of(5).seconds == pytest.approx(0.5)
