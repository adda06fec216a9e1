"""Windows of several cohorts judged in one batch (window_batch.py) give what judging each cohort's
window alone gives: the same verdicts in the same order, the same verdict state, the same counters,
over a stream of many small cohorts with every kind of trouble the rules know."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from otel_straggler import contract
from otel_straggler.detector import engine as engine_module, judge, window_batch
from otel_straggler.detector.cohort_state import CohortVerdictState
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.testing.synthetic import LARGE_MODEL_STAGES, TEN_STAGES, TRAINING_STAGES, SyntheticJob

START_NS = 1_700_000_000_000_000_000
STEP_NS = 100_000_000
STEPS = 120


def cohorts(seed: int) -> list[tuple[SyntheticJob, dict]]:
    """(job, observations' options) per cohort of one job: cohorts of 3 to 12 ranks, three stage
    sets (two of one shape, batched together), and in each a different trouble."""
    def job(index: int, ranks: int, stages=TRAINING_STAGES, **kwargs) -> SyntheticJob:
        return SyntheticJob(ranks=ranks, stages=stages, seed=seed * 100 + index, job_id="batched",
                            cohort=f"c{index}", first_rank=100 * index, **kwargs)

    return [
        # steady: onset, then recovery; its windows numbered one ahead of the others'
        (job(0, 8).slow(3, 1.4, from_step=40, to_step=80), {"first_step": 10}),
        (job(1, 8).slow(102, 1.6, stages=["forward-compute"], from_step=20, share=0.3), {}),  # intermittent
        (job(2, 8).spikes(0.05, 3.0), {}),  # heavy-tailed jitter, every rank alike
        (job(3, 6).collective_delay(20.0, from_step=40), {}),  # the network slower for everyone
        (job(4, 8).everyone_slower(1.5, from_step=50), {}),  # job_slowdown
        (job(5, 8, tokens=8192).workload(500, 4096).workload(501, 4096).slow(505, 1.3, stages=["backward-compute"],
                                                                              from_step=40), {}),
        (job(6, 12).slow(607, 1.5, on="device", from_step=35), {}),  # device only
        (job(7, 8, stages=LARGE_MODEL_STAGES).slow(702, 1.3, stages=["data-load"], from_step=45), {}),
        (job(8, 8), {"export_delay_steps": {803: 3}}),  # one rank's exports late
        (job(9, 8, stages=TEN_STAGES).slow(904, 1.5, from_step=40), {}),  # another shape: a batch of its own
        (job(10, 2).slow(1001, 2.0, from_step=40), {}),  # too few ranks to compare
        (job(11, 8, stages=LARGE_MODEL_STAGES).slow(1105, 1.8, from_step=30), {}),  # falls silent (stream)
        (job(12, 8), {}),  # its all-reduce unmarked: found to end at a synchronization point (stream)
        (job(13, 4), {}),  # a window of it a backlog too thin to judge (stream)
        # two ranks report a workload, the same: one class with the others, unless classed with c5's
        (job(14, 8).workload(1400, 2048).workload(1401, 2048).slow(1405, 1.5, stages=["optimizer"], from_step=20,
                                                                    share=0.3), {}),
        (job(20, 8).slow(2001, 1.5, from_step=30), {}),  # ends early, its last window partial (stream)
        (job(21, 8), {}),  # as c13, judged in one batch with it
    ] + [  # slowdowns near the noise bound, where a window's count of comparisons decides
        (job(15 + index, 8, jitter=(0.04, 0.06)).slow(1500 + 100 * index + 1, factor, from_step=30), {})
        for index, factor in enumerate((1.05, 1.07, 1.09, 1.11, 1.13))
    ]


def stream(seed: int) -> list[list]:
    """Per turn of the caller's clock, every cohort's next step of observations (of their arrival
    order), cohort by cohort; what a cohort loses is taken out of its turns."""
    lost = {
        "c11": lambda o: o.rank == 1105 and o.step > 60,  # stops after step 60, its peers go on for a minute
        "c13": lambda o: o.rank != 1300 and 50 <= o.step < 60,  # three of four ranks' rows of window 5
        "c21": lambda o: o.rank >= 2103 and 50 <= o.step < 60,  # five of eight
        "c20": lambda o: o.step >= 94,  # the cohort ends early: its last window holds 4 steps
    }
    per_cohort = []
    for job, options in cohorts(seed):
        observations = job.observations(STEPS, **options)
        if job.cohort == "c12":  # its all-reduce unmarked
            observations = [o._replace(collective=False) for o in observations]
        chunk = job.ranks * len(job.stages)
        gone = lost.get(job.cohort, lambda o: False)
        per_cohort.append([[o for o in observations[start:start + chunk] if not gone(o)]
                           for start in range(0, len(observations), chunk)])
    return [[o for chunks in per_cohort if turn < len(chunks) for o in chunks[turn]]
            for turn in range(max(len(chunks) for chunks in per_cohort))]


def run(turns: list[list], batched: bool, monkeypatch, config: DetectorConfig):
    monkeypatch.setattr(engine_module, "batches",
                        window_batch.batches if batched else lambda items: [[item] for item in items])
    sizes: Counter = Counter()
    judge_windows = judge.judge_windows

    def counted(batch, *args):
        sizes[batch.size] += 1
        return judge_windows(batch, *args)

    monkeypatch.setattr(engine_module, "judge_windows", counted)
    engine = Engine(config)
    verdicts = []
    now = START_NS
    for observations in turns:
        engine.ingest_many(observations)
        now += STEP_NS
        verdicts += engine.advance(now)
    return verdicts + engine.drain(now + STEP_NS), engine, sizes


def state_differences(engine: Engine, other: Engine) -> list[str]:
    """What differs between two engines' verdict states, by cohort and name (nan equal to nan)."""
    names = [name for name, value in vars(CohortVerdictState()).items() if isinstance(value, np.ndarray)]
    differences = []
    assert list(engine._cohorts) == list(other._cohorts)
    for key, cohort in engine._cohorts.items():
        state, other_state = cohort.verdict_state, other._cohorts[key].verdict_state
        arrays = [(name, getattr(state, name), getattr(other_state, name)) for name in names]
        arrays += [(f"intermittent.{name}", getattr(state.intermittent, name), getattr(other_state.intermittent, name))
                   for name in ("slow", "steps", "slow_ms", "slow_reference_ms", "alert")]
        differences += [f"{key} {name}" for name, mine, theirs in arrays
                        if mine.shape != theirs.shape or not np.array_equal(mine, theirs, equal_nan=mine.dtype.kind == "f")]
        differences += [f"{key} {name}" for name in ("full_window_steps", "job")
                        if getattr(state, name) != getattr(other_state, name)]
        if state.intermittent.position != other_state.intermittent.position:
            differences.append(f"{key} intermittent.position")
    return differences


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("report_below_floor", [False, True])
def test_windows_judged_in_batches_give_what_each_cohort_alone_gives(seed, report_below_floor, monkeypatch):
    config = DetectorConfig(report_below_floor=report_below_floor)
    turns = stream(seed)
    alone, alone_engine, alone_sizes = run(turns, False, monkeypatch, config)
    together, together_engine, together_sizes = run(turns, True, monkeypatch, config)
    assert set(alone_sizes) == {1}
    assert max(together_sizes) >= 10, together_sizes  # most cohorts' windows were judged together
    assert together == alone
    assert state_differences(together_engine, alone_engine) == []
    assert together_engine.stats() == alone_engine.stats()
    # the stream holds every kind of verdict the batch has to keep apart
    kinds = {(v.verdict, v.reason) for v in alone}
    assert {(contract.VERDICT_STRAGGLER, contract.REASON_SLOW_VS_PEERS),
            (contract.VERDICT_STRAGGLER, contract.REASON_INTERMITTENT),
            (contract.VERDICT_RECOVERED, contract.REASON_WITHIN_TOLERANCE),
            (contract.VERDICT_SILENT, contract.REASON_NO_REPORT)} <= kinds, kinds
    assert len({v.cohort for v in alone}) >= 6
