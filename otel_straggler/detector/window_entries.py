"""One closed window's rows reduced to what the judge (judge.py) compares: per (stage code, rank) its
median host and device durations and workload, the whole step's, the collectives' late steps, and
each entry's slow steps for the intermittent rule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.grouped import SMALL_WINDOW_ROWS, dense_groups, grouped_medians, grouped_medians_signed
from otel_straggler.detector.intermittent import CollectiveWaits, SlowSteps, count_slow_steps, workload_classes
from otel_straggler.detector.synchronization_points import SYNC_MIN_RANKS, mark_synchronization_points
from otel_straggler.detector.window_batch import WindowBatch


@dataclass
class Entries:
    """One entry per (stage code, slot) present in the window, sorted by code then slot. Codes and
    slots are the batch's (window_batch.py): a cohort's own where it is judged alone."""
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
    steps: np.ndarray  # per cohort: distinct steps in its window
    rows: Rows  # the window's rows, for the few questions asked of single ranks (lead_stages)
    local_code: np.ndarray  # the code within its cohort (0: the whole step)
    local_slot: np.ndarray  # the slot within its cohort
    pair: np.ndarray  # index of its (code, slot) into the state's per-(code, slot) arrays, flattened
    cohort: np.ndarray  # which cohort of the batch (0 for a cohort judged alone)
    starts: np.ndarray  # where each cohort's entries start (and, last, end): they come cohort by cohort
    row_starts: np.ndarray  # where each cohort's rows start (and, last, end)
    slots_per_cohort: int

    def rows_of_cohort(self, slot: int) -> "Rows":
        """The rows of the cohort of `slot` (a slot of the batch): a rank's rows are among them."""
        index = slot // self.slots_per_cohort if self.row_starts.size > 2 else 0
        start, stop = int(self.row_starts[index]), int(self.row_starts[index + 1])
        rows = self.rows
        if start == 0 and stop == rows.code.size:
            return rows
        return Rows(rows.code[start:stop], rows.slot[start:stop], rows.step[start:stop], rows.host[start:stop],
                    rows.end_unix_nano[start:stop])


@dataclass
class Rows:
    """The window's rows as judged: stage code (collective bit as judged), slot, step offset, host
    ms and end time."""
    code: np.ndarray
    slot: np.ndarray
    step: np.ndarray
    host: np.ndarray
    end_unix_nano: np.ndarray


def window_entries(batch: WindowBatch, config: DetectorConfig) -> tuple[Entries, list[int]]:
    """The batch's entries, and per cohort its rows with an invalid device duration."""
    state = batch.state
    window_steps, slots, codes = batch.window_steps, batch.slots_per_cohort, batch.codes_per_cohort
    slot_count = batch.slot_count
    host, device, tokens, end_unix_nano = batch.host, batch.device, batch.tokens, batch.end_unix_nano
    slot, local_slot, step_offset = batch.slot, batch.local_slot, batch.step_offset
    code = mark_synchronization_points(state, batch.code, local_slot, step_offset, host, end_unix_nano, window_steps,
                                       slots, None if batch.size == 1 else batch.row_starts)
    has_device = np.isfinite(device) & (device >= 0)
    invalid_device_rows = batch.per_cohort_rows(~np.isnan(device) & ~has_device)

    # per (stage, rank, step): the stage's intervals summed (micro-batches, gradient accumulation),
    # device only where every interval has one; then per (stage, rank) the median over steps.
    # Keyed over the cohorts' slots instead of max_ranks: same order, a range close to the row
    # count, so that grouping them counts into a table (sums_by_bin, dense_groups) instead of sorting
    slot_steps = slots * window_steps
    cells, (cell_host, cell_device, cell_device_missing) = sums_by_bin(
        code * slot_steps + local_slot * window_steps + step_offset, host, np.where(has_device, device, 0.0),
        (~has_device).astype(np.float64), stride=slot_steps)
    cell_groups = cells // window_steps  # code * slots + slot within the cohort
    stage_groups, stage_host = grouped_medians(cell_groups, cell_host)
    complete_cells = cell_device_missing == 0
    device_groups, device_medians = grouped_medians(cell_groups[complete_cells], cell_device[complete_cells])
    stage_device = np.full(stage_groups.size, np.nan)
    stage_device[np.searchsorted(stage_groups, device_groups)] = device_medians

    # whole step: per (slot, step) sums of the non-collective intervals, then per-slot medians
    step_bin = slot * window_steps + step_offset
    compute = (code & 1) == 0
    bins, (host_sum, device_sum, device_missing) = sums_by_bin(
        step_bin[compute], host[compute], np.where(has_device, device, 0.0)[compute],
        (~has_device[compute]).astype(np.float64))
    whole_slots, whole_host = grouped_medians(bins // window_steps, host_sum)
    complete = device_missing == 0
    whole_device_slots, whole_device_medians = grouped_medians(bins[complete] // window_steps,
                                                               device_sum[complete])
    whole_device = np.full(whole_slots.size, np.nan)
    whole_device[np.searchsorted(whole_slots, whole_device_slots)] = whole_device_medians

    # workload: tokens per (slot, step) averaged over the step's rows that carry it, per-slot median
    reported = np.isfinite(tokens) & (tokens > 0)
    token_bins, (token_sum, token_rows) = sums_by_bin(step_bin[reported], tokens[reported],
                                                       np.ones(int(np.count_nonzero(reported))))
    token_slots, token_medians = grouped_medians(token_bins // window_steps, token_sum / token_rows)
    tokens_by_slot = np.full(slot_count, np.nan)
    tokens_by_slot[token_slots] = np.where(np.isfinite(token_medians), token_medians, np.nan)

    stage_code = stage_groups // slots
    stage_local_slot = stage_groups - stage_code * slots
    whole_cohort = whole_slots // slots
    entry_code = np.concatenate((whole_cohort * codes, stage_code))
    entry_local_slot = np.concatenate((whole_slots - whole_cohort * slots, stage_local_slot))
    entry_slot = np.concatenate((whole_slots, stage_code // codes * slots + stage_local_slot))
    entry_host = np.concatenate((whole_host, stage_host))
    entry_device = np.concatenate((whole_device, stage_device))
    pair = entry_code * slots + entry_local_slot
    if batch.size > 1:  # cohort by cohort, each as it would be alone: its whole step first
        order = np.argsort(pair)
        entry_code, entry_local_slot, entry_slot = entry_code[order], entry_local_slot[order], entry_slot[order]
        entry_host, entry_device, pair = entry_host[order], entry_device[order], pair[order]
    present = np.zeros(slot_count, dtype=bool)
    present[slot] = True
    last_end = np.zeros(slot_count, dtype=np.int64)
    np.maximum.at(last_end, slot, end_unix_nano)
    late_steps, arrival_steps = collective_late_steps(code, local_slot, step_offset, host, window_steps, slots,
                                                      entry_code, pair)
    # per (stage, rank, step) time of the compute stages, and the whole step's sums, for intermittent.py
    cell_code = cells // slot_steps
    cell_step = cells % window_steps
    cell_slot = cell_code // codes * slots + (cell_groups - cell_code * slots)
    compute_cells = ((cell_code & 1) == 0) & (cell_code % codes > 0)
    cell_code, cell_slot, cell_step = cell_code[compute_cells], cell_slot[compute_cells], cell_step[compute_cells]
    stage_cell_ms = cell_host[compute_cells]
    bin_slots = bins // window_steps
    slow_steps = count_slow_steps(
        np.concatenate((bin_slots // slots * codes, cell_code)),
        np.concatenate((bin_slots, cell_slot)),
        np.concatenate((bins % window_steps, cell_step)),
        np.concatenate((host_sum, stage_cell_ms)),
        workload_classes(tokens_by_slot, config.work_tolerance, slots if batch.size > 1 else None),
        entry_code, entry_slot, window_steps,
        config.intermittent_threshold, config.min_gap_ms, config.min_cohort_size,
        CollectiveWaits(slot[~compute], step_offset[~compute], host[~compute]), None if batch.size == 1 else slots)
    entry_cohort = batch.cohort_of_codes(entry_code)
    return Entries(
        late_steps=late_steps, arrival_steps=arrival_steps, slow_steps=slow_steps,
        code=entry_code,
        slot=entry_slot,
        host=entry_host,
        device=entry_device,
        tokens=tokens_by_slot[entry_slot],
        present=present,
        last_end_unix_nano=last_end,
        steps=batch.steps_per_cohort(),
        rows=Rows(code, slot, step_offset, host, end_unix_nano),
        local_code=entry_code - entry_cohort * codes,
        local_slot=entry_local_slot,
        pair=pair,
        cohort=entry_cohort,
        starts=np.searchsorted(entry_cohort, np.arange(batch.size + 1)),
        row_starts=batch.row_starts,
        slots_per_cohort=slots,
    ), invalid_device_rows


def collective_late_steps(code: np.ndarray, slot: np.ndarray, step_offset: np.ndarray, host: np.ndarray,
                          window_steps: int, slot_count: int,
                          entry_codes: np.ndarray, entry_pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per collective entry (code, slot): the steps in which its wait was under the step's median
    wait, and the steps of its code with at least SYNC_MIN_RANKS ranks. `slot`: each row's slot
    within its code's cohort, below `slot_count`; `entry_pairs`: code * slot_count + that slot."""
    count = entry_codes.size
    late, steps = np.zeros(count, np.int64), np.zeros(count, np.int64)
    rows = ((code & 1) == 1).nonzero()[0]
    if rows.size == 0:
        return late, steps
    step_ids, by_step = dense_groups(code[rows] * window_steps + step_offset[rows])
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
    late[collective] = late_pairs[entry_pairs[collective]]
    # per code, its (code, step) groups with enough ranks
    steps_per_code = np.bincount(step_ids[enough_in_step] // window_steps, minlength=code_count)
    steps[collective] = steps_per_code[entry_codes]
    return late, steps


def sums_by_bin(bins: np.ndarray, *weights: np.ndarray,
                stride: Optional[int] = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the distinct bins, each weight column summed per bin); stride: as dense_groups'."""
    if bins.size == 0:
        return bins, [np.zeros(0) for _ in weights]
    if bins.size <= SMALL_WINDOW_ROWS:  # a small window's bins repeat: their grouping is cached
        distinct, index = dense_groups(bins, stride)
        return distinct, [np.bincount(index, weights=column) for column in weights]
    if int(bins.max()) < max(4 * bins.size, 1 << 16):  # dense enough to count directly
        used = np.bincount(bins).nonzero()[0]
        return used, [np.bincount(bins, weights=column)[used] for column in weights]
    distinct, index = dense_groups(bins, stride)
    return distinct, [np.bincount(index, weights=column) for column in weights]
