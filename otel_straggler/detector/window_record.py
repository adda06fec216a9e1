"""windows.jsonl: every judged window's median stage duration per rank, for the report's heat map
and rank timelines and for the demo's live view. Off with `record_windows`; bounded by
`max_window_record_bytes`.

The engine thread does next to nothing: the engine hands each window it is about to judge to
`WindowRecord.judged` (its `windows_judged` listener), which queues the window's rows (closed, so
nothing appends to them any more) with the cohort's stage names and ranks of that moment. A writer
thread of its own wakes every flush interval, computes the medians with numpy and appends one line
per (rank, stage), so the ingest path pays for neither the statistics nor the disk.

Each line is a `WindowMedian`, the statistic the judge compares: per step the rank's intervals of
the stage summed (micro-batches), then the median over the window's steps, of host durations and,
where the rank measured them in every interval of a step, of device durations. Stage `*` is the
whole step: per step the sum of the rank's non-collective intervals, then the median (the judge
also treats a stage that ends at a synchronization point as a collective, so its `*` can be a
little shorter). Every window not written whole is counted in status.json (`windows.windows_dropped`) by
reason: `queue_full` (more than MAX_PENDING_ROWS rows waiting), `file_full`, `write_failed`, `error`;
a listener that failed is counted under `windows.errors`. Not recorded: the last windows of an
incarnation that a restart superseded (judged as it is retired).
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.periodic_writer import PeriodicWriter
from otel_straggler.detector.evidence import WINDOWS_FILE, JsonLinesFile
from otel_straggler.detector.grouped import grouped_medians

_log = logging.getLogger(__name__)
# rows of judged windows waiting for the writer (40 bytes each, which the engine would have freed
# once judged): about a flush interval of a very large job; beyond it a window is counted and dropped
MAX_PENDING_ROWS = 4_000_000
NO_RANK = -1


@dataclass(frozen=True)
class WindowMedian:
    """One line of windows.jsonl: a rank's median duration of one stage over one window."""

    job_id: str
    cohort: str
    rank: int
    stage: str
    window: int
    median_ms: float
    steps: int  # the steps the median is over
    collective: bool
    device_ms: Optional[float] = None  # the median device duration, where the rank measured it

    def to_dict(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies every field, 5x the cost of the whole line
        record = {"job_id": self.job_id, "cohort": self.cohort, "rank": self.rank, "stage": self.stage,
                  "window": self.window, "median_ms": self.median_ms, "steps": self.steps,
                  "collective": self.collective}
        if self.device_ms is not None:  # most ranks measure none: the line stays short
            record["device_ms"] = self.device_ms
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Optional["WindowMedian"]:
        """The record's median, or None for a record that is not one."""
        try:
            device_ms = record.get("device_ms")
            median = cls(
                job_id=str(record["job_id"]), cohort=str(record.get("cohort", "")), rank=int(record["rank"]),
                stage=str(record["stage"]), window=int(record["window"]), median_ms=float(record["median_ms"]),
                steps=int(record.get("steps", 0)), collective=bool(record.get("collective", False)),
                device_ms=None if device_ms is None else float(device_ms),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if not math.isfinite(median.median_ms) or (
                median.device_ms is not None and not math.isfinite(median.device_ms)):
            return None
        return median


class JudgedWindow(NamedTuple):
    """What the engine thread hands over: enough to name every row after the cohort has changed."""

    job_id: str
    cohort: str
    rows: Any  # windows.WindowRows, closed
    layout: Any  # windows.RowLayout
    stage_names: tuple[Optional[str], ...]  # by stage index
    slot_ranks: np.ndarray  # by slot; NO_RANK for a free slot


def window_medians(judged: JudgedWindow) -> list[WindowMedian]:
    """The window's lines, rank by rank, `*` first and then the stages in the order the cohort met them."""
    rows, layout = judged.rows, judged.layout
    length = min(len(rows.keys), len(rows.host_ms), len(rows.device_ms))
    if length == 0:
        return []
    keys = np.frombuffer(rows.keys, dtype=np.int64)[:length]
    host = np.frombuffer(rows.host_ms, dtype=np.float64)[:length]
    device = np.frombuffer(rows.device_ms, dtype=np.float64)[:length]
    group, code, slot, step_offset = layout.unpack(keys)
    has_device = np.isfinite(device) & (device >= 0)
    steps_of = layout.window_steps
    # each stage: per (stage, rank) over the steps, as the judge compares them (a key is its group's step)
    groups, host_median, device_median, steps = _per_step_medians(keys, steps_of, host, device, has_device)
    # the whole step: per rank over the steps, the sum of the non-collective intervals
    compute = (code & 1) == 0
    whole_slots, whole_host, whole_device, whole_steps = _per_step_medians(
        slot[compute] * steps_of + step_offset[compute], steps_of, host[compute], device[compute], has_device[compute])

    cells: list[tuple[int, int, WindowMedian]] = []  # (rank, stage index, line)
    window = rows.window

    def add(slot_index: int, stage_index: int, collective: bool, host_ms: float, device_ms: float, count: int) -> None:
        if not 0 <= slot_index < judged.slot_ranks.size or not 0 <= stage_index < len(judged.stage_names):
            return
        rank, stage = int(judged.slot_ranks[slot_index]), judged.stage_names[stage_index]
        if rank == NO_RANK or stage is None:
            return
        cells.append((rank, stage_index, WindowMedian(
            judged.job_id, judged.cohort, rank, stage, window, round(host_ms, 4), count, collective,
            round(device_ms, 4) if math.isfinite(device_ms) else None)))

    for slot_index, host_ms, device_ms, count in zip(whole_slots.tolist(), whole_host.tolist(),
                                                     whole_device.tolist(), whole_steps.tolist(), strict=True):
        add(slot_index, 0, False, host_ms, device_ms, count)
    stage_code = groups // layout.slot_stride
    for stage_code_, slot_index, host_ms, device_ms, count in zip(
            stage_code.tolist(), (groups - stage_code * layout.slot_stride).tolist(), host_median.tolist(),
            device_median.tolist(), steps.tolist(), strict=True):
        add(slot_index, stage_code_ // 2, bool(stage_code_ & 1), host_ms, device_ms, count)
    cells.sort(key=lambda cell: cell[:2])
    return [median for _, _, median in cells]


def _per_step_medians(step_keys: np.ndarray, window_steps: int, host: np.ndarray, device: np.ndarray,
                      has_device: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows keyed group * window_steps + step: per group, (groups, median host ms, median device ms,
    steps) over its steps, each step's intervals summed; the device sum only where every interval
    of the step has a device duration (nan where no step has one)."""
    step_bins, row_bin = np.unique(step_keys, return_inverse=True)
    row_bin = row_bin.reshape(-1)
    step_host = np.bincount(row_bin, weights=host, minlength=step_bins.size)
    step_device = np.bincount(row_bin, weights=np.where(has_device, device, 0.0), minlength=step_bins.size)
    unmeasured = np.bincount(row_bin, weights=(~has_device).astype(np.float64), minlength=step_bins.size)
    step_group = step_bins // window_steps
    groups, steps = np.unique(step_group, return_counts=True)
    _, host_median = grouped_medians(step_group, step_host)
    measured = unmeasured == 0
    return groups, host_median, _medians_where(groups, step_group[measured], step_device[measured]), steps


def _medians_where(all_groups: np.ndarray, groups: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per group of `all_groups` (sorted), the median of its `values`; nan where it has none."""
    medians = np.full(all_groups.size, np.nan)
    found, found_medians = grouped_medians(groups, values)
    medians[np.searchsorted(all_groups, found)] = found_medians
    return medians


WindowListener = Callable[[list[WindowMedian]], None]


class WindowRecord(PeriodicWriter):
    """Queues judged windows (engine thread) and writes their medians (its own thread)."""

    def __init__(self, directory: str, max_bytes: int, flush_interval_s: float) -> None:
        super().__init__("straggler-windows", flush_interval_s)
        self.path = os.path.join(directory, WINDOWS_FILE)
        self._max_bytes = max_bytes
        self._file: Optional[JsonLinesFile] = None
        self._pending: list[JudgedWindow] = []
        self._pending_rows = 0
        self._listeners: list[WindowListener] = []
        self._counts_lock = threading.Lock()
        self._recorded = 0
        self._dropped: Counter[str] = Counter()  # windows not written whole, by reason
        self._errors: Counter[str] = Counter()  # survived, by kind
        self._logged: set[str] = set()

    @classmethod
    def from_config(cls, config: DetectorConfig) -> Optional["WindowRecord"]:
        """None when the config turns recording off."""
        if not config.record_windows:
            return None
        return cls(config.evidence_dir, config.max_window_record_bytes, config.flush_interval_s)

    def add_listener(self, listener: WindowListener) -> None:
        """`listener(medians)` gets each window's lines on the writer thread, file full or not."""
        self._listeners.append(listener)

    def judged(self, cohort, windows: list) -> None:
        """Engine thread: `windows` (WindowRows) of `cohort` (windows.Cohort) are being judged. Never raises."""
        try:
            self._queue(cohort, [rows for rows in windows if len(rows)])
        except Exception:  # noqa: BLE001 - the pictures may lose a window; detection must not
            self._failed(self._dropped, "error", "queueing a judged window failed")

    def _queue(self, cohort, windows: list) -> None:
        if not windows:
            return
        slot_ranks = np.array([NO_RANK if entry is None else entry.rank for entry in cohort.slot_entries],
                              dtype=np.int64)
        stage_names = tuple(cohort.stage_names)
        queue_full = 0
        with self._wake:
            for rows in windows:
                if self._pending_rows + len(rows) > MAX_PENDING_ROWS:
                    queue_full += 1
                    continue
                self._pending.append(JudgedWindow(cohort.job_id, cohort.name, rows, cohort.layout, stage_names,
                                                  slot_ranks))
                self._pending_rows += len(rows)
        self._count(self._dropped, "queue_full", queue_full)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def counts(self) -> dict:
        """For status.json."""
        with self._counts_lock:
            counts = {"path": self.path, "windows_recorded": self._recorded, "windows_dropped": dict(self._dropped),
                      "errors": dict(self._errors)}
        if self._file is not None:
            counts.update(bytes=self._file.size, lines_written=self._file.lines_written,
                          torn_bytes_repaired=self._file.torn_bytes_repaired)
        return counts

    def flush(self) -> None:
        with self._wake:
            pending, self._pending, self._pending_rows = self._pending, [], 0
        for judged in pending:
            self._write(judged)

    def _write(self, judged: JudgedWindow) -> None:
        if not self._listeners and self._file is not None and self._file.size >= self._max_bytes:
            self._count(self._dropped, "file_full", 1)  # nothing would be written or shown: skip the statistics
            return
        try:
            medians = window_medians(judged)
        except Exception:  # noqa: BLE001 - a bug here must not stop the detector
            self._failed(self._dropped, "error", "computing a window's medians failed")
            return
        for listener in self._listeners:
            try:
                listener(medians)
            except Exception:  # noqa: BLE001 - a listener's bug costs its own view only
                self._failed(self._errors, "listener", "a window listener failed")
        lines = [(json.dumps(median.to_dict(), separators=(",", ":")) + "\n").encode() for median in medians]
        try:
            if self._file is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._file = JsonLinesFile(self.path, self._max_bytes)
            dropped_before = self._file.lines_dropped_file_full
            self._file.append(lines)
        except OSError:
            self._failed(self._dropped, "write_failed", f"cannot append to {self.path}")
            return
        if self._file.lines_dropped_file_full > dropped_before:
            self._count(self._dropped, "file_full", 1)
            return
        with self._counts_lock:
            self._recorded += 1

    def _failed(self, counter: Counter, reason: str, message: str) -> None:
        self._count(counter, reason, 1)
        if reason not in self._logged:  # once per reason: a full disk would otherwise flood the log
            self._logged.add(reason)
            _log.exception("%s (counted, logged once)", message)

    def _count(self, counter: Counter, reason: str, amount: int) -> None:
        if amount > 0:
            with self._counts_lock:
                counter[reason] += amount


def detector_engine(config: DetectorConfig, record: Optional[WindowRecord], **options: Any) -> Engine:
    """The engine a detector runs: one that records its windows when `record` is given."""
    return Engine(config, windows_judged=None if record is None else record.judged, **options)
