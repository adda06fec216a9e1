"""The evidence directory: `verdicts.jsonl` (CONTRACT §3a), a `status.json` snapshot, and
`windows.jsonl` (window_record.py). Both JSON-lines files are appended alike (`JsonLinesFile`).

Crash safety comes from how bytes reach the file, not from the caller: lines are appended through an
O_APPEND descriptor, all pending lines in one os.write, so a SIGKILL leaves either whole lines or,
if the kernel cut a large write short, one torn tail. Opening the file repairs that tail (the bytes
after the last newline are cut off and counted), so the file is always whole JSON lines.
`status.json` is replaced atomically (temporary file, then os.replace), so readers never see half.
"""
from __future__ import annotations

import json
import math
import os
from typing import Iterable, Optional

from otel_straggler import contract
from otel_straggler.detector.observation import Verdict

VERDICTS_FILE = "verdicts.jsonl"
STATUS_FILE = "status.json"
WINDOWS_FILE = "windows.jsonl"
_TAIL_PROBE_BYTES = 64 * 1024


def verdict_line(verdict: Verdict) -> bytes:
    """One JSON line with exactly the CONTRACT §3a fields, in contract order. A non-finite number
    (which JSON cannot hold) is written as null, like a missing one."""
    record = verdict.to_dict()
    for key in ("slowdown", "gap_ms", "rank_ms", "reference_ms"):
        value = record[key]
        if isinstance(value, float) and not math.isfinite(value):
            record[key] = None
    ordered = {key: record[key] for key in contract.VERDICT_FIELDS}
    return (json.dumps(ordered, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _cut_torn_tail(fd: int) -> int:
    """Truncates the file after its last newline; returns how many bytes were cut."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - _TAIL_PROBE_BYTES)
        chunk = os.pread(fd, end - start, start)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        end = start
    else:
        keep = 0
    if keep < size:
        os.ftruncate(fd, keep)
    return size - keep


class JsonLinesFile:
    """One append-only file of whole lines, at most max_bytes. Not thread-safe: one writer thread calls it."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._fd: Optional[int] = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self.torn_bytes_repaired = _cut_torn_tail(self._fd)
        self.size = os.fstat(self._fd).st_size
        self.lines_written = 0
        self.lines_dropped_file_full = 0
        self._torn_from: Optional[int] = None  # where a failed write began: a torn line may follow it

    def append(self, lines: Iterable[bytes]) -> None:
        """Appends whole lines in one write (loops only on a short write); lines that would take the
        file past max_bytes are dropped and counted instead."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        if self._torn_from is not None:
            self._repair()
            if self._torn_from is not None:  # still torn: a batch appended now would follow the fragment
                raise OSError(f"{self.path} ends in part of a line that cannot be cut off")
        accepted = []
        size = self.size
        for line in lines:
            if size + len(line) > self.max_bytes:
                self.lines_dropped_file_full += 1
                continue
            accepted.append(line)
            size += len(line)
        if not accepted:
            return
        before = self.size
        view = memoryview(b"".join(accepted))
        try:
            while view:
                written = os.write(self._fd, view)
                self.size += written
                view = view[written:]
            os.fsync(self._fd)  # once per flush interval (emit.py)
        except OSError:
            # a write cut short (the disk filled up) leaves a torn line, which the next append would
            # follow, and a failed fsync lines that may not last: cut back to where this batch began
            # (none of it is written, as it is counted)
            self._torn_from = before
            self._repair()
            raise
        self.lines_written += len(accepted)

    def _repair(self) -> None:
        """Cuts the file back to where the failed write began; if that fails too, the next append
        tries again first."""
        fd, torn_from = self._fd, self._torn_from
        assert fd is not None and torn_from is not None  # called on an open file with a torn write only
        try:
            os.ftruncate(fd, torn_from)
        except OSError:
            return
        self.size, self._torn_from = torn_from, None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class EvidenceFiles(JsonLinesFile):
    """Owns verdicts.jsonl and status.json. Not thread-safe: one writer thread calls it."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        os.makedirs(directory, exist_ok=True)
        super().__init__(os.path.join(directory, VERDICTS_FILE), max_bytes)
        self.directory = directory
        self.verdicts_path = self.path
        self.status_path = os.path.join(directory, STATUS_FILE)

    def write_status(self, status: dict) -> None:
        temporary = self.status_path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(status, handle, indent=1, sort_keys=True, default=str)
            handle.write("\n")
        os.replace(temporary, self.status_path)


# status.json sections that count since the first start in this evidence directory: a restarted
# detector carries them on (the rest describes the running process: its engine, queue, ports)
CARRIED_SECTIONS = ("spans", "rejections", "requests", "errors", "verdicts", "verdicts_dropped")


def carried_counters(status_path: str) -> dict:
    """The counters a previous process left in status.json, to carry on from: CARRIED_SECTIONS (each
    {name: count}), `processes` (how many ran before) and `counting_since_unix_nano` (the first's
    start). Empty when there is no readable file; a section that is not counts is left out."""
    try:
        with open(status_path, encoding="utf-8") as handle:
            previous = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(previous, dict):
        return {}
    carried: dict = {}
    for section in CARRIED_SECTIONS:
        counts = previous.get(section)
        if isinstance(counts, dict) and all(isinstance(value, int) and not isinstance(value, bool)
                                            for value in counts.values()):
            carried[section] = counts
    history = previous.get("history")
    if not isinstance(history, dict):
        history = {}
    processes = history.get("processes", 1)
    since = history.get("counting_since_unix_nano", previous.get("started_unix_nano"))
    carried["processes"] = processes if isinstance(processes, int) else 1
    if isinstance(since, int):
        carried["counting_since_unix_nano"] = since
    return carried

