"""windows.jsonl: the medians of every judged window, as the detector writes them (live, replay and
in-process), within their bounds, and what status.json counts of them."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from otel_straggler.detector import window_record
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.observation import Observation
from otel_straggler.detector.replay import replay
from otel_straggler.detector.service import DetectorService
from otel_straggler.detector.window_record import WindowMedian, WindowRecord, detector_engine

from otel_straggler.testing.otlp_spans import json_line, per_step_requests, service_config, slow_rank_observations
from .test_service import send_slow_rank_job

STAGES = (("data-load", False), ("forward-compute", False), ("all-grads-sync", True))


def observation(rank: int, step: int, stage: str, host_ms: float, collective: bool = False, seq: int = 0,
                device_ms=None) -> Observation:
    return Observation(job_id="job-1", epoch=0, cohort="default", rank=rank, stage=stage, step=step, seq=seq,
                       host_ms=host_ms, device_ms=device_ms, collective=collective, tokens=None, samples=None,
                       end_unix_nano=1_700_000_000_000_000_000 + step)


def job(ranks: int = 3, steps: int = 4) -> list[Observation]:
    """Rank r's stage s at step t takes 10 * (s + 1) + r + t ms; forward-compute also has a device time."""
    observations = []
    for step in range(steps):
        for rank in range(ranks):
            for index, (stage, collective) in enumerate(STAGES):
                host_ms = 10.0 * (index + 1) + rank + step
                device_ms = host_ms - 1.0 if stage == "forward-compute" else None
                observations.append(observation(rank, step, stage, host_ms, collective, step * 10 + index, device_ms))
    return observations


def recorded(tmp_path: Path, observations: list[Observation], **changes) -> tuple[WindowRecord, list[dict]]:
    config = DetectorConfig(window_steps=2, evidence_dir=str(tmp_path), **changes)
    record = WindowRecord.from_config(config)
    engine = detector_engine(config, record)
    engine.ingest_many(observations)
    engine.drain(2_000_000_000_000_000_000)
    assert record.stop(timeout_s=10)
    path = tmp_path / "windows.jsonl"
    return record, [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_each_judged_window_has_a_line_per_rank_and_stage_with_the_whole_step_first(tmp_path):
    record, lines = recorded(tmp_path, job())
    assert {line["window"] for line in lines} == {0, 1}
    first_rank = [(line["stage"], line["collective"]) for line in lines if line["window"] == 0 and line["rank"] == 0]
    assert first_rank == [("*", False), ("data-load", False), ("forward-compute", False), ("all-grads-sync", True)]
    by_key = {(line["window"], line["rank"], line["stage"]): line for line in lines}
    forward = by_key[(1, 2, "forward-compute")]  # steps 2 and 3: 20 + 2 + 2, 20 + 2 + 3
    assert (forward["median_ms"], forward["device_ms"], forward["steps"]) == (24.5, 23.5, 2)
    assert "device_ms" not in by_key[(1, 2, "data-load")]  # no device time measured: no field
    # the whole step: per step the non-collective stages summed (data-load + forward), then the median
    whole = by_key[(0, 1, "*")]
    assert whole["median_ms"] == statistics.median([11.0 + 21.0, 12.0 + 22.0]) and whole["steps"] == 2
    assert "device_ms" not in whole  # data-load has no device time, so no step has a device sum
    assert record.counts()["windows_recorded"] == 2 and record.counts()["lines_written"] == len(lines) == 24


def test_a_stage_run_twice_in_a_step_counts_as_its_sum_as_the_judge_compares_it(tmp_path):
    micro_batches = [observation(rank, step, "forward-compute", 10.0 + step, seq=step * 10 + half,
                                 device_ms=9.0 if half == 0 or rank != 1 else None)
                     for step in range(4) for rank in range(3) for half in range(2)]
    _, lines = recorded(tmp_path, micro_batches)
    forward = {(line["window"], line["rank"]): line for line in lines if line["stage"] == "forward-compute"}
    assert (forward[(1, 0)]["median_ms"], forward[(1, 0)]["steps"], forward[(1, 0)]["device_ms"]) == (25.0, 2, 18.0)
    assert "device_ms" not in forward[(1, 1)]  # one interval of each step has no device time: no device sum


def test_lines_read_back_as_window_medians():
    line = {"job_id": "j", "cohort": "c", "rank": 1, "stage": "s", "window": 3, "median_ms": 2.5, "steps": 10,
            "collective": False, "device_ms": 2.0}
    assert WindowMedian.from_dict(line) == WindowMedian("j", "c", 1, "s", 3, 2.5, 10, False, 2.0)
    assert WindowMedian.from_dict({**line, "median_ms": "nan"}) is None
    assert WindowMedian.from_dict({"rank": 1}) is None
    older = {key: value for key, value in line.items() if key != "device_ms"}  # the demo's lines of before
    assert WindowMedian.from_dict(older).device_ms is None
    assert WindowMedian.from_dict(line).to_dict() == line


def test_the_file_stops_at_its_bound_and_every_window_left_out_is_counted(tmp_path):
    _, unbounded = recorded(tmp_path / "unbounded", job(steps=8))
    one_window = sum(len(json.dumps(line, separators=(",", ":"))) + 1 for line in unbounded if line["window"] == 0)
    record, lines = recorded(tmp_path / "bounded", job(steps=8), max_window_record_bytes=one_window + 50)
    written = (tmp_path / "bounded" / "windows.jsonl").read_bytes()
    assert len(written) <= one_window + 50 and written.endswith(b"\n")  # whole lines only
    counts = record.counts()
    assert counts["windows_recorded"] == 1 and counts["windows_dropped"] == {"file_full": 3}
    assert counts["lines_written"] == len(lines)


def test_a_window_over_the_queue_bound_is_counted_not_held(tmp_path, monkeypatch):
    monkeypatch.setattr(window_record, "MAX_PENDING_ROWS", 20)  # one window of the job has 18 rows
    record, lines = recorded(tmp_path, job(steps=4))
    assert record.counts()["windows_dropped"] == {"queue_full": 1}
    assert {line["window"] for line in lines} == {0}


def test_listeners_get_each_window_and_a_failing_one_is_counted(tmp_path):
    config = DetectorConfig(window_steps=2, evidence_dir=str(tmp_path))
    record = WindowRecord.from_config(config)
    seen = []
    record.add_listener(seen.append)
    record.add_listener(lambda medians: 1 / 0)
    engine = detector_engine(config, record)
    engine.ingest_many(job())
    engine.drain(2_000_000_000_000_000_000)
    record.stop(timeout_s=10)
    assert [{median.window for median in medians} for medians in seen] == [{0}, {1}]
    assert record.counts()["errors"] == {"listener": 2} and record.counts()["windows_recorded"] == 2


def test_record_windows_off_records_nothing(tmp_path):
    assert WindowRecord.from_config(DetectorConfig(record_windows=False)) is None
    service = DetectorService(service_config(tmp_path, record_windows=False))
    assert service.window_record is None


def test_a_detector_run_writes_windows_jsonl_and_counts_it_in_status(tmp_path):
    config = service_config(tmp_path)
    service = DetectorService(config)
    service.start()
    send_slow_rank_job(service)
    assert service.stop(timeout_s=10)
    evidence = Path(config.evidence_dir)
    lines = [json.loads(line) for line in (evidence / "windows.jsonl").read_text().splitlines()]
    status = json.loads((evidence / "status.json").read_text())
    assert status["windows"]["windows_recorded"] == status["engine"]["windows_closed"] == 8  # 40 steps of 5
    assert status["windows"]["lines_written"] == len(lines) and status["windows"]["windows_dropped"] == {}
    slow = [line["median_ms"] for line in lines if line["stage"] == "*" and line["window"] == 7]
    assert len(slow) == 8  # every rank
    rank_3 = next(line for line in lines if line["stage"] == "*" and line["window"] == 7 and line["rank"] == 3)
    assert rank_3["median_ms"] > 1.2 * statistics.median(slow)  # the slow rank, 30% slower


def test_replay_writes_windows_jsonl_too(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json_line(spans) for spans in per_step_requests(slow_rank_observations(ranks=4, steps=20))))
    summary = replay([str(path)], service_config(tmp_path))
    lines = (tmp_path / "evidence" / "windows.jsonl").read_text().splitlines()
    recorded_windows = summary.status["windows"]
    assert recorded_windows["windows_recorded"] == 4 and len(lines) == recorded_windows["lines_written"]


@pytest.mark.parametrize("engine", [None, "custom"])
def test_only_the_default_engine_records(tmp_path, engine):
    from otel_straggler.detector.engine import Engine

    config = service_config(tmp_path)
    service = DetectorService(config, engine=Engine(config) if engine else None)
    assert (service.window_record is None) == bool(engine)
