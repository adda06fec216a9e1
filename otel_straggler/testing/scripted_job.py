"""A small job scripted second by second against the real engine, for the hang and incarnation tests
(test_hangs.py) and the hostile-world probe (benchmarks/hostile.py): while it makes progress every
rank finishes ten steps a second; heartbeats come every 5 s with the stages the script says are
open; the detector's clock runs half a second ahead; `clock_offset` skews a rank's clock."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.observation import GpuSample, Heartbeat, Observation, Placement

START = 1_700_000_000_000_000_000
SECOND = 1_000_000_000
# (name, host ms, collective): a 100 ms step
STAGES = (("forward-compute", 40.0, False), ("backward-compute", 50.0, False), ("all-grads-sync", 10.0, True))
CONFIG = DetectorConfig(hang_timeout_s=60.0)

OpenStages = Callable[[int, int], tuple]  # (rank, now ns) -> ((stage, since ns), ...), outermost first


def in_stage(name: str, since: int) -> OpenStages:
    return lambda rank, now: ((name, since),)


class ScriptedJob:
    def __init__(self, engine: Engine, ranks: int = 4, restart: int = 0, job_id: str = "job", seed: int = 0,
                 cohort: str = "c", world_size: Optional[int] = None) -> None:
        """world_size: what the ranks' placements report (None: nothing), `ranks` of them send."""
        self.engine = engine
        self.cohort = cohort
        self.ranks = ranks
        self.restart = restart
        self.job_id = job_id
        self.now = START
        self.step = 0
        self.seq = dict.fromkeys(range(ranks), 0)
        self.frozen: set[int] = set()  # ranks that send nothing at all (SIGSTOP)
        self.clock_offset: dict[int, int] = {}  # rank -> how far its clock is ahead (ns; negative: behind)
        self.slow: dict[int, float] = {}  # rank -> factor on its compute stages
        self.heartbeat_s = 5
        self.gpu: Optional[Callable[[int, int], Optional[GpuSample]]] = None  # (rank, now ns) -> its GPU sample
        self.heartbeats_from = START
        self.rng = np.random.default_rng(seed)
        engine.ingest_placements([Placement(job_id, 0, restart, rank, f"node-{rank // 2}", rank % 2, cohort, world_size)
                                  for rank in range(ranks)])

    def restart_from(self, step: int, restart: int) -> None:
        """Every rank's process starts over, resuming at `step`: sequences from 0, a new count."""
        self.restart, self.step = restart, step
        self.seq = dict.fromkeys(range(self.ranks), 0)
        self.frozen = set()

    def run(self, seconds: int, progress: bool = True, open_stages: Optional[OpenStages] = None,
            restart_of: Optional[dict] = None) -> list:
        verdicts = []
        for _ in range(seconds):
            observations = []
            if progress:
                for _ in range(10):
                    observations += self._step(restart_of or {})
            beats = []
            if (self.now - START) % (self.heartbeat_s * SECOND) == 0 and self.now >= self.heartbeats_from:
                for rank in range(self.ranks):
                    if rank in self.frozen:
                        continue
                    opened = open_stages(rank, self.now) if open_stages else (("forward-compute", self.now),)
                    skew = self.clock_offset.get(rank, 0)
                    restart = (restart_of or {}).get(rank, self.restart)
                    beats.append(Heartbeat(self.job_id, 0, self.cohort, rank, restart,
                                           self.step, self.now + skew, tuple(name for name, _ in opened),
                                           tuple(since + skew for _, since in opened),
                                           self.gpu(rank, self.now) if self.gpu else None))
            self.now += SECOND
            self.engine.ingest_many(observations)
            self.engine.ingest_heartbeats(beats)
            verdicts += self.engine.advance(self.now + SECOND // 2)
        return verdicts

    def _step(self, restart_of: dict) -> list[Observation]:
        observations = []
        step_start = self.now + (self.step % 10) * SECOND // 10
        for rank in range(self.ranks):
            if rank in self.frozen:
                continue
            end = step_start + int(self.rng.uniform(0, 2e6)) + self.clock_offset.get(rank, 0)
            for name, base_ms, collective in STAGES:
                host_ms = base_ms * (1 if collective else self.slow.get(rank, 1.0)) * self.rng.uniform(0.98, 1.02)
                end += int(host_ms * 1e6)
                observations.append(Observation(self.job_id, 0, self.cohort, rank, name, self.step, self.seq[rank],
                                                host_ms, None, collective, None, None, end,
                                                restart_of.get(rank, self.restart)))
                self.seq[rank] += 1
        self.step += 1
        return observations


def hangs(verdicts, verdict=contract.VERDICT_HANG) -> list:
    return [v for v in verdicts if v.verdict == verdict]


def stuck_rank_one(since: int) -> OpenStages:
    """Rank 1 never left forward-compute; the others wait in the all-reduce."""
    return lambda rank, now: (("forward-compute", since),) if rank == 1 else (("all-grads-sync", since + 50_000_000),)
