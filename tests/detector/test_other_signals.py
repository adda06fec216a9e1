"""Ranks exporting straight to the detector also export their own metrics: the detector accepts
and drops metrics and logs, counted, so those exporters neither fail nor retry."""
from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from otel_straggler.testing.otlp_spans import running_service, service_config
from .test_receiver import post


def export_one_counter(exporter) -> bool:
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("test").create_counter("straggler.instrumentation.spans").add(3, {"outcome": "exported"})
    try:
        return reader.force_flush(10_000)
    finally:
        provider.shutdown()


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_metrics_sent_to_the_detector_are_accepted_counted_and_dropped(tmp_path, transport):
    with running_service(service_config(tmp_path)) as service:
        grpc_port, http_port = service.bound_ports
        if transport == "grpc":
            exporter = GrpcMetricExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True, timeout=10)
        else:
            exporter = HttpMetricExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/metrics", timeout=10)
        assert export_one_counter(exporter)
        status = service.status()
        assert set(status["requests"]) == {"other_signal"}  # the flush, and the provider's last export
        assert status["requests"]["other_signal"] >= 1
        assert status["spans"]["accepted"] == 0


def test_logs_over_http_get_an_empty_answer_and_other_paths_stay_unknown(tmp_path):
    with running_service(service_config(tmp_path)) as service:
        http_port = service.bound_ports[1]
        assert post(http_port, b"", path="/v1/logs")[0] == 200
        assert post(http_port, b"", path="/v1/profiles")[0] == 404
        assert post(http_port, b"", path="/v1/metrics", method="GET")[0] == 405
        assert service.status()["requests"] == {"other_signal": 1}
