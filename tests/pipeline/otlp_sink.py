"""A minimal OTLP/gRPC receiver that records what it is sent: a stand-in for a detector shard.

It answers the three OTLP export services, keeps every request, and can demand TLS and a bearer
token the way `otel-straggler detect --tls-cert-file ... --auth-token-file ...` does, so the
collector's side of routing and auth is tested without the detector.
"""

from __future__ import annotations

import subprocess
import threading
from concurrent import futures
from pathlib import Path
from typing import Optional

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from otel_straggler.testing.services import LOOPBACK


def attributes_of(key_values) -> dict:
    """OTLP KeyValue list → plain dict (string, int, double, bool values)."""
    out = {}
    for kv in key_values:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind) if kind else None
    return out


class OtlpSink:
    def __init__(self, port: int = 0, token: Optional[str] = None,
                 tls: Optional[tuple[Path, Path]] = None) -> None:
        """port 0 picks a free one; token demands `authorization: Bearer <token>`;
        tls is (certificate, private key) PEM files."""
        self.token = token
        self.tls = tls
        self.requested_port = port
        self.port = 0
        self.lock = threading.Lock()
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.log_requests: list[logs_service_pb2.ExportLogsServiceRequest] = []
        self.authorization_headers: list[str] = []
        self.refused = 0
        self.server: Optional[grpc.Server] = None

    # -- lifecycle --
    def start(self) -> "OtlpSink":
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        sink = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                sink._admit(context)
                with sink.lock:
                    sink.trace_requests.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                sink._admit(context)
                with sink.lock:
                    sink.metric_requests.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request, context):
                sink._admit(context)
                with sink.lock:
                    sink.log_requests.append(request)
                return logs_service_pb2.ExportLogsServiceResponse()

        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), self.server)
        address = f"{LOOPBACK}:{self.requested_port}"
        if self.tls:
            cert, key = self.tls
            credentials = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1).wait(5)
            self.server = None

    def __enter__(self) -> "OtlpSink":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    # -- what arrived --
    def _admit(self, context) -> None:
        metadata = dict(context.invocation_metadata())
        header = metadata.get("authorization", "")
        with self.lock:
            self.authorization_headers.append(header)
        if self.token is not None and header != f"Bearer {self.token}":
            with self.lock:
                self.refused += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing bearer token")

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received so far."""
        with self.lock:
            requests = list(self.trace_requests)
        return [(attributes_of(rs.resource.attributes), span)
                for request in requests for rs in request.resource_spans
                for ss in rs.scope_spans for span in ss.spans]

    def log_records(self) -> list[tuple[dict, object]]:
        with self.lock:
            requests = list(self.log_requests)
        return [(attributes_of(rl.resource.attributes), record)
                for request in requests for rl in request.resource_logs
                for sl in rl.scope_logs for record in sl.log_records]


def make_self_signed_certificate(directory: Path, name: str = "detector") -> tuple[Path, Path]:
    """A throwaway certificate for `name` and 127.0.0.1 (it is its own CA); (cert, key) paths."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name},IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60)
    return cert, key
