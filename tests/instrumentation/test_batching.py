"""The rank's batching span processor (batching.BatchingSpanProcessor): bounded, every loss
counted by reason, a shutdown that keeps its deadline, a flush that keeps its timeout, OTEL_BSP_*
read as the SDK reads them."""
from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_straggler.instrumentation.batching import BatchingSpanProcessor


class HeldExporter(SpanExporter):
    """Exports block until released (or until shutdown, as an exporter's retry wait ends)."""

    def __init__(self, hold: bool = True) -> None:
        self.released = threading.Event()
        if not hold:
            self.released.set()
        self.exporting = threading.Event()
        self.exported: list = []
        self.failed = 0
        self.shut_down = False

    def export(self, spans):
        self.exporting.set()
        self.released.wait(30)
        if self.shut_down:
            self.failed += len(spans)
            return SpanExportResult.FAILURE
        self.exported += spans
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.shut_down = True
        self.released.set()


def end_spans(processor, count: int) -> None:
    tracer = TracerProvider().get_tracer("test")
    for index in range(count):
        span = tracer.start_span(f"span-{index}")
        span.end()
        processor.on_end(span)


def test_a_full_queue_drops_the_oldest_and_counts_each_span():
    exporter = HeldExporter()
    processor = BatchingSpanProcessor(exporter, schedule_delay_millis=60_000, max_queue_size=10,
                                      max_export_batch_size=5, environ={})
    try:
        end_spans(processor, 5)  # a full batch: the worker takes it and is held in export
        assert exporter.exporting.wait(5)
        end_spans(processor, 25)
        assert processor.queue_length() == 10 and processor.dropped_queue_full == 15
        exporter.released.set()
        assert processor.force_flush(5000)
        assert [span.name for span in exporter.exported][-10:] == [f"span-{index}" for index in range(15, 25)]
    finally:
        processor.shutdown()
    assert len(exporter.exported) + processor.dropped_queue_full == 30


def test_shutdown_keeps_its_deadline_and_counts_what_was_left():
    exporter = HeldExporter()
    processor = BatchingSpanProcessor(exporter, schedule_delay_millis=60_000, max_queue_size=100,
                                      max_export_batch_size=10, environ={})
    end_spans(processor, 10)
    assert exporter.exporting.wait(5)  # held: as an export retrying through an outage
    end_spans(processor, 35)
    processor.shutdown_deadline = time.monotonic() + 0.6
    started = time.monotonic()
    processor.shutdown()
    assert time.monotonic() - started < 0.9
    # the held batch was told to stop (the exporter's shutdown) and failed; the rest never left
    assert exporter.shut_down and exporter.failed == 10
    assert processor.unexported_at_shutdown == 35
    end_spans(processor, 3)  # after shutdown: ignored
    assert processor.queue_length() == 0


class ShutDownWhilePrewriting(HeldExporter):
    """Its prewrite, which on_end() runs after checking for shutdown and before queueing, lets a
    shutdown on another thread finish first: the race of a span ended while the rank shuts down."""

    def __init__(self) -> None:
        super().__init__(hold=False)
        self.processor = None
        self.race = False

    def prewrite(self, span):
        if self.race:
            self.race = False
            closer = threading.Thread(target=self.processor.shutdown)
            closer.start()
            closer.join(5)
        return span

    def prewrite_many(self, spans):
        return [self.prewrite(span) for span in spans]


@pytest.mark.parametrize("many", [False, True], ids=["on_end", "on_end_many"])
def test_a_span_handed_on_while_shutdown_makes_its_last_count_is_counted(many):
    exporter = ShutDownWhilePrewriting()
    processor = BatchingSpanProcessor(exporter, schedule_delay_millis=60_000, max_queue_size=100,
                                      max_export_batch_size=50, environ={})
    exporter.processor = processor
    end_spans(processor, 3)
    exporter.race = True
    tracer = TracerProvider().get_tracer("test")
    late = [tracer.start_span(f"late-{index}") for index in range(2)]
    for span in late:
        span.end()
    if many:
        processor.on_end_many(late)
    else:
        processor.on_end(late[0])
        late = late[:1]
    assert processor.queue_length() == 0
    # the first 3 went out at shutdown; the late ones are counted, not left in the queue
    assert len(exporter.exported) == 3 and processor.unexported_at_shutdown == len(late)


def test_force_flush_keeps_its_timeout_and_says_whether_it_finished():
    exporter = HeldExporter()
    processor = BatchingSpanProcessor(exporter, schedule_delay_millis=60_000, environ={})
    try:
        end_spans(processor, 3)
        started = time.monotonic()
        assert processor.force_flush(100) is False
        assert time.monotonic() - started < 0.5
        exporter.released.set()
        assert processor.force_flush(5000) is True
        assert len(exporter.exported) == 3
        assert processor.force_flush(0) is True  # nothing queued: at once
    finally:
        processor.shutdown()


def test_spans_go_out_by_the_schedule_delay_without_a_flush():
    exporter = HeldExporter(hold=False)
    processor = BatchingSpanProcessor(exporter, environ={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        end_spans(processor, 3)
        deadline = time.monotonic() + 5
        while len(exporter.exported) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(exporter.exported) == 3
    finally:
        processor.shutdown()


def test_otel_bsp_variables_are_read_as_the_sdk_reads_them(caplog):
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_BSP_MAX_QUEUE_SIZE": "64",
               "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "16", "OTEL_BSP_EXPORT_TIMEOUT": "not a number"}
    processor = BatchingSpanProcessor(HeldExporter(hold=False), environ=environ)
    try:
        assert (processor.schedule_delay_s, processor.max_queue_size, processor.max_export_batch_size,
                processor.export_timeout_s) == (0.25, 64, 16, 30.0)  # the bad one: the SDK's default
        assert "OTEL_BSP_EXPORT_TIMEOUT" in caplog.text
    finally:
        processor.shutdown()
    with pytest.raises(ValueError, match="max_export_batch_size must be less than or equal to max_queue_size"):
        BatchingSpanProcessor(HeldExporter(), environ={"OTEL_BSP_MAX_QUEUE_SIZE": "8"})


def test_spans_that_came_during_a_scheduled_export_wait_for_the_next_one():
    """As in the SDK's processor: one batch per schedule, not a second export right after for
    what came meanwhile (a receiver that learns a rank's pace from its deliveries would see a
    burst of two, a fraction of a second apart)."""
    exporter = HeldExporter()
    sizes: list[int] = []
    export = exporter.export
    exporter.export = lambda spans: (sizes.append(len(spans)), export(spans))[1]
    processor = BatchingSpanProcessor(exporter, schedule_delay_millis=1000, environ={})
    try:
        end_spans(processor, 3)
        assert exporter.exporting.wait(5)  # the scheduled export, held
        end_spans(processor, 2)
        exporter.released.set()
        time.sleep(0.2)  # a fifth of a schedule
        assert sizes == [3] and processor.queue_length() == 2
        deadline = time.monotonic() + 5
        while len(exporter.exported) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sizes == [3, 2]
    finally:
        processor.shutdown()
