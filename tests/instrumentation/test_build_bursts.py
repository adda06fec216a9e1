"""The builder thread works in short bursts with pauses between them, so a training thread that
wants the GIL back never waits for a whole build interval's worth of spans."""
from __future__ import annotations

import time

import otel_straggler as ots
from otel_straggler.instrumentation import pipeline

STAGES = ("forward-compute", "backward-compute", "optimizer")


def test_the_builder_thread_builds_in_bounded_bursts_with_pauses_and_loses_nothing(in_memory, wait_until):
    handle = in_memory.configure(build_interval_ms=60_000.0)  # the thread waits for a wake-up
    with ots.step(0):
        with ots.stage("forward-compute"):
            pass
    assert handle.flush(timeout_s=5.0)  # makes the builder (lazily) and builds all at once
    builder = handle._pipeline.builder
    bursts: list[tuple[float, int]] = []  # (when it began, records it took)
    build_pending = builder.build_pending

    def counted(*args, **kwargs):
        began, queued = time.monotonic(), len(builder.recorder.completed)
        remaining = build_pending(*args, **kwargs)
        bursts.append((began, queued - len(builder.recorder.completed)))
        return remaining

    builder.build_pending = counted
    for n in range(1, 101):
        with ots.step(n):
            for name in STAGES:
                with ots.stage(name):
                    pass
    queued = len(builder.recorder.completed)
    assert queued >= 400  # a step's begin record and its three intervals, per step
    handle._pipeline._wake.set()
    assert wait_until(lambda: not builder.recorder.completed, timeout_s=10.0)

    assert sum(taken for _, taken in bursts) == queued
    assert max(taken for _, taken in bursts) == pipeline.BUILD_BURST_RECORDS
    assert len(bursts) >= queued // pipeline.BUILD_BURST_RECORDS
    gaps = [later - earlier for (earlier, _), (later, _) in zip(bursts, bursts[1:])]
    assert min(gaps) >= pipeline.BUILD_PAUSE_S
    spans = in_memory.spans()
    assert len([span for span in spans if span.name != "train.step"]) == 1 + 100 * len(STAGES)
    assert sum(handle.status()["lost"].values()) == 0


def test_a_backlog_over_half_the_queue_is_built_without_pauses(in_memory, wait_until, monkeypatch):
    monkeypatch.setattr(pipeline, "BUILD_PAUSE_S", 0.2)  # long enough to tell a pause from none
    handle = in_memory.configure(build_interval_ms=60_000.0, queue_size=64)
    with ots.step(0):
        with ots.stage("forward-compute"):
            pass
    assert handle.flush(timeout_s=5.0)
    builder = handle._pipeline.builder
    completed = builder.recorder.completed
    began: list[float] = []
    build_pending = builder.build_pending
    builder.build_pending = lambda *args, **kwargs: began.append(time.monotonic()) or build_pending(*args, **kwargs)
    with ots.step(1):
        while len(completed) < 64:
            with ots.stage("forward-compute"):
                pass
    handle._pipeline._wake.set()
    assert wait_until(lambda: not completed and len(began) == 4, timeout_s=10.0)

    # 64 -> 48 -> 32 records left: still half the queue or more, so no pause; 16 left: a pause
    gaps = [later - earlier for earlier, later in zip(began, began[1:])]
    assert gaps[0] < pipeline.BUILD_PAUSE_S and gaps[1] < pipeline.BUILD_PAUSE_S
    assert gaps[2] >= pipeline.BUILD_PAUSE_S
    assert handle.status()["lost"]["queue_full"] == 0
