"""The gateway config with the real collector, Jaeger and Prometheus: what goes in comes out.

Spans from the stock OTel SDK exporter reach Jaeger and the detector tier (a fake shard on the
port the gateway routes to); detector-shaped metrics reach Prometheus under the documented names,
the alert rules fire on them, and every dashboard panel's query returns data; verdict events reach
the events file.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from otel_straggler.testing import services
from .telemetry import (Rank, send_detector_metrics, send_hang_metrics, send_job_slowdown_metrics, send_rank_steps,
                        send_verdict_event)

pytestmark = pytest.mark.services

DEADLINE_S = 45


def _generator():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "generate_dashboards", services.CONFIG_DIR / "grafana" / "generate_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def detector_shard(pipeline, otlp_sink_factory):
    """A fake detector shard on the port the stack's gateway routes spans to."""
    return otlp_sink_factory(port=pipeline.detector_grpc_port)


def test_spans_reach_jaeger_and_the_detector_tier(pipeline, detector_shard):
    job_id = f"smoke-{uuid.uuid4().hex[:8]}"
    service = f"training-{job_id}"
    rank = Rank(job_id=job_id, rank=1, world_size=2, cohort="tp0-pp0", service_name=service)
    sent = send_rank_steps(pipeline.collector_grpc, rank, range(3))

    def shard_spans():
        spans = [(res, span) for res, span in detector_shard.spans() if res.get("training.job.id") == job_id]
        return spans if len(spans) >= sent else None

    received = services.wait_until(shard_spans, DEADLINE_S, what="spans at the detector shard")
    assert len(received) == sent, "each span reaches the detector tier once"
    resource, _ = received[0]
    assert resource["training.rank"] == 1 and resource["training.cohort"] == "tp0-pp0"
    stage_spans = [span for _, span in received if span.name == "forward-compute"]
    assert {"training.stage", "training.step", "training.seq", "training.stage.collective"} <= {
        kv.key for kv in stage_spans[0].attributes}

    def jaeger_traces():
        traces = services.jaeger_traces(pipeline.jaeger_query_url, service)
        return traces if sum(len(t["spans"]) for t in traces) >= sent else None

    traces = services.wait_until(jaeger_traces, DEADLINE_S, what="traces in Jaeger")
    assert len(traces) == 3, "one trace per step"
    trace = traces[0]
    names = {span["operationName"] for span in trace["spans"]}
    assert {"train.step", "forward-compute", "backward-compute", "grads-all-reduce"} <= names
    process_tags = {tag["key"]: tag["value"] for process in trace["processes"].values() for tag in process["tags"]}
    assert process_tags["training.job.id"] == job_id
    assert process_tags["training.cohort"] == "tp0-pp0"


def test_detector_metrics_reach_prometheus_and_every_panel_has_data(pipeline):
    job_id = f"metrics-{uuid.uuid4().hex[:8]}"
    # Collector panels need spans through the gateway too; rate() needs two scrapes, so the
    # metrics are sent twice, a few scrape intervals apart.
    send_rank_steps(pipeline.collector_grpc, Rank(job_id, 0, 4, "tp0-pp0"), range(2))
    send_detector_metrics(pipeline.collector_grpc, job_id, slow_rank=2, ranks=range(4))

    def alert_series():
        return services.prometheus_query(pipeline.prometheus_url, f'straggler_alert_active{{training_job_id="{job_id}"}}')

    series = services.wait_until(lambda: len(alert_series()) == 4 and alert_series(), DEADLINE_S,
                                 what="straggler_alert_active in Prometheus")
    active = {s["metric"]["training_rank"] for s in series if float(s["value"][1]) == 1}
    assert active == {"2"}
    labels = series[0]["metric"]
    assert labels["job"] == "otel-straggler-detector" and labels["instance"] == "shard-test"
    assert {"training_job_id", "training_cohort", "training_stage", "training_rank", "host_name",
            "training_local_rank"} <= set(labels)
    assert {(s["metric"]["training_rank"], s["metric"]["host_name"], s["metric"]["training_local_rank"])
            for s in series} == {(str(rank), "node-0", str(rank)) for rank in range(4)}

    # A hang of the same job, rank 5 the culprit: its own gauge, one series per culprit. And the
    # job against its baseline, one series per cohort (sent together: one wait for both).
    send_hang_metrics(pipeline.collector_grpc, job_id, culprit=5)
    send_job_slowdown_metrics(pipeline.collector_grpc, job_id, cohort="tp0-pp0", ratio=1.36)
    hang = services.wait_until(lambda: services.prometheus_query(
        pipeline.prometheus_url, f'straggler_job_hang{{training_job_id="{job_id}"}}'), DEADLINE_S, what="straggler_job_hang")
    assert len(hang) == 1 and {
        "training_job_id": job_id, "training_rank": "5", "host_name": "node-0", "training_local_rank": "5",
        "training_stage": "batch-generator", "reason": "never_entered_collective"}.items() <= hang[0]["metric"].items()
    job_slowdown = services.wait_until(lambda: services.prometheus_query(
        pipeline.prometheus_url, f'straggler_job_slowdown{{training_job_id="{job_id}"}}'), DEADLINE_S,
        what="straggler_job_slowdown")
    assert len(job_slowdown) == 1 and float(job_slowdown[0]["value"][1]) == 1.36
    assert {"training_job_id": job_id, "training_cohort": "tp0-pp0", "job": "otel-straggler-detector",
            "instance": "shard-test"}.items() <= job_slowdown[0]["metric"].items()

    for name in ("straggler_rank_slowdown", "straggler_verdicts_total", "straggler_detector_spans_total"):
        assert services.wait_until(lambda: services.prometheus_query(pipeline.prometheus_url, name), DEADLINE_S,
                                   what=name)
    verdicts = services.prometheus_query(
        pipeline.prometheus_url, f'straggler_verdicts_total{{training_job_id="{job_id}", verdict="straggler"}}')
    assert [v["metric"]["training_rank"] for v in verdicts] == ["2"]

    # The rules Prometheus evaluates (rules.yml) page for the straggler and the hang, naming the node.
    def firing():
        alerts = services.prometheus_query(
            pipeline.prometheus_url, f'ALERTS{{alertstate="firing", training_job_id="{job_id}"}}')
        found = {(a["metric"]["alertname"], a["metric"]["training_rank"], a["metric"].get("host_name")) for a in alerts}
        return found if len(found) >= 2 else None

    assert services.wait_until(firing, DEADLINE_S, what="TrainingStragglerDetected and TrainingJobHung firing") == {
        ("TrainingStragglerDetected", "2", "node-0"), ("TrainingJobHung", "5", "node-0")}

    # The straggler's page carries the detector's evidence in words, looked up by the rule's
    # template query on straggler_alert_evidence as the exporter labels it.
    def straggler_page():
        status, body = services.http_get(f"{pipeline.prometheus_url}/api/v1/alerts")
        if status != 200:
            return None
        return next((a["annotations"] for a in json.loads(body)["data"]["alerts"]
                     if a["labels"]["alertname"] == "TrainingStragglerDetected"
                     and a["labels"].get("training_job_id") == job_id), None)

    page = services.wait_until(straggler_page, DEADLINE_S, what="TrainingStragglerDetected's annotations")
    assert page["summary"].endswith(
        ": suspect gpu_throttled (SM clock 1410 MHz vs 1980 MHz at its peers; hw_thermal throttling; 89 °C)"), page
    assert page["next_step"] == "Check the node's cooling and power, then dcgmi diag -r 3 on its GPU.", page

    send_detector_metrics(pipeline.collector_grpc, job_id, slow_rank=2, ranks=range(4))
    generator = _generator()
    for title, expr in generator.panel_queries():
        query = generator.expand_variables(expr, job_id=job_id, rate_interval="1m")
        services.wait_until(lambda: services.prometheus_query(pipeline.prometheus_url, query), DEADLINE_S,
                            what=f"data for panel {title!r}: {query}")


def test_verdict_events_reach_the_events_file(pipeline):
    job_id = f"events-{uuid.uuid4().hex[:8]}"
    send_verdict_event(pipeline.collector_grpc, job_id, rank=2)
    events_path = Path(pipeline.events_path)

    def event_lines():
        if not events_path.exists():
            return None
        return [line for line in events_path.read_text().splitlines() if job_id in line] or None

    line = services.wait_until(event_lines, DEADLINE_S, what="event in the events file")[0]
    record = json.loads(line)["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
    assert record["eventName"] == "straggler.verdict"
    attributes = {a["key"]: a["value"] for a in record["attributes"]}
    assert attributes["verdict"] == {"stringValue": "straggler"}
