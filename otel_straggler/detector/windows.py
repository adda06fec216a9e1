"""Per-cohort window accumulation: which rows belong to which open window, and when a window closes.

A cohort is one (job, topology epoch, cohort) triple: the ranks that are compared with each other.
Window `w` holds steps [w*W, (w+1)*W). Its rows are four flat columns (packed key, host ms, device
ms, tokens) appended on the ingest hot path; all grouping happens once, when the window is judged.

A window closes, at the caller's `advance(now)`, when
- every reporting rank of the cohort has reported a later window (the cohort moved past it), or
- every reporting rank that has not moved past it is overdue: its last new window came longer ago
  than its own delivery gap allows (twice the largest recent gap between its deliveries, plus a
  second; `max_export_lag_s` until it has shown `GAPS_BEFORE_TRUSTED` gaps, and never more: one
  gap says little, as a batch processor's full-batch export just before its scheduled one makes a
  gap of a fraction of its period). Ranks export in bursts (the
  SDK's batch processor waits 5 s by default), so a rank 2-3 windows behind its peers is usually
  one export away, not stuck: the window waits for it, bounded, instead of judging without it, or
- more than half of them have reported a window `window_close_lag` later (a bound in steps), or
- it received no data for `window_grace_s` by the caller's clock, or
- the cohort would exceed `max_open_windows` (the oldest is closed early, counted).
"Reporting" ranks exclude `silent` ones, so a rank that stopped does not hold windows open for long.
None of the first three closes a window in the cohort's first second after its first data (a rank
never seen is not waited for otherwise), or, while fewer ranks have reported than the cohort is known
to have (`expected_ranks`), in its first `max_export_lag_s`.
"""
from __future__ import annotations

import operator
from array import array
from collections import Counter
from typing import Optional

import numpy as np

from otel_straggler.contract import WHOLE_STEP_STAGE
from otel_straggler.detector.cohort_state import CohortVerdictState

NEVER_REPORTED = -(1 << 62)  # a rank's latest window before its first accepted row
SEQ_UNSEEN = -(1 << 63)  # de-duplication slot never written
OUT_OF_ORDER_JUDGED_KEPT = 64  # windows judged while an older one was still open, remembered for `late`
GAPS_BEFORE_TRUSTED = 3  # delivery gaps a rank shows before its own pace sets its patience
# a rank's largest recent delivery gap shrinks by this at each delivery, so it follows a faster exporter
GAP_DECAY = 0.8
DELIVERY_MARGIN_NS = 1_000_000_000  # beyond twice the gap: one transfer and one detector tick
STARTUP_HOLD_NS = 1_000_000_000  # a cohort's windows wait this long after its first data for ranks not seen yet


class RowLayout:
    """How one row's (stage code, slot, step) is packed into one int64 key, shared by the ingest hot
    path and the judge. code = 2 * stage index + collective; stage index 0 is the whole step ("*").
    key = code * (slot_stride * W) + slot * W + (step - window * W)."""

    def __init__(self, window_steps: int, slot_stride: int) -> None:
        self.window_steps = window_steps
        self.slot_stride = slot_stride
        self.code_stride = slot_stride * window_steps
        self.collective_offset = self.code_stride

    def stage_offset(self, stage_index: int) -> int:
        return 2 * stage_index * self.code_stride

    def unpack(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(group = code * slot_stride + slot, code, slot, step offset within the window)."""
        group = keys // self.window_steps
        step_offset = keys - group * self.window_steps
        code = group // self.slot_stride
        return group, code, group - code * self.slot_stride, step_offset


class WindowRows:
    """The rows of one open window, as flat columns."""

    __slots__ = ("window", "keys", "host_ms", "device_ms", "tokens", "end_unix_nano", "rows_noticed",
                 "last_data_unix_nano")

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys = array("q")
        self.host_ms = array("d")
        self.device_ms = array("d")  # nan: no device duration
        self.tokens = array("d")  # 0: not reported
        self.end_unix_nano = array("q")  # the interval's end by the rank's clock: synchronization points
        # rows seen by the last `windows_to_judge` (-1: it never looked), and when it saw the latest
        # come in (read only once it has looked)
        self.rows_noticed = -1
        self.last_data_unix_nano = 0

    def __len__(self) -> int:
        return len(self.keys)

    def has_unnoticed_rows(self) -> bool:
        """Rows came since the last `windows_to_judge` looked (or it never has)."""
        return self.rows_noticed != len(self.keys)

    def repair(self) -> None:
        """After an append failed half way: cut every column to the common length."""
        columns = (self.keys, self.host_ms, self.device_ms, self.tokens, self.end_unix_nano)
        length = min(len(column) for column in columns)
        for column in columns:
            del column[length:]


class RankEntry:
    """One rank of one cohort: where its rows go and which of its sequence numbers were seen."""

    __slots__ = ("job_id", "epoch", "rank", "cohort", "cohort_name", "restart", "slot", "key_slot",
                 "recent_seqs", "latest_window")

    def __init__(self, job_id: str, epoch: int, rank: int, cohort: "Cohort", slot: int,
                 layout: RowLayout, dedup_horizon: int) -> None:
        self.job_id = job_id
        self.epoch = epoch
        self.rank = rank
        self.cohort = cohort
        self.cohort_name = cohort.name
        self.restart = cohort.restart  # a higher count on an observation starts a new incarnation
        self.slot = slot
        self.key_slot = slot * layout.window_steps
        # ring indexed by seq mod horizon, holding the seq last seen there
        self.recent_seqs = array("q", [SEQ_UNSEEN]) * dedup_horizon
        self.latest_window = NEVER_REPORTED

    def forget_seqs(self) -> None:
        # in place: the ingest loop holds a reference to this array
        self.recent_seqs[:] = array("q", [SEQ_UNSEEN]) * len(self.recent_seqs)


class Cohort:
    """Ranks, stage names and open windows of one cohort, all bounded, and its verdict state."""

    def __init__(self, job_id: str, epoch: int, name: str, layout: RowLayout, max_ranks: int,
                 max_stages: int, max_open_windows: int, counts: Counter, now_unix_nano: int,
                 max_export_lag_s: float = 15.0, restart: int = 0, patient_start: bool = False) -> None:
        self.job_id = job_id
        self.epoch = epoch
        self.name = name
        self.restart = restart  # the highest training.restart.count of this incarnation
        self.latest_end_unix_nano = 0  # the latest end of an accepted interval, late ones too: the job's progress
        self.layout = layout
        self.last_active_unix_nano = now_unix_nano
        self._counts = counts
        self._max_ranks = max_ranks
        self._max_stages = max_stages
        self._max_open_windows = max_open_windows
        self.verdict_state = CohortVerdictState()

        self.slot_entries: list[Optional[RankEntry]] = []
        self._entries_by_rank: dict[int, RankEntry] = {}
        self._free_slots: list[int] = []
        self._latest_window_by_slot = np.zeros(0, dtype=np.int64)
        # delivery timing by the caller's clock: when each rank last reached a new window, and its
        # largest recent gap between such deliveries, and how many gaps it has shown (capped)
        self._reached_ns_by_slot = np.zeros(0, dtype=np.int64)
        self._delivery_gap_ns_by_slot = np.zeros(0, dtype=np.int64)
        self._delivery_gaps_seen_by_slot = np.zeros(0, dtype=np.int64)
        self._reached_since_advance: list[int] = []
        self._last_delivery_ns = 0  # when any rank last reached a new window
        self._first_advance_unix_nano: Optional[int] = None
        self._last_advance_unix_nano = 0
        self._max_lag_ns = int(max_export_lag_s * 1e9)
        # a new incarnation (restart > 0) waits as long as any rank may lag: its ranks are known to be
        # coming back, and restarted processes start seconds apart; so does a patient start (replay)
        patient = restart or patient_start
        self._startup_hold_ns = self._max_lag_ns if patient else min(STARTUP_HOLD_NS, self._max_lag_ns)
        # how many ranks the cohort has, where its ranks say (the job's world size, for a cohort in
        # which every rank plays the same role): until that many have reported, its first windows
        # wait as long as a rank may lag, since the ranks not seen yet are known to be coming
        self.expected_ranks: Optional[int] = None
        # closing rule: how many reporting (not silent) ranks have each latest window
        self._ranks_by_latest_window: Counter = Counter()
        self._reporting_ranks = 0

        self.stage_offsets: dict[str, int] = {}  # hot path: stage name -> key offset
        self.stage_names: list[Optional[str]] = [WHOLE_STEP_STAGE]  # by stage index
        self._stage_last_judged = [0]  # by stage index: last window it had rows in, for eviction
        self._free_stage_indices: list[int] = []

        self.open_windows: dict[int, WindowRows] = {}
        self._closed_early: list[WindowRows] = []  # closed by the open-window bound, judged at next advance
        self._judged_below: Optional[int] = None  # every window below this one has been judged
        self._judged_out_of_order: set[int] = set()
        self._windows_version = 0  # bumps whenever a window opens or closes: eviction scans cache on it
        self._nothing_evictable_at = (-1, -1)  # (ranks, stages) versions where a scan found nothing

    # ---- ranks ----
    def add_rank(self, rank: int, dedup_horizon: int) -> tuple[Optional[RankEntry], Optional[RankEntry]]:
        """(its entry, or None when full and nothing is evictable; the entry evicted for it or None).
        A rank that comes back from another cohort gets its old entry back."""
        if rank in self._entries_by_rank:
            return self._entries_by_rank[rank], None
        evicted = None
        if not self._free_slots and len(self.slot_entries) >= self._max_ranks:
            evicted = self._evict_idle_rank()
            if evicted is None:
                return None, None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self.slot_entries)
            self.slot_entries.append(None)
            if slot >= self._latest_window_by_slot.size:
                size = max(16, 2 * self._latest_window_by_slot.size)
                grown = np.full(size, NEVER_REPORTED, dtype=np.int64)
                grown[:self._latest_window_by_slot.size] = self._latest_window_by_slot
                self._latest_window_by_slot = grown
                for name in ("_reached_ns_by_slot", "_delivery_gap_ns_by_slot", "_delivery_gaps_seen_by_slot"):
                    old = getattr(self, name)
                    setattr(self, name, np.concatenate((old, np.zeros(size - old.size, dtype=np.int64))))
            self.verdict_state.ensure(len(self.stage_names), slot + 1)
        entry = RankEntry(self.job_id, self.epoch, rank, self, slot, self.layout, dedup_horizon)
        self.slot_entries[slot] = entry
        self._entries_by_rank[rank] = entry
        self._latest_window_by_slot[slot] = NEVER_REPORTED
        self._reached_ns_by_slot[slot] = self._delivery_gap_ns_by_slot[slot] = 0
        self._delivery_gaps_seen_by_slot[slot] = 0
        self.verdict_state.reset_slot(slot)
        return entry, evicted

    def remove_rank(self, entry: RankEntry) -> None:
        if self._is_reporting(entry):
            self._stop_counting(entry.latest_window)
        self.slot_entries[entry.slot] = None
        del self._entries_by_rank[entry.rank]
        self._latest_window_by_slot[entry.slot] = NEVER_REPORTED
        self.verdict_state.reset_slot(entry.slot)
        self._free_slots.append(entry.slot)

    def slot_of(self, rank: int) -> Optional[int]:
        entry = self._entries_by_rank.get(rank)
        return None if entry is None else entry.slot

    def rank_in(self, slot: int) -> int:
        """The rank that holds `slot`, one with rows in a window being judged: never a free slot."""
        entry = self.slot_entries[slot]
        if entry is None:
            raise LookupError(f"no rank holds slot {slot} of cohort {self.name!r}")
        return entry.rank

    def stage_name(self, index: int) -> str:
        """The name of stage `index`, one with rows in a window being judged: never a freed index."""
        name = self.stage_names[index]
        if name is None:
            raise LookupError(f"no stage has index {index} in cohort {self.name!r}")
        return name

    def stage_index(self, stage: str) -> Optional[int]:
        """The stage's index (0: the whole step), or None when the cohort has not seen it."""
        if stage == WHOLE_STEP_STAGE:
            return 0
        return self.stage_names.index(stage) if stage in self.stage_offsets else None

    def latest_windows(self, slot_count: int) -> np.ndarray:
        """Per slot, the latest window its rank has sent rows for (NEVER_REPORTED: none), a view."""
        return self._latest_window_by_slot[:slot_count]

    def rank_reached(self, entry: RankEntry, window: int) -> None:
        """A rank's first row in a later window than any before (once per rank per window)."""
        if self.verdict_state.silent[entry.slot]:
            self.verdict_state.rejoin(entry.slot)
        elif entry.latest_window != NEVER_REPORTED:
            self._stop_counting(entry.latest_window)
        entry.latest_window = window
        self._latest_window_by_slot[entry.slot] = window
        self._ranks_by_latest_window[window] += 1
        self._reporting_ranks += 1
        self._reached_since_advance.append(entry.slot)

    def rank_restarted(self, entry: RankEntry) -> None:
        """Its sequence numbers started over: a new process, so its warmup starts over too."""
        entry.forget_seqs()
        self.verdict_state.windows_seen[entry.slot] = 0

    def ranks_fell_silent(self, slots: np.ndarray) -> None:
        for slot in slots.tolist():
            entry = self.slot_entries[slot]
            if entry is not None and entry.latest_window != NEVER_REPORTED:
                self._stop_counting(entry.latest_window)

    def ranks_came_back(self, slots: np.ndarray) -> None:
        for slot in slots.tolist():
            entry = self.slot_entries[slot]
            if entry is not None and entry.latest_window != NEVER_REPORTED:
                self._ranks_by_latest_window[entry.latest_window] += 1
                self._reporting_ranks += 1

    def rank_count(self) -> int:
        return len(self.slot_entries) - len(self._free_slots)

    def _is_reporting(self, entry: RankEntry) -> bool:
        return entry.latest_window != NEVER_REPORTED and not self.verdict_state.silent[entry.slot]

    def _stop_counting(self, latest_window: int) -> None:
        self._ranks_by_latest_window[latest_window] -= 1
        if not self._ranks_by_latest_window[latest_window]:
            del self._ranks_by_latest_window[latest_window]
        self._reporting_ranks -= 1

    def _evict_idle_rank(self) -> Optional[RankEntry]:
        """The rank whose latest row is oldest, if it has no rows in any window still to be judged."""
        if self._nothing_evictable_at[0] == self._windows_version:
            return None
        latest = self._latest_window_by_slot[:len(self.slot_entries)]
        slot = int(np.argmin(latest))
        pending = self._pending_windows()
        if pending and latest[slot] >= min(pending):
            self._nothing_evictable_at = (self._windows_version, self._nothing_evictable_at[1])
            return None
        evicted = self.slot_entries[slot]
        if evicted is None:  # a free slot: none while every slot is taken, the one case this is called in
            return None
        self.remove_rank(evicted)
        self._counts["evictions_ranks"] += 1
        return evicted

    # ---- stages ----
    def add_stage(self, stage: str) -> Optional[int]:
        """Key offset of a new stage name; None when the table is full and nothing is evictable."""
        if not self._free_stage_indices and len(self.stage_names) - 1 >= self._max_stages:
            if not self._evict_idle_stage():
                return None
        if self._free_stage_indices:
            index = self._free_stage_indices.pop()
            self.stage_names[index] = stage
        else:
            index = len(self.stage_names)
            self.stage_names.append(stage)
            self._stage_last_judged.append(0)
            self.verdict_state.ensure(len(self.stage_names), len(self.slot_entries))
        self._stage_last_judged[index] = NEVER_REPORTED
        offset = self.layout.stage_offset(index)
        self.stage_offsets[stage] = offset
        return offset

    def stage_seen(self, stage_index: int, window: int) -> None:
        self._stage_last_judged[stage_index] = window

    def _evict_idle_stage(self) -> bool:
        """Frees the least recently judged stage that has no rows in a window still to be judged."""
        if self._nothing_evictable_at[1] == self._windows_version:
            return False
        in_use = set()
        for rows in self._pending_rows():
            if len(rows):
                _, codes, _, _ = self.layout.unpack(np.frombuffer(rows.keys, dtype=np.int64))
                in_use.update((np.unique(codes) // 2).tolist())
        candidates = {index: name for index, name in enumerate(self.stage_names)
                      if index and name is not None and index not in in_use}
        if not candidates:
            self._nothing_evictable_at = (self._nothing_evictable_at[0], self._windows_version)
            return False
        index = min(candidates, key=self._stage_last_judged.__getitem__)
        del self.stage_offsets[candidates[index]]
        self.stage_names[index] = None
        self._free_stage_indices.append(index)
        self.verdict_state.reset_code(2 * index)
        self.verdict_state.reset_code(2 * index + 1)
        self._counts["evictions_stages"] += 1
        return True

    def established(self) -> bool:
        """Judged, or reporting over more than one window: a job at work, not an id sent once."""
        return len(self.open_windows) > 1 or self.latest_judged_window() >= 0

    def latest_judged_window(self) -> int:
        """The highest window judged so far; -1 before the first."""
        return max([(self._judged_below or 0) - 1, *self._judged_out_of_order])

    def collective_stage_names(self) -> set[str]:
        """Stages judged as collectives in a closed window (marked so, or found to end at a
        synchronization point), or marked so in a window still open."""
        indices = set((np.flatnonzero(self.verdict_state.collective_seen) // 2).tolist())
        for rows in self._pending_rows():
            if len(rows):
                _, codes, _, _ = self.layout.unpack(np.frombuffer(rows.keys, dtype=np.int64))
                indices.update((np.unique(codes[(codes & 1) == 1]) // 2).tolist())
        return self._stage_names(indices)

    def sync_point_stage_names(self) -> set[str]:
        """Stages judged as collectives only because they were found to end at a synchronization
        point (the spans do not mark them): evidence from windows past, weaker than a mark."""
        return self._stage_names(set((np.flatnonzero(self.verdict_state.sync_point_seen) // 2).tolist()))

    def _stage_names(self, indices: set[int]) -> set[str]:
        names = self.stage_names
        return {name for index in indices if index < len(names) and (name := names[index]) is not None}

    # ---- windows ----
    def is_judged(self, window: int) -> bool:
        return (self._judged_below is not None and window < self._judged_below) or window in self._judged_out_of_order

    def open_window(self, window: int) -> Optional[WindowRows]:
        """The rows of a window not open yet; None when it was already judged (the row is late)."""
        window = operator.index(window)  # TypeError for a step that is not an integer
        if self.is_judged(window):
            return None
        if len(self.open_windows) >= self._max_open_windows:
            oldest = min(self.open_windows)
            if window < oldest:  # it would be closed at once: the cohort is far past it
                return None
            self._closed_early.append(self._close(oldest))
            self._counts["evictions_windows"] += 1
            if len(self._closed_early) > self._max_open_windows:
                self._closed_early.pop(0)
                self._counts["windows_dropped"] += 1
        rows = WindowRows(window)
        self.open_windows[window] = rows
        self._windows_version += 1
        return rows

    def windows_to_judge(self, now_unix_nano: int, grace_ns: int, close_lag: int,
                         max_rows_per_rank: Optional[int] = None) -> list[WindowRows]:
        """Takes the windows that close now (see the module docstring), oldest first."""
        closing, self._closed_early = self._closed_early, []
        for rows in self.open_windows.values():
            if rows.has_unnoticed_rows():
                rows.rows_noticed = len(rows)
                rows.last_data_unix_nano = now_unix_nano
                self.last_active_unix_nano = now_unix_nano
        self._note_deliveries(now_unix_nano)
        latest = sorted(self._ranks_by_latest_window.items())
        reporting = self._reporting_ranks
        # a bound that grows with the cohort, so an ordinary window of a large one never reaches it
        max_rows = None if max_rows_per_rank is None else max_rows_per_rank * max(1, reporting)
        on_time_from = None  # looked up once, where the first two tests leave it to decide
        # at the start a rank's first export can come up to one export period after another's, and
        # a rank never seen is not waited for: the cohort's first windows wait that long for them
        starting = self._starting(now_unix_nano)
        for window in sorted(self.open_windows):
            moved_past = sum(count for latest_window, count in latest if latest_window > window)
            far_ahead = sum(count for latest_window, count in latest if latest_window >= window + close_lag)
            cohort_moved_on = reporting > 0 and not starting and (moved_past >= reporting or 2 * far_ahead > reporting)
            if reporting > 0 and not starting and not cohort_moved_on and moved_past > 0:
                # the ranks still short of this window are all overdue
                if on_time_from is None:
                    on_time_from = self._lowest_on_time_window(now_unix_nano)
                cohort_moved_on = window < on_time_from
            rows = self.open_windows[window]
            idle = now_unix_nano - rows.last_data_unix_nano >= grace_ns
            # full: a window whose step does not advance while spans keep coming would grow without bound
            full = max_rows is not None and len(rows) >= max_rows
            if cohort_moved_on or idle or full:
                if not (cohort_moved_on or idle):
                    self._counts["windows_closed_full"] += 1
                closing.append(self._close(window))
        return closing

    def next_idle_close_unix_nano(self, grace_ns: int) -> Optional[int]:
        """When the earliest open window goes idle, or the ranks it waits for become overdue, if no
        data comes (None: no open window); 0 when a window waits to be judged now or has rows the
        last `windows_to_judge` did not notice."""
        if self._closed_early:
            return 0
        earliest: Optional[int] = None
        for rows in self.open_windows.values():
            if rows.has_unnoticed_rows():
                return 0
            due = rows.last_data_unix_nano + grace_ns
            earliest = due if earliest is None else min(earliest, due)
        if self.open_windows and self._first_advance_unix_nano is not None:
            hold_ends = self._first_advance_unix_nano + self._hold_ns()
            if hold_ends > self._last_advance_unix_nano:  # held at the last look: look again when it ends
                earliest = hold_ends if earliest is None else min(earliest, hold_ends)
        if self.open_windows and self._reporting_ranks:
            waiting = self._waiting_slots(min(self.open_windows))
            if waiting.size and waiting.size < self._reporting_ranks:
                due = int(np.max(self._reached_ns_by_slot[waiting] + self._patience_ns(waiting))) + 1
                earliest = due if earliest is None else min(earliest, due)
        return earliest

    # ---- delivery lag ----
    def _note_deliveries(self, now_unix_nano: int) -> None:
        """Ranks that reached a new window since the last call delivered at about `now`: their gap
        since the previous delivery updates a decaying maximum (the largest recent gap)."""
        slots, self._reached_since_advance = self._reached_since_advance, []
        if not slots:
            return
        if self._last_delivery_ns and now_unix_nano - self._last_delivery_ns > self._max_lag_ns:
            # The whole cohort was quiet for longer than any rank may lag: a pause every rank took
            # (a checkpoint save), not every rank overdue. They resume together: each one's wait
            # starts now, and the pause is no delivery gap to learn.
            reporting = self._reporting_slots()
            self._reached_ns_by_slot[reporting] = now_unix_nano
            self._last_delivery_ns = now_unix_nano
            return
        self._last_delivery_ns = now_unix_nano
        entries = self.slot_entries
        count = len(entries)
        live = [slot for slot in set(slots) if slot < count and entries[slot] is not None]  # not evicted since
        if not live:
            return
        live_slots = np.array(live, dtype=np.int64)
        previous = self._reached_ns_by_slot[live_slots]
        again = live_slots[previous != 0]  # a rank's later deliveries: one gap each
        gap = np.minimum(np.maximum(now_unix_nano - previous[previous != 0], 0), self._max_lag_ns)
        decayed = (self._delivery_gap_ns_by_slot[again] * GAP_DECAY).astype(np.int64)  # truncated, as int()
        self._delivery_gap_ns_by_slot[again] = np.maximum(gap, decayed)
        seen = self._delivery_gaps_seen_by_slot[again]
        self._delivery_gaps_seen_by_slot[again] = np.where(seen < GAPS_BEFORE_TRUSTED, seen + 1, seen)
        self._reached_ns_by_slot[live_slots] = now_unix_nano

    def delivery_clocks_paused(self, paused_ns: int) -> None:
        """The detector did not look for `paused_ns`: each rank's wait for its next delivery starts
        that much later, so that a detector stall does not make ranks overdue."""
        reached = self._reached_ns_by_slot[:len(self.slot_entries)]
        reached[reached > 0] += paused_ns

    def _starting(self, now_unix_nano: int) -> bool:
        if self._first_advance_unix_nano is None:
            self._first_advance_unix_nano = now_unix_nano
        self._last_advance_unix_nano = now_unix_nano
        return now_unix_nano - self._first_advance_unix_nano < self._hold_ns()

    def _hold_ns(self) -> int:
        """How long the first windows wait after the cohort's first data for ranks not seen yet."""
        if self.expected_ranks is not None and self.rank_count() < self.expected_ranks:
            return self._max_lag_ns
        return self._startup_hold_ns

    def _patience_ns(self, slots: np.ndarray) -> np.ndarray:
        gap = self._delivery_gap_ns_by_slot[slots]
        trusted = self._delivery_gaps_seen_by_slot[slots] >= GAPS_BEFORE_TRUSTED
        return np.where(trusted, np.minimum(2 * gap + DELIVERY_MARGIN_NS, self._max_lag_ns), self._max_lag_ns)

    def _reporting_slots(self) -> np.ndarray:
        count = len(self.slot_entries)
        latest = self._latest_window_by_slot[:count]
        return np.flatnonzero((latest != NEVER_REPORTED) & ~self.verdict_state.silent[:count])

    def _waiting_slots(self, window: int) -> np.ndarray:
        """Reporting (not silent) ranks whose latest window is `window` or earlier."""
        slots = self._reporting_slots()
        return slots[self._latest_window_by_slot[slots] <= window]

    def _lowest_on_time_window(self, now_unix_nano: int) -> int:
        """The lowest latest window among reporting ranks that are not overdue: a window below it
        waits only for overdue ranks. Very large when every rank is overdue."""
        slots = self._reporting_slots()
        on_time = slots[now_unix_nano - self._reached_ns_by_slot[slots] <= self._patience_ns(slots)]
        return int(self._latest_window_by_slot[on_time].min()) if on_time.size else 1 << 62

    def all_windows(self) -> list[WindowRows]:
        """Takes every window still to be judged, oldest first (end of input)."""
        closing, self._closed_early = self._closed_early, []
        closing.extend(self._close(window) for window in sorted(self.open_windows))
        return closing

    def _unfollowed_jump(self, window: int) -> bool:
        """A window far past the judged ones that most of the cohort's ranks have not reached:
        one span with an absurd step, say. Judged all the same, but it does not move the mark
        below which every window counts as judged (to it, which would make every later span of
        the cohort late); a whole cohort moving on (a job resumed further on) does."""
        if self._judged_below is None or window < self._judged_below + self._max_open_windows:
            return False
        reached = sum(count for latest_window, count in self._ranks_by_latest_window.items() if latest_window >= window)
        return 2 * reached <= self._reporting_ranks

    def pending_window_count(self) -> int:
        return len(self.open_windows) + len(self._closed_early)

    def _pending_windows(self) -> list[int]:
        return [rows.window for rows in self._pending_rows()]

    def _pending_rows(self) -> list[WindowRows]:
        return list(self.open_windows.values()) + self._closed_early

    def _close(self, window: int) -> WindowRows:
        rows = self.open_windows.pop(window)
        self._windows_version += 1
        if (not self.open_windows or window < min(self.open_windows)) and not self._unfollowed_jump(window):
            self._judged_below = window + 1 if self._judged_below is None else max(self._judged_below, window + 1)
            while self._judged_below in self._judged_out_of_order:
                self._judged_out_of_order.discard(self._judged_below)
                self._judged_below += 1
        else:
            self._judged_out_of_order.add(window)
            if len(self._judged_out_of_order) > OUT_OF_ORDER_JUDGED_KEPT:
                # bounded memory: forgetting one means a stray row for it would open it again
                self._judged_out_of_order.discard(min(self._judged_out_of_order))
        return rows
