"""Seeded synthetic stage observations of a synchronous data-parallel training job, for the engine's
tests and benchmarks.

One `SyntheticJob` is one cohort: `ranks` ranks running the same `stages` every step. Each interval's
host duration is the stage's base time times per-step jitter; its device duration (for stages timed
on the device) is 97% of that. Slowdowns are added per rank with `slow(...)`. A collective stage
lasts its own base time plus the wait for the slowest rank of the step, as a blocking all-reduce does.
`observations()` returns them in an arrival order close to OTLP exports: step by step, each rank's
spans together, optionally with ranks' exports delayed, clocks offset and starts skewed (which only
move `end_unix_nano`, as on real hosts). With `noise` (a `HostNoise`, host_noise.py)
the per-step noise is that of busy hosts, drifting and heavy-tailed, instead of the Gaussian jitter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from otel_straggler.detector.observation import Observation
from .host_noise import HostNoise


@dataclass(frozen=True)
class Stage:
    name: str
    base_ms: float
    collective: bool = False
    device: bool = True  # reports a device duration


# a training step of a small data-parallel job: ~100 ms of compute, then the gradient all-reduce
TRAINING_STAGES = (
    Stage("data-load", 4.0, device=False),
    Stage("forward-compute", 30.0),
    Stage("backward-compute", 60.0),
    Stage("all-grads-sync", 8.0, collective=True),
    Stage("optimizer", 6.0),
)

# a ~1 s step of a larger model: the absolute floor (5 ms) is then far below 5% of every big stage
LARGE_MODEL_STAGES = (
    Stage("data-load", 20.0, device=False),
    Stage("forward-compute", 300.0),
    Stage("backward-compute", 600.0),
    Stage("all-grads-sync", 80.0, collective=True),
    Stage("optimizer", 40.0),
)

# ten stages, for the throughput benchmark
TEN_STAGES = tuple(Stage(f"stage-{index}", 2.0 + index) for index in range(9)) + (
    Stage("all-grads-sync", 5.0, collective=True),)


@dataclass
class _Slowdown:
    factor: float
    stages: Optional[frozenset]
    first_step: int
    last_step: Optional[int]
    on: str  # "both", "host" or "device"
    share: float = 1.0  # of the rank's steps in range that are slowed (the same steps for every stage)

    def applies(self, stage: str, step: int) -> bool:
        return ((self.stages is None or stage in self.stages) and step >= self.first_step
                and (self.last_step is None or step <= self.last_step))

    def slows_step(self, seed: int, rank: int, step: int) -> bool:
        # a draw of its own per (rank, step): adding an intermittent slowdown leaves every other draw
        return self.share >= 1.0 or np.random.default_rng([seed, 0x1E7, rank, step]).random() < self.share


@dataclass
class SyntheticJob:
    ranks: int = 64
    stages: Sequence[Stage] = TRAINING_STAGES
    seed: int = 0
    jitter: tuple[float, float] = (0.02, 0.03)  # each rank's per-step noise (std dev), drawn in this range
    job_id: str = "job-1"
    cohort: str = "tp0-pp0"
    epoch: int = 0
    first_rank: int = 0
    tokens: Optional[int] = None  # tokens per step reported on every span; None: not reported
    noise: Optional[HostNoise] = None  # replaces `jitter` when set
    _slowdowns: dict = field(default_factory=dict)
    _collective_delays: list = field(default_factory=list)
    _tokens_by_rank: dict = field(default_factory=dict)
    _stage_jitter: dict = field(default_factory=dict)
    _spikes: Optional[tuple[float, float]] = None

    def slow(self, rank: int, factor: float, *, stages: Optional[Sequence[str]] = None, from_step: int = 0,
             to_step: Optional[int] = None, on: str = "both", share: float = 1.0) -> "SyntheticJob":
        """Multiplies `rank`'s durations of `stages` (default: every non-collective stage) by
        `factor` for steps [from_step, to_step]; `on` picks host, device or both durations. With
        `share` < 1 only that share of those steps, drawn at random (an intermittent straggler)."""
        self._slowdowns.setdefault(rank, []).append(
            _Slowdown(factor, frozenset(stages) if stages is not None else None, from_step, to_step, on, share))
        return self

    def spikes(self, share: float, factor: float) -> "SyntheticJob":
        """In `share` of all (rank, step) pairs, drawn at random, one compute stage (drawn too) takes
        `factor` times as long: healthy heavy-tailed jitter, every rank alike."""
        self._spikes = (share, factor)
        return self

    def collective_delay(self, extra_ms: float, *, from_step: int = 0, to_step: Optional[int] = None) -> "SyntheticJob":
        """Every rank's collectives take `extra_ms` longer in steps [from_step, to_step]: a slower
        network, the whole job alike."""
        self._collective_delays.append((extra_ms, from_step, to_step))
        return self

    def everyone_slower(self, factor: float, *, stages: Optional[Sequence[str]] = None, from_step: int = 0,
                        to_step: Optional[int] = None) -> "SyntheticJob":
        """`slow` for every rank: the whole job's compute alike (a software rollout, a drift)."""
        for rank in range(self.first_rank, self.first_rank + self.ranks):
            self.slow(rank, factor, stages=stages, from_step=from_step, to_step=to_step)
        return self

    def workload(self, rank: int, tokens) -> "SyntheticJob":
        """What `rank` reports as tokens per step (any value, to test bad ones too)."""
        self._tokens_by_rank[rank] = tokens
        return self

    def stage_jitter(self, stage: str, noise: float) -> "SyntheticJob":
        """Per-step noise of one stage, as a multiplicative log-normal sigma (10x jitter: ~1.0)."""
        self._stage_jitter[stage] = noise
        return self

    def observations(self, steps: int, *, first_step: int = 0, export_delay_steps: Optional[dict] = None,
                     clock_offset_ms: Optional[dict] = None, start_skew_s: Optional[dict] = None,
                     seq_start: int = 0) -> list[Observation]:
        """All spans of steps [first_step, first_step + steps), in arrival order."""
        rng = np.random.default_rng(self.seed)
        rank_ids = range(self.first_rank, self.first_rank + self.ranks)
        noise_level = rng.uniform(self.jitter[0], self.jitter[1], size=self.ranks)
        export_delay_steps = export_delay_steps or {}
        arrivals: list[tuple[int, int, list[Observation]]] = []
        seq = {rank: seq_start for rank in rank_ids}
        clock_ns = {rank: int(1.7e18 + (start_skew_s or {}).get(rank, 0.0) * 1e9
                              + (clock_offset_ms or {}).get(rank, 0.0) * 1e6) for rank in rank_ids}
        noise_factors = (self.noise.step_factors(self.ranks, len(self.stages), self.seed, first_step)
                         if self.noise is not None else None)
        tokens = {rank: self._tokens_by_rank.get(rank, self.tokens) for rank in rank_ids}
        job_id, epoch, cohort = self.job_id, self.epoch, self.cohort
        # positional Observation(...) from plain lists: the benchmarks build hundreds of thousands
        self._since_sync = np.zeros(self.ranks)
        self._spike_rng = np.random.default_rng([self.seed, 0x5B1E])
        for step in range(first_step, first_step + steps):
            host, device = self._step_durations(rng, step, noise_level, noise_factors)
            rows = zip(rank_ids, host.tolist(), device.tolist(), strict=True)
            for index, (rank, host_row, device_row) in enumerate(rows):
                batch = []
                for stage, host_ms, device_ms in zip(self.stages, host_row, device_row, strict=True):
                    clock_ns[rank] += int(host_ms * 1e6)
                    batch.append(Observation(job_id, epoch, cohort, rank, stage.name, step, seq[rank], host_ms,
                                             device_ms if stage.device else None, stage.collective, tokens[rank],
                                             None, clock_ns[rank]))
                    seq[rank] += 1
                arrivals.append((step + export_delay_steps.get(rank, 0), index, batch))
        arrivals.sort(key=lambda arrival: (arrival[0], arrival[1]))
        return [observation for _, _, batch in arrivals for observation in batch]

    def _step_durations(self, rng: np.random.Generator, step: int, noise_level: np.ndarray,
                        noise_factors: Optional[Iterator[np.ndarray]]):
        """(host, device) durations, shape (ranks, stages), collectives including the wait."""
        stage_count = len(self.stages)
        base = np.array([stage.base_ms for stage in self.stages])
        if noise_factors is not None:
            host = base * next(noise_factors)
        else:
            noise = rng.normal(0.0, 1.0, size=(self.ranks, stage_count)) * noise_level[:, None]
            host = base * np.clip(1.0 + noise, 0.5, 1.5)
        for stage_index, stage in enumerate(self.stages):
            sigma = self._stage_jitter.get(stage.name)
            if sigma is not None:
                host[:, stage_index] = stage.base_ms * rng.lognormal(0.0, sigma, size=self.ranks)
        if self._spikes is not None:
            share, factor = self._spikes
            compute = [index for index, stage in enumerate(self.stages) if not stage.collective]
            spiked = np.flatnonzero(self._spike_rng.random(self.ranks) < share)
            host[spiked, np.asarray(compute)[self._spike_rng.integers(len(compute), size=spiked.size)]] *= factor
        device = host * 0.97
        for index in range(self.ranks):
            for slowdown in self._slowdowns.get(self.first_rank + index, ()):
                if not slowdown.slows_step(self.seed, self.first_rank + index, step):
                    continue
                for stage_index, stage in enumerate(self.stages):
                    if not stage.collective and slowdown.applies(stage.name, step):
                        if slowdown.on in ("both", "host"):
                            host[index, stage_index] *= slowdown.factor
                        if slowdown.on in ("both", "device"):
                            device[index, stage_index] *= slowdown.factor
        # a blocking collective ends when the last rank arrives: the others wait the difference.
        # A rank arrives after its compute since the previous collective (`since_sync`, carried
        # over from the previous step's stages after its last collective), so the stages after a
        # collective run on each rank's own time until the next one
        since_sync = self._since_sync
        delay = sum(extra for extra, first, last in self._collective_delays
                    if step >= first and (last is None or step <= last))
        for stage_index, stage in enumerate(self.stages):
            if stage.collective:
                wait = since_sync.max() - since_sync + delay
                host[:, stage_index] += wait
                device[:, stage_index] += wait
                since_sync = np.zeros(self.ranks)
            else:
                since_sync = since_sync + np.maximum(host[:, stage_index], device[:, stage_index])
        self._since_sync = since_sync
        return host, device
