"""OTLP/gRPC trace receiver: opentelemetry.proto.collector.trace.v1.TraceService/Export.

The method is registered with a raw-bytes request (no deserializer) instead of through the
generated servicer, whose handler would parse the full ExportTraceServiceRequest before decode.py
parses it again with its faster view; the service and message names still come from the generated
opentelemetry-proto module. Codes follow the OTLP spec: INVALID_ARGUMENT for a malformed request,
UNAUTHENTICATED without the right bearer token, RESOURCE_EXHAUSTED with RetryInfo when the queue is
full (exporters retry it after the given delay), RESOURCE_EXHAUSTED over the size bound (after
decompression, counted as on the HTTP side), partial success in the response. gRPC does gzip, and
refuses on its own, uncounted, requests so far over the bound that this code never sees them.

The server is gRPC's asyncio one on the intake loop (intake_loop.py): a call waiting for its message
is a coroutine, not a thread, so streams that announce a message and send it slowly (or never) hold
no worker. Export is registered as a stream-unary method (the wire is the same: one message, then
the client half-closes) so that the wait for the message is bounded here: RECEIVE_TIMEOUT_S, then
DEADLINE_EXCEEDED (`errors.grpc_request_deadline`). At most `max_calls` calls at once: one beyond
takes the place of the call that has waited longest for its message (UNAVAILABLE,
`errors.grpc_evicted_waiting`), and is refused (RESOURCE_EXHAUSTED) only when every call is being
handled. Each connection may open MAX_STREAMS_PER_CONNECTION streams at once (HTTP/2 settings).
Decoding and queueing run on the intake loop's worker threads.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any, Optional

import grpc
from google.protobuf.any_pb2 import Any as AnyMessage
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_straggler.detector.intake_loop import IntakeLoop
from otel_straggler.detector.receiver import RETRY_AFTER_S, OtlpIntake, Result

_SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"]
_Response = trace_service_pb2.ExportTraceServiceResponse
# accepted and dropped (receiver.OTHER_SIGNALS): service -> its empty response
_OTHER_SIGNALS: dict[ServiceDescriptor, type[Message]] = {
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


RECEIVE_TIMEOUT_S = 15.0
MAX_STREAMS_PER_CONNECTION = 16


class OtlpGrpcReceiver:
    def __init__(self, intake: OtlpIntake, loop: IntakeLoop, address: str, port: int, max_calls: int,
                 tls_key_and_cert: Optional[tuple[bytes, bytes]] = None) -> None:
        self._intake = intake
        self._loop = loop
        self._max_calls = max_calls
        self._calls = 0
        self._waiting: dict[asyncio.Future, float] = {}  # read of a call's message -> when it began
        self._evicted: set[asyncio.Future] = set()
        _check_bindable(address, port)
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        self._server, self.port = loop.call(self._create(target, tls_key_and_cert))

    async def _create(self, target: str, tls_key_and_cert):
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", _grpc_receive_limit(self._intake.max_request_bytes)),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # gRPC sets SO_REUSEPORT by default: a second detector on the same port would then start
            # and silently take half of the first one's connections
            ("grpc.so_reuseport", 0)])
        handler: grpc.RpcMethodHandler[Any, Any] = grpc.stream_unary_rpc_method_handler(
            self._export, response_serializer=_Response.SerializeToString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE.full_name, {"Export": handler}),))
        for service, response_type in _OTHER_SIGNALS.items():
            other: grpc.RpcMethodHandler[Any, Any] = grpc.stream_unary_rpc_method_handler(
                self._other_signal(response_type), response_serializer=response_type.SerializeToString)
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service.full_name, {"Export": other}),))
        try:
            if tls_key_and_cert is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, grpc.ssl_server_credentials([tls_key_and_cert]))
        except RuntimeError as error:  # a failure the plain socket did not meet
            raise OSError(str(error)) from None
        return server, port

    def start(self) -> None:
        self._loop.call(self._server.start())

    def stop(self, grace_s: float) -> None:
        """Refuses new calls at once and lets calls in progress finish for up to grace_s."""
        try:
            self._loop.call(self._server.stop(grace_s), timeout_s=grace_s + 2.0)
        except Exception:  # noqa: BLE001 - stopping: whatever is left goes with the loop
            pass

    # ---------------------------------------------------------------- calls

    async def _message(self, requests, context) -> bytes:
        """The call's one message, within the bounds above (aborts the call otherwise)."""
        intake = self._intake
        if not intake.authorized(dict(context.invocation_metadata()).get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if self._calls >= self._max_calls and not self._evict_longest_waiting():
            intake.refused(Result.OVERLOADED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls at once, retry later")
        read = asyncio.ensure_future(requests.__anext__())
        self._waiting[read] = self._loop.loop.time()
        try:
            request = await asyncio.wait_for(read, RECEIVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            intake.counters.add_error("grpc_request_deadline")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no message within {RECEIVE_TIMEOUT_S:g} s")
        except asyncio.CancelledError:
            if read in self._evicted:  # not the call itself ending
                self._evicted.discard(read)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "waited longest for its message; retry")
            raise
        except StopAsyncIteration:
            try:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            except grpc.aio.AbortError:
                intake.refused(Result.MALFORMED)
                raise
            except Exception:  # noqa: BLE001 - the call is already over: gRPC refused the message
                raise asyncio.CancelledError from None  # itself (over its receive bound), uncounted
        finally:
            self._waiting.pop(read, None)
        if len(request) > intake.max_request_bytes:  # counted here, not refused by gRPC unseen
            intake.refused(Result.TOO_LARGE)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request over {intake.max_request_bytes} bytes")
        return request

    def _evict_longest_waiting(self) -> bool:
        if not self._waiting:
            return False
        longest = min(self._waiting, key=self._waiting.__getitem__)
        del self._waiting[longest]
        self._evicted.add(longest)
        longest.cancel()
        self._intake.counters.add_error("grpc_evicted_waiting")
        return True

    def _other_signal(self, response_type):
        async def export(requests, context):
            self._calls += 1
            try:
                await self._message(requests, context)
            finally:
                self._calls -= 1
            self._intake.other_signal()
            return response_type()

        return export

    async def _export(self, requests, context) -> trace_service_pb2.ExportTraceServiceResponse:
        self._calls += 1
        try:
            request = await self._message(requests, context)
            outcome = await self._loop.work(self._intake.export, request, False)
        finally:
            self._calls -= 1
        if outcome.result is Result.MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, outcome.message)
        if outcome.result is Result.OVERLOADED:
            context.set_trailing_metadata(_retry_info_metadata(outcome.message))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.message)
        response = _Response()
        if outcome.rejected_spans:
            response.partial_success.rejected_spans = outcome.rejected_spans
            response.partial_success.error_message = outcome.message
        return response
