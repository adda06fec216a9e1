"""DetectorService as the demo embeds it: lifecycle, listeners, status, rank state, and the three
outputs (evidence, OTLP metrics and events, Prometheus scrape) against the real engine."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler import contract
from otel_straggler.detector.config import ConfigError
from otel_straggler.detector.service import DetectorService

from otel_straggler.testing.otlp_spans import (heartbeat_span, per_step_requests, running_service, service_config,
                                               slow_rank_observations, verdict_records)

RANKS = 8
RULES = Path(__file__).resolve().parents[2] / "collector-config" / "prometheus" / "rules.yml"


def send_slow_rank_job(service, ranks: int = RANKS) -> None:
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{service.bound_ports[0]}", insecure=True, timeout=10)
    requests = per_step_requests(slow_rank_observations(ranks=ranks))
    # one heartbeat per rank: the job is watched for hangs, so its straggler.job.hang series exists
    requests[0] = requests[0] + [heartbeat_span(rank, 1_700_000_000_000_000_000, job_id="job-1") for rank in range(ranks)]
    for spans in requests:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_listeners_see_every_verdict_on_the_engine_thread_and_a_failing_one_is_counted(tmp_path):
    seen, threads = [], set()
    config = service_config(tmp_path)
    service = DetectorService(config)

    def listener(verdict):
        seen.append(verdict)
        threads.add(threading.current_thread().name)

    def broken_listener(verdict):
        raise RuntimeError("a bug in the demo")

    service.add_verdict_listener(broken_listener)
    service.add_verdict_listener(listener)
    service.start()
    send_slow_rank_job(service)
    assert service.stop(timeout_s=10)
    assert {v.rank for v in seen if v.verdict == contract.VERDICT_STRAGGLER} == {3}
    assert threads == {"straggler-engine"}
    written = verdict_records(Path(config.evidence_dir) / "verdicts.jsonl")
    assert [record["rank"] for record in written] == [v.rank for v in seen]
    status = json.loads((Path(config.evidence_dir) / "status.json").read_text())
    assert status["errors"]["listener"] == len(seen)
    assert status["spans"]["accepted"] == RANKS * 5 * 40
    assert status["verdicts"]["straggler"] == len([v for v in seen if v.verdict == contract.VERDICT_STRAGGLER])
    assert status["engine"]["windows_closed"] > 0


def test_rank_state_shows_the_alert_while_running(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        send_slow_rank_job(service)
        wait_for(lambda: any(state.alert_active for state in service.rank_state()))
        alerted = {state.rank for state in service.rank_state() if state.alert_active}
        assert alerted == {3}
        assert service.status()["state"] == "running"


def test_lifecycle_errors_are_clear(tmp_path):
    service = DetectorService(service_config(tmp_path))
    with pytest.raises(RuntimeError):
        service.bound_ports
    assert service.stop() is True  # stopping a service never started is harmless
    service.start()
    with pytest.raises(RuntimeError):
        service.start()
    assert service.stop() is True
    assert service.status()["state"] == "stopped"


def test_a_port_in_use_fails_start_and_leaves_nothing_running(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = {thread.name for thread in threading.enumerate()}
        service = DetectorService(service_config(tmp_path, http_port=taken.getsockname()[1]))
        with pytest.raises(OSError):
            service.start()
        time.sleep(0.2)
        leftover = {thread.name for thread in threading.enumerate()} - before
        assert not {name for name in leftover if name.startswith("straggler-")}


@pytest.mark.parametrize("changes, complaint", [
    ({"auth_token_file": "/nonexistent/token"}, "--auth-token-file"),
    ({"auth_token_file": "{empty}", }, "is empty"),
    ({"auth_token_file": "{token}", "auth_token": "x"}, "give one of them"),
    ({"tls_cert_file": "/nonexistent.crt", "tls_key_file": "/nonexistent.key"}, "--tls-cert-file"),
])
def test_bad_auth_or_tls_settings_fail_start_with_one_line(tmp_path, changes, complaint):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text("t\n")
    changes = {key: value.format(empty=tmp_path / "empty", token=tmp_path / "token") for key, value in changes.items()}
    service = DetectorService(service_config(tmp_path, **changes))
    with pytest.raises(ConfigError, match=re.escape(complaint)) as error:
        service.start()
    assert "\n" not in str(error.value)


def test_verdict_metrics_and_events_are_exported_over_otlp(tmp_path, monkeypatch):
    from pipeline.otlp_sink import OtlpSink, attributes_of

    with OtlpSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://{sink.endpoint}")
        config = service_config(tmp_path, export_metrics=True, metric_export_interval_s=0.2)
        with running_service(config) as service:
            send_slow_rank_job(service)
            wait_for(lambda: any(state.alert_active for state in service.rank_state()))
            time.sleep(0.5)  # a periodic export while the alert is active
        points = {}
        for request in sink.metric_requests:
            for resource_metrics in request.resource_metrics:
                assert attributes_of(resource_metrics.resource.attributes)["service.name"] == "otel-straggler-detector"
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        data = getattr(metric, metric.WhichOneof("data"))
                        for point in data.data_points:
                            points.setdefault(metric.name, []).append((attributes_of(point.attributes), _value(point)))
        alerts = [attributes for attributes, value in points[contract.METRIC_ALERT_ACTIVE] if value == 1]
        assert {attributes[contract.RANK] for attributes in alerts} == {3}
        assert set(alerts[0]) == {contract.JOB_ID, contract.COHORT, contract.STAGE, contract.RANK, contract.HOST_NAME}
        assert alerts[0][contract.HOST_NAME] == "node-0"  # from the rank's resource
        assert any(value > 1.1 for attributes, value in points[contract.METRIC_RANK_SLOWDOWN]
                   if attributes[contract.RANK] == 3)
        verdict_counts = [attributes for attributes, _ in points[contract.METRIC_VERDICTS]]
        assert {"verdict", "reason", contract.STAGE, contract.RANK, contract.JOB_ID, contract.HOST_NAME} == \
            set(verdict_counts[0])
        assert [value for attributes, value in points[contract.METRIC_JOB_HANG]][-1:] == [0]  # watched, no hang
        # the job is slower while rank 3 is, but that is rank 3's alert (no job_slowdown verdict)
        assert {(attributes[contract.JOB_ID], attributes[contract.COHORT])
                for attributes, _ in points[contract.METRIC_JOB_SLOWDOWN]} == {("job-1", "tp0-pp0")}
        spans = {attributes["outcome"]: value for attributes, value in points[contract.METRIC_DETECTOR_SPANS]}
        assert spans["accepted"] == RANKS * 5 * 40 and spans["malformed"] == 0
        for health in ("straggler.detector.windows.closed", "straggler.detector.ingest.lag",
                       "straggler.detector.requests", "straggler.detector.queue.spans"):
            assert health in points
        events = [record for _, record in sink.log_records()]
        written = verdict_records(Path(config.evidence_dir) / "verdicts.jsonl")
        assert len(events) == len(written) > 0
        assert all(record.event_name == contract.VERDICT_EVENT_NAME for record in events)
        first = attributes_of(events[0].attributes)
        assert first["rank"] == written[0]["rank"] and first["verdict"] == written[0]["verdict"]
        # every evidence-file field that is not null, and for an alert what it points at and what to do
        advice = {"suspect", "next_step"} if written[0]["verdict"] == contract.VERDICT_STRAGGLER else set()
        assert set(first) == {key for key, value in written[0].items() if value is not None} | advice
        evidence = [attributes for attributes, value in points[contract.METRIC_ALERT_EVIDENCE] if value == 1]
        assert {attributes[contract.RANK] for attributes in evidence} == {3}
        assert evidence[0]["suspect"] == "unknown" and evidence[0]["gpu"] == ""  # host timing, no GPU samples
        assert evidence[0]["next_step"].startswith("Check, in this order: its GPU on node-0")


def _value(point) -> float:
    """A number data point's value, or a histogram point's count."""
    if hasattr(point, "as_int"):
        return point.as_double if point.WhichOneof("value") == "as_double" else point.as_int
    return point.count


def test_without_an_endpoint_nothing_is_exported_and_nothing_complains(tmp_path, monkeypatch, caplog):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with running_service(service_config(tmp_path, export_metrics=True)) as service:
        send_slow_rank_job(service)
        assert not service._telemetry.exporting_metrics and not service._telemetry.exporting_events
    assert not [record for record in caplog.records if record.levelname in ("WARNING", "ERROR")]


def test_idle_scrape_connections_are_bounded_and_taken_back(tmp_path, monkeypatch):
    """Connections that never send a request fill the endpoint's slots (more get 503 at once, no
    thread each) until the request deadline frees them; both counted."""
    from otel_straggler.detector import http_server, telemetry_prometheus

    monkeypatch.setattr(http_server, "REQUEST_DEADLINE_S", 1.0)
    with running_service(service_config(tmp_path, prometheus_port=0)) as service:
        address = ("127.0.0.1", service.prometheus_port)
        idle = [socket.create_connection(address, timeout=5) for _ in range(telemetry_prometheus.MAX_SCRAPE_CONNECTIONS)]
        try:
            time.sleep(0.2)
            with socket.create_connection(address, timeout=5) as refused:
                assert refused.recv(4096).startswith(b"HTTP/1.1 503 ")
            deadline = time.monotonic() + 10
            while True:
                try:
                    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=5) as response:
                        assert response.status == 200
                        break
                except (OSError, urllib.error.HTTPError):
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            # the first slot freed lets the scrape in; the rest are shut at their own deadlines
            # (their threads started at different times), each seen here as the server's EOF
            for connection in idle:
                assert connection.recv(4096) == b""
        finally:
            for connection in idle:
                connection.close()
        errors = service.status()["errors"]
        assert errors.get("prometheus_refused", 0) >= 1
        assert errors.get("prometheus_request_deadline") == telemetry_prometheus.MAX_SCRAPE_CONNECTIONS


def test_the_prometheus_endpoint_serves_the_names_the_alert_rules_use(tmp_path):
    with running_service(service_config(tmp_path, prometheus_port=0)) as service:
        send_slow_rank_job(service)
        wait_for(lambda: service.status()["verdicts"].get(contract.VERDICT_STRAGGLER))  # emitted, so counted
        url = f"http://127.0.0.1:{service.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)
    exposed = set(re.findall(r"^([a-z_]+)[{ ]", text, re.MULTILINE))
    # The alert expressions must find their series. Annotations may name other metrics in their
    # advice, and look up straggler_alert_evidence, which they do without (a generic next_step).
    rules = yaml.safe_load(RULES.read_text())
    exprs = " ".join(rule["expr"] for group in rules["groups"] for rule in group["rules"])
    used_by_rules = set(re.findall(r"\b(straggler_[a-z_]+)", exprs))
    assert used_by_rules and used_by_rules <= exposed
    assert re.search(r'^straggler_alert_active\{training_job_id="job-1",training_cohort="tp0-pp0",'
                     r'training_stage="[^"]+",training_rank="3",host_name="node-0"\} 1$', text, re.MULTILINE)
    assert re.search(r'^straggler_job_hang\{training_job_id="job-1",training_rank="-1",host_name="",'
                     r'training_local_rank="-1",training_stage="\*",reason="none"\} 0$', text, re.MULTILINE)
    assert re.search(r'^straggler_job_slowdown\{training_job_id="job-1",training_cohort="tp0-pp0"\} [0-9.]+$',
                     text, re.MULTILINE)
    assert f'straggler_detector_spans_total{{outcome="accepted"}} {RANKS * 5 * 40}' in text
    assert "# TYPE straggler_detector_ingest_lag_seconds histogram" in text
