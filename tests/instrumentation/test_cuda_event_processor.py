"""CudaEventSpanProcessor on its own, in a plain SDK TracerProvider, with fake device events
whose completion the test drives: late and out-of-order completion, timeouts, errors, its
bound, its drain, its order, and that it never raises into its caller."""
from __future__ import annotations

import threading
import time
from typing import Optional

import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from otel_straggler import contract
from otel_straggler.processors.cuda_event_span_processor import TIMED_OUT_POLL_S, CudaEventSpanProcessor
from otel_straggler.processors.device_events import EventPool, FakeDeviceEvents

KERNEL_MS = 2.5
POOL_SIZE = 64


class RecordingProcessor(SpanProcessor):
    """The next processor: keeps what reaches it, optionally raises or stalls in on_end."""

    def __init__(self) -> None:
        self.ended: list = []
        self.started = 0
        self.flushed = 0
        self.shut_down = False
        self.raise_in: set[str] = set()
        self.stall_on: Optional[str] = None  # a span name whose on_end waits for `release`
        self.stalled = threading.Event()
        self.release = threading.Event()

    def _maybe_raise(self, method: str) -> None:
        if method in self.raise_in:
            raise RuntimeError(f"next processor fails in {method}")

    def on_start(self, span, parent_context=None) -> None:
        self._maybe_raise("on_start")
        self.started += 1

    def on_end(self, span) -> None:
        self._maybe_raise("on_end")
        if span.name == self.stall_on:
            self.stalled.set()
            self.release.wait(5.0)
        self.ended.append(span)  # recorded when the call completes, as a queue would be filled

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._maybe_raise("force_flush")
        self.flushed += 1
        return True

    def shutdown(self) -> None:
        self._maybe_raise("shutdown")
        self.shut_down = True

    def names(self) -> list[str]:
        return [span.name for span in self.ended]

    def by_name(self) -> dict:
        return {span.name: span for span in self.ended}


class DeviceTimedTracer:
    """A plain SDK TracerProvider with the processor installed, and spans timed by fake events."""

    def __init__(self, **processor_options) -> None:
        self.backend = FakeDeviceEvents(kernel_ms=KERNEL_MS)
        self.pool = EventPool(self.backend, POOL_SIZE)
        self.next = RecordingProcessor()
        processor_options.setdefault("readout_timeout_s", 5.0)
        self.processor = CudaEventSpanProcessor(self.next, self.backend, poll_interval_s=0.001,
                                                release_event=self.pool.release, **processor_options)
        self.provider = TracerProvider()
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("device-timing-test")

    def end_span(self, name: str, device_timed: bool = True) -> tuple:
        """Ends a span whose stage recorded a start and an end event (kernel_ms apart)."""
        span = self.tracer.start_span(name)
        events = (self.pool.record(), self.pool.record()) if device_timed else (None, None)
        if device_timed:
            self.processor.attach_device_events(span, *events)
        span.end()
        return events

    def complete(self, events: tuple) -> None:
        for event in events:
            self.backend.complete_event(event)


@pytest.fixture
def device_with():
    """DeviceTimedTracer with processor options of the test's choosing, shut down after it."""
    made = []

    def make(**options) -> DeviceTimedTracer:
        made.append(DeviceTimedTracer(**options))
        return made[-1]

    yield make
    for timed in made:
        timed.backend.complete_all()
        timed.provider.shutdown()


@pytest.fixture
def device(device_with) -> DeviceTimedTracer:
    return device_with()


def test_a_span_is_held_until_its_events_complete_late(device, wait_until):
    events = device.end_span("forward-compute")
    time.sleep(0.05)
    assert device.next.ended == [] and device.processor.pending() == 1
    device.complete(events)
    assert wait_until(lambda: device.next.ended)
    attributes = device.next.ended[0].attributes
    assert attributes[contract.TIMING] == contract.TIMING_DEVICE
    assert attributes[contract.DEVICE_DURATION_MS] == pytest.approx(KERNEL_MS)
    assert device.processor.counters["device_timed"] == 1
    assert wait_until(lambda: device.pool.free_count() == POOL_SIZE)  # read events go back to the pool


def test_out_of_order_completion_keeps_the_order_spans_ended_in(device, wait_until):
    first = device.end_span("first")
    second = device.end_span("second")
    third = device.end_span("third")
    device.complete(third)
    device.complete(second)
    time.sleep(0.05)
    assert device.next.ended == []  # the front one still runs: everything behind it waits
    device.complete(first)
    assert wait_until(lambda: len(device.next.ended) == 3)
    assert device.next.names() == ["first", "second", "third"]
    assert all(span.attributes[contract.DEVICE_DURATION_MS] == pytest.approx(KERNEL_MS) for span in device.next.ended)


def test_spans_without_events_pass_straight_through_or_wait_their_turn(device, wait_until):
    device.end_span("host-only-alone", device_timed=False)
    assert device.next.names() == ["host-only-alone"]  # nothing held: forwarded in on_end itself

    held = device.end_span("device-timed")
    device.end_span("host-only-behind", device_timed=False)
    time.sleep(0.02)
    assert device.next.names() == ["host-only-alone"]
    device.complete(held)
    assert wait_until(lambda: len(device.next.ended) == 3)
    assert device.next.names() == ["host-only-alone", "device-timed", "host-only-behind"]
    assert contract.TIMING not in device.next.by_name()["host-only-behind"].attributes


def test_events_that_never_complete_time_out_as_device_unavailable(device_with, wait_until):
    device = device_with(readout_timeout_s=0.05)
    stuck_events = device.end_span("stuck")
    behind = device.end_span("behind")
    device.complete(behind)
    assert wait_until(lambda: len(device.next.ended) == 2, timeout_s=2.0)
    stuck, after = device.next.ended
    assert (stuck.name, after.name) == ("stuck", "behind")
    assert stuck.attributes[contract.TIMING] == contract.TIMING_DEVICE_UNAVAILABLE
    assert stuck.attributes[contract.TIMING_REASON] == "readout_timeout"
    assert contract.DEVICE_DURATION_MS not in stuck.attributes
    assert after.attributes[contract.TIMING] == contract.TIMING_DEVICE
    assert device.processor.counters["readout_timeout"] == 1
    # timed-out events may still be pending on the device: not reused until it has passed them
    time.sleep(3 * TIMED_OUT_POLL_S)
    assert device.pool.free_count() == POOL_SIZE - 2
    device.complete(stuck_events)  # the stall ends (a peer's checkpoint written, say)
    assert wait_until(lambda: device.pool.free_count() == POOL_SIZE, timeout_s=2.0)
    assert device.processor.counters["readout_timeout"] == 1


def test_a_failing_event_query_is_an_event_error(device, wait_until):
    device.backend.fail_next_query = True
    device.complete(device.end_span("failing"))
    device.complete(device.end_span("fine"))
    assert wait_until(lambda: len(device.next.ended) == 2)
    failing, fine = device.next.ended
    assert failing.attributes[contract.TIMING] == contract.TIMING_DEVICE_UNAVAILABLE
    assert failing.attributes[contract.TIMING_REASON] == "event_error"
    assert fine.attributes[contract.TIMING] == contract.TIMING_DEVICE
    assert device.processor.counters["event_error"] == 1


def test_the_processor_is_bounded_and_forwards_what_it_cannot_hold(device_with):
    device = device_with(max_pending=4)
    for number in range(4):
        device.end_span(f"held-{number}")
    free_before = device.pool.free_count()
    device.end_span("overflow")
    assert device.processor.pending() == 4
    assert device.next.names() == ["overflow"]  # at once, not held
    overflow = device.next.ended[0]
    assert overflow.attributes[contract.TIMING] == contract.TIMING_DEVICE_UNAVAILABLE
    assert overflow.attributes[contract.TIMING_REASON] == "processor_full"
    assert device.processor.counters["processor_full"] == 1
    assert device.pool.free_count() == free_before  # its events went back to the pool


def test_force_flush_waits_for_the_device_and_reports_when_it_cannot(device, wait_until):
    events = device.end_span("completes-soon")
    threading.Timer(0.05, device.complete, args=(events,)).start()
    assert device.processor.force_flush(timeout_millis=3000) is True
    assert device.next.names() == ["completes-soon"] and device.next.flushed == 1

    device.end_span("never-completes")
    started = time.monotonic()
    assert device.processor.force_flush(timeout_millis=100) is False
    assert time.monotonic() - started < 2.0
    assert device.next.names() == ["completes-soon"]


def test_shutdown_drains_held_spans_within_the_readout_timeout(device_with):
    device = device_with(readout_timeout_s=0.1)
    done = device.end_span("done")
    device.end_span("stuck")
    device.complete(done)
    started = time.monotonic()
    device.provider.shutdown()
    assert time.monotonic() - started < 2.0
    assert device.next.names() == ["done", "stuck"]
    assert device.next.by_name()["stuck"].attributes[contract.TIMING_REASON] == "readout_timeout"
    assert device.next.shut_down
    assert device.processor.pending() == 0

    device.end_span("after-shutdown")  # no hang, no raise, not lost silently
    assert device.next.names()[-1] == "after-shutdown"


def test_a_span_ending_as_the_worker_drains_for_the_last_time_is_still_forwarded(device, wait_until):
    device.processor.shutdown()  # the worker has drained for the last time and stopped
    device.processor._shutdown = False  # as on_end saw it a moment before: the race's window
    device.end_span("late")
    assert device.next.names() == ["late"]  # forwarded, not held where nothing would forward it
    assert device.next.by_name()["late"].attributes[contract.TIMING_REASON] == "processor_shut_down"
    assert device.pool.free_count() == POOL_SIZE and device.processor.pending() == 0
    device.processor._shutdown = True


def test_spans_whose_end_never_reaches_it_are_bounded_and_their_events_come_back(device_with, wait_until):
    device = device_with(max_pending=4)
    for number in range(10):  # attached, never ended through this processor (one ahead of it raised)
        span = device.tracer.start_span(f"never-ended-{number}")
        device.processor.attach_device_events(span, device.pool.record(), device.pool.record())
    assert len(device.processor._events_by_span_id) == 4
    assert device.processor.counters["next_processor_error"] == 6
    device.backend.complete_all()
    assert wait_until(lambda: device.pool.free_count() == POOL_SIZE - 8, timeout_s=2.0)  # 4 still attached


def test_a_second_shutdown_does_not_wait_again(device_with, wait_until):
    device = device_with(readout_timeout_s=1.0)
    device.end_span("stuck")  # its events never complete: the first shutdown waits out its readout
    first = threading.Thread(target=device.processor.shutdown)
    first.start()
    assert wait_until(lambda: device.processor._closing)
    started = time.monotonic()
    device.processor.shutdown()  # as a provider's exit handler would, while the owner's is running
    assert time.monotonic() - started < 0.2
    first.join(5.0)
    assert device.next.names() == ["stuck"] and device.next.shut_down


def test_a_span_whose_attributes_fail_is_forwarded_once_and_its_events_released_once(device, monkeypatch,
                                                                                      wait_until):
    from otel_straggler.processors import cuda_event_span_processor as module

    real, failures = module.with_attributes, []

    def failing_once(*args):
        if not failures:
            failures.append(1)
            raise RuntimeError("attributes")
        return real(*args)

    monkeypatch.setattr(module, "with_attributes", failing_once)
    held = device.end_span("held")  # waits for its events: the worker reads it
    behind = device.end_span("behind")
    device.complete(held)
    device.complete(behind)
    assert wait_until(lambda: device.next.names() == ["held", "behind"])
    assert contract.TIMING not in device.next.by_name()["held"].attributes  # forwarded without them
    # its device timing lost once, as internal_error: not counted as device-timed as well
    assert device.processor.counters["internal_error"] == 1 and device.processor.counters["device_timed"] == 1
    assert wait_until(lambda: device.pool.free_count() == POOL_SIZE)
    free = list(device.pool._free)
    assert len({id(event) for event in free}) == len(free)  # no event twice in the pool


def test_a_span_ending_after_its_events_whose_attributes_fail_is_forwarded_without_them(device, monkeypatch):
    """on_end reads events already complete itself: a failure to add the attributes there must
    not lose the span."""
    from otel_straggler.processors import cuda_event_span_processor as module

    def failing(*args):
        raise RuntimeError("attributes")

    monkeypatch.setattr(module, "with_attributes", failing)
    span = device.tracer.start_span("done-on-the-device")
    events = (device.pool.record(), device.pool.record())
    device.processor.attach_device_events(span, *events)
    device.complete(events)
    span.end()
    assert device.next.names() == ["done-on-the-device"]
    assert contract.TIMING not in device.next.by_name()["done-on-the-device"].attributes
    assert device.processor.counters["internal_error"] == 1 and device.processor.counters["device_timed"] == 0
    assert device.pool.free_count() == POOL_SIZE


@pytest.mark.parametrize("method", ["on_start", "on_end", "force_flush", "shutdown"])
def test_a_failing_next_processor_never_raises_into_the_caller(device, method, wait_until):
    device.next.raise_in.add(method)
    device.complete(device.end_span("first"))
    device.end_span("host-only", device_timed=False)
    device.processor.force_flush(timeout_millis=1000)
    device.processor.shutdown()
    assert device.processor.counters["next_processor_error"] >= 1
    if method != "on_end":
        assert wait_until(lambda: device.next.names() == ["first", "host-only"])


def test_forwarding_a_held_span_and_a_new_one_concurrently_keeps_their_order(device, wait_until):
    # The worker forwards a held span while the span owner ends the next one: the next one
    # must not overtake it, however the threads interleave.
    device.next.stall_on = "ended-first"
    device.complete(device.end_span("ended-first"))
    assert device.next.stalled.wait(2.0)
    device.end_span("ended-second", device_timed=False)
    device.next.release.set()
    assert wait_until(lambda: len(device.next.ended) == 2)
    assert device.next.names() == ["ended-first", "ended-second"]


def test_it_sits_beside_other_processors_in_any_provider():
    backend = FakeDeviceEvents(auto_complete=True, kernel_ms=KERNEL_MS)
    pool = EventPool(backend, 4)
    device_timed, plain = RecordingProcessor(), RecordingProcessor()
    provider = TracerProvider()
    provider.add_span_processor(plain)
    processor = CudaEventSpanProcessor(device_timed, backend, release_event=pool.release)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("any")
    for _ in range(10):  # more spans than the pool has events: events come back after each readout
        with tracer.start_as_current_span("user-span") as span:
            processor.attach_device_events(span, pool.record(), pool.record())
        assert processor.force_flush(1000)
    provider.shutdown()
    assert len(plain.ended) == len(device_timed.ended) == 10
    assert all(span.attributes[contract.DEVICE_DURATION_MS] == pytest.approx(KERNEL_MS) for span in device_timed.ended)
    assert device_timed.started == plain.started == 10 and device_timed.shut_down and plain.shut_down
