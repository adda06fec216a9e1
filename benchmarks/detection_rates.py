"""False positives and detection of the engine's rules, for three reference choices, on seeded
synthetic jobs (otel_straggler/testing/synthetic.py). The figures in docs/detection.md come from this script.

    python benchmarks/detection_rates.py [--seeds 10] [--windows 60]

Jobs: a ~1 s training step (data-load 20 ms, forward 300 ms, backward 600 ms, a blocking all-reduce
80 ms plus waits, optimizer 40 ms), every rank with per-step jitter drawn in 2-3% (std dev).
- false positives: healthy ranks only; ranks that got a `straggler` verdict, per rank and window
- persistent spread: healthy ranks that are persistently up to +-2.5% apart (a slower GPU, thermals)
- detection: one rank slower by +4% ... +10% on every compute stage: share of seeds where it was
  caught within the run, and the median number of windows from its first judged window to onset
Busy hosts (otel_straggler/testing/host_noise.py): instead of the Gaussian jitter, each rank drifts (an AR(1)
factor, 3.5% std dev, correlation time 5 windows), its per-step jitter is Student-t (3 degrees of
freedom) and 0.5% of intervals are 3x, so healthy ranks sit 5-8% off their peers for windows in a row.
- false positives: healthy ranks under that noise; then the same jobs with a busy host (the last 8
  ranks, 56-63, slower by +5% to +15% together in windows 20-27, then back): a noisy neighbour, no
  straggler
- detection: the same jobs with one rank +5%, +10% or +20% slower in backward-compute only; then
  +10% with the busy host as well. Noise and seeds are those of the false-positive rows: the other
  ranks alerted compare with them, and the busy host adds its episode and nothing else.
Job slowdown (the whole job slower than its own baseline, job_baseline.py), with the default
reference: from window 20 the all-reduce takes 5x as long (a degraded network, +32% per step),
every rank computes 20% slower (a software rollout), every rank 2% then (window 40) 4% slower (a
drift: no verdict wanted), one rank 50% slower (a straggler: its alert, no job verdict), and the
healthy and busy-host jobs above: share of seeds with `job_slowdown`, median windows from the
change to it, `job_slowdown` verdicts where none is wanted per 10,000 cohort-windows, stragglers named.
Intermittent stragglers and streams real clusters send (default config, from window 20): one
rank slower in a share of its steps only (intermittent.py); a whole node of 8 ranks, a quarter of
the ranks, one rank's data loading 20 -> 36 ms, one rank's backward slower on the device only
(host intervals unchanged), one rank +10% with a fifth of all intervals missing their device
duration; and healthy jobs with spikes on every rank: share of seeds in which every wanted rank
was flagged (with the wanted reason or timing) within 5 windows, median windows from the change to
the last of them, and ranks flagged that should not be, per 10,000 rank-windows (all rules, and
those flagged as intermittent).
Reference choices: the median of the comparable peers (the default), their 25th percentile, and the
fastest peer (quantile 0). The rank under test is always left out of its own reference. Seeds run in
`--jobs` processes (default: one per core); the figures do not depend on how many.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.contract import REASON_INTERMITTENT
from otel_straggler.testing.host_noise import BusyHost, HostNoise
from otel_straggler.testing.synthetic import LARGE_MODEL_STAGES as STAGES, SyntheticJob

QUANTILES = {"median (default)": 0.5, "25th percentile": 0.25, "fastest peer": 0.0}
STEP_NS = 100_000_000
HOST_NOISE = HostNoise()  # the defaults: see otel_straggler/testing/host_noise.py
NOISY_SLOW_STAGE = "backward-compute"
WINDOW_STEPS = DetectorConfig().window_steps
CHANGE_WINDOW = 20  # job slowdown, intermittent and stream scenarios: the window the job changes in
WINDOWS_TO_ALERT = 5  # the intermittent target: flagged within 5 windows of the change


def judged(observations: list, ranks: int, config: DetectorConfig) -> list:
    """Every verdict, ingesting one step of input at a time and advancing the clock 0.1 s after each."""
    engine = Engine(config)
    chunk = ranks * len(STAGES)
    verdicts, now = [], 0
    for start in range(0, len(observations), chunk):
        engine.ingest_many(observations[start:start + chunk])
        now += STEP_NS
        verdicts += engine.advance(now)
    return verdicts + engine.drain(now + STEP_NS)


def onsets(observations: list, ranks: int, quantile: float) -> dict[int, int]:
    """rank -> window of its first straggler verdict."""
    verdicts = judged(observations, ranks, DetectorConfig(reference_quantile=quantile))
    first: dict[int, int] = {}
    for verdict in verdicts:
        if verdict.verdict == contract.VERDICT_STRAGGLER:
            first.setdefault(verdict.rank, verdict.window)
    return first


@dataclass(frozen=True)
class Scenario:
    """One kind of seeded job: how its healthy ranks differ and which rank, if any, is slow."""
    ranks: int
    seed_base: int
    spread: float = 0.0  # healthy ranks persistently up to +-spread apart
    slow_factor: Optional[float] = None  # the rank ranks // 3 this much slower
    slow_stages: Optional[tuple[str, ...]] = None  # None: every compute stage
    noise: Optional[HostNoise] = None  # None: the synthetic job's Gaussian jitter
    collective_delay_ms: float = 0.0  # every rank's all-reduce this much longer from CHANGE_WINDOW
    everyone_factors: tuple = ()  # (factor, from window, to window or None): every rank's compute alike

    @property
    def slow_rank(self) -> Optional[int]:
        return self.ranks // 3 if self.slow_factor is not None else None

    def job(self, seed: int) -> SyntheticJob:
        job = SyntheticJob(ranks=self.ranks, stages=STAGES, seed=self.seed_base + seed, noise=self.noise)
        if self.spread:
            offsets = np.random.default_rng(seed).uniform(-self.spread, self.spread, size=self.ranks)
            for rank, offset in enumerate(offsets):
                job.slow(rank, 1.0 + offset)
        if self.slow_factor is not None:
            job.slow(self.slow_rank, self.slow_factor, stages=self.slow_stages)
        if self.collective_delay_ms:
            job.collective_delay(self.collective_delay_ms, from_step=CHANGE_WINDOW * WINDOW_STEPS)
        for factor, first, last in self.everyone_factors:
            job.everyone_slower(factor, from_step=first * WINDOW_STEPS,
                                to_step=None if last is None else (last + 1) * WINDOW_STEPS - 1)
        return job


def alerts(scenario: Scenario, seed: int, windows: int) -> dict[str, dict[int, int]]:
    """per reference: rank -> window of its first straggler verdict, for one seed."""
    observations = scenario.job(seed).observations(windows * WINDOW_STEPS)
    return {name: onsets(observations, scenario.ranks, quantile) for name, quantile in QUANTILES.items()}


def runs(pool: Executor, scenario: Scenario, seeds: int, windows: int) -> list[dict[str, dict[int, int]]]:
    return list(pool.map(alerts, [scenario] * seeds, range(seeds), [windows] * seeds))


def false_positives(pool: Executor, scenario: Scenario, seeds: int, windows: int) -> dict[str, tuple[int, int]]:
    """per reference: (ranks alerted, rank-windows judged)."""
    alerted = {name: 0 for name in QUANTILES}
    for first in runs(pool, scenario, seeds, windows):
        for name in QUANTILES:
            alerted[name] += len(first[name])
    judged = seeds * scenario.ranks * (windows - DetectorConfig().warmup_windows)
    return {name: (count, judged) for name, count in alerted.items()}


def detection(pool: Executor, scenario: Scenario, seeds: int, windows: int) -> dict[str, tuple[float, float, int]]:
    """per reference: (share of seeds caught, median windows to onset, other ranks alerted)."""
    caught = {name: [] for name in QUANTILES}
    others = {name: 0 for name in QUANTILES}
    first_judged = DetectorConfig().warmup_windows
    slow_rank = scenario.slow_rank
    for first_by_reference in runs(pool, scenario, seeds, windows):
        for name, first in first_by_reference.items():
            if slow_rank in first:
                caught[name].append(first[slow_rank] - first_judged + 1)
            others[name] += len(set(first) - {slow_rank})
    return {name: (len(times) / seeds, statistics.median(times) if times else float("nan"), others[name])
            for name, times in caught.items()}


def job_verdicts(scenario: Scenario, seed: int, windows: int) -> tuple[list[int], set[int]]:
    """(windows of the job_slowdown verdicts, ranks named stragglers) for one seed, default config."""
    verdicts = judged(scenario.job(seed).observations(windows * WINDOW_STEPS), scenario.ranks, DetectorConfig())
    return ([v.window for v in verdicts if v.verdict == contract.VERDICT_JOB_SLOWDOWN],
            {v.rank for v in verdicts if v.verdict == contract.VERDICT_STRAGGLER})


def print_job_slowdown(pool: Executor, rows, seeds: int, windows: int) -> None:
    print(f"{'scenario':<44}{'wanted':>8}{'caught':>8}{'windows':>9}{'unwanted /10k':>15}{'stragglers':>12}")
    for label, scenario, wanted in rows:
        results = list(pool.map(job_verdicts, [scenario] * seeds, range(seeds), [windows] * seeds))
        # after warmup and the baseline's first windows, one cohort per job
        judged = seeds * (windows - DetectorConfig().warmup_windows - 5)
        caught = [next((w for w in found if w >= CHANGE_WINDOW), None) for found, _ in results] if wanted else []
        delays = [w - CHANGE_WINDOW + 1 for w in caught if w is not None]
        unwanted = sum(len(found) if not wanted else sum(1 for w in found if w < CHANGE_WINDOW)
                       for found, _ in results)
        stragglers = sum(len(named) for _, named in results)
        print(f"{label:<44}{'yes' if wanted else 'no':>8}"
              f"{f'{len(delays) / seeds:.0%}' if wanted else '-':>8}"
              f"{f'{statistics.median(delays):g}' if delays else '-':>9}"
              f"{unwanted / judged * 1e4:>15.1f}{stragglers:>12}")


@dataclass(frozen=True)
class Incident:
    """Some ranks of a 64-rank job slower from CHANGE_WINDOW on, in `share` of their steps, and the
    verdict wanted for each: a straggler with `reason` (any when None) and `timing` (any when None)."""
    ranks: int
    seed_base: int
    slow_ranks: tuple = ()
    factor: float = 1.0
    stages: Optional[tuple[str, ...]] = None  # None: every compute stage
    share: float = 1.0
    on: str = "both"
    noise: Optional[HostNoise] = None
    spikes: Optional[tuple[float, float]] = None  # (share of (rank, step) pairs, factor) on every rank
    without_device: float = 0.0  # share of all intervals that carry no device duration
    reason: Optional[str] = None
    timing: Optional[str] = None

    def observations(self, seed: int, windows: int) -> list:
        job = SyntheticJob(ranks=self.ranks, stages=STAGES, seed=self.seed_base + seed, noise=self.noise)
        if self.spikes is not None:
            job.spikes(*self.spikes)
        for rank in self.slow_ranks:
            job.slow(rank, self.factor, stages=self.stages, from_step=CHANGE_WINDOW * WINDOW_STEPS,
                     share=self.share, on=self.on)
        observations = job.observations(windows * WINDOW_STEPS)
        if self.without_device:
            dropped = np.random.default_rng([self.seed_base + seed, 0xDE5]).random(len(observations)) < self.without_device
            observations = [o._replace(device_ms=None) if drop else o for o, drop in zip(observations, dropped.tolist())]
        return observations


def incident_alerts(incident: Incident, seed: int, windows: int) -> tuple[dict[int, int], set[int], set[int]]:
    """(wanted rank -> window of its first wanted verdict, ranks flagged that are not wanted, those
    of them flagged as intermittent)."""
    verdicts = judged(incident.observations(seed, windows), incident.ranks, DetectorConfig())
    first: dict[int, int] = {}
    unwanted, unwanted_intermittent = set(), set()
    for verdict in verdicts:
        if verdict.verdict != contract.VERDICT_STRAGGLER:
            continue
        if verdict.rank not in incident.slow_ranks:
            unwanted.add(verdict.rank)
            if verdict.reason == REASON_INTERMITTENT:
                unwanted_intermittent.add(verdict.rank)
        elif verdict.window >= CHANGE_WINDOW and (incident.reason in (None, verdict.reason)) and \
                (incident.timing in (None, verdict.timing)):
            first.setdefault(verdict.rank, verdict.window)
    return first, unwanted, unwanted_intermittent


def print_incidents(pool: Executor, rows, seeds: int, windows: int) -> None:
    print(f"{'scenario':<52}{'caught':>8}{'windows':>9}{'false /10k':>12}{'intermittent':>14}")
    for label, incident in rows:
        results = list(pool.map(incident_alerts, [incident] * seeds, range(seeds), [windows] * seeds))
        delays = [max(first[rank] for rank in incident.slow_ranks) - CHANGE_WINDOW + 1
                  for first, _, _ in results if incident.slow_ranks and set(first) == set(incident.slow_ranks)]
        caught = sum(delay <= WINDOWS_TO_ALERT for delay in delays)
        unwanted = sum(len(ranks) for _, ranks, _ in results)
        unwanted_intermittent = sum(len(ranks) for _, _, ranks in results)
        rank_windows = seeds * incident.ranks * (windows - DetectorConfig().warmup_windows)
        print(f"{label:<52}{f'{caught / seeds:.0%}' if incident.slow_ranks else '-':>8}"
              f"{f'{statistics.median(delays):g}' if delays else '-':>9}{unwanted / rank_windows * 1e4:>12.1f}"
              f"{unwanted_intermittent / rank_windows * 1e4:>14.1f}")


def describe(noise: HostNoise) -> str:
    return (f"each rank drifting (AR(1), {noise.drift_std:.1%} std dev, correlation time "
            f"{noise.drift_steps / WINDOW_STEPS:g} windows), Student-t (df {noise.jitter_df:g}) jitter of "
            f"{noise.jitter_scale:.1%} scale, {noise.spike_rate:.1%} of intervals {noise.spike_factor:g}x")


def describe_episode(episode: BusyHost) -> str:
    first_rank = episode.host * episode.ranks_per_host
    return (f"ranks {first_rank}-{first_rank + episode.ranks_per_host - 1} {episode.slowdown[0] - 1:+.0%} to "
            f"{episode.slowdown[1] - 1:+.0%} in windows {episode.first_step // WINDOW_STEPS}-"
            f"{episode.last_step // WINDOW_STEPS}")


def print_false_positives(pool: Executor, rows, windows: int) -> None:
    names = list(QUANTILES)
    print(f"{'scenario':<40}" + "".join(f"{name:>20}" for name in names))
    for label, scenario, row_seeds in rows:
        result = false_positives(pool, scenario, row_seeds, windows)
        print(f"{label:<40}" + "".join(f"{f'{a} / {j}':>20}" for a, j in (result[n] for n in names)))


def print_detection(pool: Executor, rows, seeds: int, windows: int) -> None:
    names = list(QUANTILES)
    print(f"{'slow rank':<40}" + "".join(f"{name:>20}" for name in names))
    for label, scenario in rows:
        result = detection(pool, scenario, seeds, windows)
        print(f"{label:<40}"
              + "".join(f"{f'{s:.0%}, {m:g}, {o}':>20}" for s, m, o in (result[n] for n in names)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--windows", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--large-ranks", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="seeds run in this many processes (the figures do not depend on it)")
    args = parser.parse_args()
    ranks, seeds, windows = args.ranks, args.seeds, args.windows
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        print(f"jobs: ~1 s steps, 2-3% per-step jitter, {windows} windows of 10 steps, {seeds} seeds, "
              f"default thresholds (5%, 5 ms, 3 windows)")

        print("\nfalse positives: ranks alerted / rank-windows judged")
        print_false_positives(pool, (
            (f"{ranks} healthy ranks", Scenario(ranks, 1000), seeds),
            (f"{args.large_ranks} healthy ranks", Scenario(args.large_ranks, 1000), max(1, seeds // 4)),
            (f"{ranks} ranks, persistent +-2.5% spread", Scenario(ranks, 1000, spread=0.025), seeds),
        ), windows)

        print(f"\ndetection at {ranks} ranks: caught in share of seeds, median windows to onset "
              f"(3 is the minimum), other ranks alerted")
        print_detection(pool, [(f"+{round((factor - 1) * 100)}%", Scenario(ranks, 2000, slow_factor=factor))
                               for factor in (1.04, 1.05, 1.06, 1.08, 1.10)], seeds, windows)

        busy = BusyHost(host=ranks // 8 - 1, first_step=20 * WINDOW_STEPS, last_step=28 * WINDOW_STEPS - 1)
        print(f"\nbusy hosts: {describe(HOST_NOISE)}; busy host: {describe_episode(busy)}")
        print("\nfalse positives under busy-host noise: ranks alerted / rank-windows judged")
        with_busy_host = replace(HOST_NOISE, busy_host=busy)
        print_false_positives(pool, (
            (f"{ranks} ranks, drifting heavy-tailed noise", Scenario(ranks, 3000, noise=HOST_NOISE), seeds),
            (f"{ranks} ranks, same, busy host", Scenario(ranks, 3000, noise=with_busy_host), seeds),
        ), windows)

        print(f"\ndetection at {ranks} ranks under busy-host noise, one rank slower in {NOISY_SLOW_STAGE}: "
              f"caught in share of seeds, median windows to onset, other ranks alerted")
        print_detection(pool, [(f"+{round((factor - 1) * 100)}%",
                                Scenario(ranks, 3000, slow_factor=factor, slow_stages=(NOISY_SLOW_STAGE,),
                                         noise=HOST_NOISE)) for factor in (1.05, 1.10, 1.20)]
                        + [("+10%, busy host elsewhere",
                            Scenario(ranks, 3000, slow_factor=1.10, slow_stages=(NOISY_SLOW_STAGE,),
                                     noise=with_busy_host))], seeds, windows)

        print(f"\njob slowdown at {ranks} ranks (threshold {DetectorConfig().job_slowdown_threshold:.0%}, "
              f"changes from window {CHANGE_WINDOW}): share of seeds caught, median windows from the change "
              f"(3 is the minimum), unwanted job_slowdown verdicts per 10,000 cohort-windows, stragglers named")
        print_job_slowdown(pool, (
            ("all-reduce 80 -> 400 ms (+32% per step)", Scenario(ranks, 4000, collective_delay_ms=320.0), True),
            ("every rank's compute +20%", Scenario(ranks, 4000, everyone_factors=((1.2, CHANGE_WINDOW, None),)), True),
            ("drift: every rank +2%, then +4%", Scenario(ranks, 4000, everyone_factors=(
                (1.02, CHANGE_WINDOW, 39), (1.04, 40, None))), False),
            ("one rank +50% (a straggler)", Scenario(ranks, 4000, slow_factor=1.5), False),
            ("healthy", Scenario(ranks, 1000), False),
            ("healthy, drifting heavy-tailed noise", Scenario(ranks, 3000, noise=HOST_NOISE), False),
            ("same, busy host", Scenario(ranks, 3000, noise=with_busy_host), False),
        ), seeds, windows)

        print(f"\nintermittent stragglers and streams real clusters send at {ranks} ranks (changes from window "
              f"{CHANGE_WINDOW}): share of seeds with every wanted rank flagged within {WINDOWS_TO_ALERT} windows, "
              f"median windows from the change, ranks wrongly flagged per 10,000 rank-windows")
        slow = NOISY_SLOW_STAGE
        print_incidents(pool, (
            ("one rank +50% in 30% of its steps (backward)", Incident(
                ranks, 5000, (ranks // 3,), 1.5, (slow,), 0.3, reason=REASON_INTERMITTENT)),
            ("one rank +50% in 20% of its steps", Incident(
                ranks, 5000, (ranks // 3,), 1.5, (slow,), 0.2, reason=REASON_INTERMITTENT)),
            ("one rank +100% in 10% of its steps", Incident(
                ranks, 5000, (ranks // 3,), 2.0, (slow,), 0.1, reason=REASON_INTERMITTENT)),
            ("one rank +50% in 30%, drifting heavy-tailed noise", Incident(
                ranks, 3000, (ranks // 3,), 1.5, (slow,), 0.3, noise=HOST_NOISE, reason=REASON_INTERMITTENT)),
            (f"{args.large_ranks} healthy ranks, 1% of steps one stage 3x", Incident(
                args.large_ranks, 6000, spikes=(0.01, 3.0))),
            ("healthy, noise as above with 4x the spikes (2%)", Incident(
                ranks, 3000, noise=replace(HOST_NOISE, spike_rate=0.02))),
            ("healthy, 4x the spikes, busy host", Incident(
                ranks, 3000, noise=replace(with_busy_host, spike_rate=0.02))),
            ("a whole node (8 ranks) +10%", Incident(ranks, 5000, tuple(range(8, 16)), 1.10)),
            ("a quarter of the ranks +10%", Incident(ranks, 5000, tuple(range(ranks // 4)), 1.10)),
            ("one rank's data loading 20 -> 36 ms", Incident(ranks, 5000, (ranks // 3,), 1.8, ("data-load",))),
            ("one rank's backward +30% on the device only", Incident(
                ranks, 5000, (ranks // 3,), 1.3, (slow,), on="device", timing="device")),
            ("one rank +10%, a fifth of intervals without device", Incident(
                ranks, 5000, (ranks // 3,), 1.10, without_device=0.2)),
        ), seeds, windows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
