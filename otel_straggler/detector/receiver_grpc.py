"""OTLP/gRPC trace receiver: opentelemetry.proto.collector.trace.v1.TraceService/Export.

The method is registered with a raw-bytes request (no deserializer) instead of through the
generated servicer, whose handler would parse the full ExportTraceServiceRequest before decode.py
parses it again with its faster view; the service and message names still come from the generated
opentelemetry-proto module. Codes follow the OTLP spec: INVALID_ARGUMENT for a malformed request,
UNAUTHENTICATED without the right bearer token, RESOURCE_EXHAUSTED with RetryInfo when the queue is
full (exporters retry it after the given delay), RESOURCE_EXHAUSTED over the size bound (after
decompression, counted as on the HTTP side), partial success in the response. gRPC does gzip, and
refuses on its own, uncounted, requests so far over the bound that this code never sees them.
"""
from __future__ import annotations

import socket
from concurrent import futures
from typing import Optional

import grpc
from google.protobuf.any_pb2 import Any as AnyMessage
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_straggler.detector.receiver import RETRY_AFTER_S, OtlpIntake, Result

_SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"]
_Response = trace_service_pb2.ExportTraceServiceResponse
# accepted and dropped (receiver.OTHER_SIGNALS): service -> its empty response
_OTHER_SIGNALS = {
    metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"]: metrics_service_pb2.ExportMetricsServiceResponse,
    logs_service_pb2.DESCRIPTOR.services_by_name["LogsService"]: logs_service_pb2.ExportLogsServiceResponse,
}
# gRPC's own bound sits this far above max_request_bytes: requests a little over ours reach the
# handler to be refused and counted there, while gRPC still bounds what a request can cost in memory
_GRPC_LIMIT_HEADROOM = 1.25
_GRPC_LIMIT_MAX = 2**31 - 1  # gRPC's channel arguments are C ints


def _grpc_receive_limit(max_request_bytes: int) -> int:
    return min(int(max_request_bytes * _GRPC_LIMIT_HEADROOM), _GRPC_LIMIT_MAX)


def _check_bindable(address: str, port: int) -> None:
    """Raises the OSError that binding address:port meets (unknown address, port in use, ...).
    gRPC reports a failed bind as a RuntimeError without the reason, which goes to a log line of
    its own, so the bind is tried first with a plain socket set up as gRPC sets up its own (with
    SO_REUSEPORT off, see OtlpGrpcReceiver)."""
    failures: list[OSError] = []
    for family, kind, protocol, _, socket_address in socket.getaddrinfo(
            address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(socket_address)
                return  # gRPC too listens when at least one of the addresses binds
            except OSError as error:
                failures.append(error)
    raise failures[0]  # getaddrinfo gives at least one address or raises


def _retry_info_metadata(message: str) -> tuple[tuple[str, bytes], ...]:
    """RetryInfo as trailing metadata, both where the OTLP spec puts it (inside the rich status,
    `grpc-status-details-bin`) and where the Python exporter reads it (`google.rpc.retryinfo-bin`)."""
    retry_info = error_details_pb2.RetryInfo(retry_delay=Duration(seconds=RETRY_AFTER_S))
    detail = AnyMessage()
    detail.Pack(retry_info)
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[detail])
    return (("grpc-status-details-bin", status.SerializeToString()),
            ("google.rpc.retryinfo-bin", retry_info.SerializeToString()))


class OtlpGrpcReceiver:
    def __init__(self, intake: OtlpIntake, address: str, port: int, workers: int,
                 tls_key_and_cert: Optional[tuple[bytes, bytes]] = None) -> None:
        self._intake = intake
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="straggler-otlp-grpc"),
            # calls beyond this are refused by gRPC with RESOURCE_EXHAUSTED instead of queueing without bound
            maximum_concurrent_rpcs=workers * 4,
            # gRPC sets SO_REUSEPORT by default: a second detector on the same port would then start
            # and silently take half of the first one's connections
            options=[("grpc.max_receive_message_length", _grpc_receive_limit(intake.max_request_bytes)),
                     ("grpc.so_reuseport", 0)],
        )
        handler = grpc.unary_unary_rpc_method_handler(self._export, response_serializer=_Response.SerializeToString)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE.full_name, {"Export": handler}),))
        for service, response_type in _OTHER_SIGNALS.items():
            other = grpc.unary_unary_rpc_method_handler(self._other_signal(response_type),
                                                        response_serializer=response_type.SerializeToString)
            self._server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service.full_name, {"Export": other}),))
        _check_bindable(address, port)
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        try:
            if tls_key_and_cert is None:
                self.port = self._server.add_insecure_port(target)
            else:
                self.port = self._server.add_secure_port(target, grpc.ssl_server_credentials([tls_key_and_cert]))
        except RuntimeError as error:  # a failure the plain socket did not meet
            raise OSError(str(error)) from None

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_s: float) -> None:
        """Refuses new calls at once and lets calls in progress finish for up to grace_s."""
        self._server.stop(grace_s).wait(grace_s + 1.0)

    def _refuse_if_too_large(self, request: bytes, context: grpc.ServicerContext) -> None:
        """The size bound, applied here rather than by gRPC so that the refusal is counted."""
        if len(request) > self._intake.max_request_bytes:
            self._intake.refused(Result.TOO_LARGE)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request over {self._intake.max_request_bytes} bytes")

    def _other_signal(self, response_type):
        def export(request: bytes, context: grpc.ServicerContext):
            if not self._intake.authorized(dict(context.invocation_metadata()).get("authorization")):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            self._refuse_if_too_large(request, context)
            self._intake.other_signal()
            return response_type()

        return export

    def _export(self, request: bytes, context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        metadata = dict(context.invocation_metadata())
        if not self._intake.authorized(metadata.get("authorization")):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        self._refuse_if_too_large(request, context)
        outcome = self._intake.export(request, is_json=False)
        if outcome.result is Result.MALFORMED:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, outcome.message)
        if outcome.result is Result.OVERLOADED:
            context.set_trailing_metadata(_retry_info_metadata(outcome.message))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.message)
        response = _Response()
        if outcome.rejected_spans:
            response.partial_success.rejected_spans = outcome.rejected_spans
            response.partial_success.error_message = outcome.message
        return response
