"""Each rank's median stage duration per window, for the live view and windows.jsonl.

The detector's verdicts carry medians only for the windows that changed a verdict, so the demo
taps the observations on their way into the engine (`TappedEngine`, passed to DetectorService)
and keeps its own small tally. A window is reported once every rank seen so far has reported a
later step, or at `finish()`. Observations of a window already reported are ignored.
"""
from __future__ import annotations

import statistics
import threading
from typing import Iterable

from otel_straggler.demo.evidence import WindowMedian
from otel_straggler.detector.observation import Observation

CellKey = tuple[str, str, int, str]  # (job, cohort, rank, stage)


class WindowMedians:
    """Thread-safe: the engine thread adds, the demo's main loop takes what is complete."""

    def __init__(self, window_steps: int) -> None:
        self._window_steps = window_steps
        self._lock = threading.Lock()
        # window -> (job, cohort, rank, stage) -> seq -> host ms; keyed by seq so a re-sent span counts once
        self._open: dict[int, dict[CellKey, dict[int, float]]] = {}
        self._collective: dict[str, bool] = {}
        self._stage_order: dict[str, int] = {}
        self._latest_step: dict[tuple[str, str, int], int] = {}  # (job, cohort, rank) -> highest step
        self._reported_below = 0  # every window under this one has been reported

    def add(self, observations: Iterable[Observation]) -> None:
        with self._lock:
            for observation in observations:
                window = observation.step // self._window_steps
                if window < self._reported_below:
                    continue
                key = (observation.job_id, observation.cohort, observation.rank, observation.stage)
                self._open.setdefault(window, {}).setdefault(key, {})[observation.seq] = observation.host_ms
                if observation.stage not in self._stage_order:  # the order the job runs its stages in
                    self._stage_order[observation.stage] = len(self._stage_order)
                self._collective[observation.stage] = observation.collective
                rank_key = key[:3]
                self._latest_step[rank_key] = max(observation.step, self._latest_step.get(rank_key, -1))

    def take_complete(self) -> list[WindowMedian]:
        """The windows every rank has moved past, oldest first; each is returned once."""
        with self._lock:
            if not self._latest_step:
                return []
            slowest_rank_window = min(self._latest_step.values()) // self._window_steps
            return self._take_below(slowest_rank_window)

    def finish(self) -> list[WindowMedian]:
        """Every window still held, complete or not: the run is over."""
        with self._lock:
            return self._take_below(max(self._open, default=-1) + 1)

    def _take_below(self, end_window: int) -> list[WindowMedian]:
        medians = []
        for window in sorted(window for window in self._open if window < end_window):
            cells = sorted(self._open.pop(window).items(),
                           key=lambda cell: (*cell[0][:3], self._stage_order[cell[0][3]]))
            for (job, cohort, rank, stage), durations in cells:
                medians.append(WindowMedian(job, cohort, rank, stage, window, statistics.median(durations.values()),
                                            len(durations), self._collective.get(stage, False)))
        self._reported_below = max(self._reported_below, end_window)
        return medians


class TappedEngine:
    """The detector's engine with the observations copied to `WindowMedians` first; every other
    call goes straight to the engine."""

    def __init__(self, engine, medians: WindowMedians) -> None:
        self._engine = engine
        self._medians = medians
        self.tap_errors = 0

    def ingest_many(self, observations: Iterable[Observation]) -> dict[str, int]:
        observations = list(observations)
        try:
            self._medians.add(observations)
        except Exception:  # noqa: BLE001 - the pictures may lose a window; detection must not
            self.tap_errors += 1
        return self._engine.ingest_many(observations)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
