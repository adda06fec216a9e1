"""Jobs whose ranks send heartbeats but no stage span: instrumented, timing nothing. status.json lists
them (`jobs_without_stages`), once they have been at it longer than first spans may take to come."""
from __future__ import annotations

import json
import time
from pathlib import Path

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.decode import DecodedBatch
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.observation import Heartbeat, Observation
from otel_straggler.detector.driver import MAX_JOBS_WITHOUT_STAGES_NAMED, EngineDriver, IntakeCounters

from otel_straggler.testing.otlp_spans import heartbeat_span, running_service, service_config, stage_spans

START = 1_700_000_000_000_000_000
SECOND = 1_000_000_000


def beats(job_id: str, ranks: int, at: int) -> list[Heartbeat]:
    return [Heartbeat(job_id, 0, "default", rank, 0, None, at, (), ()) for rank in range(ranks)]


def test_a_job_with_heartbeats_and_no_stage_span_is_listed_once_past_the_export_lag():
    driver = EngineDriver(Engine(DetectorConfig(max_export_lag_s=10.0)), IntakeCounters(), lambda verdicts: None)
    timed = [Observation("busy", 0, "default", rank, "forward-compute", 0, 0, 10.0, None, False, None, None,
                         START + SECOND) for rank in range(2)]
    driver.ingest(DecodedBatch(observations=timed, heartbeats=beats("busy", 2, START) + beats("quiet", 4, START)),
                  START)
    driver.advance(START + 5 * SECOND)
    assert driver.jobs_without_stages() == {"count": 0, "jobs": []}  # its first spans may still be on the way
    driver.advance(START + 12 * SECOND)
    assert driver.jobs_without_stages() == {"count": 1, "jobs": [{"job_id": "quiet", "ranks": 4, "seconds": 12.0}]}

    late = Observation("quiet", 0, "default", 0, "forward-compute", 0, 0, 10.0, None, False, None, None,
                       START + 13 * SECOND)
    driver.ingest(DecodedBatch(observations=[late]), START + 13 * SECOND)
    driver.advance(START + 14 * SECOND)
    assert driver.jobs_without_stages() == {"count": 0, "jobs": []}


def test_the_list_is_bounded_longest_first_and_counts_them_all():
    driver = EngineDriver(Engine(DetectorConfig(max_export_lag_s=1.0)), IntakeCounters(), lambda verdicts: None)
    jobs = MAX_JOBS_WITHOUT_STAGES_NAMED + 4
    for index in range(jobs):
        driver.ingest(DecodedBatch(heartbeats=beats(f"job-{index:02d}", 1, START + index * SECOND)), START)
    driver.drain(START + 60 * SECOND)
    listed = driver.jobs_without_stages()
    assert listed["count"] == jobs
    assert [job["job_id"] for job in listed["jobs"]] == [f"job-{index:02d}" for index in range(MAX_JOBS_WITHOUT_STAGES_NAMED)]
    assert listed["jobs"][0]["seconds"] == 60.0


def test_status_json_lists_jobs_without_stages(tmp_path):
    config = service_config(tmp_path, max_export_lag_s=0.1)
    with running_service(config) as service:
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{service.bound_ports[0]}", insecure=True, timeout=10)
        now = time.time_ns()
        timed = stage_spans(0, job_id="busy") + [heartbeat_span(0, now, job_id="busy")]
        quiet = [heartbeat_span(rank, now, (), job_id="quiet") for rank in range(3)]
        assert exporter.export(timed + quiet) is SpanExportResult.SUCCESS
        exporter.shutdown()
        deadline = time.monotonic() + 10
        while service.status()["jobs_without_stages"]["count"] == 0:
            assert time.monotonic() < deadline, service.status()
            time.sleep(0.05)
        listed = service.status()["jobs_without_stages"]
        assert listed["count"] == 1 and listed["jobs"][0]["job_id"] == "quiet" and listed["jobs"][0]["ranks"] == 3
        time.sleep(3 * config.flush_interval_s)
        written = json.loads((Path(config.evidence_dir) / "status.json").read_text())
        assert [job["job_id"] for job in written["jobs_without_stages"]["jobs"]] == ["quiet"]
