"""Where spans and the rank's own metrics go: OTLP exporters chosen by the standard
OTEL_EXPORTER_OTLP_* variables (or configure() arguments), behind a counting wrapper so every
export failure is known by number. Spans go through our exporters (otlp_exporters: encoded by
span_encoding, not the SDK's encoder, which costs several times the GIL-holding time per span),
over gRPC (the default) and over HTTP; the rank's metrics through the SDK's exporters."""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping, Optional, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_straggler.otlp_environ import check_exporter_environ, resolve_protocol



def _http_url(endpoint: str, path: str) -> str:
    base = endpoint if "://" in endpoint else f"http://{endpoint}"
    return base if base.rstrip("/").endswith(path) else base.rstrip("/") + path


def span_exporter(endpoint: Optional[str], protocol: Optional[str],
                  environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """An OTLP span exporter of ours (otlp_exporters); an explicit endpoint wins over the env."""
    protocol = resolve_protocol(protocol, environ, "TRACES")
    check_exporter_environ("traces", protocol, environ)
    from otel_straggler.instrumentation.otlp_exporters import GrpcSpanExporter, HttpSpanExporter

    if protocol == "grpc":
        return GrpcSpanExporter(endpoint, environ)
    return HttpSpanExporter(_http_url(endpoint, "/v1/traces") if endpoint else None, environ)


def metric_exporter(endpoint: Optional[str], protocol: Optional[str], environ: Mapping[str, str] = os.environ):
    protocol = resolve_protocol(protocol, environ, "METRICS")
    check_exporter_environ("metrics", protocol, environ)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint, insecure=_insecure(endpoint))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HTTPMetricExporter

    return HTTPMetricExporter(endpoint=_http_url(endpoint, "/v1/metrics") if endpoint else None)


def _insecure(endpoint: Optional[str]) -> Optional[bool]:
    if endpoint is None:
        return None  # the exporter decides from OTEL_EXPORTER_OTLP_INSECURE / the env endpoint
    return not endpoint.startswith("https://")


class CountingSpanExporter(SpanExporter):
    """Counts spans exported and spans lost to failed exports, then delegates."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        # spans may be queued encoded where the exporter can take them so (see SpanEncoder.prewrite)
        self.prewrite: Optional[Callable[[ReadableSpan], Any]] = getattr(exporter, "prewrite", None)
        self.prewrite_many: Optional[Callable[[list[ReadableSpan]], list]] = (
            getattr(exporter, "prewrite_many", None) if self.prewrite is not None else None)
        inner_within = getattr(exporter, "export_within", None)
        # export by a deadline, where the exporter can (the batching processor gives one)
        self.export_within: Optional[Callable[[Sequence[Any], Optional[float]], SpanExportResult]] = (
            None if inner_within is None else self._export_within)
        self.exported = 0
        self.export_failed = 0
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return self._export_within(spans, None)

    def _export_within(self, spans: Sequence[Any], deadline: Optional[float]) -> SpanExportResult:
        try:
            export_within = getattr(self.exporter, "export_within", None)
            if deadline is None or export_within is None:
                result = self.exporter.export(spans)
            else:
                result = export_within(spans, deadline)
        except Exception:
            result = SpanExportResult.FAILURE
        with self._lock:
            if result == SpanExportResult.SUCCESS:
                self.exported += len(spans)
            else:
                self.export_failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def start_rank_metrics(
    read_status: Callable[[], dict],
    resource,
    endpoint: Optional[str],
    protocol: Optional[str],
    environ: Mapping[str, str] = os.environ,
    gpu: Any = None,
):
    """The rank's own loss counters as OTel metrics (`straggler.instrumentation.*`), read from
    status() at each collection, so the hot path pays nothing for them. With `gpu` (a
    gpu_health.GpuHealth), also its latest sample as the OTel hardware metrics (`hw.*`)."""
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    # the period comes from OTEL_METRIC_EXPORT_INTERVAL, as for any SDK metric reader
    reader = PeriodicExportingMetricReader(metric_exporter(endpoint, protocol, environ))
    provider = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)  # the pipeline's
    meter = provider.get_meter("otel_straggler.instrumentation")

    def lost(options: CallbackOptions):
        return [Observation(count, {"reason": reason}) for reason, count in read_status()["lost"].items()]

    def spans(options: CallbackOptions):
        status = read_status()
        return [Observation(status[key], {"outcome": key})
                for key in ("intervals", "spans_built", "heartbeats", "exported")]

    meter.create_observable_counter("straggler.instrumentation.lost", [lost], unit="{interval}",
                                    description="intervals or spans lost on the rank, by reason")
    meter.create_observable_counter("straggler.instrumentation.spans", [spans], unit="{span}",
                                    description="intervals taken to be built or dropped, spans built, "
                                                "heartbeats built, spans exported")

    def gpu_errors(options: CallbackOptions):
        return [Observation(count, {"kind": kind}) for kind, count in read_status()["gpu_health"]["errors"].items()]

    meter.create_observable_counter("straggler.instrumentation.gpu_health.errors", [gpu_errors], unit="{error}",
                                    description="GPU health sampling errors, by kind (not_supported: once per field)")
    if gpu is not None:
        _hardware_metrics(meter, gpu)
    return provider


def _hardware_metrics(meter, gpu) -> None:
    """The GPU's latest health sample as the OTel semantic conventions' hardware metrics
    (hw.gpu.utilization and hw.power, hw.temperature gauges; hw.gpu.memory.usage an
    up-down counter, observed as the current value), read at collection: nothing when the
    sampler has no sample (off, stopped) or the field is not supported."""
    from opentelemetry.metrics import CallbackOptions, Observation

    from otel_straggler import contract
    from otel_straggler.instrumentation.gpu_health import MEMORY_USED

    def observe(key: str, **extra: str):
        def callback(options: CallbackOptions):
            latest = gpu.latest  # replaced whole by each sample: one read
            value = latest.get(key)
            if value is None:
                return []
            attributes = {"hw.type": "gpu", "hw.id": str(latest.get(contract.GPU_UUID, "")), **extra}
            if gpu.name:
                attributes["hw.name"] = gpu.name
            return [Observation(value, attributes)]
        return [callback]

    meter.create_observable_gauge("hw.gpu.utilization", observe(contract.GPU_UTILIZATION, **{"hw.gpu.task": "general"}),
                                  unit="1", description="Fraction of time spent in a specific task")
    meter.create_observable_up_down_counter("hw.gpu.memory.usage", observe(MEMORY_USED), unit="By",
                                            description="GPU memory used")
    meter.create_observable_gauge("hw.power", observe(contract.GPU_POWER_W), unit="W",
                                  description="Instantaneous power consumed by the component")
    meter.create_observable_gauge("hw.temperature", observe(contract.GPU_TEMPERATURE_C), unit="Cel",
                                  description="Temperature in degrees Celsius")
