"""Judging one closed window of one cohort: statistics, references, thresholds, alert state.

Everything is computed for all (stage, rank) pairs of the window at once with numpy; verdict objects
are built only for the few pairs whose state changes. Per pair and window:

- statistic: the median host duration and, where the rank has device durations, the median device
  duration of its intervals of that stage. The whole step (stage "*") is, per rank and step, the sum
  of its non-collective intervals (device sum only when every one of them has a device duration),
  then the median over the window's steps. Nested timers are summed too: every rank of a cohort
  nests the same way, so the comparison is unaffected.
- reference: see peer_reference.py (median of the comparable peers, the rank left out). Device
  durations are compared with peers that have device durations.
- slow: slowdown > 1 + rel_threshold AND gap > min_gap_ms AND slowdown - 1 beyond z x the stage's
  noise (_beyond_noise), on host or device; over the relative threshold but not the gap is
  `below_absolute_floor`, never slow. A stage that ends at a synchronization point
  (_mark_synchronization_points) is judged as a collective.
- usable: the rank has at least min_cohort_size - 1 comparable peers; otherwise
  `cohort_below_min_size` (the stage has too few ranks) or `workload_incomparable`.

Verdicts emitted (healthy windows emit nothing; the live slowdown gauge updates every window):
- `straggler`/`slow_vs_peers` when a pair is slow for persist_windows consecutive usable windows
  (a rank's first warmup_windows windows are not judged at all; an unusable window breaks a streak);
- `straggler`/`intermittent` for a pair slow in a share of its steps well beyond its peers' while
  its median does not move (intermittent.py), and its `recovered`/`within_tolerance`;
- `recovered`/`within_tolerance` at the first usable window back within the relative threshold
  while an alert is active; an unusable window, or one over the ratio but under the floor, holds it;
- `uncertain`/`recovery_evidence_insufficient` when an active alert meets an unusable window;
  `uncertain`/`cohort_below_min_size` or `workload_incomparable` for an unusable pair without alert;
  `uncertain`/`below_absolute_floor` once a pair has been over the ratio but under the floor for
  persist_windows consecutive windows. Each of these is noted once per pair until its next
  straggler or recovered verdict, so a jittery stage does not repeat itself every window;
- collective stages are never slow by their own duration: a pair whose wait is long for
  persist_windows windows gets one `uncertain`/`waiting_on_peer` (attribution `waiting_on_peer`);
- `silent`/`no_report` (stage "*") when a rank misses silent_windows consecutive closed windows
  and its peers' intervals end more than max_export_lag_s after its last one (_judge_presence).
"""
from __future__ import annotations

import math
import dataclasses
import functools
import statistics
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.grouped import dense_groups, grouped_medians, grouped_medians_signed
from otel_straggler.detector.intermittent import (CollectiveWaits, IntermittentState, SlowSteps, count_slow_steps,
                                                  judge_intermittent, workload_classes)
from otel_straggler.detector.job_baseline import JobBaseline, judge_pace, window_pace
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.peer_reference import (WORKLOAD_COMPARABLE, WORKLOAD_NOT_REPORTED,
                                                    PeerReferences, peer_references)

REASON_SLOW_VS_PEERS = "slow_vs_peers"
REASON_INTERMITTENT = "intermittent"  # slow in a sizeable share of its steps (intermittent.py)
REASON_WITHIN_TOLERANCE = "within_tolerance"
REASON_BELOW_ABSOLUTE_FLOOR = "below_absolute_floor"
REASON_COHORT_BELOW_MIN_SIZE = "cohort_below_min_size"
REASON_WORKLOAD_INCOMPARABLE = "workload_incomparable"
REASON_RECOVERY_EVIDENCE_INSUFFICIENT = "recovery_evidence_insufficient"
REASON_WAITING_ON_PEER = "waiting_on_peer"
REASON_NO_REPORT = "no_report"
REASON_LAST_TO_ARRIVE = "last_to_arrive"  # at a collective: the rank its peers wait for
REASON_RESTARTED = "restarted"  # an alert ended by a new incarnation of its cohort (training.restart.count)

# the last uncertain reason noted per pair, as a small int (0: none), so each is noted once
_UNCERTAIN_REASONS = (None, REASON_COHORT_BELOW_MIN_SIZE, REASON_WORKLOAD_INCOMPARABLE,
                      REASON_RECOVERY_EVIDENCE_INSUFFICIENT, REASON_BELOW_ABSOLUTE_FLOOR)
_SMALL, _INCOMPARABLE, _INSUFFICIENT, _FLOOR = 1, 2, 3, 4

TIMING_HOST = "host"
TIMING_DEVICE = "device"

# synchronization points (_mark_synchronization_points)
SYNC_SLOPE_LIMIT = 0.5  # halfway between a synchronized end (slope 0) and a free one (slope 1)
SYNC_SMOOTHING = 0.3  # weight of each window's slope in the smoothed one
SYNC_MIN_RANKS = 3  # ranks with the same (stage, step) for its deviations to count
SYNC_MIN_STEPS = 3
SYNC_MIN_START_SPREAD_MS = 0.1  # rms start deviation below which the ends say nothing
# the cohort's noise (_beyond_noise)
NOISE_SMOOTHING = 0.2  # weight of each window's spread in the smoothed variance
NORMAL_MAD = 0.6745  # median absolute deviation of N(0, 1)
HALF_NORMAL_MAD = 0.3986  # median absolute deviation from its median of the lower half of N(0, 1)



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
        self.full_window_steps = 0  # the most distinct steps a judged window of the cohort had
        self.job = JobBaseline()  # the cohort's pace against its own baseline (job_baseline.py)
        self.intermittent = IntermittentState()  # slow steps per (code, slot), recent windows

    def ensure(self, stage_count: int, slot_count: int) -> None:
        """Room for `stage_count` stage indices (two codes each) and `slot_count` slots, grown by doubling."""
        codes, slots = self.alert.shape
        if 2 * stage_count <= codes and slot_count <= slots:
            return
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

        for name, fill in (("alert", False), ("slow_streak", 0), ("within_streak", 0), ("floor_streak", 0), ("late_streak", 0),
                           ("last_uncertain", 0), ("slowdown", np.nan)):
            old = getattr(self, name)
            new = np.full((codes, slots), fill, dtype=old.dtype)
            new[:old.shape[0], :old.shape[1]] = old
            setattr(self, name, new)
        offset = np.full((2, codes, slots), np.nan)
        offset[:, :self.last_offset.shape[1], :self.last_offset.shape[2]] = self.last_offset
        self.last_offset = offset
        self.intermittent.ensure(codes, slots)

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


@dataclass
class WindowJudgement:
    verdicts: list[Verdict] = field(default_factory=list)
    coverage_gaps: int = 0
    fell_silent: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    came_back: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    invalid_device_rows: int = 0
    quiet_below_floor: int = 0  # `below_absolute_floor` notices not emitted (config.report_below_floor off)


@dataclass
class _Comparison:
    """One duration kind (host or device) compared for every entry."""
    median: np.ndarray
    references: PeerReferences
    entries: np.ndarray  # which entries these rows are (device: only those with device durations)
    usable: np.ndarray
    slowdown: np.ndarray
    over: np.ndarray  # slowdown over the relative threshold
    over_floor: np.ndarray  # ... and gap over the floor
    slow: np.ndarray  # ... and beyond the cohort's noise


def judge_window(cohort, rows, config: DetectorConfig, now_unix_nano: int) -> WindowJudgement:
    """Judges the closed window `rows` of `cohort` (windows.Cohort) and updates its verdict state."""
    state: CohortVerdictState = cohort.verdict_state
    layout = cohort.layout
    slot_count = len(cohort.slot_entries)
    with np.errstate(all="ignore"):  # inf/nan from hostile values are handled as unusable below
        entries, invalid_device_rows = _entries(rows, layout, slot_count, state, config)
        # ranks with no rows here that have sent a later window's: alive, their rows of this one lost
        # on the way (an exporter's full queue while the detector was down); where they outnumber
        # the ranks present, the window is a backlog too thin to compare anyone in
        moved_past = np.count_nonzero(~entries.present & (cohort.latest_windows(slot_count) > rows.window))
        thin = moved_past > np.count_nonzero(entries.present)
        judgement = _judge_entries(cohort, rows.window, entries, config, now_unix_nano, thin)
    judgement.invalid_device_rows = invalid_device_rows
    _judge_presence(cohort, rows.window, entries, config, now_unix_nano, judgement)
    judgement.verdicts += _judge_pace(cohort, rows, entries, config, now_unix_nano)
    state.windows_seen[:slot_count][entries.present] += 1
    state.collective_seen[entries.code[(entries.code & 1) == 1]] = True  # for hangs: who waits where
    for stage_index in np.flatnonzero(np.bincount(entries.code // 2)).tolist():
        if stage_index:
            cohort.stage_seen(stage_index, rows.window)
    return judgement


@dataclass
class _Entries:
    """One entry per (stage code, slot) present in the window, sorted by code then slot."""
    code: np.ndarray
    slot: np.ndarray
    host: np.ndarray
    device: np.ndarray  # nan: no device duration
    tokens: np.ndarray  # the slot's tokens per step; nan: not reported
    present: np.ndarray  # bool per slot: the rank had rows in this window
    last_end_unix_nano: np.ndarray = None  # per slot: its latest interval end in this window (0: none)
    # collective entries: steps in which its wait was under the step's median wait (it arrived
    # later than half of its peers), and steps with enough ranks to tell; 0 elsewhere
    late_steps: np.ndarray = None
    arrival_steps: np.ndarray = None
    slow_steps: SlowSteps = None  # per entry (compute stages and the whole step): its slow steps
    steps: int = 0  # distinct steps in the window
    rows: "_Rows" = None  # the window's rows, for the few questions asked of single ranks (_lead)


@dataclass
class _Rows:
    """The window's rows as judged: stage code (collective bit as judged), slot, step offset, host
    ms and end time."""
    code: np.ndarray
    slot: np.ndarray
    step: np.ndarray
    host: np.ndarray
    end_unix_nano: np.ndarray


def _entries(rows, layout, slot_count: int, state: CohortVerdictState,
             config: DetectorConfig) -> tuple[_Entries, int]:
    keys = np.frombuffer(rows.keys, dtype=np.int64)
    host = np.frombuffer(rows.host_ms, dtype=np.float64)
    device = np.frombuffer(rows.device_ms, dtype=np.float64)
    tokens = np.frombuffer(rows.tokens, dtype=np.float64)
    end_unix_nano = np.frombuffer(rows.end_unix_nano, dtype=np.int64)
    _, code, slot, step_offset = layout.unpack(keys)
    code = _mark_synchronization_points(state, code, slot, step_offset, host, end_unix_nano, layout, slot_count)
    has_device = np.isfinite(device) & (device >= 0)
    invalid_device_rows = int(np.count_nonzero(~np.isnan(device) & ~has_device))

    # per (stage, rank, step): the stage's intervals summed (micro-batches, gradient accumulation),
    # device only where every interval has one; then per (stage, rank) the median over steps.
    # Keys repacked over the cohort's slots instead of max_ranks: same order, a range close to the
    # row count, so that grouping them counts into a table (_sums_by_bin, dense_groups) instead of sorting
    slot_steps = slot_count * layout.window_steps
    step_bin = slot * layout.window_steps + step_offset
    compact_cells, (cell_host, cell_device, cell_device_missing) = _sums_by_bin(
        code * slot_steps + step_bin, host, np.where(has_device, device, 0.0), (~has_device).astype(np.float64))
    cells = compact_cells // slot_steps * layout.code_stride + compact_cells % slot_steps  # the layout's keys
    del compact_cells  # the window's largest arrays are these: none is kept longer than before
    cell_groups = cells // layout.window_steps
    stage_groups, stage_host = grouped_medians(cell_groups, cell_host)
    complete_cells = cell_device_missing == 0
    device_groups, device_medians = grouped_medians(cell_groups[complete_cells], cell_device[complete_cells])
    stage_device = np.full(stage_groups.size, np.nan)
    stage_device[np.searchsorted(stage_groups, device_groups)] = device_medians

    # whole step: per (slot, step) sums of the non-collective intervals, then per-slot medians
    compute = (code & 1) == 0
    bins, (host_sum, device_sum, device_missing) = _sums_by_bin(
        step_bin[compute], host[compute], np.where(has_device, device, 0.0)[compute],
        (~has_device[compute]).astype(np.float64))
    whole_slots, whole_host = grouped_medians(bins // layout.window_steps, host_sum)
    complete = device_missing == 0
    whole_device_slots, whole_device_medians = grouped_medians(bins[complete] // layout.window_steps,
                                                               device_sum[complete])
    whole_device = np.full(whole_slots.size, np.nan)
    whole_device[np.searchsorted(whole_slots, whole_device_slots)] = whole_device_medians

    # workload: tokens per (slot, step) averaged over the step's rows that carry it, per-slot median
    reported = np.isfinite(tokens) & (tokens > 0)
    token_bins, (token_sum, token_rows) = _sums_by_bin(step_bin[reported], tokens[reported],
                                                       np.ones(int(np.count_nonzero(reported))))
    token_slots, token_medians = grouped_medians(token_bins // layout.window_steps, token_sum / token_rows)
    tokens_by_slot = np.full(slot_count, np.nan)
    tokens_by_slot[token_slots] = np.where(np.isfinite(token_medians), token_medians, np.nan)

    stage_code = stage_groups // layout.slot_stride
    stage_slot = stage_groups - stage_code * layout.slot_stride
    all_slots = np.concatenate((whole_slots, stage_slot))
    present = np.zeros(slot_count, dtype=bool)
    present[slot] = True
    last_end = np.zeros(slot_count, dtype=np.int64)
    np.maximum.at(last_end, slot, end_unix_nano)
    entry_codes = np.concatenate((np.zeros(whole_slots.size, dtype=np.int64), stage_code))
    late_steps, arrival_steps = _late_steps(code, slot, step_offset, host, layout, entry_codes, all_slots)
    # per (stage, rank, step) time of the compute stages, and the whole step's sums, for intermittent.py
    _, cell_code, cell_slot, cell_step = layout.unpack(cells)
    compute_cells = ((cell_code & 1) == 0) & (cell_code > 0)
    cell_code, cell_slot, cell_step = cell_code[compute_cells], cell_slot[compute_cells], cell_step[compute_cells]
    stage_cell_ms = cell_host[compute_cells]
    slow_steps = count_slow_steps(
        np.concatenate((np.zeros(bins.size, dtype=np.int64), cell_code)),
        np.concatenate((bins // layout.window_steps, cell_slot)),
        np.concatenate((bins % layout.window_steps, cell_step)),
        np.concatenate((host_sum, stage_cell_ms)), workload_classes(tokens_by_slot, config.work_tolerance),
        entry_codes, all_slots, layout.slot_stride, layout.window_steps,
        config.intermittent_threshold, config.min_gap_ms, config.min_cohort_size,
        CollectiveWaits(slot[~compute], step_offset[~compute], host[~compute]))
    return _Entries(
        late_steps=late_steps, arrival_steps=arrival_steps, slow_steps=slow_steps,
        code=np.concatenate((np.zeros(whole_slots.size, dtype=np.int64), stage_code)),
        slot=all_slots,
        host=np.concatenate((whole_host, stage_host)),
        device=np.concatenate((whole_device, stage_device)),
        tokens=tokens_by_slot[all_slots],
        present=present,
        last_end_unix_nano=last_end,
        steps=int(np.count_nonzero(np.bincount(step_offset))),  # offsets are in [0, window_steps)
        rows=_Rows(code, slot, step_offset, host, end_unix_nano),
    ), invalid_device_rows


def _mark_synchronization_points(state: CohortVerdictState, code: np.ndarray, slot: np.ndarray,
                                 step_offset: np.ndarray, host: np.ndarray, end_unix_nano: np.ndarray, layout,
                                 slot_count: int) -> np.ndarray:
    """`code` with the collective bit set on the rows of stages that end at a synchronization point
    (a collective hidden inside, such as DDP's all-reduce inside backward), judged as collectives.

    A collective ends at the same instant on every rank of its group, so across ranks the end of
    such a stage does not follow its start: per (stage, step), each rank's start and end deviate
    from the ranks' medians; each rank's own median deviation over the window's steps is removed
    (a clock offset, or a rank that is consistently later); the slope of the end deviations on the
    start deviations is near 0 at a synchronization point and near 1 for a stage each rank runs on
    its own. The slope is smoothed over windows and compared with SYNC_SLOPE_LIMIT."""
    stage_rows = ((code & 1) == 0) & (code > 0)
    if not stage_rows.any():
        return code
    end_ms = (end_unix_nano[stage_rows] - end_unix_nano[stage_rows].min()) / 1e6
    start_ms = end_ms - host[stage_rows]
    # one cell per (stage, rank, step): its last interval, the one a synchronization point would
    # end (of several micro-batches, only the one that synchronizes does)
    # cells keyed over the cohort's slots: (code * slot_count + slot) * window_steps + step offset
    cells, index = dense_groups((code[stage_rows] * slot_count + slot[stage_rows]) * layout.window_steps
                                + step_offset[stage_rows])
    finite = np.isfinite(end_ms) & np.isfinite(start_ms)
    if cells.size == index.size:  # one interval per cell (no micro-batches): it is the last
        last = np.empty_like(index)
        last[index] = np.arange(index.size)
    else:
        order = np.lexsort((np.where(finite, end_ms, -np.inf), index))
        last = order[np.r_[index[order][1:] != index[order][:-1], True]]  # per cell, its row with the latest end
    cell_end = np.where(finite[last], end_ms[last], np.inf)
    cell_start = np.where(finite[last], start_ms[last], np.inf)
    cell_group = cells // layout.window_steps
    cell_step = cells - cell_group * layout.window_steps
    cell_code = cell_group // slot_count
    cell_slot = cell_group - cell_code * slot_count
    usable = np.isfinite(cell_start) & np.isfinite(cell_end)
    cell_code, cell_slot, cell_step = cell_code[usable], cell_slot[usable], cell_step[usable]
    cell_start, cell_end = cell_start[usable], cell_end[usable]
    # deviations from the ranks' medians of the same (stage, step), where enough ranks have it
    step_ids, by_step = dense_groups(cell_code * layout.window_steps + cell_step)
    ranks_in_step = np.bincount(by_step)
    _, median_end = grouped_medians_signed(by_step, cell_end, step_ids.size)
    _, median_start = grouped_medians_signed(by_step, cell_start, step_ids.size)
    enough = ranks_in_step[by_step] >= SYNC_MIN_RANKS
    end_dev = (cell_end - median_end[by_step])[enough]
    start_dev = (cell_start - median_start[by_step])[enough]
    cell_code, cell_slot = cell_code[enough], cell_slot[enough]
    # each rank's own offset over the window removed
    rank_ids, by_rank = dense_groups(cell_code * slot_count + cell_slot)
    _, rank_end = grouped_medians_signed(by_rank, end_dev, rank_ids.size)
    _, rank_start = grouped_medians_signed(by_rank, start_dev, rank_ids.size)
    end_dev = end_dev - rank_end[by_rank]
    start_dev = start_dev - rank_start[by_rank]
    codes, by_code = dense_groups(cell_code)
    cells_per_code = np.bincount(by_code, minlength=codes.size)
    covariance = np.bincount(by_code, weights=end_dev * start_dev, minlength=codes.size)
    start_variance = np.bincount(by_code, weights=start_dev * start_dev, minlength=codes.size)
    end_variance = np.bincount(by_code, weights=end_dev * end_dev, minlength=codes.size)
    duration_dev = end_dev - start_dev
    duration_variance = np.bincount(by_code, weights=duration_dev * duration_dev, minlength=codes.size)
    # evidence: enough cells; starts that differ enough for their ends to be telling; ends closer
    # together than the starts, and durations that absorb the starts' spread (a wait does; a stage
    # too short to hold one does not)
    evident = (cells_per_code >= SYNC_MIN_RANKS * SYNC_MIN_STEPS) & \
        (start_variance > cells_per_code * SYNC_MIN_START_SPREAD_MS ** 2) & (end_variance < start_variance) & \
        (duration_variance >= 0.25 * start_variance)
    slope = covariance[evident] / start_variance[evident]
    evident_codes = codes[evident]
    previous = state.sync_slope[evident_codes]
    state.sync_slope[evident_codes] = np.where(np.isnan(previous), slope,
                                               previous + SYNC_SMOOTHING * (slope - previous))
    # judged as a synchronization point in a window with its own evidence and a smoothed slope
    # under the limit
    synchronized = np.zeros(state.sync_slope.size, dtype=bool)
    synchronized[evident_codes] = state.sync_slope[evident_codes] < SYNC_SLOPE_LIMIT
    if not synchronized.any():
        return code
    marked = stage_rows & synchronized[np.minimum(code, synchronized.size - 1)]
    return np.where(marked, code | 1, code)


def _late_steps(code: np.ndarray, slot: np.ndarray, step_offset: np.ndarray, host: np.ndarray, layout,
                entry_codes: np.ndarray, entry_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per collective entry (code, slot): the steps in which its wait was under the step's median
    wait, and the steps of its code with at least SYNC_MIN_RANKS ranks."""
    count = entry_codes.size
    late, steps = np.zeros(count, np.int64), np.zeros(count, np.int64)
    rows = np.flatnonzero((code & 1) == 1)
    if rows.size == 0:
        return late, steps
    step_ids, by_step = dense_groups(code[rows] * layout.window_steps + step_offset[rows])
    ranks_in_step = np.bincount(by_step)
    _, step_median = grouped_medians_signed(by_step, host[rows], step_ids.size)
    enough = ranks_in_step[by_step] >= SYNC_MIN_RANKS
    under = enough & (host[rows] < step_median[by_step])
    pair = code[rows] * layout.slot_stride + slot[rows]
    # one step per (code, step) group with enough ranks
    first_rows = np.unique(by_step[enough], return_index=True)[1]
    collective = np.flatnonzero(entry_codes & 1)
    entry_codes = entry_codes[collective]
    late[collective] = _counts_of(pair[under], entry_codes * layout.slot_stride + entry_slots[collective])
    steps[collective] = _counts_of(code[rows][enough][first_rows], entry_codes)
    return late, steps


def _counts_of(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """How many times each of `keys` occurs in `values` (0 where it does not)."""
    if values.size == 0 or keys.size == 0:
        return np.zeros(keys.size, dtype=np.int64)
    distinct, counts = np.unique(values, return_counts=True)
    position = np.minimum(np.searchsorted(distinct, keys), distinct.size - 1)
    return np.where(distinct[position] == keys, counts[position], 0)


def _sums_by_bin(bins: np.ndarray, *weights: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the distinct bins, each weight column summed per bin)."""
    if bins.size == 0:
        return bins, [np.zeros(0) for _ in weights]
    if int(bins.max()) < max(4 * bins.size, 1 << 16):  # dense enough to count directly
        used = np.bincount(bins).nonzero()[0]
        return used, [np.bincount(bins, weights=column)[used] for column in weights]
    distinct, index = dense_groups(bins)
    return distinct, [np.bincount(index, weights=column) for column in weights]


def _compare(entries: np.ndarray, segment: np.ndarray, median: np.ndarray, tokens: np.ndarray,
             floor_ms: np.ndarray, config: DetectorConfig, noise_var: np.ndarray, pair: np.ndarray,
             last_offset: np.ndarray) -> _Comparison:
    references = peer_references(segment, median, tokens, config.reference_quantile, config.work_tolerance)
    reference = references.reference
    slowdown = np.where(reference > 0, median / reference, np.where(median > 0, np.inf, 1.0))
    gap = median - reference
    usable = (references.peer_count + 1 >= config.min_cohort_size) & np.isfinite(reference) & ~np.isnan(slowdown)
    over = usable & (slowdown > 1.0 + config.rel_threshold)
    beyond_noise = _beyond_noise(segment, median, slowdown, usable, config, noise_var, pair, last_offset)
    return _Comparison(median, references, entries, usable, slowdown, over, over & (gap > floor_ms),
                       over & (gap > floor_ms) & beyond_noise)


def _beyond_noise(segment: np.ndarray, median: np.ndarray, slowdown: np.ndarray, usable: np.ndarray,
                  config: DetectorConfig, noise_var: np.ndarray, pair: np.ndarray,
                  last_offset: np.ndarray) -> np.ndarray:
    """Per entry: its deviation from its reference, log(slowdown), exceeds z * sigma of its stage.

    sigma (docs/detection.md, Thresholds), per stage, the larger of two robust spreads of the
    ranks' log durations, smoothed over windows in `noise_var` (one value per code, updated here):
    - across ranks: the faster half's log window medians around their own median, so that slow
      ranks, up to half of them, do not widen it;
    - over time: the ranks' changes since their previous window of their log median's offset from
      the stage's median over its ranks (`last_offset`, per pair, updated here), over sqrt(2).
      Contention is one-sided (a rank cannot run faster than its uncontended speed), so when it
      moves from rank to rank (more processes than cores, a noisy neighbour) the faster ranks
      bunch at that speed and say little of how far a healthy rank is slowed, while each rank's
      offset jumps from window to window; a rank slow for a reason stays slow and hardly changes.
      The offset, not the deviation from the rank's reference: with 3 ranks a healthy rank's
      reference is the mean of its two peers, so a straggler's own swings moved every healthy
      rank's deviation and widened the bound past a 4x straggler; the median over all ranks
      follows the healthy ones.
    Logs: the slowdown is a ratio, and a short stage's durations have a long right tail (a few ms of
    scheduling delay on a 1 ms stage) that the log scale shortens.
    z: the normal quantile 1 - false_alarm_rate / n for the n comparisons of the window
    (Bonferroni): a healthy rank of any stage crosses it in about false_alarm_rate of the windows,
    before persist_windows asks for more."""
    result = np.zeros(slowdown.size, dtype=bool)
    judged = np.flatnonzero(usable & np.isfinite(slowdown) & (slowdown > 0) & (median > 0))
    if judged.size == 0:
        return result
    deviation = np.log(slowdown[judged])
    segments, by_segment = dense_groups(segment[judged])
    log_median = np.log(median[judged])
    _, stage_median = grouped_medians_signed(by_segment, log_median, segments.size)
    across = _half_spread(segments, by_segment, log_median, log_median < stage_median[by_segment],
                          np.ones(judged.size), None)
    offset = log_median - stage_median[by_segment]
    previous = last_offset[pair[judged]]
    moved = np.isfinite(previous)
    over_time = np.zeros(segments.size)
    moved_segments, change = grouped_medians_signed(by_segment[moved], np.abs(offset[moved] - previous[moved]),
                                                    segments.size)
    over_time[moved_segments] = change / (NORMAL_MAD * math.sqrt(2.0))
    last_offset[pair[judged]] = offset
    sigma = _smoothed(segments, np.fmax(across, over_time), noise_var)
    result[judged] = deviation > _noise_z(judged.size, config.false_alarm_rate) * sigma[by_segment]
    return result


def _late_beyond_noise(code: np.ndarray, wait_ms: np.ndarray, lateness: np.ndarray, step_ms: np.ndarray,
                       candidates: np.ndarray, arrival_var: np.ndarray, z: float) -> np.ndarray:
    """Per entry: its lateness at a collective, over its whole-step compute, exceeds z * sigma:
    as _beyond_noise, mirrored (the spread of the half of the ranks that waited longest, that is
    arrived earliest, so late ranks, up to half of them, do not widen it). A rank whose host
    drifts slower for a while is then consistently late, and still not a straggler."""
    result = np.zeros(code.size, dtype=bool)
    judged = np.flatnonzero(candidates & np.isfinite(step_ms) & (step_ms > 0) & np.isfinite(lateness))
    if judged.size == 0:
        return result
    segments, by_segment = dense_groups(code[judged])
    relative_wait = wait_ms[judged] / step_ms[judged]
    _, centre = grouped_medians_signed(by_segment, relative_wait, segments.size)
    sigma = _half_spread(segments, by_segment, relative_wait, relative_wait > centre[by_segment],
                         np.ones(judged.size), arrival_var)
    result[judged] = lateness[judged] / step_ms[judged] > z * sigma[by_segment]
    return result


def _half_spread(segments: np.ndarray, by_segment: np.ndarray, values: np.ndarray, healthy: np.ndarray,
                 scale: np.ndarray, smoothed_var: Optional[np.ndarray]) -> np.ndarray:
    """sigma per segment: the spread of the `healthy` half of its values (the faster ranks, or the
    earlier arrivals) around their own median, each distance over its `scale`, as a half-normal
    median absolute deviation; smoothed over windows in `smoothed_var` (by segment id, updated)
    unless that is None."""
    centre = np.zeros(segments.size)
    half_segments, half_centre = grouped_medians_signed(by_segment[healthy], values[healthy], segments.size)
    centre[half_segments] = half_centre
    distance = np.abs(values[healthy] - centre[by_segment[healthy]]) / scale[healthy]
    spread = np.zeros(segments.size)
    half_segments, half_spread = grouped_medians_signed(by_segment[healthy], distance, segments.size)
    spread[half_segments] = half_spread / HALF_NORMAL_MAD
    return spread if smoothed_var is None else _smoothed(segments, spread, smoothed_var)


def _smoothed(segments: np.ndarray, spread: np.ndarray, smoothed_var: np.ndarray) -> np.ndarray:
    """sqrt of the variance smoothed over windows (weight NOISE_SMOOTHING) in `smoothed_var`, updated."""
    previous = smoothed_var[segments]
    variance = spread ** 2
    smoothed_var[segments] = np.where(np.isnan(previous), variance, previous + NOISE_SMOOTHING * (variance - previous))
    return np.sqrt(smoothed_var[segments])


def _consistently_late(early_steps: int, steps: int, comparisons: int, config: DetectorConfig) -> bool:
    """A rank whose wait at a collective was under the step's median wait (it arrived later than
    half of its peers) in `early_steps` of `steps` steps. By chance that is a coin flip per step, so
    the binomial tail P(X >= early_steps) must be under (false_alarm_rate / comparisons) ** (1 /
    persist_windows): an alert needs persist_windows such windows in a row, which by chance happen
    with at most the window's Bonferroni share (for windows that are independent)."""
    if steps < SYNC_MIN_STEPS or 2 * early_steps <= steps:
        return False
    level = (config.false_alarm_rate / max(1, comparisons)) ** (1.0 / config.persist_windows)
    if steps <= 1000:
        tail = sum(math.comb(steps, k) for k in range(early_steps, steps + 1)) / 2.0 ** steps
    else:
        tail = 0.5 * math.erfc((early_steps - steps / 2) / math.sqrt(steps / 2))
    return tail < level


@functools.lru_cache(maxsize=4096)
def _noise_z(comparisons: int, false_alarm_rate: float) -> float:
    return statistics.NormalDist().inv_cdf(1.0 - false_alarm_rate / max(1, comparisons))


def _judge_entries(cohort, window: int, entries: _Entries, config: DetectorConfig, now: int,
                   thin: bool = False) -> WindowJudgement:
    state: CohortVerdictState = cohort.verdict_state
    judgement = WindowJudgement()
    count = entries.code.size
    if count == 0:
        return judgement
    everyone = np.arange(count)
    collective = (entries.code & 1) == 1
    # a collective absorbs every peer's arrival jitter; waiting counts only when it is a sizeable
    # part of the rank's step: over rel_threshold of its whole-step compute time as well as the floor
    step_compute_ms = np.full(state.windows_seen.size, np.nan)
    whole_step = entries.code == 0
    step_compute_ms[entries.slot[whole_step]] = entries.host[whole_step]
    floor_ms = np.where(collective, np.fmax(config.min_gap_ms, config.rel_threshold * step_compute_ms[entries.slot]),
                        config.min_gap_ms)
    flat = entries.code * state.alert.shape[1] + entries.slot
    host = _compare(everyone, entries.code, entries.host, entries.tokens, floor_ms, config, state.noise_var[0],
                    flat, state.last_offset[0].reshape(-1))
    with_device = np.flatnonzero(~np.isnan(entries.device))
    device = _compare(with_device, entries.code[with_device], entries.device[with_device],
                      entries.tokens[with_device], floor_ms[with_device], config, state.noise_var[1],
                      flat[with_device], state.last_offset[1].reshape(-1))

    # device comparisons scattered onto all entries
    device_usable = np.zeros(count, dtype=bool)
    device_usable[with_device] = device.usable
    device_over = np.zeros(count, dtype=bool)
    device_over[with_device] = device.over
    device_slow = np.zeros(count, dtype=bool)
    device_slow[with_device] = device.slow
    device_over_floor = np.zeros(count, dtype=bool)
    device_over_floor[with_device] = device.over_floor
    device_slowdown = np.full(count, np.nan)
    device_slowdown[with_device] = device.slowdown

    usable = host.usable
    slow = usable & (host.slow | device_slow)
    over = usable & (host.over | device_over)
    # over the ratio, under the absolute floor; over both but within the cohort's noise: neither
    floor = over & ~(host.over_floor | device_over_floor)
    within = usable & ~over
    # which duration the verdict reports: the one that convicted, else device where comparable
    host_flag = np.where(slow, host.slow, host.over)
    device_flag = np.where(slow, device_slow, device_over)
    use_device = device_flag | (device_usable & ~host_flag)
    slowdown = np.where(usable, np.where(use_device, device_slowdown, host.slowdown), np.nan)

    # at a collective (marked or found) the rank that arrives last waits least: its lateness is the
    # peers' wait minus its own, counted when over the collective floor and beyond the noise
    lateness = host.references.reference - entries.host
    comparisons = int(np.count_nonzero(usable))
    late = collective & usable & (lateness > floor_ms) & _late_beyond_noise(
        entries.code, entries.host, lateness, step_compute_ms[entries.slot], collective & usable,
        state.arrival_var, _noise_z(comparisons, config.false_alarm_rate))
    for entry in np.flatnonzero(late).tolist():
        late[entry] = _consistently_late(int(entries.late_steps[entry]), int(entries.arrival_steps[entry]),
                                         comparisons, config)

    state.slowdown.reshape(-1)[flat] = slowdown  # gauges update every window, warmup included
    # a window with under half the steps of the cohort's full ones (the job's last, say), or a
    # backlog's (`thin`), is too thin to start, end or break anything: it is not judged, and holds
    # every streak and alert
    partial = 2 * entries.steps < state.full_window_steps or thin
    state.full_window_steps = max(state.full_window_steps, entries.steps)
    judged = (state.windows_seen[entries.slot] >= config.warmup_windows) & (not partial)
    compute = judged & ~collective
    waiting = judged & collective

    alert = state.alert.reshape(-1)[flat]
    slow_streak = np.where(slow, state.slow_streak.reshape(-1)[flat] + 1, 0)
    floor_streak = np.where(floor, state.floor_streak.reshape(-1)[flat] + 1, 0)
    unusable_reason = np.where(host.references.segment_size < config.min_cohort_size, _SMALL, _INCOMPARABLE)
    uncertain_reason = np.where(compute & ~usable, np.where(alert, _INSUFFICIENT, unusable_reason), 0)
    floor_reason = np.where(compute & floor & ~alert & (floor_streak >= config.persist_windows), _FLOOR, 0)
    last_notice = state.last_uncertain.reshape(-1)[flat]

    onset = compute & slow & ~alert & (slow_streak >= config.persist_windows)
    # recovery needs the rank back within the relative tolerance: a window under the floor but
    # still over the ratio holds the alert, so a gap hovering at the floor does not flap. The whole
    # step needs persist_windows such windows in a row: it sums whatever stages a window holds of
    # the rank, so one window that lacks a stage's spans (lost on the way) looks fast
    within_streak = np.where(compute & within, state.within_streak.reshape(-1)[flat] + 1, 0)
    recovery = compute & alert & within & ((entries.code != 0) | (within_streak >= config.persist_windows))
    uncertain_notice = (uncertain_reason != 0) & (uncertain_reason != last_notice)
    floor_notice = (floor_reason != 0) & (floor_reason != last_notice)
    if not config.report_below_floor:  # noise under the floor: counted, not said
        judgement.quiet_below_floor = int(np.count_nonzero(floor_notice))
        floor_notice = np.zeros_like(floor_notice)
    waiting_notice = waiting & slow & (slow_streak == config.persist_windows)
    # the arrival rule keeps its own streak; its alert lives in the collective code's alert state
    late_streak = np.where(late, state.late_streak.reshape(-1)[flat] + 1, 0)
    late_onset = waiting & late & ~alert & (late_streak >= config.persist_windows)
    # back in time at the collective, over enough steps to tell (a wait that turned longer in one
    # step says nothing)
    late_recovery = waiting & alert & usable & (lateness <= floor_ms) & (entries.arrival_steps >= SYNC_MIN_STEPS)
    onset = onset | late_onset
    recovery = recovery | late_recovery
    # several stages of one rank slow at once: the onset goes to the stage that explains the others
    held = alert & ~recovery & (compute | waiting)  # a leading stage holding its alert still explains
    # clearly slower than its peers (over the relative threshold and the floor), whether or not
    # beyond its own noise: where the whole step is convicted, such a stage can carry its time
    clearly_over = compute & usable & (host.over_floor | device_over_floor)
    onset, also_slow, explained = _lead(cohort.stage_names, entries, onset, late_onset, compute & slow,
                                        waiting & late, held, clearly_over, lateness,
                                        entries.host - host.references.reference)
    late_onset = onset & waiting
    # an uncertain reason is noted once per pair, until its next straggler or recovered verdict
    notice = np.where(uncertain_reason != 0, uncertain_reason, np.where(floor_reason != 0, floor_reason, last_notice))
    notice = np.where(onset | recovery, 0, notice)

    update = flat[judged]
    state.alert.reshape(-1)[update] = ((alert | onset) & ~recovery)[judged]
    state.slow_streak.reshape(-1)[update] = slow_streak[judged]
    state.within_streak.reshape(-1)[update] = within_streak[judged]
    state.floor_streak.reshape(-1)[update] = floor_streak[judged]
    state.late_streak.reshape(-1)[update] = late_streak[judged]
    state.last_uncertain.reshape(-1)[update] = notice[judged]

    # intermittent stragglers (intermittent.py): tested where the steady rule holds no alert; its
    # alert, once it holds one, supersedes theirs. Slow windows are recorded (a streak broken by a
    # dip is evidence of neither rule otherwise) until a streak ends in an alert: its windows are
    # then that alert's evidence, and the pair's ring starts over, so a rank slow for
    # persist_windows windows in a row is the steady rule's, and not intermittent once it is back
    # the stages a leading stage explains count as under its alert: not tested on their own
    steady_alert = ((alert | onset) & ~recovery) | explained
    comparable = compute & usable  # compute: judged (past warmup) and not a collective
    started = np.flatnonzero(compute & (onset | explained))
    state.intermittent.reset((entries.code[started], entries.slot[started]))
    if not partial:  # a thin window is no evidence for either rule
        state.intermittent.record(config.persist_windows, entries.code, entries.slot, entries.slow_steps,
                                  comparable & ~steady_alert)
    intermittent = judge_intermittent(state.intermittent, entries.code, entries.slot, comparable,
                                      comparable & ~steady_alert,
                                      compute & steady_alert, state.alert, config.false_alarm_rate,
                                      config.persist_windows)
    intermittent_also_slow = _lead_intermittent(cohort.stage_names, state, entries, intermittent,
                                                compute & slow & (entries.code >= 2), clearly_over,
                                                entries.host - host.references.reference)

    context = _VerdictContext(cohort, window, now, entries, host, device, use_device, slowdown)
    # a steady alert that ends as the intermittent one starts is handed over: one straggler verdict
    recovery_said = recovery & ~intermittent.onset
    for entry in np.flatnonzero(onset | recovery_said | uncertain_notice | floor_notice | waiting_notice).tolist():
        if late_onset[entry]:
            record = context.verdict(entry, contract.VERDICT_STRAGGLER, REASON_LAST_TO_ARRIVE,
                                     contract.ATTRIBUTION_UNKNOWN, timing_host=True)
            # slowdown: its time to the collective over its whole-step compute, as its peers see it
            step_ms = step_compute_ms[int(entries.slot[entry])]
            judgement.verdicts.append(dataclasses.replace(record, slowdown=_number(1.0 + lateness[entry] / step_ms),
                                                          also_slow=also_slow.get(entry, ())))
            continue
        if onset[entry]:
            verdict, reason = contract.VERDICT_STRAGGLER, REASON_SLOW_VS_PEERS
        elif recovery_said[entry]:
            verdict, reason = contract.VERDICT_RECOVERED, REASON_WITHIN_TOLERANCE
        elif waiting_notice[entry]:
            verdict, reason = contract.VERDICT_UNCERTAIN, REASON_WAITING_ON_PEER
        else:
            notice_code = uncertain_reason[entry] or floor_reason[entry]
            verdict, reason = contract.VERDICT_UNCERTAIN, _UNCERTAIN_REASONS[notice_code]
        attribution = _attribution(reason, host_flag[entry], device_flag[entry], device_usable[entry])
        record = context.verdict(entry, verdict, reason, attribution)
        if entry in also_slow and onset[entry]:
            record = dataclasses.replace(record, also_slow=also_slow[entry])
        judgement.verdicts.append(record)
    for entry in np.flatnonzero(intermittent.onset | intermittent.recovery).tolist():
        started = bool(intermittent.onset[entry])
        record = context.verdict(entry, contract.VERDICT_STRAGGLER if started else contract.VERDICT_RECOVERED,
                                 REASON_INTERMITTENT if started else REASON_WITHIN_TOLERANCE,
                                 contract.ATTRIBUTION_UNKNOWN, timing_host=True)
        judgement.verdicts.append(dataclasses.replace(record, **_intermittent_evidence(intermittent, entry),
                                                      also_slow=intermittent_also_slow.get(entry, ())))
    return judgement


def _lead_intermittent(stage_names: list, state: CohortVerdictState, entries: _Entries,
                       intermittent, slow_named: np.ndarray, clearly_over: np.ndarray,
                       gap_ms: np.ndarray) -> dict[int, tuple[str, ...]]:
    """_lead for the intermittent rule's onsets: on a rank whose whole step starts an intermittent
    alert, several named stages starting one too are a slowdown spread over the step, said once on
    `*`; one named stage starting one, or any other stage already alerted, explains the whole
    step's, which is then not said. Nor is it said when a named stage of the rank is slow in this
    window by the steady rule (`slow_named`): a slowdown that began in this window or the one
    before, whose stage the steady rule names once it persists (the whole step's evidence can reach
    the intermittent test first, a noisy step of an earlier window counting among its recurrences).
    Where no named stage is slow, one that carries the step's excess (_carrier) takes the whole
    step's onset, with its own evidence. The alerts not said are not kept; their evidence is.
    Returns also_slow per entry."""
    also_slow: dict[int, tuple[str, ...]] = {}
    if not intermittent.onset.any():
        return also_slow
    slots = state.alert.shape[1]
    codes = state.intermittent.alert.shape[0]
    # named stages starting one on a rank whose whole step already holds one (spread): said there
    named_onset = np.flatnonzero(intermittent.onset & (entries.code >= 2))
    whole_starting = set(entries.slot[intermittent.onset & (entries.code == 0)].tolist())
    spread = np.array([entry for entry in named_onset.tolist() if state.intermittent.alert[0, entries.slot[entry]]
                       and int(entries.slot[entry]) not in whole_starting], dtype=np.int64)
    intermittent.onset[spread] = False
    state.intermittent.alert[entries.code[spread], entries.slot[spread]] = False
    whole = np.flatnonzero(intermittent.onset & (entries.code == 0))
    if whole.size == 0:
        return also_slow
    alerted_before = state.alert[2:, :slots].any(axis=0)
    for entry in whole.tolist():
        slot = int(entries.slot[entry])
        named = np.flatnonzero(intermittent.onset & (entries.slot == slot) & (entries.code >= 2))
        names = tuple(stage_names[int(entries.code[other]) // 2] for other in named.tolist())
        other_alert = alerted_before[slot] or state.intermittent.alert[2:codes, slot].sum() > named.size
        steady_under_way = not named.size and bool(slow_named[entries.slot == slot].any())
        carrier = None if named.size or other_alert or steady_under_way else _carrier(
            entries, slot, entries.code == 0, clearly_over, gap_ms)
        if steady_under_way:
            intermittent.onset[entry] = False
            state.intermittent.alert[0, slot] = False
        elif carrier is not None:
            intermittent.onset[entry] = False
            state.intermittent.alert[0, slot] = False
            intermittent.onset[carrier] = True
            state.intermittent.alert[entries.code[carrier], slot] = True
            also_slow[carrier] = (contract.WHOLE_STEP_STAGE,)
        elif named.size >= 2 and not other_alert:
            intermittent.onset[named] = False
            state.intermittent.alert[entries.code[named], slot] = False
            also_slow[entry] = names
        elif named.size or other_alert:
            intermittent.onset[entry] = False
            state.intermittent.alert[0, slot] = False
            for other in named.tolist():
                also_slow[other] = (contract.WHOLE_STEP_STAGE,)
    return also_slow


CONTAINED_SHARE = 0.8  # of a stage's intervals inside another's, for the other to contain it
CONTAINED_SLACK_NS = 20_000  # clock reads a few µs apart at nested starts and stops
CARRIED_SHARE = 0.5  # of the whole step's excess, for a stage within its noise to carry it


def _lead(stage_names: list, entries: _Entries, onset: np.ndarray, late_onset: np.ndarray,
          slow_compute: np.ndarray, late: np.ndarray, held: np.ndarray, clearly_over: np.ndarray,
          lateness: np.ndarray, gap_ms: np.ndarray) -> tuple[np.ndarray, dict[int, tuple[str, ...]], np.ndarray]:
    """(onsets moved to the leading stages, per leading entry the stages it explains, the entries
    explained by a leading stage).

    Of a rank's stages slow in one window (or holding an alert), one explains another when the
    other contains its time (the whole step `*` contains every stage; a stage whose intervals hold
    the first's, nested timers) or follows from it (a collective the rank is last to reach). The
    leading stages are the ones that no other explains: the innermost slow stage; `*` when there is
    none or several unrelated ones are slow (a slowdown spread over the step: `*` names them all);
    else the one collective it is latest to (time that no stage covers). Where `*` is slow and no
    named stage is, a named stage that is `clearly_over` (slower than its peers by the relative
    threshold and the floor, though within its own noise, which a noisy stage widens for windows)
    carries the step's time when it is the only innermost one and holds CARRIED_SHARE of the whole
    step's excess: the whole step's conviction says the rank is slow, the stages' excess says where.
    An onset of a stage that a leading one explains is that leading stage's onset, said once, with
    the others in `also_slow`; none when the leading stage already holds an alert. Only ranks with
    an onset in the window are looked at."""
    also_slow: dict[int, tuple[str, ...]] = {}
    explained_mask = np.zeros(onset.size, dtype=bool)
    candidates = slow_compute | late | held
    onset = onset.copy()
    if not onset.any():
        return onset, also_slow, explained_mask
    for slot in np.unique(entries.slot[onset]).tolist():
        carrier = _carrier(entries, slot, candidates, clearly_over, gap_ms)
        if carrier is not None:
            candidates = candidates.copy()
            candidates[carrier] = True
        slow_here = np.flatnonzero(candidates & (entries.slot == slot))
        if slow_here.size < 2:
            continue
        codes = entries.code[slow_here]
        named = slow_here[((codes & 1) == 0) & (codes > 0)]
        whole = slow_here[codes == 0]
        collectives = slow_here[(codes & 1) == 1]
        contains = {(outer, inner): _contains(entries.rows, slot, int(entries.code[outer]), int(entries.code[inner]))
                    for outer in named.tolist() for inner in named.tolist() if outer != inner}
        leaders = [entry for entry in named.tolist()
                   if not any(contains[(entry, inner)] for inner in named.tolist() if inner != entry)]
        if not leaders or (len(leaders) > 1 and whole.size):
            # none, or several unrelated stages slow at once: a slowdown spread over the step
            leaders = whole.tolist()
        if not leaders:  # only collectives: the one it is latest to, an onset's first
            leaders = [max(collectives.tolist(), key=lambda entry: (late_onset[entry], lateness[entry]))]
        for leader in leaders:
            explained = [entry for entry in slow_here.tolist() if entry != leader and (
                leader in whole or entry in whole or entry in collectives or contains.get((entry, leader), False))]
            if not explained:
                continue
            explained.sort(key=lambda entry: -gap_ms[entry] if np.isfinite(gap_ms[entry]) else 0.0)
            if onset[explained].any() and not held[leader]:
                onset[leader] = True
            onset[explained] = False
            explained_mask[explained] = True
            also_slow[leader] = tuple(stage_names[int(entries.code[entry]) // 2] for entry in explained)
    return onset, also_slow, explained_mask


def _carrier(entries: _Entries, slot: int, candidates: np.ndarray, clearly_over: np.ndarray,
             gap_ms: np.ndarray) -> Optional[int]:
    """The named stage that carries the rank's slow whole step when no named stage is slow (see
    _lead), or None."""
    mine = entries.slot == slot
    codes = entries.code
    whole = np.flatnonzero(mine & candidates & (codes == 0))
    if whole.size == 0 or (mine & candidates & ((codes & 1) == 0) & (codes > 0)).any():
        return None
    over = np.flatnonzero(mine & clearly_over & ((codes & 1) == 0) & (codes > 0)).tolist()
    innermost = [entry for entry in over if not any(
        _contains(entries.rows, slot, int(codes[entry]), int(codes[inner])) for inner in over if inner != entry)]
    if len(innermost) != 1:
        return None
    whole_gap, gap = float(gap_ms[whole[0]]), float(gap_ms[innermost[0]])
    return innermost[0] if np.isfinite(whole_gap) and gap >= CARRIED_SHARE * whole_gap else None


def _contains(rows: _Rows, slot: int, outer_code: int, inner_code: int) -> bool:
    """Whether, in this window, the rank's `outer_code` intervals hold most of its `inner_code` ones
    (same step, start no later, end no earlier)."""
    mine = rows.slot == slot
    outer = mine & (rows.code == outer_code)
    inner = mine & (rows.code == inner_code)
    if not outer.any() or not inner.any():
        return False
    outer_end, inner_end = rows.end_unix_nano[outer], rows.end_unix_nano[inner]
    outer_start = outer_end - (rows.host[outer] * 1e6).astype(np.int64)
    inner_start = inner_end - (rows.host[inner] * 1e6).astype(np.int64)
    held = ((rows.step[inner][:, None] == rows.step[outer][None, :])
            & (outer_start[None, :] <= inner_start[:, None] + CONTAINED_SLACK_NS)
            & (inner_end[:, None] <= outer_end[None, :] + CONTAINED_SLACK_NS)).any(axis=1)
    return bool(np.count_nonzero(held) >= CONTAINED_SHARE * held.size)


def _intermittent_evidence(judgement, entry: int) -> dict:
    """The verdict's numbers for an intermittent straggler: its slow steps over the windows tested
    (count, share, the peers' share), and their mean time against the mean median of the same
    steps (null without slow steps, as at a recovery)."""
    slow, steps = int(judgement.slow[entry]), int(judgement.steps[entry])
    counts = {"slow": slow, "steps": steps, "share": _number(slow / steps if steps else 0.0)}
    peer_share = _number(judgement.peer_share[entry])
    if peer_share is not None:  # null where no peer had steps: an event attribute has no null
        counts["peer_share"] = peer_share
    evidence = {"slow_steps": counts, "rank_ms": None, "reference_ms": None, "gap_ms": None, "slowdown": None}
    if slow:
        rank_ms, reference_ms = float(judgement.slow_ms[entry]), float(judgement.slow_reference_ms[entry])
        evidence.update(rank_ms=_number(rank_ms), reference_ms=_number(reference_ms),
                        gap_ms=_number(rank_ms - reference_ms),
                        slowdown=_number(rank_ms / reference_ms if reference_ms > 0 else math.nan))
    return evidence


def _attribution(reason: str, host_flag: bool, device_flag: bool, device_usable: bool) -> str:
    if reason == REASON_WAITING_ON_PEER:
        return contract.ATTRIBUTION_WAITING
    if reason not in (REASON_SLOW_VS_PEERS, REASON_BELOW_ABSOLUTE_FLOOR) or not (host_flag or device_flag):
        return contract.ATTRIBUTION_UNKNOWN
    if device_flag:
        return contract.ATTRIBUTION_GPU
    return contract.ATTRIBUTION_HOST if device_usable else contract.ATTRIBUTION_UNKNOWN


class _VerdictContext:
    """Builds the few verdict records of one window from its comparison arrays."""

    def __init__(self, cohort, window: int, now: int, entries: _Entries, host: _Comparison,
                 device: _Comparison, use_device: np.ndarray, slowdown: np.ndarray) -> None:
        self.cohort, self.window, self.now, self.entries = cohort, window, now, entries
        self.host, self.device, self.use_device, self.slowdown = host, device, use_device, slowdown
        self.device_row = np.full(entries.code.size, -1, dtype=np.int64)
        self.device_row[device.entries] = np.arange(device.entries.size)

    def verdict(self, entry: int, verdict: str, reason: str, attribution: str, timing_host: bool = False) -> Verdict:
        uses_device = bool(self.use_device[entry]) and not timing_host
        comparison, row = (self.device, int(self.device_row[entry])) if uses_device else (self.host, entry)
        peers = comparison.entries[comparison.references.peers(row)]
        slot = int(self.entries.slot[entry])
        code = int(self.entries.code[entry])
        workload = int(comparison.references.workload[row])
        if reason == REASON_WORKLOAD_INCOMPARABLE:
            workload_comparable: Optional[bool] = False
        elif workload == WORKLOAD_NOT_REPORTED:
            workload_comparable = None
        else:
            workload_comparable = workload == WORKLOAD_COMPARABLE
        reference = float(comparison.references.reference[row])
        rank_ms = float(comparison.median[row])
        return Verdict(
            time_unix_nano=self.now,
            job_id=self.cohort.job_id,
            cohort=self.cohort.name,
            stage=self.cohort.stage_names[code // 2],
            rank=self.cohort.slot_entries[slot].rank,
            window=self.window,
            verdict=verdict,
            reason=reason,
            slowdown=_number(self.slowdown[entry]),
            gap_ms=_number(rank_ms - reference),
            rank_ms=_number(rank_ms),
            reference_ms=_number(reference),
            reference_ranks=tuple(self.cohort.slot_entries[int(s)].rank for s in self.entries.slot[peers]),
            timing=TIMING_DEVICE if uses_device else TIMING_HOST,
            attribution=attribution,
            workload_comparable=workload_comparable,
        )


def _number(value) -> Optional[float]:
    """Verdict numbers: 4 decimals (the medians carry float32 precision); null when not finite."""
    value = float(value)
    return round(value, 4) if math.isfinite(value) else None


def _judge_presence(cohort, window: int, entries: _Entries, config: DetectorConfig, now: int,
                    judgement: WindowJudgement) -> None:
    """Coverage gaps and `silent`: ranks of the cohort that had no rows in this window.

    A rank that misses silent_windows windows in a row falls silent at once (windows stop waiting
    for it), but its verdict waits until its peers' intervals, in the windows judged, end more than
    max_export_lag_s after its own last one: only then is the gap longer than any export delay. A
    rank that has already sent rows of a later window is alive whatever it lacks here (its exporter
    dropped them, as ranks do while a detector is down and a peer's backlog arrives later): a
    coverage gap, never a step towards silence. Ranks that all stop
    together, as torchrun stops the survivors of a crash before their last export, never get
    there, and a new incarnation replaces them without a `silent` verdict (CONTRACT §training.restart.count)."""
    state: CohortVerdictState = cohort.verdict_state
    present = entries.present
    slot_count = present.size
    roster = np.array([entry is not None for entry in cohort.slot_entries], dtype=bool)
    silent = state.silent[:slot_count]
    reported = state.silent_reported[:slot_count]
    missed = state.missed_windows[:slot_count]
    last_end = state.last_end_unix_nano[:slot_count]
    np.maximum(last_end, entries.last_end_unix_nano, out=last_end)
    missing = roster & ~present
    gaps = missing & ~silent
    judgement.coverage_gaps = int(np.count_nonzero(gaps))
    missed[missing] += 1
    missed[present | (cohort.latest_windows(slot_count) > window)] = 0
    fell_silent = gaps & (missed >= config.silent_windows)
    came_back = present & silent
    silent[fell_silent] = True
    silent[came_back] = reported[came_back] = False
    judgement.fell_silent = np.flatnonzero(fell_silent)
    judgement.came_back = np.flatnonzero(came_back)
    # by the judged windows' own rows (not what has arrived since), so that replay agrees with live
    peers_moved_on = int(last_end.max(initial=0)) - last_end > int(config.max_export_lag_s * 1e9)
    confirmed = roster & silent & ~reported & peers_moved_on
    reported[confirmed] = True
    for slot in np.flatnonzero(confirmed).tolist():
        judgement.verdicts.append(Verdict(
            time_unix_nano=now, job_id=cohort.job_id, cohort=cohort.name, stage=contract.WHOLE_STEP_STAGE,
            rank=cohort.slot_entries[slot].rank, window=window, verdict=contract.VERDICT_SILENT,
            reason=REASON_NO_REPORT, slowdown=None, gap_ms=None, rank_ms=None, reference_ms=None,
            reference_ranks=(), timing=TIMING_HOST, attribution=contract.ATTRIBUTION_UNKNOWN,
            workload_comparable=None))


def _judge_pace(cohort, rows, entries: _Entries, config: DetectorConfig, now: int) -> list[Verdict]:
    """`job_slowdown` (job_baseline.py): the cohort's pace against its own baseline."""
    state: CohortVerdictState = cohort.verdict_state
    slot_count = entries.present.size
    tokens_by_slot = np.full(slot_count, np.nan)
    tokens_by_slot[entries.slot] = entries.tokens
    stages = entries.code != 0
    pace = window_pace(rows, cohort.layout, slot_count, tokens_by_slot, entries.present,
                       entries.code[stages], entries.host[stages])
    # a straggler makes every rank wait: its own alert explains the slower steps
    # an intermittent one only for the whole step: slow steps of one stage are too small a share of
    # the step to explain the cohort's pace
    blamed = bool(state.alert.any() or state.intermittent.alert[:1].any() or (state.slow_streak[0::2] > 0).any()
                  or (state.late_streak > 0).any())
    return judge_pace(state.job, pace, blamed, cohort, rows.window, config, now)


def restarted_verdicts(cohort, now: int) -> list[Verdict]:
    """`recovered`/`restarted` for each alert still active in a cohort a new incarnation replaces."""
    state: CohortVerdictState = cohort.verdict_state
    slot_count = len(cohort.slot_entries)
    verdicts = []
    codes = state.alert.shape[0]
    active = state.alert[:, :slot_count] | state.intermittent.alert[:codes, :slot_count]
    for code, slot in zip(*(index.tolist() for index in np.nonzero(active))):
        entry, stage = cohort.slot_entries[slot], cohort.stage_names[code // 2]
        if entry is None or stage is None:
            continue
        verdicts.append(Verdict(
            time_unix_nano=now, job_id=cohort.job_id, cohort=cohort.name, stage=stage, rank=entry.rank,
            window=cohort.latest_judged_window(),
            verdict=contract.VERDICT_RECOVERED, reason=REASON_RESTARTED, slowdown=None, gap_ms=None, rank_ms=None,
            reference_ms=None, reference_ranks=(), timing=TIMING_HOST, attribution=contract.ATTRIBUTION_UNKNOWN,
            workload_comparable=None))
    return verdicts
