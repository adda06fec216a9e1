"""Shared set-up for the rank-side tests: a clean environment, configure() with a guaranteed
shutdown, in-memory span collection, a fake Megatron parallel state, and in-test OTLP
receivers (gRPC and HTTP) on free 127.0.0.1 ports."""
from __future__ import annotations

import gzip
import http.server
import os
import socket
import sys
import threading
import time
import types
from concurrent import futures
from typing import Any, Callable, Optional

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_straggler
from otel_straggler.instrumentation import rank_state
from otel_straggler.processors.cuda_event_span_processor import CudaEventSpanProcessor

# Everything that steers configuration or identity; each test starts without any of it.
_ENV_PREFIXES = ("OTEL_", "SLURM_", "TORCHELASTIC_")
_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_MEGATRON_STATE = "megatron.core.parallel_state"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.delitem(sys.modules, _MEGATRON_STATE, raising=False)
    assert otel_straggler.current() is None, "a previous test left the instrumentation on"


@pytest.fixture
def configure() -> Callable[..., otel_straggler.Instrumentation]:
    """otel_straggler.configure(), shut down after the test whatever happens (configure() is
    process-global: the next test's configure() must start from scratch)."""
    handles: list = []

    def configure_for_test(**kwargs: Any) -> otel_straggler.Instrumentation:
        kwargs.setdefault("build_interval_ms", 5.0)
        # heartbeats off unless a test asks for them (keyword or env): most tests count their spans exactly
        if "OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS" not in kwargs.get("environ", os.environ):
            kwargs.setdefault("heartbeat_interval_ms", 0)
        handle = otel_straggler.configure(**kwargs)
        handles.append(handle)
        return handle

    yield configure_for_test
    for handle in handles:
        handle.shutdown(timeout_s=3.0)
    assert rank_state.current_recorder() is None and otel_straggler.current() is None


class InMemorySpans:
    """The instrumentation on a user's TracerProvider that keeps finished spans in memory;
    with a device backend, a CudaEventSpanProcessor sits in front of the in-memory export."""

    def __init__(self, configure: Callable[..., otel_straggler.Instrumentation]) -> None:
        self._configure = configure
        self.exporter = InMemorySpanExporter()
        self.provider: Optional[TracerProvider] = None
        self.device_processor: Optional[CudaEventSpanProcessor] = None
        self.handle: Optional[otel_straggler.Instrumentation] = None

    def configure(self, device_backend: Any = None, readout_timeout_s: float = 5.0,
                  **kwargs: Any) -> otel_straggler.Instrumentation:
        self.provider = TracerProvider()
        processor = SimpleSpanProcessor(self.exporter)
        if device_backend is not None:
            processor = self.device_processor = CudaEventSpanProcessor(
                processor, device_backend, readout_timeout_s=readout_timeout_s, poll_interval_s=0.001)
            kwargs["device_processor"] = processor
        self.provider.add_span_processor(processor)
        kwargs.setdefault("job_id", "job-in-memory")
        kwargs.setdefault("rank", 0)
        self.handle = self._configure(tracer_provider=self.provider, **kwargs)
        return self.handle

    def spans(self) -> list:
        assert self.handle.flush(timeout_s=5.0)
        return list(self.exporter.get_finished_spans())

    def stage_spans(self) -> list:
        return [span for span in self.spans() if span.name not in ("train.step", "train.heartbeat")]

    def heartbeats(self) -> list:
        return [span for span in self.exporter.get_finished_spans() if span.name == "train.heartbeat"]

    def close(self) -> None:
        if self.handle is not None:
            self.handle.shutdown(timeout_s=3.0)
        if self.device_processor is not None:
            self.device_processor.backend.complete_all()
        if self.provider is not None:
            self.provider.shutdown()


@pytest.fixture
def in_memory(configure) -> InMemorySpans:
    spans = InMemorySpans(configure)
    yield spans
    spans.close()


def fake_parallel_state(tp=(1, 2), pp=(0, 2), cp=(0, 1), ep=(0, 1), dp=(3, 4), vpp=None) -> types.ModuleType:
    """A stand-in for megatron.core.parallel_state: (rank, size) per dimension, None when the
    dimension is not in use (Megatron returns None for VPP then)."""
    state = types.ModuleType(_MEGATRON_STATE)
    state.model_parallel_is_initialized = lambda: True
    for dim, getter in (("tensor_model", tp), ("pipeline_model", pp), ("context", cp),
                        ("expert_model", ep), ("data", dp), ("virtual_pipeline_model", vpp)):
        rank, size = getter if getter is not None else (None, None)
        setattr(state, f"get_{dim}_parallel_rank", lambda rank=rank: rank)
        setattr(state, f"get_{dim}_parallel_world_size", lambda size=size: size)
    return state


@pytest.fixture
def megatron_state(monkeypatch: pytest.MonkeyPatch) -> Callable[..., types.ModuleType]:
    """Installs a fake Megatron parallel state in sys.modules, as an initialised Megatron has."""

    def install(**dims: Any) -> types.ModuleType:
        state = fake_parallel_state(**dims)
        monkeypatch.setitem(sys.modules, _MEGATRON_STATE, state)
        return state

    return install


def poll_until(condition: Callable[[], Any], timeout_s: float = 5.0, interval_s: float = 0.005) -> Any:
    """Polls a condition on background work; returns its last value (falsy if it timed out)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(interval_s)
    return value


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    return poll_until


@pytest.fixture
def unreachable_endpoint() -> str:
    """A 127.0.0.1 address nothing listens on: the port was bound once by us, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


# -- in-test OTLP receivers ------------------------------------------------------------------

def any_value(value) -> Any:
    """An OTLP AnyValue as the Python value it carries, keeping its wire type (int vs str)."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def attributes(key_values) -> dict:
    return {item.key: any_value(item.value) for item in key_values}


class ReceivedSpan:
    __slots__ = ("resource", "span", "attributes")

    def __init__(self, resource: dict, span) -> None:
        self.resource = resource
        self.span = span
        self.attributes = attributes(span.attributes)


class OtlpReceiver:
    """What an in-test receiver got: decoded trace and metric export requests (list.append is
    atomic, readers take a copy). `endpoint` and `protocol` are what configure() takes."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.endpoint = ""
        self.trace_requests: list = []
        self.metric_requests: list = []

    def spans(self) -> list[ReceivedSpan]:
        return [ReceivedSpan(attributes(resource_spans.resource.attributes), span)
                for request in list(self.trace_requests) for resource_spans in request.resource_spans
                for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]

    def metric_points(self) -> dict[str, list[tuple[dict, Any]]]:
        """Metric name -> (attributes, value) of each of its data points."""
        points: dict[str, list] = {}
        for request in list(self.metric_requests):
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        for point in getattr(metric, metric.WhichOneof("data")).data_points:
                            value = getattr(point, point.WhichOneof("value"))
                            points.setdefault(metric.name, []).append((attributes(point.attributes), value))
        return points


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.trace_requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.metric_requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


@pytest.fixture
def grpc_receiver() -> OtlpReceiver:
    """An OTLP/gRPC receiver for traces and metrics."""
    receiver = OtlpReceiver("grpc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(receiver), server)
    receiver.endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield receiver
    server.stop(grace=None)


class _OtlpHttpHandler(http.server.BaseHTTPRequestHandler):
    routes = {  # path -> (request type, response type, where the receiver keeps requests)
        "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse,
                       "trace_requests"),
        "/v1/metrics": (metrics_service_pb2.ExportMetricsServiceRequest,
                        metrics_service_pb2.ExportMetricsServiceResponse, "metric_requests"),
    }

    def do_POST(self) -> None:
        route = self.routes.get(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if route is None:
            self.send_error(404)
            return
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request_type, response_type, kept_in = route
        request = request_type()
        request.ParseFromString(body)
        getattr(self.server.receiver, kept_in).append(request)
        payload = response_type().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass  # keep the test output to the assertions


@pytest.fixture
def http_receiver() -> OtlpReceiver:
    """An OTLP/HTTP (protobuf) receiver for POST /v1/traces and /v1/metrics."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttpHandler)
    server.daemon_threads = True
    server.receiver = receiver = OtlpReceiver("http/protobuf")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="otlp-http-receiver",
                              daemon=True)
    thread.start()
    receiver.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield receiver
    server.shutdown()
    server.server_close()


@pytest.fixture(params=["grpc", "http"])
def otlp_receiver(request) -> OtlpReceiver:
    """Each test using it runs once per OTLP transport."""
    return request.getfixturevalue(f"{request.param}_receiver")
