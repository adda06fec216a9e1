"""The detector's verdict events as OTLP log records, exported by our own code on public API only:
each event becomes a LogRecord of the opentelemetry-proto package's generated classes, a batch an
ExportLogsServiceRequest, sent by our OTLP sender (instrumentation/otlp_exporters.py, LOGS:
LogsService/Export over gRPC, POST .../v1/logs over HTTP, the OTEL_EXPORTER_OTLP_[LOGS_]*
variables, retries within the export timeout).

`emit` never blocks the caller (the verdict writer): it appends to a bounded queue that one worker
thread drains, up to MAX_BATCH events a request. Every event that is not delivered is counted once
by `on_dropped(reason, count)`: `queue_full` (the queue held MAX_QUEUE events already),
`export_failed` (its request failed after the retries its deadline allowed), `encode_failed` (a
value the encoder could not take), `shutdown` (emitted after shutdown began, or still queued when
its deadline passed). A failed request is also counted by `on_failed_export()`.

The records are what the SDK's log pipeline made of the same call: time and observed time, severity
number (no severity text), a string body, the attributes as given (lists as arrays, mappings as
key-value lists, other types as their str()), the event name, the resource's attributes and schema
URL, the instrumentation scope's name; no trace context.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs, SeverityNumber
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceMessage
from opentelemetry.sdk.resources import Resource

_log = logging.getLogger(__name__)
MAX_QUEUE = 2048  # as the SDK's batching log processor's default queue
MAX_BATCH = 512  # events in one export request, as its default batch

SEVERITY_INFO = SeverityNumber.SEVERITY_NUMBER_INFO
SEVERITY_WARN = SeverityNumber.SEVERITY_NUMBER_WARN
SEVERITY_ERROR = SeverityNumber.SEVERITY_NUMBER_ERROR


def any_value(value: Any) -> AnyValue:
    """A Python value as an OTLP AnyValue, as the SDK's exporters encode attribute values."""
    if value is None:
        return AnyValue()
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, Sequence):
        return AnyValue(array_value=ArrayValue(values=[any_value(item) for item in value]))
    if isinstance(value, Mapping):
        return AnyValue(kvlist_value=KeyValueList(values=key_values(value)))
    return AnyValue(string_value=str(value))  # what the SDK's attribute cleaning makes of other types


def key_values(attributes: Mapping[Any, Any]) -> list[KeyValue]:
    return [KeyValue(key=str(key), value=any_value(value)) for key, value in attributes.items()]


class EventExporter:
    """Log records for one resource and instrumentation scope, exported in the background."""

    def __init__(self, sender: Any, resource: Resource, scope_name: str,
                 on_dropped: Callable[[str, int], None], on_failed_export: Callable[[], None],
                 max_queue: int = MAX_QUEUE, max_batch: int = MAX_BATCH) -> None:
        self._sender = sender  # otlp_exporters.OtlpSender: deadline(), send(body, count, deadline), shutdown()
        self._resource = ResourceMessage(attributes=key_values(resource.attributes))
        self._resource_schema_url = resource.schema_url or ""
        self._scope = InstrumentationScope(name=scope_name)
        self._on_dropped = on_dropped
        self._on_failed_export = on_failed_export
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._closing = False
        self._deadline: Optional[float] = None  # set by shutdown: what is left must be sent by then
        self._abandoned = False  # the shutdown deadline passed: the worker takes no more batches
        self.exported = 0  # events delivered
        self._thread = threading.Thread(target=self._run, name="straggler-event-export", daemon=True)
        self._thread.start()

    def emit(self, time_unix_nano: int, severity_number: SeverityNumber.ValueType, body: str,
             attributes: Mapping[str, Any], event_name: str) -> None:
        """Queues one event; never blocks (beyond a lock held only to append or to take a batch)."""
        event = (time_unix_nano, time.time_ns(), severity_number, body, attributes, event_name)
        with self._ready:
            if self._closing:
                reason = "shutdown"
            elif len(self._queue) >= self._max_queue:
                reason = "queue_full"
            else:
                self._queue.append(event)
                self._ready.notify()
                return
        self._on_dropped(reason, 1)

    def shutdown(self, timeout_s: float) -> None:
        """Sends what is queued within `timeout_s`, then stops; what is left is counted as dropped
        (`shutdown`)."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            self._closing = True
            self._deadline = deadline
            self._ready.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._ready:
            self._abandoned = True
        self._sender.shutdown()  # a send still waiting to retry gives up now
        self._thread.join(1.0)
        with self._ready:
            left = len(self._queue)
            self._queue.clear()
        if left:
            self._on_dropped("shutdown", left)

    # ---------------------------------------------------------------- the worker

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if not self._queue or self._abandoned or (
                        self._deadline is not None and time.monotonic() >= self._deadline):
                    return  # closing, and everything sent or its time up (shutdown counts what is left)
                batch = [self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))]
                deadline = self._deadline
            try:
                self._export(batch, deadline)
            except Exception:  # noqa: BLE001 - counted; the worker must survive to send the next ones
                _log.exception("verdict event export failed unexpectedly")
                self._on_dropped("export_failed", len(batch))

    def _export(self, batch: list, deadline: Optional[float]) -> None:
        records = []
        for event in batch:
            try:
                records.append(self._record(*event))
            except Exception:  # noqa: BLE001 - one event the encoder cannot take does not sink the rest
                _log.warning("a verdict event could not be encoded, dropped (counted as encode_failed)",
                             exc_info=True)
                self._on_dropped("encode_failed", 1)
        if not records:
            return
        request = ExportLogsServiceRequest(resource_logs=[ResourceLogs(
            resource=self._resource, schema_url=self._resource_schema_url,
            scope_logs=[ScopeLogs(scope=self._scope, log_records=records)])])
        if self._sender.send(request.SerializeToString(), len(records), self._sender.deadline(deadline)):
            self.exported += len(records)
        else:
            self._on_failed_export()
            self._on_dropped("export_failed", len(records))

    @staticmethod
    def _record(time_unix_nano: int, observed_unix_nano: int, severity_number: SeverityNumber.ValueType, body: str,
                attributes: Mapping[str, Any], event_name: str) -> LogRecord:
        return LogRecord(time_unix_nano=time_unix_nano, observed_time_unix_nano=observed_unix_nano,
                         severity_number=severity_number, body=any_value(body), attributes=key_values(attributes),
                         event_name=event_name)
