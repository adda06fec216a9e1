"""Stages that end at a synchronization point (a collective hidden inside, such as DDP's all-reduce
inside backward), found from the ranks' start and end times and judged as collectives (judge.py)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from otel_straggler.detector.cohort_state import CohortVerdictState
from otel_straggler.detector.grouped import cached_structure, dense_groups, grouped_medians_signed

SYNC_SLOPE_LIMIT = 0.5  # halfway between a synchronized end (slope 0) and a free one (slope 1)
SYNC_SMOOTHING = 0.3  # weight of each window's slope in the smoothed one
SYNC_MIN_RANKS = 3  # ranks with the same (stage, step) for its deviations to count
SYNC_MIN_STEPS = 3
SYNC_MIN_START_SPREAD_MS = 0.1  # rms start deviation below which the ends say nothing


def mark_synchronization_points(state: CohortVerdictState, code: np.ndarray, slot: np.ndarray,
                                step_offset: np.ndarray, host: np.ndarray, end_unix_nano: np.ndarray, window_steps: int,
                                slot_count: int, row_starts: Optional[np.ndarray] = None) -> np.ndarray:
    """`code` with the collective bit set on the rows of stages that end at a synchronization point
    (a collective hidden inside, such as DDP's all-reduce inside backward), judged as collectives.

    A collective ends at the same instant on every rank of its group, so across ranks the end of
    such a stage does not follow its start: per (stage, step), each rank's start and end deviate
    from the ranks' medians; each rank's own median deviation over the window's steps is removed
    (a clock offset, or a rank that is consistently later); the slope of the end deviations on the
    start deviations is near 0 at a synchronization point and near 1 for a stage each rank runs on
    its own. The slope is smoothed over windows and compared with SYNC_SLOPE_LIMIT.
    `slot`: a rank's slot within its stage code's cohort (below `slot_count`); `row_starts`: where each
    cohort's rows start, for windows of several cohorts judged at once (window_batch.py)."""
    stage_rows = ((code & 1) == 0) & (code > 0)
    if not stage_rows.any():
        return code
    end_ms = (end_unix_nano[stage_rows] - _earliest_end(end_unix_nano, stage_rows, row_starts)) / 1e6
    start_ms = end_ms - host[stage_rows]
    # one cell per (stage, rank, step): its last interval, the one a synchronization point would
    # end (of several micro-batches, only the one that synchronizes does)
    # cells keyed over the cohort's slots: (code * slot_count + slot) * window_steps + step offset
    cell_keys = (code[stage_rows] * slot_count + slot[stage_rows]) * window_steps + step_offset[stage_rows]
    plan = cached_structure("sync cells", cell_keys, lambda: _cell_plan(cell_keys, window_steps, slot_count),
                            window_steps, slot_count)
    cells, index, last = plan[:3]
    finite = np.isfinite(end_ms) & np.isfinite(start_ms)
    if cells.size != index.size:  # micro-batches: per cell, its row with the latest end
        order = np.lexsort((np.where(finite, end_ms, -np.inf), index))
        last = order[np.r_[index[order][1:] != index[order][:-1], True]]
    cell_end = np.where(finite[last], end_ms[last], np.inf)
    cell_start = np.where(finite[last], start_ms[last], np.inf)
    usable = np.isfinite(cell_start) & np.isfinite(cell_end)
    if usable.all():  # the usual window: its groups are the cached ones
        by_step, step_count, enough, by_rank, rank_count, codes, by_code, cells_per_code = plan[6:]
    else:
        cell_code, cell_slot, cell_step = (column[usable] for column in plan[3:6])
        cell_start, cell_end = cell_start[usable], cell_end[usable]
        by_step, step_count, enough, by_rank, rank_count, codes, by_code, cells_per_code = _cell_groups(
            cell_code, cell_slot, cell_step, window_steps, slot_count)
    # deviations from the ranks' medians of the same (stage, step), where enough ranks have it
    _, median_end = grouped_medians_signed(by_step, cell_end, int(step_count))
    _, median_start = grouped_medians_signed(by_step, cell_start, int(step_count))
    end_dev = (cell_end - median_end[by_step])[enough]
    start_dev = (cell_start - median_start[by_step])[enough]
    # each rank's own offset over the window removed
    _, rank_end = grouped_medians_signed(by_rank, end_dev, int(rank_count))
    _, rank_start = grouped_medians_signed(by_rank, start_dev, int(rank_count))
    end_dev = end_dev - rank_end[by_rank]
    start_dev = start_dev - rank_start[by_rank]
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
    state.sync_point_seen |= synchronized  # for hangs: a stage found to synchronize, not marked so
    marked = stage_rows & synchronized[np.minimum(code, synchronized.size - 1)]
    return np.where(marked, code | 1, code)


def _earliest_end(end_unix_nano: np.ndarray, stage_rows: np.ndarray, row_starts: Optional[np.ndarray]):
    """The origin of the stage rows' times: the earliest end of the cohort's stage rows, per row."""
    if row_starts is None:
        return end_unix_nano[stage_rows].min()
    earliest = np.minimum.reduceat(np.where(stage_rows, end_unix_nano, np.iinfo(np.int64).max), row_starts[:-1])
    return np.repeat(earliest, np.diff(row_starts))[stage_rows]


def _cell_plan(cell_keys: np.ndarray, window_steps: int, slot_count: int) -> tuple:
    """What depends on a window's stage rows' (stage, rank, step) keys alone: the cells and each
    row's cell, each cell's row where it has one only, the cells' code, slot and step, and their
    groups (_cell_groups) where every cell is usable."""
    cells, index = dense_groups(cell_keys, slot_count * window_steps)
    last = np.zeros(0, dtype=np.int64)
    if cells.size == index.size:  # one interval per cell (no micro-batches): it is the last
        last = np.empty_like(index)
        last[index] = np.arange(index.size)
    cell_group = cells // window_steps
    cell_step = cells - cell_group * window_steps
    cell_code = cell_group // slot_count
    cell_slot = cell_group - cell_code * slot_count
    return (cells, index, last, cell_code, cell_slot, cell_step) + _cell_groups(
        cell_code, cell_slot, cell_step, window_steps, slot_count)


def _cell_groups(cell_code: np.ndarray, cell_slot: np.ndarray, cell_step: np.ndarray, window_steps: int,
                 slot_count: int) -> tuple:
    """Cells by (stage, step): each cell's group, the group count, and whether its group has
    SYNC_MIN_RANKS ranks; those cells by rank: group, count; by code: the codes, group, cells."""
    step_ids, by_step = dense_groups(cell_code * window_steps + cell_step, window_steps)
    enough = np.bincount(by_step)[by_step] >= SYNC_MIN_RANKS
    cell_code, cell_slot = cell_code[enough], cell_slot[enough]
    rank_ids, by_rank = dense_groups(cell_code * slot_count + cell_slot, slot_count)
    codes, by_code = dense_groups(cell_code)
    cells_per_code = np.bincount(by_code, minlength=codes.size)
    return (by_step, np.array(step_ids.size), enough, by_rank, np.array(rank_ids.size), codes, by_code,
            cells_per_code)
