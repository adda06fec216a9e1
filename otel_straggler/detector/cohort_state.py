"""What a cohort's judge (judge.py) remembers between windows, as arrays per rank and per (stage code, rank).

Cohorts judged together (window_batch.py) have their states stacked into one (`stack`). After
judging, each state's arrays become views of the stacked arrays (`unstack`), so that when the same
cohorts are judged together again, as the cohorts of one job are window after window, the stacked
state is used as it is, with nothing copied either way. A state whose arrays are about to be
replaced (grown, or its ring made anew) first dissolves its stack: every member gets arrays of its
own again, so stacked arrays never outlive their members' use of them.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from otel_straggler.detector.intermittent import IntermittentState
from otel_straggler.detector.job_baseline import JobBaseline


class CohortVerdictState:
    """What is remembered between windows, as arrays: per slot (rank) and per (code, slot)."""

    def __init__(self) -> None:
        self.windows_seen = np.zeros(0, dtype=np.int64)  # closed windows the rank had rows in
        self.missed_windows = np.zeros(0, dtype=np.int64)  # consecutive closed windows without its rows
        self.silent = np.zeros(0, dtype=bool)  # missed silent_windows windows: no longer waited for
        self.silent_reported = np.zeros(0, dtype=bool)  # ... and its `silent` verdict was emitted
        self.last_end_unix_nano = np.zeros(0, dtype=np.int64)  # latest interval end in its judged windows
        self.alert = np.zeros((0, 0), dtype=bool)
        self.slow_streak = np.zeros((0, 0), dtype=np.int64)
        self.within_streak = np.zeros((0, 0), dtype=np.int64)  # consecutive judged windows within tolerance
        self.floor_streak = np.zeros((0, 0), dtype=np.int64)
        self.last_uncertain = np.zeros((0, 0), dtype=np.int8)
        self.slowdown = np.zeros((0, 0))  # latest window's slowdown; nan: none yet
        # per code: the smoothed slope of the ranks' end-time deviations on their start-time
        # deviations (near 0: the stage ends at a synchronization point), and the smoothed variance
        # of the ranks' relative deviations from their references, host and device (nan: none yet)
        self.sync_slope = np.zeros(0)
        self.noise_var = np.zeros((2, 0))
        # per kind (host, device) and (code, slot): its latest log median's offset from the stage's median over ranks
        self.last_offset = np.zeros((2, 0, 0))
        self.late_streak = np.zeros((0, 0), dtype=np.int64)  # per (collective code, slot)
        self.arrival_var = np.zeros(0)  # per collective code: smoothed variance of the ranks' lateness
        self.collective_seen = np.zeros(0, dtype=bool)  # per code: judged as a collective in some window
        # per code: found to end at a synchronization point in some window (a stage the spans do not
        # mark as a collective, judged as one: evidence weaker than a mark)
        self.sync_point_seen = np.zeros(0, dtype=bool)
        self.full_window_steps = 0  # the most distinct steps a judged window of the cohort had
        self.job = JobBaseline()  # the cohort's pace against its own baseline (job_baseline.py)
        self.intermittent = IntermittentState()  # slow steps per (code, slot), recent windows
        # the stacked state whose arrays this state's are views of, and the states stacked in it (a
        # stacked state's own): see the module docstring
        self.stacked_in: Optional[CohortVerdictState] = None
        self.members: Optional[list[CohortVerdictState]] = None

    def ensure(self, stage_count: int, slot_count: int) -> None:
        """Room for `stage_count` stage indices (two codes each) and `slot_count` slots, grown by doubling."""
        codes, slots = self.alert.shape
        if 2 * stage_count <= codes and slot_count <= slots:
            return
        self.leave_stack()
        codes = codes if 2 * stage_count <= codes else max(2 * codes, 2 * stage_count, 4)
        slots = slots if slot_count <= slots else max(2 * slots, slot_count, 16)
        for name in ("windows_seen", "missed_windows", "silent", "silent_reported", "last_end_unix_nano"):
            old = getattr(self, name)
            new = np.zeros(slots, dtype=old.dtype)
            new[:old.size] = old
            setattr(self, name, new)
        if codes > self.sync_slope.size:
            grown = np.full(codes, np.nan)
            grown[:self.sync_slope.size] = self.sync_slope
            self.sync_slope = grown
            noise = np.full((2, codes), np.nan)
            noise[:, :self.noise_var.shape[1]] = self.noise_var
            self.noise_var = noise
            arrival = np.full(codes, np.nan)
            arrival[:self.arrival_var.size] = self.arrival_var
            self.arrival_var = arrival
            seen = np.zeros(codes, dtype=bool)
            seen[:self.collective_seen.size] = self.collective_seen
            self.collective_seen = seen
            found = np.zeros(codes, dtype=bool)
            found[:self.sync_point_seen.size] = self.sync_point_seen
            self.sync_point_seen = found

        for name, fill in (("alert", False), ("slow_streak", 0), ("within_streak", 0), ("floor_streak", 0),
                           ("late_streak", 0),
                           ("last_uncertain", 0), ("slowdown", np.nan)):
            old = getattr(self, name)
            new = np.full((codes, slots), fill, dtype=old.dtype)
            new[:old.shape[0], :old.shape[1]] = old
            setattr(self, name, new)
        offset = np.full((2, codes, slots), np.nan)
        offset[:, :self.last_offset.shape[1], :self.last_offset.shape[2]] = self.last_offset
        self.last_offset = offset
        self.intermittent.ensure(codes, slots)

    def ensure_ring(self, windows: int) -> None:
        """The intermittent ring of `windows` rows (IntermittentState.ensure_ring)."""
        if windows != self.intermittent.windows:
            self.leave_stack()
        self.intermittent.ensure_ring(windows)

    def leave_stack(self) -> None:
        """Before this state's arrays are replaced: the stack it is in gives every member arrays of its own."""
        if self.stacked_in is not None:
            _dissolve(self.stacked_in)

    def reset_slot(self, slot: int) -> None:
        self.windows_seen[slot] = self.missed_windows[slot] = self.last_end_unix_nano[slot] = 0
        self.silent[slot] = self.silent_reported[slot] = False
        self._reset((slice(None), slot))
        self.intermittent.reset((slice(None), slot))

    def reset_code(self, code: int) -> None:
        self._reset((code, slice(None)))
        self.intermittent.reset((code, slice(None)))
        self.sync_slope[code] = np.nan
        self.noise_var[:, code] = np.nan
        self.arrival_var[code] = np.nan
        self.collective_seen[code] = False
        self.sync_point_seen[code] = False

    def rejoin(self, slot: int) -> None:
        """A silent rank reports again, likely a new process: warmup starts over."""
        self.windows_seen[slot] = self.missed_windows[slot] = 0
        self.silent[slot] = self.silent_reported[slot] = False

    def _reset(self, where) -> None:
        self.alert[where] = False
        self.slow_streak[where] = self.within_streak[where] = self.floor_streak[where] = self.late_streak[where] = 0
        self.last_uncertain[where] = 0
        self.slowdown[where] = np.nan
        self.last_offset[(slice(None),) + where] = np.nan


# what is kept per slot, per (code, slot) and per code, by name
_SLOT_ARRAYS = ("windows_seen", "missed_windows", "silent", "silent_reported", "last_end_unix_nano")
_PAIR_ARRAYS = ("alert", "slow_streak", "within_streak", "floor_streak", "last_uncertain", "slowdown", "late_streak")
_CODE_ARRAYS = ("sync_slope", "arrival_var", "collective_seen", "sync_point_seen")
_RING_ARRAYS = ("slow", "steps", "slow_ms", "slow_reference_ms")


def stack(states: list[CohortVerdictState]) -> CohortVerdictState:
    """The states of cohorts judged together (window_batch.py), all of one shape, as one: per-slot
    arrays one cohort's after another, per-code and per-(code, slot) ones stacked along the codes.
    The intermittent ring's position is per cohort (an array); the job baselines stay the cohorts'.
    The same states stacked last time, in the same order: that stacked state, as it is."""
    previous = states[0].stacked_in
    if previous is not None and _still_stacked(previous, states):
        previous.intermittent.position = np.array([state.intermittent.position for state in states], dtype=np.int64)
        return previous
    for old in {id(state.stacked_in): state.stacked_in for state in states if state.stacked_in is not None}.values():
        _dissolve(old)
    stacked = CohortVerdictState()
    for name in _SLOT_ARRAYS + _PAIR_ARRAYS + _CODE_ARRAYS:
        setattr(stacked, name, np.concatenate([getattr(state, name) for state in states]))
    stacked.noise_var = np.concatenate([state.noise_var for state in states], axis=1)
    stacked.last_offset = np.concatenate([state.last_offset for state in states], axis=1)
    ring = stacked.intermittent
    ring.windows = states[0].intermittent.windows
    ring.position = np.array([state.intermittent.position for state in states], dtype=np.int64)
    for name in _RING_ARRAYS:
        setattr(ring, name, np.concatenate([getattr(state.intermittent, name) for state in states], axis=1))
    ring.alert = np.concatenate([state.intermittent.alert for state in states])
    return stacked


def unstack(stacked: CohortVerdictState, states: list[CohortVerdictState]) -> None:
    """After judging: each of `states` reads and writes its part of `stacked` (views), and its ring's
    position is the stacked one's."""
    if stacked.members is None:
        _view(stacked, states, range(len(states)), copy=False)
        stacked.members = list(states)
    for state, position in zip(states, stacked.intermittent.position.tolist(), strict=True):
        state.intermittent.position = position


def _still_stacked(stacked: CohortVerdictState, states: list[CohortVerdictState]) -> bool:
    """Whether `states` are the members of `stacked`, in order, their arrays still views of its own
    (the ring and the alerts checked as witnesses)."""
    members = stacked.members
    if members is None or len(members) != len(states):
        return False
    ring, alert = stacked.intermittent.slow, stacked.alert
    return all(member is state and state.stacked_in is stacked and state.alert.base is alert
               and state.intermittent.slow.base is ring for member, state in zip(members, states, strict=True))


def _dissolve(stacked: CohortVerdictState) -> None:
    """Every member of `stacked` that still views it gets copies of its part as arrays of its own."""
    members = stacked.members
    if not members:  # never judged, so nothing views it
        return
    _view(stacked, members, [index for index, state in enumerate(members) if state.stacked_in is stacked], copy=True)
    stacked.members = None


def _view(stacked: CohortVerdictState, members: list[CohortVerdictState], which, copy: bool) -> None:
    """Points the arrays of members[index] for each index of `which` at its part of `stacked`
    (with `copy`, at copies of it, and out of the stack)."""
    count = len(members)
    codes, slots = stacked.alert.shape[0] // count, stacked.windows_seen.size // count
    take = np.copy if copy else (lambda array: array)
    for index in which:
        state = members[index]
        by_slot = slice(index * slots, (index + 1) * slots)
        by_code = slice(index * codes, (index + 1) * codes)
        for name in _SLOT_ARRAYS:
            setattr(state, name, take(getattr(stacked, name)[by_slot]))
        for name in _PAIR_ARRAYS + _CODE_ARRAYS:
            setattr(state, name, take(getattr(stacked, name)[by_code]))
        state.noise_var = take(stacked.noise_var[:, by_code])
        state.last_offset = take(stacked.last_offset[:, by_code])
        ring = state.intermittent
        for name in _RING_ARRAYS:
            setattr(ring, name, take(getattr(stacked.intermittent, name)[:, by_code]))
        ring.alert = take(stacked.intermittent.alert[by_code])
        state.stacked_in = None if copy else stacked
