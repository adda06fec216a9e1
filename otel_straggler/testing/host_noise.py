"""The noise of busy hosts, for `SyntheticJob(noise=...)`: what healthy ranks do on loaded machines,
which independent Gaussian jitter never does.

Each interval's duration is the stage's base time times

    exp(drift[rank, step] + jitter_scale * t) * spike * busy_host

- `drift`: per-rank slow drift, an AR(1) process stepped once per training step (a discretised
  Ornstein-Uhlenbeck process): drift[s+1] = phi * drift[s] + sqrt(1 - phi^2) * drift_std * N(0, 1),
  phi = exp(-1 / drift_steps), started in its stationary distribution N(0, drift_std^2). With the
  defaults (3.5% stationary std, correlation time 50 steps = 5 windows of 10 steps) a healthy rank's
  window medians sit 5-8% off its peers' for several windows in a row every so often.
- `t`: Student-t per-interval jitter, `jitter_df` degrees of freedom (3: finite variance, heavy
  tails), scaled by `jitter_scale` (1.5%: a std dev of about 2.6%, like the Gaussian jitter).
- `spike`: `spike_factor` (3x) on a share `spike_rate` (0.5%) of intervals (a GC pause, a page fault
  storm), else 1.
- `busy_host`: optionally, a noisy neighbour: the ranks of one host (`ranks_per_host` consecutive
  ranks) all slower together, each by a factor drawn in `slowdown`, for steps
  [first_step, last_step], then back.
- `contention`: optionally, contention that moves from rank to rank (more rank processes than
  cores): in each block of `contention_steps` steps a random `contention_share` of the ranks is
  slower, each by a factor drawn in `contention`, the others at their own speed. One-sided, as real
  contention is: no rank ever runs faster than its uncontended speed.

Its draws come from generators seeded by the job's seed (the busy host's and the contention's from
ones of their own, so adding them leaves the drift and jitter as they were): a job with this noise is as
deterministic as one without.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np


@dataclass(frozen=True)
class BusyHost:
    host: int  # host index: ranks [host * ranks_per_host, (host + 1) * ranks_per_host) of the job
    first_step: int
    last_step: int
    ranks_per_host: int = 8
    slowdown: tuple[float, float] = (1.05, 1.15)  # each of the host's ranks slower by a factor drawn here


@dataclass(frozen=True)
class HostNoise:
    drift_std: float = 0.035  # stationary std dev of the per-rank drift (of its log)
    drift_steps: float = 50.0  # the drift's correlation time, in training steps
    jitter_scale: float = 0.015
    jitter_df: float = 3.0
    spike_rate: float = 0.005
    spike_factor: float = 3.0
    busy_host: Optional[BusyHost] = None
    contention_share: float = 0.0
    contention_steps: int = 5
    contention: tuple[float, float] = (1.1, 1.4)

    @property
    def drift_phi(self) -> float:
        """The drift's step-to-step autocorrelation."""
        return math.exp(-1.0 / self.drift_steps)

    def step_factors(self, ranks: int, stages: int, seed: int, first_step: int = 0) -> Iterator[np.ndarray]:
        """Multiplicative factors of shape (ranks, stages), one array per step from `first_step` on."""
        # the episode and the contention have generators of their own: with or without them, the drift
        # and jitter are the same
        streams = np.random.SeedSequence([seed, 0x5E1F]).spawn(3)
        rng, episode_rng, contention_rng = (np.random.default_rng(stream) for stream in streams)
        phi = self.drift_phi
        innovation = math.sqrt(1.0 - phi * phi) * self.drift_std
        drift = rng.normal(0.0, self.drift_std, size=ranks)
        episode = self.busy_host
        busy = np.ones(ranks)
        if episode is not None:
            first = episode.host * episode.ranks_per_host
            busy[first:first + episode.ranks_per_host] = episode_rng.uniform(*episode.slowdown,
                                                                             size=episode.ranks_per_host)
        contended = np.ones(ranks)
        step = first_step
        while True:
            if self.contention_share > 0 and (step - first_step) % self.contention_steps == 0:
                contended = np.ones(ranks)
                chosen = contention_rng.permutation(ranks)[:round(self.contention_share * ranks)]
                contended[chosen] = contention_rng.uniform(*self.contention, size=chosen.size)
            jitter = self.jitter_scale * rng.standard_t(self.jitter_df, size=(ranks, stages))
            spikes = np.where(rng.random((ranks, stages)) < self.spike_rate, self.spike_factor, 1.0)
            factors = np.exp(drift[:, None] + jitter) * spikes
            if episode is not None and episode.first_step <= step <= episode.last_step:
                factors *= busy[:, None]
            yield factors * contended[:, None]
            drift = phi * drift + innovation * rng.normal(0.0, 1.0, size=ranks)
            step += 1
