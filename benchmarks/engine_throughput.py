"""Engine throughput (observations per second, one core) and peak memory.

    python benchmarks/engine_throughput.py [--ranks 1024] [--steps 40] [--rounds 5] [--memory-ranks 10000]

Arms, measured in the same run and interleaved round by round (the machine is noisy):
  python floor      a loop that reads every field of each observation and appends one tuple:
                    the least any pure-Python consumer of decoded observations pays (the reference)
  ingest_many       the engine's intake alone (de-duplication, windowing, column appends)
  ingest + advance  intake plus window closing and judging, advancing once per step of input,
                    as the service does every 0.1 s
Layouts: one data-parallel cohort of all ranks, and the same ranks as cohorts of 8 (a TP x PP grid).
Observations are built before timing (the decode module's cost is its own benchmark).

Memory: tracemalloc peak while `--memory-ranks` ranks x 10 stages run through three windows,
generated one step at a time; the in-flight step of observations is measured and reported apart.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.testing.synthetic import TEN_STAGES, SyntheticJob

BATCH = 512  # observations per ingest_many call: one OTLP export batch
STEP_NS = 100_000_000


def build(ranks: int, steps: int, cohort_size: int) -> list:
    jobs = [SyntheticJob(ranks=min(cohort_size, ranks - first), stages=TEN_STAGES, seed=first,
                         cohort=f"cohort-{first // cohort_size}", first_rank=first).slow(first, 1.1)
            for first in range(0, ranks, cohort_size)]
    per_job = [job.observations(steps) for job in jobs]
    # arrival: step by step, all cohorts interleaved, as a collector gateway forwards them
    per_step = ranks * len(TEN_STAGES)
    merged = []
    for step in range(steps):
        for job, observations in zip(jobs, per_job):
            size = job.ranks * len(TEN_STAGES)
            merged += observations[step * size:(step + 1) * size]
    assert len(merged) == per_step * steps
    return merged


def python_floor(observations: list, per_step: int) -> float:
    kept = []
    append = kept.append
    start = time.perf_counter()
    for o in observations:
        append((o.job_id, o.epoch, o.cohort, o.rank, o.stage, o.step, o.seq, o.host_ms, o.device_ms,
                o.collective, o.tokens))
    return time.perf_counter() - start


def engine_arm(observations: list, per_step: int, advance: bool) -> float:
    engine = Engine(DetectorConfig())
    now = 0
    start = time.perf_counter()
    for step_start in range(0, len(observations), per_step):
        step = observations[step_start:step_start + per_step]
        for batch_start in range(0, len(step), BATCH):
            engine.ingest_many(step[batch_start:batch_start + BATCH])
        if advance:
            now += STEP_NS
            engine.advance(now)
    if advance:
        engine.drain(now + STEP_NS)
    elapsed = time.perf_counter() - start
    assert engine.stats()["accepted"] == len(observations)
    return elapsed


def throughput(ranks: int, steps: int, rounds: int, cohort_size: int) -> dict[str, float]:
    observations = build(ranks, steps, cohort_size)
    per_step = ranks * len(TEN_STAGES)
    arms = {
        "python floor": lambda: python_floor(observations, per_step),
        "ingest_many": lambda: engine_arm(observations, per_step, advance=False),
        "ingest + advance": lambda: engine_arm(observations, per_step, advance=True),
    }
    seconds = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            gc.collect()
            seconds[name].append(arm())
    return {name: len(observations) / statistics.median(times) for name, times in seconds.items()}


def peak_memory(ranks: int, steps: int) -> tuple[float, float, int]:
    """(peak MiB while ingesting and judging, MiB of one in-flight step of observations, windows closed)."""
    job = SyntheticJob(ranks=ranks, stages=TEN_STAGES, seed=1).slow(7, 1.1)
    stage_count = len(TEN_STAGES)
    tracemalloc.start()
    step_observations = job.observations(1)
    in_flight = tracemalloc.get_traced_memory()[0]
    del step_observations
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    engine = Engine(DetectorConfig())
    now = 0
    for step in range(steps):
        observations = job.observations(1, first_step=step, seq_start=step * stage_count)
        for batch_start in range(0, len(observations), BATCH):
            engine.ingest_many(observations[batch_start:batch_start + BATCH])
        del observations
        now += STEP_NS
        engine.advance(now)
    engine.drain(now + STEP_NS)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak / 2**20, in_flight / 2**20, engine.stats()["windows_closed"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory-ranks", type=int, default=10_000)
    parser.add_argument("--memory-steps", type=int, default=30)
    args = parser.parse_args()

    print(f"engine throughput: {args.ranks} ranks x {len(TEN_STAGES)} stages x {args.steps} steps, "
          f"batches of {BATCH}, median of {args.rounds} rounds, one core")
    print(f"{'layout':<28}{'arm':<20}{'observations/s':>16}{'vs python floor':>18}")
    for label, cohort_size in ((f"1 cohort of {args.ranks}", args.ranks), ("cohorts of 8", 8)):
        rates = throughput(args.ranks, args.steps, args.rounds, cohort_size)
        floor = rates["python floor"]
        for name, rate in rates.items():
            print(f"{label:<28}{name:<20}{rate:>16,.0f}{rate / floor:>17.2f}x")
    if not args.memory_ranks:  # 0: throughput only
        return 0
    peak, in_flight, windows = peak_memory(args.memory_ranks, args.memory_steps)
    print(f"\npeak memory: {args.memory_ranks} ranks x {len(TEN_STAGES)} stages x {args.memory_steps} steps "
          f"({windows} windows judged)")
    print(f"{'traced peak (engine + one step in flight)':<48}{peak:>10.1f} MiB")
    print(f"{'of which one step of observations in flight':<48}{in_flight:>10.1f} MiB")
    print(f"{'engine, per rank':<48}{(peak - in_flight) * 1024 / args.memory_ranks:>10.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
