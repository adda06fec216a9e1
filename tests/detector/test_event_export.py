"""The detector's verdict events over our own OTLP logs export (event_export.py): the same records
over gRPC and HTTP, the logs variables before the general ones, and every event that is not
delivered counted by reason without the detector ever waiting on the export."""
from __future__ import annotations

import http.server
import threading
import time

import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.sdk.resources import Resource

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.event_export import SEVERITY_WARN, EventExporter
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.telemetry import DetectorTelemetry, verdict_attributes

PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                   "NO_PROXY", "no_proxy", "NETRC")


def straggler(rank: int = 3, at: int = 1_700_000_000_000_000_000) -> Verdict:
    return Verdict(time_unix_nano=at, job_id="job-1", cohort="tp0-pp0", stage="forward-compute", rank=rank,
                   window=7, verdict=contract.VERDICT_STRAGGLER, reason="persistent", slowdown=1.4, gap_ms=12.5,
                   rank_ms=40.0, reference_ms=28.5, reference_ranks=(0, 1, 2), timing="device",
                   attribution="compute", workload_comparable=True, host="node-0", local_rank=rank,
                   gpu={"sm_clock_mhz": 1410, "clock_event_reasons": ["hw_thermal"], "power_w": None},
                   also_slow=("backward-compute",))


class LogsReceiver(http.server.ThreadingHTTPServer):
    """POST /v1/logs (or any path): keeps (path, headers, body), answers 200 or the scripted status."""
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, dict, bytes]] = []
        self.statuses: list[int] = []
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"

    def records(self) -> list:
        return [(resource_logs, scope_logs, record)
                for _, _, body in self.requests
                for resource_logs in logs_service_pb2.ExportLogsServiceRequest.FromString(body).resource_logs
                for scope_logs in resource_logs.scope_logs for record in scope_logs.log_records]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        status = self.server.statuses.pop(0) if self.server.statuses else 200
        payload = logs_service_pb2.ExportLogsServiceResponse().SerializeToString()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def receiver(monkeypatch):
    for variable in PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    server = LogsReceiver()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def telemetry(tmp_path, environ: dict) -> DetectorTelemetry:
    return DetectorTelemetry(DetectorConfig(grpc_port=4317, evidence_dir=str(tmp_path)), health=dict,
                             rank_states=list, export_otlp=True, environ=environ)


def test_events_over_http_go_to_the_logs_endpoint_with_the_logs_settings_first(tmp_path, receiver):
    environ = {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": f"{receiver.endpoint}/custom/v1/logs",
               "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_HEADERS": "x-general=1,x-both=general",
               "OTEL_EXPORTER_OTLP_LOGS_HEADERS": "x-both=logs",
               "OTEL_EXPORTER_OTLP_LOGS_COMPRESSION": "none"}
    events = telemetry(tmp_path, environ)
    verdict = straggler()
    events.record_verdicts([verdict])
    events.shutdown(5.0)
    assert [path for path, _, _ in receiver.requests] == ["/custom/v1/logs"]
    headers = receiver.requests[0][1]
    assert headers["x-both"] == "logs" and "x-general" not in headers  # the logs variable, not merged
    [(resource_logs, scope_logs, record)] = receiver.records()
    resource = {kv.key: kv.value.string_value for kv in resource_logs.resource.attributes}
    assert resource["service.name"] == "otel-straggler-detector" and resource["service.instance.id"].endswith(":4317")
    assert scope_logs.scope.name == "otel_straggler.detector"
    assert record.event_name == contract.VERDICT_EVENT_NAME and record.severity_number == SEVERITY_WARN
    assert record.time_unix_nano == verdict.time_unix_nano and record.observed_time_unix_nano > 0
    assert record.body.string_value.startswith("rank 3 on node-0 (local rank 3) straggler (persistent)")
    attributes = {kv.key: kv.value for kv in record.attributes}
    assert list(attributes) == list(verdict_attributes(verdict))
    assert attributes["gpu.sm_clock_mhz"].int_value == 1410 and "gpu.power_w" not in attributes
    assert [value.string_value for value in attributes["gpu.clock_event_reasons"].array_value.values] == ["hw_thermal"]
    assert [value.int_value for value in attributes["reference_ranks"].array_value.values] == [0, 1, 2]
    assert attributes["workload_comparable"].bool_value is True
    assert not record.trace_id and not record.span_id and not record.severity_text
    assert events.export_failures == {} and events.events_dropped == {}


def test_the_general_endpoint_gets_the_logs_path_over_http(receiver):
    from otel_straggler.instrumentation.otlp_exporters import LOGS, sender

    exporter = EventExporter(sender(LOGS, "http/protobuf", {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}),
                             Resource.create({}), "scope", lambda reason, count: None, lambda: None)
    for index in range(3):
        exporter.emit(index, SEVERITY_WARN, "event", {}, "e")
    exporter.shutdown(5.0)
    assert {path for path, _, _ in receiver.requests} == {"/v1/logs"}
    assert len(receiver.records()) == 3 and exporter.exported == 3


def test_a_failed_export_is_counted_and_its_events_dropped_by_reason(tmp_path, receiver):
    receiver.statuses = [400]  # not retryable
    events = telemetry(tmp_path, {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": f"{receiver.endpoint}/v1/logs",
                                  "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/protobuf"})
    events.record_verdicts([straggler(0), straggler(1)])
    deadline = time.monotonic() + 10
    while not events.export_failures and time.monotonic() < deadline:
        time.sleep(0.02)
    events.record_verdicts([straggler(2)])  # exports work again
    events.shutdown(5.0)
    assert events.export_failures == {"logs": 1}
    assert events.events_dropped == {"export_failed": 2}
    assert len(receiver.requests) == 2 and len(receiver.records()) == 3  # the refused request held two


class BlockedSender:
    """A sender whose first send waits until released: the queue behind it fills."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sent: list[int] = []
        self.stopped = False

    def deadline(self, given=None) -> float:
        return time.monotonic() + 10 if given is None else given

    def send(self, body: bytes, count: int, deadline: float) -> bool:
        self.release.wait(max(0.0, deadline - time.monotonic()))
        if self.stopped or not self.release.is_set():
            return False
        self.sent.append(count)
        return True

    def shutdown(self) -> None:
        self.stopped = True
        self.release.set()


def test_emitting_never_waits_on_the_export_and_what_cannot_be_kept_is_counted():
    dropped: dict[str, int] = {}
    failed = []
    sender = BlockedSender()
    exporter = EventExporter(sender, Resource.create({}), "scope",
                             lambda reason, count: dropped.__setitem__(reason, dropped.get(reason, 0) + count),
                             lambda: failed.append(1), max_queue=4, max_batch=2)
    started = time.monotonic()
    exporter.emit(1, SEVERITY_WARN, "first", {}, "e")
    time.sleep(0.2)  # the worker took it and waits in send
    for index in range(6):
        exporter.emit(index, SEVERITY_WARN, "more", {"i": index}, "e")
    assert time.monotonic() - started < 1.0
    assert dropped == {"queue_full": 2}  # 4 queued behind the one being sent
    sender.release.set()
    exporter.shutdown(5.0)
    exporter.emit(9, SEVERITY_WARN, "late", {}, "e")
    assert sender.sent == [1, 2, 2] and exporter.exported == 5
    assert dropped == {"queue_full": 2, "shutdown": 1} and failed == []


def test_events_still_queued_when_the_shutdown_deadline_passes_are_counted():
    dropped: dict[str, int] = {}
    sender = BlockedSender()
    exporter = EventExporter(sender, Resource.create({}), "scope",
                             lambda reason, count: dropped.__setitem__(reason, dropped.get(reason, 0) + count),
                             lambda: None, max_batch=1)
    for index in range(3):
        exporter.emit(index, SEVERITY_WARN, "stuck", {}, "e")
    started = time.monotonic()
    exporter.shutdown(0.3)
    assert time.monotonic() - started < 2.0
    # the one in the send fails when the sender stops; the two behind it never left the queue
    assert dropped == {"export_failed": 1, "shutdown": 2} and sender.sent == []


def test_a_value_the_encoder_cannot_take_drops_that_event_only(receiver):
    from otel_straggler.instrumentation.otlp_exporters import LOGS, HttpSender

    dropped: dict[str, int] = {}

    class Broken:
        def __str__(self):
            raise ValueError("no words")

    exporter = EventExporter(HttpSender(LOGS, f"{receiver.endpoint}/v1/logs", {}), Resource.create({}), "scope",
                             lambda reason, count: dropped.__setitem__(reason, dropped.get(reason, 0) + count),
                             lambda: None)
    exporter.emit(1, SEVERITY_WARN, "bad", {"x": Broken()}, "e")
    exporter.emit(2, SEVERITY_WARN, "good", {"x": 1}, "e")
    exporter.shutdown(5.0)
    assert dropped == {"encode_failed": 1}
    assert [record.body.string_value for _, _, record in receiver.records()] == ["good"]


def test_one_metric_collection_reads_the_rank_states_once_and_the_next_reads_them_afresh(tmp_path):
    """The slowdown, alert-active and alert-evidence callbacks of one collection share a snapshot
    (each read takes the engine's lock and lists every compared stage and rank)."""
    from otel_straggler.detector.engine import RankState

    reads = []
    states = [RankState("job", 0, "c", "forward", 1, 1.3, True)]

    def rank_states():
        reads.append(1)
        return list(states)

    metrics = DetectorTelemetry(DetectorConfig(grpc_port=4317, evidence_dir=str(tmp_path), prometheus_port=0),
                                health=dict, rank_states=rank_states, export_otlp=False, environ={})
    try:
        def active() -> dict:
            data = metrics.scrape_reader.get_metrics_data()
            points = {}
            for resource in data.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name == "straggler.alert.active":
                            points.update({p.attributes["training.rank"]: p.value for p in metric.data.data_points})
            return points

        assert active() == {1: 1} and len(reads) == 1
        states[0] = states[0]._replace(alert_active=False, slowdown=1.0)
        assert active() == {1: 0} and len(reads) == 2
    finally:
        metrics.shutdown(5.0)
