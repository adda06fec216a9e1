"""Closed windows of several cohorts judged in one pass (judge.py), as one cohort of cohorts.

A small cohort's window (a tensor- and pipeline-parallel job's cohorts hold a few ranks each) costs
the judge a few hundred numpy calls whatever its size, which is most of what judging it costs.
Windows of cohorts whose verdict states have one shape, closing at the same `advance`, are judged
together: their rows are concatenated, and every cohort's stage codes and slots are offset into
ranges of their own, so that

- a stage code of the batch (`code`) is cohort * codes_per_cohort + the cohort's code: every rule
  groups by stage code, so peers, references, noise and synchronization points stay within a
  cohort, and codes_per_cohort is even, so the collective bit and the stage index keep their meaning;
- a slot of the batch (`slot`) is cohort * slots_per_cohort + the cohort's slot, for what is kept per
  rank; what is kept per (code, slot) is indexed by `pair` = code * slots_per_cohort + the cohort's
  slot (`local_slot`), in the cohort states' arrays stacked along their codes.

The cohorts' verdict states are stacked into one (cohort_state.stack) before judging, and read
through views of it after (cohort_state.unstack): the same cohorts batched again reuse it as it is.
What a rule counts over a whole window (its comparisons, for the Bonferroni levels; the window's
steps; the workload classes; the times' origin) is counted per cohort. A batch of one cohort is
that cohort: its own state, codes and slots unchanged.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from otel_straggler.detector.cohort_state import CohortVerdictState, stack, unstack
from otel_straggler.detector.windows import Cohort, RowLayout, WindowRows

# a batch holds at most this many rows, and a window of over a quarter of it is judged alone: a
# large window gains nothing (its work is per row), and the bound keeps a batch's memory a small one's
MAX_BATCH_ROWS = 1 << 16


class WindowBatch:
    """Closed windows of `cohorts` (one each), judged as one. Columns are per row of the batch,
    the cohorts' rows one after another."""

    def __init__(self, cohorts: Sequence[Cohort], windows: Sequence[WindowRows], ring_windows: int) -> None:
        self.cohorts = list(cohorts)
        self.windows = [rows.window for rows in windows]
        self.size = len(self.cohorts)
        first = self.cohorts[0]
        self.layout: RowLayout = first.layout
        self.window_steps = self.layout.window_steps
        states = [cohort.verdict_state for cohort in self.cohorts]
        for state in states:  # one shape for every cohort's ring (intermittent.ring_length(persist_windows))
            state.ensure_ring(ring_windows)
        self.codes_per_cohort, self.slots_per_cohort = states[0].alert.shape
        self.state: CohortVerdictState = states[0] if self.size == 1 else stack(states)
        self.full_window_steps = np.array([state.full_window_steps for state in states], dtype=np.int64)
        self.slot_counts = [len(cohort.slot_entries) for cohort in self.cohorts]
        # per-rank arrays: a cohort's own slots, or every cohort's slot range
        self.slot_count = self.slot_counts[0] if self.size == 1 else self.size * self.slots_per_cohort

        keys = [np.frombuffer(rows.keys, dtype=np.int64) for rows in windows]
        self.row_counts = np.array([column.size for column in keys], dtype=np.int64)
        self.row_starts = np.concatenate(([0], np.cumsum(self.row_counts)))
        _, code, slot, self.step_offset = self.layout.unpack(_joined(keys))
        self.host = _joined([np.frombuffer(rows.host_ms, dtype=np.float64) for rows in windows])
        self.device = _joined([np.frombuffer(rows.device_ms, dtype=np.float64) for rows in windows])
        self.tokens = _joined([np.frombuffer(rows.tokens, dtype=np.float64) for rows in windows])
        self.end_unix_nano = _joined([np.frombuffer(rows.end_unix_nano, dtype=np.int64) for rows in windows])
        self.local_slot = slot
        if self.size == 1:
            self.row_cohort: Optional[np.ndarray] = None
            self.code, self.slot = code, slot
        else:
            self.row_cohort = np.repeat(np.arange(self.size), self.row_counts)
            self.code = code + self.row_cohort * self.codes_per_cohort
            self.slot = slot + self.row_cohort * self.slots_per_cohort
        self.stage_names = first.stage_names if self.size == 1 else self._stage_names()

    def _stage_names(self) -> list[Optional[str]]:
        """By stage index of the batch (code // 2)."""
        per_cohort = self.codes_per_cohort // 2
        names: list[Optional[str]] = []
        for cohort in self.cohorts:
            own = cohort.stage_names[:per_cohort]
            names.extend(own)
            names.extend([None] * (per_cohort - len(own)))
        return names

    # ---- per cohort ----
    def cohort_of_codes(self, code: np.ndarray) -> np.ndarray:
        return code // self.codes_per_cohort

    def per_cohort_count(self, cohort_of: np.ndarray) -> list[int]:
        """How many of `cohort_of` (a cohort index each) fall in each cohort."""
        if self.size == 1:
            return [int(cohort_of.size)]
        return np.bincount(cohort_of, minlength=self.size).tolist()

    def per_cohort_rows(self, mask: np.ndarray) -> list[int]:
        """How many rows of `mask` each cohort has."""
        if self.row_cohort is None:
            return [int(np.count_nonzero(mask))]
        return np.bincount(self.row_cohort[mask], minlength=self.size).tolist()

    def steps_per_cohort(self) -> np.ndarray:
        """The distinct steps of each cohort's window."""
        steps = self.window_steps
        if self.row_cohort is None:
            return np.array([np.count_nonzero(np.bincount(self.step_offset))])  # offsets are in [0, window_steps)
        seen = np.bincount(self.row_cohort * steps + self.step_offset, minlength=self.size * steps)
        return np.count_nonzero(seen.reshape(self.size, steps), axis=1)

    def slot_range(self, index: int) -> slice:
        """The batch's slots of cohort `index` that hold (or held) its ranks."""
        start = index * self.slots_per_cohort if self.size > 1 else 0
        return slice(start, start + self.slot_counts[index])

    def row_range(self, index: int) -> slice:
        return slice(int(self.row_starts[index]), int(self.row_starts[index + 1]))

    def rosters(self) -> tuple[np.ndarray, np.ndarray]:
        """Per slot of the batch: whether a rank holds it, and whether its rank has sent rows of a
        later window than the one judged (slots no rank has held: neither)."""
        held = np.zeros(self.slot_count, dtype=bool)
        moved_on = np.zeros(self.slot_count, dtype=bool)
        for index, cohort in enumerate(self.cohorts):
            slots = self.slot_range(index)
            held[slots] = [entry is not None for entry in cohort.slot_entries]
            # a window is a Python int, which may be past int64 (a hostile step)
            moved_on[slots] = cohort.latest_windows(self.slot_counts[index]) > self.windows[index]
        return held, moved_on

    def by_cohort(self, per_slot: np.ndarray) -> np.ndarray:
        """A per-slot array of the batch as one row per cohort (a view)."""
        return per_slot.reshape(self.size, -1)

    def write_back(self) -> None:
        """Each cohort's state pointed at its part of the stacked state (views, kept until the stack
        dissolves; nothing to do for a batch of one but the full-window steps)."""
        for index, cohort in enumerate(self.cohorts):
            cohort.verdict_state.full_window_steps = int(self.full_window_steps[index])
        if self.size > 1:
            unstack(self.state, [cohort.verdict_state for cohort in self.cohorts])


def _joined(columns: list[np.ndarray]) -> np.ndarray:
    return columns[0] if len(columns) == 1 else np.concatenate(columns)


def batch_key(cohort: Cohort, rows: WindowRows) -> Optional[tuple]:
    """Windows whose keys are equal can be judged in one batch; None: judged alone (a large window)."""
    if len(rows) == 0 or len(rows) > MAX_BATCH_ROWS // 4:
        return None
    return id(cohort.layout), cohort.verdict_state.alert.shape


def batches(items: list[tuple[Cohort, WindowRows]]) -> list[list[tuple[Cohort, WindowRows]]]:
    """`items` (one window per cohort) in batches, each of cohorts alike, at most MAX_BATCH_ROWS rows."""
    groups: dict[tuple, list[list[tuple[Cohort, WindowRows]]]] = {}
    rows_in: dict[tuple, int] = {}
    alone = []
    for cohort, rows in items:
        key = batch_key(cohort, rows)
        if key is None:
            alone.append([(cohort, rows)])
            continue
        if key not in groups or rows_in[key] + len(rows) > MAX_BATCH_ROWS:
            groups.setdefault(key, []).append([])
            rows_in[key] = 0
        groups[key][-1].append((cohort, rows))
        rows_in[key] += len(rows)
    return alone + [batch for group in groups.values() for batch in group]
