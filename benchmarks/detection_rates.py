"""False positives and detection of the engine's rules, for three reference choices, on seeded
synthetic jobs (tests/detector/synthetic.py). The figures in docs/detection.md come from this script.

    python benchmarks/detection_rates.py [--seeds 10] [--windows 60]

Jobs: a ~1 s training step (data-load 20 ms, forward 300 ms, backward 600 ms, a blocking all-reduce
80 ms plus waits, optimizer 40 ms), every rank with per-step jitter drawn in 2-3% (std dev).
- false positives: healthy ranks only; ranks that got a `straggler` verdict, per rank and window
- persistent spread: healthy ranks that are persistently up to +-2.5% apart (a slower GPU, thermals)
- detection: one rank slower by +4% ... +10% on every compute stage: share of seeds where it was
  caught within the run, and the median number of windows from its first judged window to onset
Reference choices: the median of the comparable peers (the default), their 25th percentile, and the
fastest peer (quantile 0). The rank under test is always left out of its own reference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from otel_straggler import contract  # noqa: E402
from otel_straggler.detector.config import DetectorConfig  # noqa: E402
from otel_straggler.detector.engine import Engine  # noqa: E402
from tests.detector.synthetic import LARGE_MODEL_STAGES as STAGES, SyntheticJob  # noqa: E402
QUANTILES = {"median (default)": 0.5, "25th percentile": 0.25, "fastest peer": 0.0}
STEP_NS = 100_000_000


def onsets(observations: list, ranks: int, quantile: float) -> dict[int, int]:
    """rank -> window of its first straggler verdict."""
    engine = Engine(DetectorConfig(reference_quantile=quantile))
    chunk = ranks * len(STAGES)
    verdicts, now = [], 0
    for start in range(0, len(observations), chunk):
        engine.ingest_many(observations[start:start + chunk])
        now += STEP_NS
        verdicts += engine.advance(now)
    verdicts += engine.drain(now + STEP_NS)
    first: dict[int, int] = {}
    for verdict in verdicts:
        if verdict.verdict == contract.VERDICT_STRAGGLER:
            first.setdefault(verdict.rank, verdict.window)
    return first


def false_positives(ranks: int, seeds: int, windows: int, spread: float) -> dict[str, tuple[int, int]]:
    """per reference: (ranks alerted, rank-windows judged)."""
    alerted = {name: 0 for name in QUANTILES}
    for seed in range(seeds):
        job = SyntheticJob(ranks=ranks, stages=STAGES, seed=1000 + seed)
        offsets = np.random.default_rng(seed).uniform(-spread, spread, size=ranks)
        for rank, offset in enumerate(offsets):
            if spread:
                job.slow(rank, 1.0 + offset)
        observations = job.observations(windows * 10)
        for name, quantile in QUANTILES.items():
            alerted[name] += len(onsets(observations, ranks, quantile))
    judged = seeds * ranks * (windows - DetectorConfig().warmup_windows)
    return {name: (count, judged) for name, count in alerted.items()}


def detection(ranks: int, seeds: int, windows: int, factor: float) -> dict[str, tuple[float, float, int]]:
    """per reference: (share of seeds caught, median windows to onset, other ranks alerted)."""
    caught = {name: [] for name in QUANTILES}
    others = {name: 0 for name in QUANTILES}
    first_judged = DetectorConfig().warmup_windows
    for seed in range(seeds):
        job = SyntheticJob(ranks=ranks, stages=STAGES, seed=2000 + seed).slow(ranks // 3, factor)
        observations = job.observations(windows * 10)
        for name, quantile in QUANTILES.items():
            first = onsets(observations, ranks, quantile)
            if ranks // 3 in first:
                caught[name].append(first[ranks // 3] - first_judged + 1)
            others[name] += len(set(first) - {ranks // 3})
    return {name: (len(times) / seeds, statistics.median(times) if times else float("nan"), others[name])
            for name, times in caught.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--windows", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--large-ranks", type=int, default=256)
    args = parser.parse_args()
    names = list(QUANTILES)
    print(f"jobs: ~1 s steps, 2-3% per-step jitter, {args.windows} windows of 10 steps, {args.seeds} seeds, "
          f"default thresholds (5%, 5 ms, 3 windows)")

    print(f"\nfalse positives: ranks alerted / rank-windows judged")
    print(f"{'scenario':<40}" + "".join(f"{name:>20}" for name in names))
    for ranks, spread, label in ((args.ranks, 0.0, f"{args.ranks} healthy ranks"),
                                 (args.large_ranks, 0.0, f"{args.large_ranks} healthy ranks"),
                                 (args.ranks, 0.025, f"{args.ranks} ranks, persistent +-2.5% spread")):
        seeds = max(1, args.seeds // 4) if ranks > args.ranks else args.seeds
        result = false_positives(ranks, seeds, args.windows, spread)
        print(f"{label:<40}" + "".join(f"{f'{a} / {j}':>20}" for a, j in (result[n] for n in names)))

    print(f"\ndetection at {args.ranks} ranks: caught in share of seeds, median windows to onset "
          f"(3 is the minimum), other ranks alerted")
    print(f"{'slow rank':<40}" + "".join(f"{name:>20}" for name in names))
    for factor in (1.04, 1.05, 1.06, 1.08, 1.10):
        result = detection(args.ranks, args.seeds, args.windows, factor)
        print(f"{f'+{round((factor - 1) * 100)}%':<40}"
              + "".join(f"{f'{s:.0%}, {m:g}, {o}':>20}" for s, m, o in (result[n] for n in names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
