"""The rank's batching span processor, on the SDK's public SpanProcessor interface only.

It does what the SDK's BatchSpanProcessor does (a bounded queue, one worker thread exporting a
batch when the queue holds a full one or when the schedule delay has passed, OTEL_BSP_* read as the
SDK reads them) and what a rank needs besides, which the SDK's cannot give without reaching into
its internals:

- every span it loses is counted, by reason: `dropped_queue_full` (the queue was full: the oldest
  span made room, as in the SDK, with no log record per span: making one cost the builder more than
  the span, on every span of an outage), `unexported_at_shutdown` (still queued, or taken for a
  batch never handed to the exporter, when the shutdown deadline came); a failed export is counted
  by the exporter (CountingSpanExporter);
- shutdown keeps to a deadline (`shutdown_deadline`, a time.monotonic()) for the whole of it,
  exports included: an exporter that takes `export_within(spans, deadline)` is given the time left;
- force_flush keeps to its timeout, and says whether everything queued when it was called was
  exported by then;
- with an exporter that can `prewrite`, spans wait in the queue already encoded (SpanEncoder.prewrite
  says why), so the worker's export is a join of bytes.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Mapping, Optional, Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter

from otel_straggler.instrumentation.record_span import RecordSpan

_logger = logging.getLogger(__name__)
# the SDK's defaults for OTEL_BSP_*
DEFAULTS = {"OTEL_BSP_SCHEDULE_DELAY": 5000, "OTEL_BSP_MAX_QUEUE_SIZE": 2048, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 512,
            "OTEL_BSP_EXPORT_TIMEOUT": 30000}
DEFAULT_SHUTDOWN_S = 30.0


def _from_environ(environ: Mapping[str, str], variable: str) -> int:
    """As the SDK reads it: an int, else the default with a logged error."""
    default = DEFAULTS[variable]
    try:
        return int(environ.get(variable, default))
    except ValueError:
        _logger.error("Unable to parse value for %s as integer. Defaulting to %s.", variable, default)
        return default


class BatchingSpanProcessor(SpanProcessor):
    def __init__(self, exporter: SpanExporter, schedule_delay_millis: Optional[float] = None,
                 max_queue_size: Optional[int] = None, max_export_batch_size: Optional[int] = None,
                 export_timeout_millis: Optional[float] = None, environ: Optional[Mapping[str, str]] = None) -> None:
        environ = os.environ if environ is None else environ
        if schedule_delay_millis is None:
            schedule_delay_millis = _from_environ(environ, "OTEL_BSP_SCHEDULE_DELAY")
        if max_queue_size is None:
            max_queue_size = _from_environ(environ, "OTEL_BSP_MAX_QUEUE_SIZE")
        if max_export_batch_size is None:
            max_export_batch_size = _from_environ(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
        if export_timeout_millis is None:
            export_timeout_millis = _from_environ(environ, "OTEL_BSP_EXPORT_TIMEOUT")
        # the SDK's checks, with its messages
        if max_queue_size <= 0:
            raise ValueError("max_queue_size must be a positive integer.")
        if schedule_delay_millis <= 0:
            raise ValueError("schedule_delay_millis must be positive.")
        if max_export_batch_size <= 0:
            raise ValueError("max_export_batch_size must be a positive integer.")
        if max_export_batch_size > max_queue_size:
            raise ValueError("max_export_batch_size must be less than or equal to max_queue_size.")
        self.exporter = exporter
        self.schedule_delay_s = schedule_delay_millis / 1000
        self.max_queue_size = max_queue_size
        self.max_export_batch_size = max_export_batch_size
        self.export_timeout_s = export_timeout_millis / 1000 if export_timeout_millis > 0 else None
        self.dropped_queue_full = 0
        self.unexported_at_shutdown = 0
        self.shutdown_deadline: Optional[float] = None  # time.monotonic(); None: 30 s from shutdown()
        self._prewrite = getattr(exporter, "prewrite", None)
        self._prewrite_many = getattr(exporter, "prewrite_many", None) if self._prewrite is not None else None
        self._export_within = getattr(exporter, "export_within", None)
        # newest on the left, oldest on the right; appendleft on a full deque drops the oldest
        self._queue: collections.deque = collections.deque(maxlen=max_queue_size)
        self._shutdown = False
        self._closed = False  # shutdown() has made its last count: nothing queued will be exported
        self._stop_exporting_at: Optional[float] = None  # set by shutdown(): the worker's last moment
        self._in_hand = 0  # spans taken from the queue for a batch, not yet handed to the exporter
        self._exporting = False
        self._init_thread_state()
        weak_reinit = weakref.WeakMethod(self._after_fork_in_child)
        os.register_at_fork(after_in_child=lambda: (weak_reinit() or (lambda: None))())

    def _init_thread_state(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._woken = False
        self._flush_requests: list[threading.Event] = []  # set once what was queued before each is out
        self._worker = threading.Thread(target=self._run, name="otel-straggler-batch-export", daemon=True)
        self._worker.start()

    def _after_fork_in_child(self) -> None:
        """The parent's worker does not exist in a child, and the parent's spans are the parent's."""
        self._queue.clear()
        self._in_hand = 0
        if not self._shutdown:
            self._init_thread_state()

    # -- SpanProcessor -------------------------------------------------------------------------

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._shutdown:
            return
        if type(span) is not RecordSpan and not (span.context and span.context.trace_flags.sampled):
            return  # (a RecordSpan is always sampled: no need to make its SpanContext to ask)
        item: Any = span
        if self._prewrite is not None:
            try:
                item = self._prewrite(span)
            except Exception:
                item = span  # the exporter encodes it then
        queue = self._queue
        if len(queue) >= self.max_queue_size:
            self.dropped_queue_full += 1  # the oldest is dropped by the append below
        queue.appendleft(item)
        if self._shutdown:  # shutdown() began after the check above: its last count may be done
            self._count_left_after_close()
            return
        if len(queue) >= self.max_export_batch_size and not self._woken:
            with self._wake:
                self._woken = True
                self._wake.notify()

    def on_end_many(self, spans: Sequence[ReadableSpan]) -> None:
        """on_end() of each span, in order, in one call: for a processor ahead of this one that
        hands on spans by the batch (the CudaEventSpanProcessor, the span builder's ProcessorSpans),
        the exporter's prewrite_many() encoding them together where it has one."""
        if self._shutdown:
            return
        kept = [span for span in spans
                if type(span) is RecordSpan or (span.context and span.context.trace_flags.sampled)]
        items: list = kept
        if self._prewrite_many is not None:
            try:
                items = self._prewrite_many(kept)
            except Exception:
                items = self._prewrite_each(kept)
        elif self._prewrite is not None:
            items = self._prewrite_each(kept)
        queue = self._queue
        with self._wake:  # the worker takes a batch under it too: what is dropped is counted exactly
            if self._closed:  # shutdown() made its last count after the check above
                self.unexported_at_shutdown += len(items)
                return
            # newest on the left: extendleft() is appendleft() of each in turn, the oldest dropped
            # as the queue's bound is passed
            over = len(queue) + len(items) - self.max_queue_size
            if over > 0:
                self.dropped_queue_full += over
            queue.extendleft(items)
            if len(queue) >= self.max_export_batch_size and not self._woken:
                self._woken = True
                self._wake.notify()

    def _count_left_after_close(self) -> None:
        """A span appended after shutdown()'s last count (its on_end() passed the shutdown check
        first) is counted as that count would have: unexported at shutdown, never left uncounted
        in a queue nobody exports."""
        with self._wake:
            if self._closed:
                self.unexported_at_shutdown += len(self._queue)
                self._queue.clear()

    def _prewrite_each(self, spans: list[ReadableSpan]) -> list:
        prewrite = self._prewrite
        items: list = []
        for span in spans:
            try:
                items.append(prewrite(span))  # type: ignore[misc]  # called with a prewrite only
            except Exception:
                items.append(span)  # the exporter encodes it then
        return items

    def force_flush(self, timeout_millis: Optional[int] = 30000) -> bool:
        """Whether every span queued before the call was exported (or lost, and counted) within
        the timeout. The worker exports; this only waits."""
        if self._shutdown:
            return False
        timeout_s = None if timeout_millis is None else max(0.0, timeout_millis / 1000)
        done = threading.Event()
        with self._wake:
            if not self._queue and not self._in_hand and not self._exporting:
                return True
            self._flush_requests.append(done)
            self._woken = True
            self._wake.notify()
        return done.wait(timeout_s)

    def shutdown(self) -> None:
        if self._shutdown:
            return
        deadline = self.shutdown_deadline or time.monotonic() + DEFAULT_SHUTDOWN_S
        # the worker exports what is queued until shortly before the deadline; the rest of the
        # time is for the export in flight to return (its exporter's deadline) and be counted
        margin_s = min(0.5, max(0.0, deadline - time.monotonic()) / 4)
        with self._wake:
            self._stop_exporting_at = deadline - margin_s
            self._shutdown = True
            self._woken = True
            self._wake.notify()
        self._worker.join(max(0.0, self._stop_exporting_at - time.monotonic()))
        exporter_shut = False
        if self._worker.is_alive():
            # an export begun before shutdown() may be waiting to retry, by a deadline of its own:
            # shutting the exporter down ends that wait, and the export returns, counted as failed
            exporter_shut = self._shut_exporter()
            self._worker.join(max(0.0, deadline - time.monotonic()))
        with self._wake:
            self._closed = True
            self.unexported_at_shutdown += len(self._queue) + self._in_hand
            self._queue.clear()
            self._in_hand = 0
            for done in self._flush_requests:
                done.set()
            self._flush_requests.clear()
        if not exporter_shut:
            self._shut_exporter()

    def _shut_exporter(self) -> bool:
        try:
            self.exporter.shutdown()
        except Exception:
            _logger.exception("otel-straggler: the span exporter failed to shut down")
        return True

    # -- worker --------------------------------------------------------------------------------

    def _run(self) -> None:
        next_export = time.monotonic() + self.schedule_delay_s
        while True:
            with self._wake:
                while not self._woken and not self._shutdown:
                    left = next_export - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                self._woken = False
                flushes, self._flush_requests = self._flush_requests, []
            if self._shutdown:
                self._export_all(until=self._stop_exporting_at)
                return
            if flushes:
                self._export_all()  # everything queued before each flush request, and since
                next_export = time.monotonic() + self.schedule_delay_s
                for done in flushes:
                    done.set()
                continue
            if time.monotonic() >= next_export:
                # one batch of what is queued, as the SDK's processor does: the spans that came
                # while it was sent wait for the next, not a second export right after (a
                # receiver that learns an exporter's pace from its deliveries saw a burst of two)
                self._export_batch()
                next_export = time.monotonic() + self.schedule_delay_s
            while len(self._queue) >= self.max_export_batch_size and not self._shutdown:
                self._export_batch()  # full batches, whenever there are

    def _export_all(self, until: Optional[float] = None) -> None:
        while self._queue and (until is None or time.monotonic() < until):
            self._export_batch(until)

    def _export_batch(self, until: Optional[float] = None) -> None:
        queue = self._queue
        with self._wake:  # taken and counted as one step: shutdown() counts what is in hand
            count = min(self.max_export_batch_size, len(queue))
            batch = [queue.pop() for _ in range(count)]
            self._in_hand = count
        if not batch:
            return
        self._exporting = True
        try:
            now = time.monotonic()
            deadline = None if self.export_timeout_s is None else now + self.export_timeout_s
            if until is not None:
                deadline = until if deadline is None else min(deadline, until)
            with self._wake:
                self._in_hand = 0  # from here the exporter counts them, exported or failed
            if self._export_within is not None:
                self._export_within(batch, deadline)
            else:
                self.exporter.export(batch)
        except Exception:
            _logger.exception("otel-straggler: exception while exporting spans")
        finally:
            self._exporting = False

    def queue_length(self) -> int:
        return len(self._queue)
