"""The real detector behind the real gateway: its own metrics come back through the collector to
Prometheus under the names the rules and dashboards use, and its verdict events reach the gateway's
events file (the full demo run is an end-to-end test of its own).

Spans go straight to the detector: the gateway's route to the shard is test_gateway_smoke's and
test_end_to_end's subject. Through the gateway these tests would also wait on its load-balancing
exporter reconnecting to a port that earlier tests' detectors left (gRPC's reconnect backoff grows
with every failed attempt while no detector listens), which is not what they check."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from otel_straggler.testing import services
from .telemetry import Rank, send_rank_steps

pytestmark = pytest.mark.services

DEADLINE_S = 60


@pytest.fixture
def detector(pipeline, tmp_path):
    process = services.Detector(tmp_path, pipeline.detector_grpc_port, pipeline.detector_http_port,
                                otlp_endpoint=pipeline.collector_grpc, args=("--metric-export-interval-s=1",))
    with process:
        yield process


def detector_endpoint(pipeline) -> str:
    return f"{services.LOOPBACK}:{pipeline.detector_grpc_port}"


def wait_for_sum(pipeline, detector, query: str, at_least: float) -> None:
    """Waits until Prometheus answers `query` (one sum) with at least `at_least`."""
    def reached():
        result = services.prometheus_query(pipeline.prometheus_url, query)
        return result and float(result[0]["value"][1]) >= at_least

    try:
        services.wait_until(reached, DEADLINE_S, what=query)
    except TimeoutError:
        pytest.fail(f"{query} stayed below the spans sent\n--- detector log ---\n{detector.log_tail()}")


def test_detector_intake_counter_reaches_prometheus(pipeline, detector):
    job_id = f"detector-{uuid.uuid4().hex[:8]}"
    for rank in range(3):
        send_rank_steps(detector_endpoint(pipeline), Rank(job_id, rank, 3, "tp0-pp0"), range(3))
    # The detector's resource names it: job="otel-straggler-detector", instance="<host>:<grpc port>".
    query = 'sum(straggler_detector_spans_total{job="otel-straggler-detector", outcome="accepted"})'
    stage_spans = 3 * 3 * 3  # ranks x steps x stages; train.step spans carry no stage and are not counted
    wait_for_sum(pipeline, detector, query, stage_spans)


def test_detector_rejections_reach_prometheus_by_reason(pipeline, detector):
    # a rank that found no job id: every stage span is rejected, and the metric says why
    send_rank_steps(detector_endpoint(pipeline), Rank("", 0, 1, "tp0-pp0"), range(2))
    query = 'sum(straggler_detector_rejections_total{job="otel-straggler-detector", reason="missing_job_id"})'
    stage_spans = 2 * 3  # steps x stages
    wait_for_sum(pipeline, detector, query, stage_spans)
    assert "rejected as malformed (missing_job_id)" in detector.log_tail()


def test_detector_verdict_events_reach_the_events_file(pipeline, tmp_path):
    """The detector's own OTLP logs export (event_export.py) through the real gateway."""
    process = services.Detector(tmp_path, pipeline.detector_grpc_port, pipeline.detector_http_port,
                                otlp_endpoint=pipeline.collector_grpc,
                                args=("--window-steps=5", "--warmup-windows=1", "--persist-windows=1"))
    job_id = f"events-{uuid.uuid4().hex[:8]}"
    events_path = Path(pipeline.events_path)

    def attributes(record: dict) -> dict:
        return {a["key"]: a["value"] for a in record["attributes"]}

    def straggler_events():
        lines = events_path.read_text().splitlines() if events_path.exists() else []
        return [(resource_logs, record) for line in lines if job_id in line
                for resource_logs in json.loads(line)["resourceLogs"]
                for scope_logs in resource_logs["scopeLogs"] for record in scope_logs["logRecords"]
                if attributes(record).get("verdict") == {"stringValue": "straggler"}] or None

    with process:
        for rank in range(4):  # rank 3 six times as slow in every stage
            send_rank_steps(detector_endpoint(pipeline), Rank(job_id, rank, 4, "tp0-pp0"), range(25),
                            stage_ms=12.0 if rank == 3 else 2.0)
        try:
            found = services.wait_until(straggler_events, DEADLINE_S, what="a straggler event in the events file")
        except TimeoutError:
            pytest.fail(f"no straggler event of {job_id}\n--- detector log ---\n{process.log_tail()}")
    resource_logs, record = found[0]
    resource = attributes(resource_logs["resource"])
    assert resource["service.name"] == {"stringValue": "otel-straggler-detector"}
    assert record["eventName"] == "straggler.verdict" and record["severityNumber"] == 13  # WARN
    assert attributes(record)["rank"] == {"intValue": "3"} and record["body"]["stringValue"].startswith("rank 3 ")
