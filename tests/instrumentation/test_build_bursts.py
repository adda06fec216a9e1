"""The builder thread works in short bursts with pauses between them, so a training thread that
wants the GIL back never waits for a whole build interval's worth of spans; it stops pausing when
it must catch up. A burst ends at a deadline (rank_pipeline.BUILD_BURST_S after it began), looked
at every span_builder.DEADLINE_CHECK_RECORDS records: the tests set that time to 0, so every burst
takes exactly that many records, whatever this machine's speed."""
from __future__ import annotations

import time

import otel_straggler as ots
from otel_straggler.instrumentation import rank_pipeline
from otel_straggler.instrumentation.span_builder import DEADLINE_CHECK_RECORDS

STAGES = ("forward-compute", "backward-compute", "optimizer")


def count_bursts(handle) -> list[tuple[float, float, int]]:
    """(when it began, when it ended, records it took) of each build_pending call from here on;
    the builder is made first (lazily, by a flush)."""
    with ots.step(0):
        with ots.stage("forward-compute"):
            pass
    assert handle.flush(timeout_s=5.0)
    builder = handle._pipeline.builder
    bursts: list[tuple[float, float, int]] = []
    build_pending = builder.build_pending

    def counted(*args, **kwargs):
        began, queued = time.monotonic(), len(builder.recorder.completed)
        remaining = build_pending(*args, **kwargs)
        bursts.append((began, time.monotonic(), queued - len(builder.recorder.completed)))
        return remaining

    builder.build_pending = counted
    return bursts


def record_steps(count: int) -> None:
    """Steps 1..count with their stages: a step's begin record and an interval per stage each."""
    for n in range(1, count + 1):
        with ots.step(n):
            for name in STAGES:
                with ots.stage(name):
                    pass


def pauses(bursts: list[tuple[float, float, int]]) -> list[float]:
    """From the end of each burst to the start of the next."""
    return [later[0] - earlier[1] for earlier, later in zip(bursts, bursts[1:])]


def test_the_builder_thread_builds_in_bounded_bursts_with_pauses_and_loses_nothing(in_memory, wait_until, monkeypatch):
    monkeypatch.setattr(rank_pipeline, "BUILD_PAUSE_S", 0.01)  # well above a burst's own time here
    monkeypatch.setattr(rank_pipeline, "BUILD_BURST_S", 0.0)
    handle = in_memory.configure(build_interval_ms=60_000.0)  # the thread waits for a wake-up
    bursts = count_bursts(handle)
    completed = handle._pipeline.recorder.completed
    record_steps(100)
    queued = len(completed)
    assert queued >= 400  # a step's begin record and its three intervals, per step
    handle._pipeline._wake.set()
    assert wait_until(lambda: not completed, timeout_s=10.0)

    assert sum(taken for _, _, taken in bursts) == queued
    assert max(taken for _, _, taken in bursts) == DEADLINE_CHECK_RECORDS
    assert len(bursts) >= queued // DEADLINE_CHECK_RECORDS
    assert min(pauses(bursts)) >= rank_pipeline.BUILD_PAUSE_S
    spans = in_memory.spans()
    assert len([span for span in spans if span.name != "train.step"]) == 1 + 100 * len(STAGES)
    assert sum(handle.status()["lost"].values()) == 0


def test_a_backlog_over_half_the_queue_is_built_without_pauses(in_memory, wait_until, monkeypatch):
    monkeypatch.setattr(rank_pipeline, "BUILD_PAUSE_S", 0.2)  # long enough to tell a pause from none
    monkeypatch.setattr(rank_pipeline, "BUILD_BURST_S", 0.0)
    handle = in_memory.configure(build_interval_ms=60_000.0, queue_size=64)
    bursts = count_bursts(handle)
    completed = handle._pipeline.recorder.completed
    with ots.step(1):
        while len(completed) < 64:
            with ots.stage("forward-compute"):
                pass
    handle._pipeline._wake.set()
    assert wait_until(lambda: not completed and len(bursts) == 8, timeout_s=10.0)

    # 56, 48, 40, 32 records left: still half the queue or more, so no pause; 24 left: a pause
    gaps = pauses(bursts)
    assert all(gap < rank_pipeline.BUILD_PAUSE_S for gap in gaps[:4])
    assert gaps[4] >= rank_pipeline.BUILD_PAUSE_S
    assert handle.status()["lost"]["queue_full"] == 0


def test_a_build_running_past_half_its_interval_goes_on_without_pauses(in_memory, wait_until, monkeypatch):
    monkeypatch.setattr(rank_pipeline, "BUILD_PAUSE_S", 0.2)
    monkeypatch.setattr(rank_pipeline, "BUILD_BURST_S", 0.0)
    handle = in_memory.configure(build_interval_ms=1_000.0)  # pauses only in a build's first 0.5 s
    bursts = count_bursts(handle)
    completed = handle._pipeline.recorder.completed
    record_steps(50)
    handle._pipeline._wake.set()
    assert wait_until(lambda: not completed, timeout_s=10.0)

    # 200 records, 25 bursts: with a pause after every burst they would take 4.8 s
    long_pauses = [gap for gap in pauses(bursts) if gap >= rank_pipeline.BUILD_PAUSE_S]
    assert 1 <= len(long_pauses) <= 3
    assert sum(handle.status()["lost"].values()) == 0


def test_flush_builds_on_the_callers_thread_only_until_its_timeout(in_memory, wait_until, monkeypatch):
    """flush(timeout_s) holds the caller for about its timeout, not for building the whole queue
    (up to a second for a full one); what it leaves, the builder thread builds."""
    monkeypatch.setattr(rank_pipeline, "BUILD_PAUSE_S", 0.0)
    handle = in_memory.configure(build_interval_ms=60_000.0)
    bursts = count_bursts(handle)
    builder = handle._pipeline.builder
    counted = builder.build_pending

    def slow(*args, **kwargs):  # each burst takes 5 ms: 125 bursts for what is queued below
        time.sleep(0.005)
        return counted(*args, **kwargs)

    builder.build_pending = slow
    completed = handle._pipeline.recorder.completed
    record_steps(500)
    started = time.monotonic()
    assert handle.flush(timeout_s=0.02) is False
    assert time.monotonic() - started < 0.5 and len(bursts) < 50
    assert len(completed) > 0  # left for the builder thread, which the flush woke
    assert wait_until(lambda: not completed, timeout_s=10.0)
    assert handle.flush(timeout_s=5.0)
    assert len([span for span in in_memory.spans() if span.name != "train.step"]) == 1 + 500 * len(STAGES)
    assert sum(handle.status()["lost"].values()) == 0


def test_a_build_with_a_deadline_stops_at_the_first_look_past_it_and_loses_nothing(in_memory):
    handle = in_memory.configure(build_interval_ms=60_000.0)
    count_bursts(handle)  # the builder made (one step built); nothing queued
    builder = handle._pipeline.builder
    completed = handle._pipeline.recorder.completed
    record_steps(10)  # 40 records
    queued = len(completed)

    assert builder.build_pending(until=0.0) is True  # past already: one look's worth of records
    assert len(completed) == queued - DEADLINE_CHECK_RECORDS
    assert builder.build_pending(until=time.monotonic() + 60.0) is False  # far off: all of them
    assert builder.build_pending(until=0.0) is False  # nothing left: nothing to stop
    assert handle.flush(timeout_s=5.0)
    assert len([span for span in in_memory.spans() if span.name != "train.step"]) == 1 + 10 * len(STAGES)
    assert sum(handle.status()["lost"].values()) == 0


def test_the_intervals_counted_only_grow_through_a_build_and_reach_every_interval(in_memory):
    """status()["intervals"] is exported as a counter (straggler.instrumentation.spans), so it must
    never go back, read before a build, during it (here by a processor of the user's, as each span
    is handed on) or after; and once the queue is built it counts every interval."""
    from opentelemetry.sdk.trace import SpanProcessor

    readings: list[int] = []

    class StatusReader(SpanProcessor):
        def on_end(self, span) -> None:
            readings.append(handle.status()["intervals"])

    handle = in_memory.configure(build_interval_ms=60_000.0)  # built by the flush below only
    in_memory.provider.add_span_processor(StatusReader())
    record_steps(5)
    readings.append(handle.status()["intervals"])
    assert handle.flush(timeout_s=5.0)
    readings.append(handle.status()["intervals"])
    assert len(readings) > 2 * len(STAGES)
    assert readings == sorted(readings)
    assert readings[-1] == 5 * len(STAGES) == len(in_memory.stage_spans())
