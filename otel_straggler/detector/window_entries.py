"""One closed window's rows reduced to what the judge (judge.py) compares: per (stage code, rank) its
median host and device durations and workload, the whole step's, the collectives' late steps, and
each entry's slow steps for the intermittent rule."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otel_straggler.detector.cohort_state import CohortVerdictState
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.grouped import SMALL_WINDOW_ROWS, dense_groups, grouped_medians, grouped_medians_signed
from otel_straggler.detector.intermittent import CollectiveWaits, SlowSteps, count_slow_steps, workload_classes
from otel_straggler.detector.synchronization_points import SYNC_MIN_RANKS, mark_synchronization_points
from otel_straggler.detector.windows import RowLayout, WindowRows


@dataclass
class Entries:
    """One entry per (stage code, slot) present in the window, sorted by code then slot."""
    code: np.ndarray
    slot: np.ndarray
    host: np.ndarray
    device: np.ndarray  # nan: no device duration
    tokens: np.ndarray  # the slot's tokens per step; nan: not reported
    present: np.ndarray  # bool per slot: the rank had rows in this window
    last_end_unix_nano: np.ndarray  # per slot: its latest interval end in this window (0: none)
    # collective entries: steps in which its wait was under the step's median wait (it arrived
    # later than half of its peers), and steps with enough ranks to tell; 0 elsewhere
    late_steps: np.ndarray
    arrival_steps: np.ndarray
    slow_steps: SlowSteps  # per entry (compute stages and the whole step): its slow steps
    steps: int  # distinct steps in the window
    rows: Rows  # the window's rows, for the few questions asked of single ranks (lead_stages)


@dataclass
class Rows:
    """The window's rows as judged: stage code (collective bit as judged), slot, step offset, host
    ms and end time."""
    code: np.ndarray
    slot: np.ndarray
    step: np.ndarray
    host: np.ndarray
    end_unix_nano: np.ndarray


def window_entries(rows: WindowRows, layout: RowLayout, slot_count: int, state: CohortVerdictState,
                   config: DetectorConfig) -> tuple[Entries, int]:
    keys = np.frombuffer(rows.keys, dtype=np.int64)
    host = np.frombuffer(rows.host_ms, dtype=np.float64)
    device = np.frombuffer(rows.device_ms, dtype=np.float64)
    tokens = np.frombuffer(rows.tokens, dtype=np.float64)
    end_unix_nano = np.frombuffer(rows.end_unix_nano, dtype=np.int64)
    _, code, slot, step_offset = layout.unpack(keys)
    code = mark_synchronization_points(state, code, slot, step_offset, host, end_unix_nano, layout, slot_count)
    has_device = np.isfinite(device) & (device >= 0)
    invalid_device_rows = int(np.count_nonzero(~np.isnan(device) & ~has_device))

    # per (stage, rank, step): the stage's intervals summed (micro-batches, gradient accumulation),
    # device only where every interval has one; then per (stage, rank) the median over steps.
    # Keys repacked over the cohort's slots instead of max_ranks: same order, a range close to the
    # row count, so that grouping them counts into a table (sums_by_bin, dense_groups) instead of sorting
    slot_steps = slot_count * layout.window_steps
    step_bin = slot * layout.window_steps + step_offset
    compact_cells, (cell_host, cell_device, cell_device_missing) = sums_by_bin(
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
    bins, (host_sum, device_sum, device_missing) = sums_by_bin(
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
    token_bins, (token_sum, token_rows) = sums_by_bin(step_bin[reported], tokens[reported],
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
    late_steps, arrival_steps = collective_late_steps(code, slot, step_offset, host, layout, slot_count, entry_codes,
                                                      all_slots)
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
        entry_codes, all_slots, layout.window_steps,
        config.intermittent_threshold, config.min_gap_ms, config.min_cohort_size,
        CollectiveWaits(slot[~compute], step_offset[~compute], host[~compute]))
    return Entries(
        late_steps=late_steps, arrival_steps=arrival_steps, slow_steps=slow_steps,
        code=np.concatenate((np.zeros(whole_slots.size, dtype=np.int64), stage_code)),
        slot=all_slots,
        host=np.concatenate((whole_host, stage_host)),
        device=np.concatenate((whole_device, stage_device)),
        tokens=tokens_by_slot[all_slots],
        present=present,
        last_end_unix_nano=last_end,
        steps=int(np.count_nonzero(np.bincount(step_offset))),  # offsets are in [0, window_steps)
        rows=Rows(code, slot, step_offset, host, end_unix_nano),
    ), invalid_device_rows


def collective_late_steps(code: np.ndarray, slot: np.ndarray, step_offset: np.ndarray, host: np.ndarray,
                          layout: RowLayout, slot_count: int,
                          entry_codes: np.ndarray, entry_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per collective entry (code, slot): the steps in which its wait was under the step's median
    wait, and the steps of its code with at least SYNC_MIN_RANKS ranks."""
    count = entry_codes.size
    late, steps = np.zeros(count, np.int64), np.zeros(count, np.int64)
    rows = ((code & 1) == 1).nonzero()[0]
    if rows.size == 0:
        return late, steps
    step_ids, by_step = dense_groups(code[rows] * layout.window_steps + step_offset[rows])
    ranks_in_step = np.bincount(by_step)
    _, step_median = grouped_medians_signed(by_step, host[rows], step_ids.size)
    enough_in_step = ranks_in_step >= SYNC_MIN_RANKS
    under = enough_in_step[by_step] & (host[rows] < step_median[by_step])
    collective = (entry_codes & 1).nonzero()[0]
    entry_codes = entry_codes[collective]
    # counted into tables over the window's codes and the cohort's slots (a small range), not by
    # np.unique's sort of the pairs
    code_count = int(code[rows].max()) + 1
    late_pairs = np.bincount((code[rows] * slot_count + slot[rows])[under], minlength=code_count * slot_count)
    late[collective] = late_pairs[entry_codes * slot_count + entry_slots[collective]]
    # per code, its (code, step) groups with enough ranks
    steps_per_code = np.bincount(step_ids[enough_in_step] // layout.window_steps, minlength=code_count)
    steps[collective] = steps_per_code[entry_codes]
    return late, steps


def sums_by_bin(bins: np.ndarray, *weights: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the distinct bins, each weight column summed per bin)."""
    if bins.size == 0:
        return bins, [np.zeros(0) for _ in weights]
    if bins.size <= SMALL_WINDOW_ROWS:  # a small window's bins repeat: their grouping is cached
        distinct, index = dense_groups(bins)
        return distinct, [np.bincount(index, weights=column) for column in weights]
    if int(bins.max()) < max(4 * bins.size, 1 << 16):  # dense enough to count directly
        used = np.bincount(bins).nonzero()[0]
        return used, [np.bincount(bins, weights=column)[used] for column in weights]
    distinct, index = dense_groups(bins)
    return distinct, [np.bincount(index, weights=column) for column in weights]
