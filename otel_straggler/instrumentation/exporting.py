"""Where spans and the rank's own metrics go: OTLP exporters chosen by the standard
OTEL_EXPORTER_OTLP_* variables (or configure() arguments), behind a counting wrapper so every
export failure is known by number. Spans are encoded by span_encoding, not the SDK's encoder
(several times the GIL-holding time per span), over gRPC (the default) and over HTTP, where they
also go out over one kept-alive connection (http_transport) instead of a requests Session when
the endpoint allows (no proxy, no credentials)."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import types
from typing import Any, Callable, Mapping, Optional, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_straggler.otlp_environ import check_exporter_environ, resolve_protocol

_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
# set: the SDK's HTTP exporter sends through that provider's requests Session, which stays
_HTTP_CREDENTIAL_PROVIDER_VARIABLES = ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                                       "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER")
_logger = logging.getLogger(__name__)


def _http_url(endpoint: str, path: str) -> str:
    base = endpoint if "://" in endpoint else f"http://{endpoint}"
    return base if base.rstrip("/").endswith(path) else base.rstrip("/") + path


def span_exporter(endpoint: Optional[str], protocol: Optional[str], environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """An OTLP span exporter; an explicit endpoint wins over the env, which the exporters read."""
    protocol = resolve_protocol(protocol, environ, "TRACES")
    check_exporter_environ("traces", protocol, environ)
    if protocol == "grpc":
        return _grpc_span_exporter_class()(endpoint=endpoint, insecure=_insecure(endpoint))
    return _http_span_exporter_class()(endpoint=_http_url(endpoint, "/v1/traces") if endpoint else None)


@functools.cache
def _grpc_span_exporter_class() -> type:
    """The SDK's OTLP/gRPC span exporter (its channel, headers, TLS, retries and timeouts),
    encoding with our SpanEncoder instead of the SDK's encoder, which costs several times more
    GIL-holding time per span. Made on first use: grpc is imported only when it is needed."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                          ExportTraceServiceResponse)

    from otel_straggler.instrumentation.span_encoding import SpanEncoder

    class EncodedExport:
        """TraceService/Export taking the request as encoded bytes: the stub's own method would
        take a message, which the bytes would first be parsed into and then serialized from
        again (1.2 µs a span, holding the GIL)."""

        def __init__(self, channel) -> None:
            self.Export = channel.unary_unary(_EXPORT_METHOD, request_serializer=None,
                                              response_deserializer=ExportTraceServiceResponse.FromString)

    class PrewrittenOTLPSpanExporter(OTLPSpanExporter):
        """Exports ReadableSpans and spans already encoded by `prewrite` (SpanEncoder.prewrite)."""

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self._encoder = SpanEncoder()
            self.prewrite = self._encoder.prewrite

        def _initialize_channel_and_stub(self) -> None:
            # the SDK makes its channel and stub here, in __init__ and again to reconnect after
            # UNAVAILABLE: each new channel gets the bytes-taking Export
            super()._initialize_channel_and_stub()
            self._client = EncodedExport(self._channel)

        def _translate_data(self, data: Sequence[Any]) -> Any:
            encoded = self._encoder.encode(data)
            if isinstance(self._client, EncodedExport):
                return encoded
            # a stub we did not replace (an SDK that makes it elsewhere): parsing the bytes back
            # is C code, far cheaper than building the message in Python
            return ExportTraceServiceRequest.FromString(encoded)

    return PrewrittenOTLPSpanExporter


def metric_exporter(endpoint: Optional[str], protocol: Optional[str], environ: Mapping[str, str] = os.environ):
    protocol = resolve_protocol(protocol, environ, "METRICS")
    check_exporter_environ("metrics", protocol, environ)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint, insecure=_insecure(endpoint))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HTTPMetricExporter

    return HTTPMetricExporter(endpoint=_http_url(endpoint, "/v1/metrics") if endpoint else None)


@functools.cache
def _http_span_exporter_class() -> type:
    """The SDK's OTLP/HTTP span exporter (its endpoint, headers, TLS, compression, retries and
    timeouts), encoding with our SpanEncoder and sending over a KeptAliveHTTPTransport. Where the
    SDK's transport must stay (a proxy, credentials in the URL or a netrc file, a credential
    provider's session), only the encoding is ours; where the SDK is not shaped as this expects
    (its `_client` sending encoded bytes), the SDK's own export runs, unchanged."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from otel_straggler.instrumentation.span_encoding import SpanEncoder

    try:
        from otel_straggler.instrumentation import http_transport
    except ImportError:  # the SDK's transport interface (a private module of a beta package) moved
        http_transport = None
    try:
        from opentelemetry.exporter.otlp.proto.http._common import RequestPayloadTooLargeError
    except ImportError:
        RequestPayloadTooLargeError = ValueError

    class PrewrittenHTTPSpanExporter(OTLPSpanExporter):
        """Exports ReadableSpans and spans already encoded by `prewrite` (SpanEncoder.prewrite)."""

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self._encoder: Optional[SpanEncoder] = None
            client = getattr(self, "_client", None)
            sends_bytes = callable(getattr(client, "export", None))
            if not sends_bytes or not isinstance(getattr(self, "_max_request_size", None), int):
                return
            self._encoder = SpanEncoder()
            self.prewrite = self._encoder.prewrite
            session = getattr(getattr(client, "_transport", None), "_session", None)
            credential_session = any(os.environ.get(variable) for variable in _HTTP_CREDENTIAL_PROVIDER_VARIABLES)
            if (http_transport is not None and session is not None and not credential_session
                    and http_transport.usable_for(self._endpoint)):
                client._transport.close()
                client._transport = http_transport.KeptAliveHTTPTransport(verify=session.verify, cert=session.cert)

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            if self._encoder is None:
                return super().export(spans)
            if getattr(self, "_shutdown", False):
                return SpanExportResult.FAILURE
            metrics = getattr(self, "_metrics", None)  # the SDK's own exporter metrics, where it keeps them
            with (metrics.export_operation(len(spans)) if metrics is not None
                  else contextlib.nullcontext(types.SimpleNamespace())) as outcome:
                try:
                    body = self._encoder.encode(spans)
                except Exception as error:
                    _logger.exception("otel-straggler: could not encode %d spans", len(spans))
                    outcome.error = error
                    return SpanExportResult.FAILURE
                if 0 < self._max_request_size < len(body):  # 0 or less: no limit, as in the SDK
                    _logger.warning("otel-straggler: dropping %d spans, %d bytes encoded, over the exporter's "
                                    "max_request_size of %d", len(spans), len(body), self._max_request_size)
                    outcome.error = RequestPayloadTooLargeError(
                        f"Serialized span request size {len(body)} bytes exceeds max_request_size "
                        f"{self._max_request_size} bytes.")
                    return SpanExportResult.FAILURE
                sent = self._client.export(body)
                if not sent.success:  # recorded as the SDK's own export records it
                    outcome.error = sent.error
                    if sent.status_code is not None:
                        outcome.error_attrs = {"http.response.status_code": sent.status_code}
                    return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

    return PrewrittenHTTPSpanExporter


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
        self.exported = 0
        self.export_failed = 0
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        try:
            result = self.exporter.export(spans)
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
                                    description="intervals recorded, spans built, heartbeats built, spans exported")

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
