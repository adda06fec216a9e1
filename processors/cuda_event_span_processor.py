"""CudaEventSpanProcessor: attaches GPU-side durations to spans once their CUDA events complete.

A span that carries a start/end event pair (`attach_device_events` before `span.end()`) is held
until its end event has completed, then forwarded to the next processor with
`training.stage.timing = device` and `training.stage.device_duration_ms`. An event that does
not complete within `readout_timeout_s`, or that errors, yields `device_unavailable` with a
reason instead; a timed-out event goes back to the pool once the device has passed it. Spans
leave in the order they ended (per-rank completion order), so a span without events waits
behind an earlier one that has them.

It follows the SDK `BatchSpanProcessor` lifecycle: on_start / on_end / force_flush / shutdown,
one worker thread woken by an event, and it never blocks or raises into its caller. Whatever
cannot be held (`max_pending` spans) is forwarded at once as `device_unavailable` /
`processor_full` and counted.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Callable, Optional, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from otel_straggler import contract
from otel_straggler.instrumentation.record_span import RecordSpan
from otel_straggler.processors.device_events import DeviceEventBackend, give_back

# How often events past their readout are asked again whether the device has passed them, and
# at most how many each time (a long stall can leave thousands waiting: their queries hold the GIL).
TIMED_OUT_POLL_S = 0.1
TIMED_OUT_QUERIES_PER_POLL = 256


class _HeldSpan:
    __slots__ = ("span", "start_event", "end_event", "own_attributes", "deadline")

    def __init__(self, span: ReadableSpan, start_event: Any, end_event: Any, own_attributes: Optional[dict],
                 deadline: float) -> None:
        self.span = span
        self.start_event = start_event
        self.end_event = end_event
        self.own_attributes = own_attributes
        self.deadline = deadline


def with_attributes(span: ReadableSpan, extra: dict, own_attributes: Optional[dict] = None) -> ReadableSpan:
    """The span with the extra attributes: written into `own_attributes` when its maker handed
    them over, else (an ended SDK span is immutable) a copy of the span."""
    if own_attributes is not None:
        own_attributes.update(extra)
        return span
    attributes = dict(span.attributes or {})
    attributes.update(extra)
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class CudaEventSpanProcessor(SpanProcessor):
    def __init__(
        self,
        next_processor: SpanProcessor,
        backend: Optional[DeviceEventBackend],
        readout_timeout_s: float = 10.0,
        max_pending: int = 16384,
        poll_interval_s: float = 0.005,
        release_event: Optional[Callable[[Any], None]] = None,
    ) -> None:
        self.next_processor = next_processor
        self.backend = backend
        self.readout_timeout_s = readout_timeout_s
        self.max_pending = max_pending
        self.poll_interval_s = poll_interval_s
        # Events usually come from an EventPool; this hands them back once read.
        self.release_event = release_event or (lambda event: None)
        self._events_by_span_id: dict[int, tuple[Any, Any, Optional[dict]]] = {}
        self._held: collections.deque[_HeldSpan] = collections.deque()
        # Events whose span gave up waiting for them: not reusable until the device has passed
        # them (re-recorded while pending, they would time a later interval wrongly), then back
        # to the pool, so that a long stall (a peer's checkpoint, say) does not drain it. At
        # most the pool's size, as they all come from it.
        self._timed_out: collections.deque = collections.deque()
        self._next_timed_out_poll = 0.0  # time.monotonic()
        self._wake = threading.Event()
        self._shutdown = False
        self._closing = False  # shutdown() has begun (it waits for held spans before _shutdown)
        # The worker's last drain and on_end's holding of a span exclude each other, so no span
        # is held after that drain (on_end then forwards it itself).
        self._last_drain_lock = threading.Lock()
        self._drained_for_good = False
        self.counters: collections.Counter[str] = collections.Counter()
        self._worker = threading.Thread(target=self._run, name="otel-straggler-device-timing", daemon=True)
        self._worker.start()

    # -- SpanProcessor lifecycle -------------------------------------------------------------

    def attach_device_events(self, span: ReadableSpan, start_event: Any, end_event: Any,
                             own_attributes: Optional[dict] = None) -> None:
        """Marks a not-yet-ended span as timed by this event pair on the device.

        `own_attributes`: the dict behind the span's attributes, from a caller that made the
        span itself and hands it over: the device attributes are then written into it rather
        than into a copy of the span."""
        waiting = self._events_by_span_id
        if len(waiting) >= self.max_pending:
            # spans whose end never reached us (a processor ahead of us raised in on_end): the
            # oldest goes, its events to wait for the device like timed-out ones, so this stays
            # bounded
            start, end, _ = waiting.pop(next(iter(waiting)))
            self._wait_for_device((start, end))
            self.counters["next_processor_error"] += 1
            self._wake.set()  # the worker asks about them from now on
        waiting[_span_id(span)] = (start_event, end_event, own_attributes)

    def on_start(self, span: Span, parent_context: Optional[Context] = None) -> None:
        try:
            self.next_processor.on_start(span, parent_context=parent_context)
        except Exception:
            self.counters["next_processor_error"] += 1

    def on_end(self, span: ReadableSpan) -> None:
        try:
            events = self._events_by_span_id.pop(_span_id(span), None)
            if events is None and not self._held:
                self._forward(span)
                return
            if events is not None and not self._held and not self._shutdown:
                # Nothing waits ahead of it and its events may be done already (they usually
                # are by the time spans are built): then it goes on now, without the worker.
                extra = self._read(events[0], events[1], deadline=math.inf, give_up=False)
                if extra is not None:
                    self._forward(self._with_device_attributes(span, extra, events[2]))
                    return
            if self._shutdown or len(self._held) >= self.max_pending:
                self._forward_unheld(span, events, "processor_shut_down" if self._shutdown else "processor_full")
                return
            start_event, end_event, own_attributes = events if events is not None else (None, None, None)
            with self._last_drain_lock:
                if not self._drained_for_good:
                    self._held.append(_HeldSpan(span, start_event, end_event, own_attributes,
                                                time.monotonic() + self.readout_timeout_s))
                    self._wake.set()
                    return
            # shut down between the check above and now, its worker gone: nothing would forward it
            self._forward_unheld(span, events, "processor_shut_down")
        except Exception:  # never raise into the span's owner
            self.counters["internal_error"] += 1

    def on_end_timed(self, items: Sequence[tuple[ReadableSpan, Any, Any, Optional[dict]]]) -> None:
        """on_end() of many spans at once, in order, each with the device events its maker would
        have attached (attach_device_events): (span, start event, end event, own attributes), the
        events None for a span without. What on_end() of each does, in one call: spans whose
        events are done go on to the next processor together, through its `on_end_many` where it
        has one (our BatchingSpanProcessor), else one by one; from the first span that must wait,
        that span and the rest take on_end()'s own way. Never raises."""
        ready: list[ReadableSpan] = []
        device_timed = 0
        position, count = 0, len(items)
        try:
            if not self._held and not self._shutdown:
                backend = self.backend
                release = self.release_event
                while position < count:
                    span, start_event, end_event, own_attributes = items[position]
                    if start_event is not None:
                        if own_attributes is None:
                            break  # a copy of the span to make: on_end()'s way
                        try:  # _read()'s first look, for a span nothing waits ahead of
                            if not (backend.query(end_event)  # type: ignore[union-attr]
                                    and backend.query(start_event)):  # type: ignore[union-attr]
                                break  # still running on the device: it, and the rest behind it, wait
                            duration_ms = float(backend.elapsed_ms(start_event, end_event))  # type: ignore[union-attr]
                            release(start_event)
                            release(end_event)
                        except Exception:
                            self.counters["event_error"] += 1  # not reused: a failing event may fail again
                            own_attributes.update(_unavailable("event_error"))
                        else:
                            own_attributes[contract.TIMING] = contract.TIMING_DEVICE
                            own_attributes[contract.DEVICE_DURATION_MS] = duration_ms
                            device_timed += 1
                    ready.append(span)
                    position += 1
        except Exception:  # never raise into the span's owner: the span at hand is lost, counted as on_end() would
            self.counters["internal_error"] += 1
            position += 1
        if device_timed:
            self.counters["device_timed"] += device_timed
        if ready:
            self._forward_many(ready)
        for span, start_event, end_event, own_attributes in items[position:]:
            if start_event is not None:
                try:
                    self.attach_device_events(span, start_event, end_event, own_attributes)
                except Exception:
                    self.counters["internal_error"] += 1
            self.on_end(span)

    def _forward_many(self, spans: list[ReadableSpan]) -> None:
        on_end_many = getattr(self.next_processor, "on_end_many", None)
        if on_end_many is None:
            for span in spans:
                self._forward(span)
            return
        try:
            on_end_many(spans)
        except Exception:
            self.counters["next_processor_error"] += len(spans)

    def _forward_unheld(self, span: ReadableSpan, events: Optional[tuple], reason: str) -> None:
        """Forwards a span it cannot hold: its device timing unavailable for `reason`, counted."""
        if events is not None:
            self.counters[reason] += 1
            give_back(self.release_event, events[:2])
            span = self._with_device_attributes(span, _unavailable(reason), events[2])
        self._forward(span)

    def _with_device_attributes(self, span: ReadableSpan, extra: dict, own_attributes: Optional[dict]) -> ReadableSpan:
        """The span with the attributes `_read` gave it, counted once: `device_timed`, or the
        reason its timing is unavailable (counted by whoever found it). A span they cannot be added
        to goes on without them, its device timing lost as `internal_error` instead."""
        try:
            span = with_attributes(span, extra, own_attributes)
        except Exception:
            if extra[contract.TIMING] == contract.TIMING_DEVICE:
                self.counters["internal_error"] += 1
            return span
        if extra[contract.TIMING] == contract.TIMING_DEVICE:
            self.counters["device_timed"] += 1
        return span

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        drained = self._wait_drained(deadline)
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        try:
            return self.next_processor.force_flush(remaining_ms) and drained
        except Exception:
            self.counters["next_processor_error"] += 1
            return False

    def shutdown(self) -> None:
        with self._last_drain_lock:  # a second call (a provider's and its owner's) does not wait again
            if self._closing:
                return
            self._closing = True
        # Held spans still get their readout window (bounded by readout_timeout_s).
        self._wait_drained(time.monotonic() + self.readout_timeout_s + 1.0)
        self._shutdown = True
        self._wake.set()
        self._worker.join(timeout=self.readout_timeout_s + 1.0)
        try:
            self.next_processor.shutdown()
        except Exception:
            self.counters["next_processor_error"] += 1

    def pending(self) -> int:
        return len(self._held)

    def _wait_drained(self, deadline: float) -> bool:
        while self._held and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(self.poll_interval_s)
        return not self._held

    # -- worker ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._shutdown:
            self._wake.wait(self.poll_interval_s if self._held else TIMED_OUT_POLL_S if self._timed_out else None)
            self._wake.clear()
            try:
                self._forward_ready()
                if self._timed_out and time.monotonic() >= self._next_timed_out_poll:
                    self._next_timed_out_poll = time.monotonic() + TIMED_OUT_POLL_S
                    self._release_passed_timed_out()
            except Exception:
                self.counters["internal_error"] += 1
        with self._last_drain_lock:  # a span on_end holds from now on is forwarded there
            try:
                self._forward_ready(give_up=True)
            except Exception:
                self.counters["internal_error"] += 1
            self._drained_for_good = True

    def _wait_for_device(self, events: tuple[Any, Any]) -> None:
        """Events to give back once the device has passed them (see _timed_out)."""
        self._timed_out.extend(event for event in events if event is not None)

    def _release_passed_timed_out(self) -> None:
        for _ in range(min(len(self._timed_out), TIMED_OUT_QUERIES_PER_POLL)):
            event = self._timed_out.popleft()
            try:
                passed = self.backend.query(event)  # type: ignore[union-attr]  # events exist only with a backend
            except Exception:
                continue  # a failing event is not reused (as in _read)
            if passed:
                self.release_event(event)
            else:
                self._timed_out.append(event)

    def _forward_ready(self, give_up: bool = False) -> None:
        """Forwards held spans from the front while they are ready, keeping their order."""
        while self._held:
            held = self._held[0]
            if held.end_event is None:
                extra = None
            else:
                extra = self._read(held.start_event, held.end_event, held.deadline, give_up)
                if extra is None:
                    return  # front still running on the device: everything behind it waits
            span = held.span
            if extra is not None:  # its events are back in the pool, or waiting for the device, already
                span = self._with_device_attributes(span, extra, held.own_attributes)
            # Forwarded before it leaves the queue: while it is still there, a span ending
            # meanwhile queues up behind it instead of overtaking it in on_end.
            self._forward(span)
            self._held.popleft()

    def _read(self, start_event: Any, end_event: Any, deadline: float, give_up: bool) -> Optional[dict]:
        """The device attributes of an event pair; None while it is still running on the device
        and `deadline` (time.monotonic()) is ahead, unless told to give up."""
        try:
            backend = self.backend  # set: there are events to read only with a backend
            if backend.query(end_event) and backend.query(start_event):  # type: ignore[union-attr]
                duration_ms = float(backend.elapsed_ms(start_event, end_event))  # type: ignore[union-attr]
                give_back(self.release_event, (start_event, end_event))
                return {contract.TIMING: contract.TIMING_DEVICE, contract.DEVICE_DURATION_MS: duration_ms}
            if give_up or time.monotonic() >= deadline:
                reason = "readout_timeout"
                self._wait_for_device((start_event, end_event))
            else:
                return None
        except Exception:
            reason = "event_error"  # not reused: a failing event may fail again
        self.counters[reason] += 1
        return _unavailable(reason)

    def _forward(self, span: ReadableSpan) -> None:
        try:
            self.next_processor.on_end(span)
        except Exception:
            self.counters["next_processor_error"] += 1


def _span_id(span: ReadableSpan) -> int:
    """The span's id; a RecordSpan's without making its SpanContext."""
    if type(span) is RecordSpan:
        return span.record_span_id
    context = span.get_span_context()
    if context is None:  # an SDK span always has one; a ReadableSpan made by hand may not
        raise ValueError(f"span {span.name!r} has no SpanContext to key its device events by")
    return context.span_id


def _unavailable(reason: str) -> dict:
    return {contract.TIMING: contract.TIMING_DEVICE_UNAVAILABLE, contract.TIMING_REASON: reason}
