"""Intermittent stragglers: a rank slow in a sizeable share of its steps, whose window median does
not move (a GPU with correctable-error storms, a periodic host job).

Per window, each rank's time per step of each compute stage (its intervals of the stage in that
step summed) and of the whole step is compared with the median over the ranks of the same step: a
slow step is over it by more than `intermittent_threshold` and by more than `min_gap_ms`, and the
rank was not waiting at that step's collectives over `min_gap_ms` longer than the rank the others
waited for (collective_slack: then its slowness held no one up). Steps with fewer than
`min_cohort_size` ranks do not count. Over the last HORIZON x `persist_windows`
windows a rank's k slow steps of its n are tested against its peers' pooled share p over the same
windows (its own left out, and alerted pairs; floored at 1 / the peers' steps: none among a few
thousand steps does not make the rate zero):

    onset: P(X >= k), X ~ Binomial(n, p), under (false_alarm_rate / comparisons) ** persist_windows,
           comparisons the window's judged (stage, rank) pairs: the budget of the steady rule,
           persist_windows windows in a row each beyond its Bonferroni threshold; k / n at least
           MIN_SHARE; and slow steps in at least persist_windows of those windows (recurring, not
           one burst, which a spike storm or a GC pause is);
    recovery: that tail at RECOVERY_LEVEL or above, or k / n under MIN_SHARE / 2, in a window the
              pair is judged in with steps of its own and its peers' counted (else it holds).

The horizon is longer than persist_windows so that a share of 20-30% in windows of 10 steps, whose
count in any three windows varies a lot, is still found within a few windows; its evidence then
also takes up to the horizon to leave, so recovery comes that much later than the slowdown ends.

Ranks are compared within workload classes (ranks whose tokens per step are within
`work_tolerance`), and only windows in which a rank is judged (past warmup, with usable peers)
count. Heavy-tailed jitter that every rank shares gives every rank the peers' rate and stays quiet;
one spike, or one burst of spikes, is not in persist_windows windows. A rank with a lasting rate of
its own (a slower hardware bin that crosses the threshold now and then, rank 0 doing extra work in
some steps) is intermittent by this rule where it does delay the job in those steps. The steady rule
takes precedence: a pair it holds an alert for is not tested here. The pair's slow
windows are recorded until a streak of them ends in a steady alert: those windows are then that
alert's evidence, the pair's ring is cleared (judge.py), and nothing is recorded while the alert
holds (a rank slow for three windows in a row is not intermittent once it recovers). A streak
that a dip breaks before it alerts stays this rule's evidence, else neither rule would count it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from otel_straggler.detector.grouped import dense_groups, grouped_medians

HORIZON = 2  # windows tested, in persist_windows
MAX_HORIZON_WINDOWS = 16  # ... at most (a large persist_windows does not make the ring deep)
MIN_SHARE = 0.1  # slow steps a rank needs, as a share of its steps, besides the binomial test
RECOVERY_LEVEL = 0.05  # one-sided, uncorrected: the alert holds while the share is still unusual
EXACT_TAIL_STEPS = 1000  # above this many steps the tail is bounded (Chernoff) instead of summed


class IntermittentState:
    """Per (code, slot): slow steps, steps and the slow steps' time and reference, for the last
    `windows` judged windows of a cohort (a ring), and the intermittent alert."""

    def __init__(self) -> None:
        self.windows = 0  # ring length (HORIZON x persist_windows, capped), set at the first window
        # windows recorded so far; per cohort (an array) in states stacked by cohort_state.stack
        self.position: Any = 0
        self.slow = np.zeros((0, 0, 0), dtype=np.int32)
        self.steps = np.zeros((0, 0, 0), dtype=np.int32)
        self.slow_ms = np.zeros((0, 0, 0), dtype=np.float32)  # sum over slow steps of the rank's time
        self.slow_reference_ms = np.zeros((0, 0, 0), dtype=np.float32)  # ... and of the steps' medians
        self.alert = np.zeros((0, 0), dtype=bool)

    def ensure(self, codes: int, slots: int) -> None:
        """At least (codes, slots) room, keeping what is there (CohortVerdictState grows by doubling)."""
        old_codes, old_slots = self.alert.shape
        if codes <= old_codes and slots <= old_slots:
            return
        codes, slots = max(codes, old_codes), max(slots, old_slots)
        for name in ("slow", "steps", "slow_ms", "slow_reference_ms"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], codes, slots), dtype=old.dtype)
            new[:, :old_codes, :old_slots] = old
            setattr(self, name, new)
        alert = np.zeros((codes, slots), dtype=bool)
        alert[:old_codes, :old_slots] = self.alert
        self.alert = alert

    def ensure_ring(self, windows: int) -> None:
        """A ring of `windows` rows: made empty at a cohort's first judged window (or when
        persist_windows changed). An empty ring holds what no ring does: no slow steps."""
        if windows != self.windows:
            codes, slots = self.alert.shape
            for name in ("slow", "steps", "slow_ms", "slow_reference_ms"):
                setattr(self, name, np.zeros((windows, codes, slots), dtype=getattr(self, name).dtype))
            self.windows, self.position = windows, 0

    def reset(self, where) -> None:
        """Forgets pairs: `where` indexes (code, slot)."""
        for name in ("slow", "steps", "slow_ms", "slow_reference_ms"):
            getattr(self, name)[(slice(None),) + where] = 0
        self.alert[where] = False

    def record(self, persist_windows: int, code: np.ndarray, slot: np.ndarray, counts: "SlowSteps",
               counted: np.ndarray, recording: Optional[np.ndarray] = None) -> None:
        """The window's counts per (code, slot) entry become the ring's newest row; entries not
        `counted` (under a steady alert) record nothing. `recording`: for the stacked states of
        several cohorts (cohort_state.stack; their rings made by ensure_ring), which cohorts record
        this window, each in its own ring's next row."""
        if recording is not None:
            self._record_stacked(code, slot, counts, counted, recording)
            return
        windows = ring_length(persist_windows)
        self.ensure_ring(windows)
        row = self.position % windows
        for name in ("slow", "steps", "slow_ms", "slow_reference_ms"):
            target = getattr(self, name)[row]
            target[:] = 0
            target[code[counted], slot[counted]] = getattr(counts, name)[counted]
        self.position += 1

    def _record_stacked(self, code: np.ndarray, slot: np.ndarray, counts: "SlowSteps", counted: np.ndarray,
                        recording: np.ndarray) -> None:
        codes = self.alert.shape[0] // recording.size  # each cohort's
        rows = self.position % self.windows
        recorders = recording.nonzero()[0]
        cleared_rows = np.repeat(rows[recorders], codes)
        cleared_codes = (recorders[:, None] * codes + np.arange(codes)).reshape(-1)
        counted = counted & recording[code // codes]
        entry_rows = rows[code[counted] // codes]
        for name in ("slow", "steps", "slow_ms", "slow_reference_ms"):
            ring = getattr(self, name)
            ring[cleared_rows, cleared_codes] = 0
            ring[entry_rows, code[counted], slot[counted]] = getattr(counts, name)[counted]
        self.position = self.position + recording


def ring_length(persist_windows: int) -> int:
    """Windows an IntermittentState's ring holds."""
    return min(HORIZON * persist_windows, MAX_HORIZON_WINDOWS)


@dataclass
class SlowSteps:
    """Per entry of a window: its slow steps, counted steps, and the slow steps' summed time and
    summed step medians."""
    slow: np.ndarray
    steps: np.ndarray
    slow_ms: np.ndarray
    slow_reference_ms: np.ndarray


def workload_classes(tokens_by_slot: np.ndarray, tolerance: float,
                     slots_per_cohort: Optional[int] = None) -> np.ndarray:
    """Per slot, the class of ranks whose steps are compared with each other: one class while the
    reported workloads (tokens per step) are all within `tolerance` of each other (ranks without
    one among them, as the steady rule compares them); else classes of workloads within
    `tolerance` (log-spaced bins) and one of the ranks without a workload. With
    `slots_per_cohort`, the slots of several cohorts (window_batch.py), classed cohort by cohort
    (a class is compared within a stage code, which is a cohort's)."""
    if slots_per_cohort is not None:
        tokens = tokens_by_slot.reshape(-1, slots_per_cohort)
        by_cohort = np.zeros(tokens.shape, dtype=np.int64)
        reported = np.isfinite(tokens) & (tokens > 0)
        lowest = np.where(reported, tokens, np.inf).min(axis=1)
        highest = np.where(reported, tokens, -np.inf).max(axis=1)
        for cohort in (reported.any(axis=1) & ~(highest <= lowest * (1.0 + tolerance))).nonzero()[0].tolist():
            by_cohort[cohort] = workload_classes(tokens[cohort], tolerance)  # only where workloads differ
        return by_cohort.reshape(-1)
    reported = np.isfinite(tokens_by_slot) & (tokens_by_slot > 0)
    classes = np.zeros(tokens_by_slot.size, dtype=np.int64)
    if not reported.any():
        return classes
    workload = tokens_by_slot[reported]
    if workload.max() <= workload.min() * (1.0 + tolerance):
        return classes
    width = math.log1p(tolerance) if tolerance > 0 else 1e-12
    bins = np.floor(np.log(workload) / width).astype(np.int64)
    classes[reported] = bins - bins.min() + 1  # 0: the ranks without a workload
    return classes


@dataclass
class CollectiveWaits:
    """The window's rows of collective stages: slot, step offset and host ms (the wait included)."""
    slot: np.ndarray
    step: np.ndarray
    ms: np.ndarray


@dataclass
class StepSlack:
    """Per (slot, step) bin, `slot * window_steps + step`, ascending: how much longer the rank
    waited at the step's collectives than the rank of that step that waited least."""
    bins: np.ndarray
    ms: np.ndarray


def collective_slack(waits: CollectiveWaits, window_steps: int, min_ranks: int,
                     slots_per_cohort: Optional[int] = None) -> StepSlack:
    """Each rank's waits at collectives in a step summed, less the least sum among the step's ranks
    (the rank the others waited for). Steps with fewer than `min_ranks` ranks at a collective have
    none. With `slots_per_cohort`, slots of several cohorts (cohort * slots_per_cohort + the
    cohort's slot, window_batch.py): a step's ranks are its cohort's."""
    if waits.slot.size == 0:
        return StepSlack(np.zeros(0, np.int64), np.zeros(0))
    bins, inverse = dense_groups(waits.slot * window_steps + waits.step)
    summed = np.bincount(inverse, weights=waits.ms, minlength=bins.size)
    step_ids = bins % window_steps
    if slots_per_cohort is not None:
        step_ids = step_ids + bins // (slots_per_cohort * window_steps) * window_steps
    steps, by_step = dense_groups(step_ids)
    least = np.full(steps.size, np.inf)
    np.minimum.at(least, by_step, summed)
    enough = np.bincount(by_step, minlength=steps.size)[by_step] >= min_ranks
    return StepSlack(bins[enough], (summed - least[by_step])[enough])


def count_slow_steps(cell_code: np.ndarray, cell_slot: np.ndarray, cell_step: np.ndarray, cell_ms: np.ndarray,
                     slot_class: np.ndarray, entry_code: np.ndarray, entry_slot: np.ndarray, window_steps: int,
                     threshold: float, min_gap_ms: float, min_ranks: int,
                     collectives: Optional[CollectiveWaits] = None,
                     slots_per_cohort: Optional[int] = None) -> SlowSteps:
    """`cell_*`: one value per (code, slot, step), the rank's time in that step; `slot_class`: each
    slot's workload class (workload_classes); entries: (code, slot) pairs sorted by code then slot.
    With `slots_per_cohort`, slots of several cohorts (cohort * slots_per_cohort + the cohort's
    slot), each code one cohort's (window_batch.py).
    Each cell is compared with the median of its (code, step, class); a cell over it is not a slow
    step where the rank waited at that step's `collectives` over `min_gap_ms` longer than the rank
    the others waited for (collective_slack): its slowness held no one up. Returns each entry's counts
    (0 where it has no cells)."""
    count = entry_code.size
    result = SlowSteps(np.zeros(count, np.int32), np.zeros(count, np.int32), np.zeros(count), np.zeros(count))
    finite = np.isfinite(cell_ms)
    if not finite.any():
        return result
    if not finite.all():  # the usual window has none to leave out: four copies of its cells saved
        cell_code, cell_slot, cell_step = cell_code[finite], cell_slot[finite], cell_step[finite]
        cell_ms = cell_ms[finite]
    classes = int(slot_class.max(initial=0)) + 1
    step_key = (cell_code * window_steps + cell_step) * classes + slot_class[cell_slot]
    steps, step_median = grouped_medians(step_key, cell_ms)  # times are >= 0: the packed sort
    by_step = _positions(steps, step_key)
    median = step_median[by_step]
    counted = np.bincount(by_step, minlength=steps.size)[by_step] >= min_ranks
    slow = counted & (cell_ms > median * (1.0 + threshold)) & (cell_ms - median > min_gap_ms)
    if collectives is not None and collectives.slot.size and slow.any():
        slack = collective_slack(collectives, window_steps, min_ranks, slots_per_cohort)
        position = _positions(slack.bins, cell_slot * window_steps + cell_step)
        found = position >= 0  # none at all where no step had min_ranks ranks at a collective
        waited = np.zeros(position.size)
        waited[found] = slack.ms[position[found]]
        slow &= ~(waited > min_gap_ms)
    # each cell's entry (every cell of a compute stage has one), keyed (code, slot within the cohort)
    # over the slots in use, so the keys are dense enough for _positions' table
    if slots_per_cohort is None:
        slots = int(max(entry_slot.max(initial=0), cell_slot.max(initial=0))) + 1
        index = _positions(entry_code * slots + entry_slot, cell_code * slots + cell_slot)
    else:
        index = _positions(entry_code * slots_per_cohort + entry_slot % slots_per_cohort,
                           cell_code * slots_per_cohort + cell_slot % slots_per_cohort)
    has_entry = counted & (index >= 0)
    index, slow = index[has_entry], slow[has_entry]
    result.steps[:] = np.bincount(index, minlength=count)
    if slow.any():
        result.slow[:] = np.bincount(index, weights=slow, minlength=count)
        result.slow_ms[:] = np.bincount(index[slow], weights=cell_ms[has_entry][slow], minlength=count)
        result.slow_reference_ms[:] = np.bincount(index[slow], weights=median[has_entry][slow], minlength=count)
    return result


def _positions(distinct: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each key's index in the ascending `distinct` keys, -1 where absent: a lookup table where the
    keys are dense enough (one gather), else a binary search."""
    if distinct.size == 0:
        return np.full(keys.size, -1, dtype=np.int64)
    span = int(distinct[-1]) + 1
    if span <= 4 * keys.size + 65536 and int(keys.min(initial=0)) >= 0:
        table = np.full(span + 1, -1, dtype=np.int64)
        table[distinct] = np.arange(distinct.size)
        return table[np.minimum(keys, span)]
    position = np.minimum(np.searchsorted(distinct, keys), distinct.size - 1)
    return np.where(distinct[position] == keys, position, -1)


@dataclass
class IntermittentJudgement:
    """Per entry of the window: onset, recovery, and the evidence over the ring (k, n, the peers'
    share, the slow steps' mean time and mean step median)."""
    onset: np.ndarray
    recovery: np.ndarray
    slow: np.ndarray
    steps: np.ndarray
    peer_share: np.ndarray
    slow_ms: np.ndarray
    slow_reference_ms: np.ndarray


def judge_intermittent(state: IntermittentState, code: np.ndarray, slot: np.ndarray, judged: np.ndarray,
                       tested: np.ndarray, superseded: np.ndarray, steady_alert: np.ndarray,
                       false_alarm_rate: float, persist_windows: int,
                       cohort: Optional[np.ndarray] = None, cohorts: int = 1) -> IntermittentJudgement:
    """After `record`: per entry (code, slot), onset among the `tested` pairs and recovery among
    the `judged` ones (compute pairs past warmup with usable peers: the comparisons of the window)
    with an intermittent alert; an alert is cleared without a verdict where `superseded` (the steady
    rule took over) and held where the window gives no evidence. `steady_alert`: the steady rule's
    alerts per (code, slot). Updates the alert state. `cohort`: each entry's cohort, for the stacked
    states of `cohorts` cohorts (cohort_state.stack): comparisons are counted per cohort."""
    slow_by_pair = state.slow.sum(axis=0, dtype=np.int64)
    if not slow_by_pair.any() and not state.alert.any():  # the usual window: nothing to test
        nothing = np.zeros(code.size, dtype=bool)
        return IntermittentJudgement(nothing, nothing, *(np.zeros(code.size) for _ in range(5)))
    steps_by_pair = state.steps.sum(axis=0, dtype=np.int64)
    k = slow_by_pair[code, slot]
    n = steps_by_pair[code, slot]
    # the peers' pool leaves out pairs already alerted: a straggler's slow steps are not the rate
    # healthy ranks show
    codes, slots = state.alert.shape
    pooled = ~(state.alert | steady_alert[:codes, :slots])
    own = pooled[code, slot]
    peer_k = np.where(pooled, slow_by_pair, 0).sum(axis=1)[code] - np.where(own, k, 0)
    peer_n = np.where(pooled, steps_by_pair, 0).sum(axis=1)[code] - np.where(own, n, 0)
    with np.errstate(all="ignore"):
        share = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        peer_share = np.where(peer_n > 0, peer_k / np.maximum(peer_n, 1), np.nan)
        rate = np.fmax(peer_share, 1.0 / np.maximum(peer_n, 1))
    recurring = (state.slow[:, code, slot] > 0).sum(axis=0) >= min(persist_windows, state.windows)
    alert = state.alert[code, slot]
    candidates = (tested & ~alert & recurring & (share >= MIN_SHARE) & (peer_n > 0)).nonzero()[0]
    onset = np.zeros(code.size, dtype=bool)
    if cohort is None:
        comparisons = max(1, int(np.count_nonzero(judged)))
        onset[candidates] = tails_below(k[candidates], n[candidates], rate[candidates],
                                        (false_alarm_rate / comparisons) ** persist_windows)
    elif candidates.size:
        levels = [(false_alarm_rate / max(1, count)) ** persist_windows
                  for count in np.bincount(cohort[judged], minlength=cohorts).tolist()]
        of = cohort[candidates]
        onset[candidates] = tails_below(k[candidates], n[candidates], rate[candidates], np.array(levels)[of],
                                        np.array([math.log(level) for level in levels])[of])
    recovery = np.zeros(code.size, dtype=bool)
    # with no steps of its own or of its peers counted the window says nothing: the alert holds
    for entry in (alert & judged & ~superseded & (n > 0) & (peer_n > 0)).nonzero()[0].tolist():
        recovery[entry] = (share[entry] < MIN_SHARE / 2 or
                           binomial_tail(int(k[entry]), int(n[entry]), float(rate[entry])) >= RECOVERY_LEVEL)
    state.alert[code, slot] = (alert | onset) & ~recovery & ~superseded
    # the slow steps' mean time and median, for the few verdicts only
    said = (onset | recovery).nonzero()[0]
    slow_ms, slow_reference_ms = np.zeros(code.size), np.zeros(code.size)
    slow_ms[said] = state.slow_ms[:, code[said], slot[said]].sum(axis=0) / np.maximum(k[said], 1)
    slow_reference_ms[said] = state.slow_reference_ms[:, code[said], slot[said]].sum(axis=0) / np.maximum(k[said], 1)
    return IntermittentJudgement(onset, recovery, k, n, peer_share, slow_ms, slow_reference_ms)


def tails_below(k: np.ndarray, n: np.ndarray, p: np.ndarray, level, log_level=None) -> np.ndarray:
    """binomial_tail(k, n, p) < level per element, without summing where it is decided anyway: the
    Chernoff bound under the level is below it, and a probability of k itself (a part of the tail)
    at the level or above is not. Heavy jitter makes every rank a candidate; few remain. `level`:
    one, or one per element with its log in `log_level`."""
    if k.size == 0:
        return np.zeros(0, dtype=bool)
    k, n = k.astype(np.float64), n.astype(np.float64)
    p = np.clip(p, 1e-300, 1.0)
    bound = _chernoff_bound(k, n, p)
    with np.errstate(all="ignore"):
        log_pmf = (_log_factorial(n) - _log_factorial(k) - _log_factorial(n - k) + k * np.log(p)
                   + (n - k) * np.log1p(-p))
    below = (bound < level) & (k <= n)
    undecided = ~below & (n <= EXACT_TAIL_STEPS) & (k <= n) & (
        log_pmf < (math.log(level) if log_level is None else log_level) + 1e-9)
    for entry in undecided.nonzero()[0].tolist():
        below[entry] = binomial_tail(int(k[entry]), int(n[entry]), float(p[entry])) < (
            level if log_level is None else level[entry])
    return below


def _chernoff_bound(k: np.ndarray, n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """exp(-n KL(k/n || p)) where k/n > p, else 1: never under P(X >= k), X ~ Binomial(n, p)."""
    with np.errstate(all="ignore"):
        share = k / n
        log_ratio = np.where(share > 0, share * np.log(share / p), 0.0)
        log_rest = np.where(share < 1, (1 - share) * np.log((1 - share) / (1 - p)), 0.0)
        return np.where(share > p, np.exp(-n * (log_ratio + log_rest)), 1.0)


def _log_factorial(x: np.ndarray) -> np.ndarray:
    """log(x!) per element (exact to float precision for integers; Stirling's series past 256)."""
    x = np.asarray(x, dtype=np.float64)
    table = _LOG_FACTORIALS
    small = x < table.size
    large = np.where(small, 1.0, x)
    stirling = (large + 0.5) * np.log(large) - large + 0.5 * math.log(2 * math.pi) + 1.0 / (12 * large)
    return np.where(small, table[np.minimum(x, table.size - 1).astype(np.int64)], stirling)


_LOG_FACTORIALS = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, 257, dtype=np.float64)))))


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): summed exactly up to EXACT_TAIL_STEPS steps, above that the
    Chernoff bound exp(-n KL(k/n || p)), which is never under the exact tail (no extra alerts)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    p = min(max(p, 1e-300), 1.0)
    if p >= 1.0:
        return 1.0
    if n > EXACT_TAIL_STEPS:
        return float(_chernoff_bound(np.float64(k), np.float64(n), np.float64(p)))
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n = math.lgamma(n + 1)
    total = 0.0
    for i in range(k, n + 1):
        term = math.exp(log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
        total += term
        if term < total * 1e-17:  # rising terms never are: the sum stops only in the shrinking tail
            break
    return min(total, 1.0)
