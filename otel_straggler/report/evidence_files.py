"""The files of an evidence directory and their records.

The detector writes `verdicts.jsonl` (CONTRACT §3a), `status.json` and `windows.jsonl` (each rank's
median stage duration per window, for the report's pictures: detector/window_record.py); the demo
adds `demo.json` (how the run was set up and how it went). The report needs only `verdicts.jsonl`;
every other file adds to what it can show.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from otel_straggler.detector.evidence import STATUS_FILE, VERDICTS_FILE, WINDOWS_FILE
from otel_straggler.detector.window_record import WindowMedian

RUN_FILE = "demo.json"
EVIDENCE_FILES = (VERDICTS_FILE, STATUS_FILE, WINDOWS_FILE, RUN_FILE)


@dataclass(frozen=True)
class Injection:
    """What the demo injects: `slowdown` x the stage's own time, slept inside it; or, with `hang`,
    the rank blocks inside the stage for good (its peers then wait in the all-reduce)."""

    rank: int
    stage: str
    from_step: int
    slowdown: float
    hang: bool = False


@dataclass
class RunRecord:
    """demo.json: the run's settings, filled in with what happened as it goes."""

    job_id: str
    ranks: int
    steps: int
    window_steps: int
    rel_threshold: float
    min_gap_ms: float
    injection: Optional[Injection]
    started_unix_nano: int
    step_end_unix_nano: list[int] = field(default_factory=list)  # as rank 0 reported them
    losses: list[float] = field(default_factory=list)
    outcome: str = "running"  # "completed", "hang declared", or why the run stopped
    hang_timeout_s: Optional[float] = None  # the embedded detector's, for a --hang run

    def injection_started_unix_nano(self) -> Optional[int]:
        """When the injected rank entered its first slowed step, as near as rank 0's progress
        tells: the end of the step before it (all ranks leave a step together)."""
        if self.injection is None:
            return None
        if self.injection.from_step == 0:
            return self.started_unix_nano
        if len(self.step_end_unix_nano) >= self.injection.from_step:
            return self.step_end_unix_nano[self.injection.from_step - 1]
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "RunRecord":
        values = dict(record)
        if values.get("injection") is not None:
            values["injection"] = Injection(**values["injection"])
        known = set(cls.__dataclass_fields__)
        return cls(**{key: value for key, value in values.items() if key in known})


@dataclass
class Evidence:
    """Everything read back from one evidence directory."""

    directory: Path
    verdicts: list[dict[str, Any]]
    windows: list[WindowMedian]
    run: Optional[RunRecord]
    status: Optional[dict[str, Any]]
    unreadable_lines: int = 0


class EvidenceError(Exception):
    """The directory holds no readable evidence; the message is one line for the user."""


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The file's JSON objects, and how many lines were not one (a line cut short by a
    writer that is still appending is expected, not an error)."""
    records, unreadable = [], 0
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                unreadable += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                unreadable += 1
    return records, unreadable


def append_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)
    if lines:
        with path.open("a", encoding="utf-8") as out:
            out.write(lines)


def write_run(directory: Path, run: RunRecord) -> None:
    """Replaces demo.json whole (write then rename), so a reader never sees half of it."""
    partial = directory / (RUN_FILE + ".partial")
    partial.write_text(json.dumps(run.to_dict(), indent=2) + "\n", encoding="utf-8")
    partial.replace(directory / RUN_FILE)


def load(directory: Path) -> Evidence:
    directory = Path(directory)
    verdicts_path = directory / VERDICTS_FILE
    if not directory.is_dir():
        raise EvidenceError(f"{directory} is not a directory")
    if not verdicts_path.is_file() and not (directory / STATUS_FILE).is_file():
        raise EvidenceError(f"{directory} holds no {VERDICTS_FILE}: not a detector's evidence directory")
    # A detector that has judged nothing yet may not have created verdicts.jsonl.
    verdicts, unreadable = read_jsonl(verdicts_path) if verdicts_path.is_file() else ([], 0)
    verdicts = [verdict for verdict in verdicts if _is_verdict(verdict)]

    windows: list[WindowMedian] = []
    if (directory / WINDOWS_FILE).is_file():
        window_records, unreadable_windows = read_jsonl(directory / WINDOWS_FILE)
        unreadable += unreadable_windows
        windows = [median for median in map(WindowMedian.from_dict, window_records) if median is not None]

    return Evidence(
        directory=directory, verdicts=verdicts, windows=windows,
        run=_load_run(directory / RUN_FILE), status=_load_json(directory / STATUS_FILE),
        unreadable_lines=unreadable,
    )


def _is_verdict(record: dict[str, Any]) -> bool:
    return (
        isinstance(record.get("rank"), int) and isinstance(record.get("window"), int)
        and isinstance(record.get("verdict"), str) and isinstance(record.get("stage"), str)
    )


def _load_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _load_run(path: Path) -> Optional[RunRecord]:
    record = _load_json(path)
    if record is None:
        return None
    try:
        return RunRecord.from_dict(record)
    except (TypeError, ValueError):
        return None
