"""evidence.py and emit.py: whole lines with exactly the contract's fields, torn tails repaired,
bounded file and queue, status.json replaced atomically, flushes off the engine thread."""
from __future__ import annotations

import errno
import json
import math
import os
import time

import pytest

from otel_straggler import contract
from otel_straggler.detector import emit
from otel_straggler.detector.emit import VerdictEmitter
from otel_straggler.detector.evidence import EvidenceFiles, verdict_line
from otel_straggler.detector.observation import Verdict


def verdict(rank: int = 3, **changes) -> Verdict:
    values = dict(time_unix_nano=1_700_000_000_000_000_000, job_id="job-1", cohort="tp0", stage="forward-compute",
                  rank=rank, window=4, verdict="straggler", reason="slow_vs_peers", slowdown=1.12, gap_ms=3.5,
                  rank_ms=32.5, reference_ms=29.0, reference_ranks=(0, 1, 2), timing="device",
                  attribution="gpu_stream_stall", workload_comparable=None)
    values.update(changes)
    return Verdict(**values)


def test_a_verdict_line_has_exactly_the_contract_fields_in_order():
    line = verdict_line(verdict())
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    record = json.loads(line)
    assert tuple(record) == contract.VERDICT_FIELDS
    assert record["reference_ranks"] == [0, 1, 2] and record["workload_comparable"] is None


def test_non_finite_numbers_are_written_as_null():
    record = json.loads(verdict_line(verdict(slowdown=math.inf, gap_ms=math.nan)))
    assert record["slowdown"] is None and record["gap_ms"] is None and record["rank_ms"] == 32.5


@pytest.mark.parametrize("existing, kept", [
    (b'{"a":1}\n{"b":', b'{"a":1}\n'),
    (b'{"partial', b""),
    (b'{"a":1}\n' + b"x" * 200_000, b'{"a":1}\n'),  # a torn line longer than one read-back chunk
    (b'{"a":1}\n{"b":2}\n', b'{"a":1}\n{"b":2}\n'),
])
def test_opening_the_evidence_cuts_a_torn_tail_and_counts_it(tmp_path, existing, kept):
    path = tmp_path / "verdicts.jsonl"
    path.write_bytes(existing)
    files = EvidenceFiles(str(tmp_path), max_bytes=1 << 30)
    files.append([verdict_line(verdict())])
    files.close()
    content = path.read_bytes()
    assert content.startswith(kept) and content[len(kept):] == verdict_line(verdict())
    assert files.torn_bytes_repaired == len(existing) - len(kept)


def test_lines_past_the_size_bound_are_dropped_and_counted(tmp_path):
    line = verdict_line(verdict())
    files = EvidenceFiles(str(tmp_path), max_bytes=len(line) * 2 + 1)
    files.append([line] * 5)
    files.close()
    assert (tmp_path / "verdicts.jsonl").read_bytes() == line * 2
    assert (files.lines_written, files.lines_dropped_file_full) == (2, 3)


def test_a_write_cut_short_by_a_full_disk_leaves_only_whole_lines(tmp_path):
    """The file size limit (as a full disk would) cuts the second append short: the batch is not
    written at all, and what comes after it follows the first line whole."""
    import resource

    files = EvidenceFiles(str(tmp_path), max_bytes=1 << 20)
    files.append([verdict_line(verdict(rank=1))])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (files.size + 100, hard))  # room for part of a line
    try:
        with pytest.raises(OSError):
            files.append([verdict_line(verdict(rank=2)), verdict_line(verdict(rank=3))])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    files.append([verdict_line(verdict(rank=4))])
    files.close()
    with open(files.verdicts_path, "rb") as handle:
        ranks = [json.loads(line)["rank"] for line in handle]
    assert ranks == [1, 4] and files.size == os.path.getsize(files.verdicts_path)


def test_a_torn_line_that_cannot_be_cut_off_stops_appends_until_it_can(tmp_path, monkeypatch):
    """If the cut fails too (an append-only file, say), nothing is appended after the fragment."""
    import resource

    files = EvidenceFiles(str(tmp_path), max_bytes=1 << 20)
    files.append([verdict_line(verdict(rank=1))])
    real_ftruncate = os.ftruncate

    def refuse(fd, length):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "ftruncate", refuse)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (files.size + 100, hard))
    try:
        with pytest.raises(OSError):
            files.append([verdict_line(verdict(rank=2)), verdict_line(verdict(rank=3))])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with pytest.raises(OSError):
        files.append([verdict_line(verdict(rank=4))])  # the fragment is still there
    monkeypatch.setattr(os, "ftruncate", real_ftruncate)
    files.append([verdict_line(verdict(rank=5))])
    files.close()
    with open(files.verdicts_path, "rb") as handle:
        assert [json.loads(line)["rank"] for line in handle] == [1, 5]


def test_status_is_replaced_whole(tmp_path):
    files = EvidenceFiles(str(tmp_path), max_bytes=1 << 20)
    files.write_status({"spans": {"accepted": 1}})
    files.write_status({"spans": {"accepted": 2}})
    assert json.loads((tmp_path / "status.json").read_text()) == {"spans": {"accepted": 2}}
    assert sorted(os.listdir(tmp_path)) == ["status.json", "verdicts.jsonl"]


class RecordingTelemetry:
    def __init__(self, fail: bool = False) -> None:
        self.recorded: list[Verdict] = []
        self.fail = fail

    def record_verdicts(self, verdicts) -> None:
        if self.fail:
            raise RuntimeError("exporter bug")
        self.recorded.extend(verdicts)


def _lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "verdicts.jsonl").read_text().splitlines()]


def test_the_emitter_writes_within_a_flush_interval_and_everything_on_stop(tmp_path):
    telemetry = RecordingTelemetry()
    emitter = VerdictEmitter(EvidenceFiles(str(tmp_path), 1 << 20), 0.05, lambda: {"n": 1}, telemetry)
    emitter.start()
    emitter.submit([verdict(rank) for rank in range(3)])
    deadline = time.monotonic() + 5
    while len(_lines(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [record["rank"] for record in _lines(tmp_path)] == [0, 1, 2]
    emitter.submit([verdict(7)])
    assert emitter.stop(timeout_s=5)
    assert [record["rank"] for record in _lines(tmp_path)] == [0, 1, 2, 7]
    assert [v.rank for v in telemetry.recorded] == [0, 1, 2, 7]
    assert json.loads((tmp_path / "status.json").read_text()) == {"n": 1}
    assert emitter.counts()["verdicts"] == {"straggler": 4}


def test_a_full_queue_and_failing_telemetry_are_counted_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setattr(emit, "MAX_PENDING_VERDICTS", 2)
    emitter = VerdictEmitter(EvidenceFiles(str(tmp_path), 1 << 20), 60.0, dict, RecordingTelemetry(fail=True))
    emitter.submit([verdict(rank) for rank in range(5)])
    assert emitter.stop(timeout_s=5)  # never started: stop() flushes on the caller's thread
    assert [record["rank"] for record in _lines(tmp_path)] == [0, 1]
    counts = emitter.counts()
    assert counts["verdicts_dropped"] == {"queue_full": 3}
    assert counts["errors"] == {"telemetry": 1}


def test_a_failing_write_is_counted_as_dropped(tmp_path):
    files = EvidenceFiles(str(tmp_path), 1 << 20)
    emitter = VerdictEmitter(files, 60.0, dict)
    os.close(files._fd)  # the disk went away under the writer
    files._fd = os.open(os.devnull, os.O_RDONLY)
    emitter.submit([verdict()])
    emitter.flush()
    assert emitter.counts()["verdicts_dropped"] == {"write_failed": 1}
    files.close()


def test_a_full_disk_is_logged_once_with_its_errno_for_verdicts_and_status(tmp_path, monkeypatch, caplog):
    files = EvidenceFiles(str(tmp_path), 1 << 20)

    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", no_space)
    monkeypatch.setattr(files, "write_status", no_space)
    emitter = VerdictEmitter(files, 60.0, dict)
    for _ in range(2):
        emitter.submit([verdict()])
        emitter.flush()
    assert emitter.counts()["verdicts_dropped"] == {"write_failed": 2}
    assert emitter.counts()["errors"] == {"status_file": 2}
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2 and all("No space left on device" in message for message in messages)
    assert "cannot append to verdicts.jsonl" in messages[0] and "status.json" in messages[1]
    assert not any(record.exc_info for record in caplog.records)  # no "NoneType: None" traceback
    files.close()


def test_a_verdict_left_out_for_the_size_bound_is_not_counted_failed_as_well(tmp_path):
    files = EvidenceFiles(str(tmp_path), len(verdict_line(verdict(rank=1))) + 10)  # room for one line
    emitter = VerdictEmitter(files, 60.0, dict)
    os.close(files._fd)
    files._fd = os.open(os.devnull, os.O_RDONLY)  # and the write of that one fails
    emitter.submit([verdict(rank=1), verdict(rank=2)])
    emitter.flush()
    assert emitter.counts()["verdicts_dropped"] == {"file_full": 1, "write_failed": 1}
    files.close()
