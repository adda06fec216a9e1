"""The engine thread of the live service (pipeline.SpanPipeline): it advances the engine when spans
come in and when a window could go idle, and otherwise sleeps, so an idle detector costs almost no
CPU; and no window waits longer to close than its rule says."""
from __future__ import annotations

import logging
import threading
import time

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.decode import DecodedBatch
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.driver import ADVANCE_INTERVAL_S, IDLE_WAKE_S, EngineDriver, IntakeCounters, SpanPipeline

from .test_engine_rules import observation


class CountingEngine(Engine):
    """The real engine, counting advances and noting when each window closed (monotonic clock)."""

    def __init__(self, config: DetectorConfig) -> None:
        super().__init__(config)
        self.advances = 0
        self.closed_at: list[float] = []

    def advance(self, now_unix_nano: int):
        self.advances += 1
        closed_before = self.stats()["windows_closed"]
        verdicts = super().advance(now_unix_nano)
        self.closed_at += [time.monotonic()] * (self.stats()["windows_closed"] - closed_before)
        return verdicts


def started(config: DetectorConfig) -> tuple[SpanPipeline, CountingEngine]:
    engine = CountingEngine(config)
    pipeline = SpanPipeline(EngineDriver(engine, IntakeCounters(), lambda verdicts: None), config)
    pipeline.start()
    return pipeline, engine


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_idle_engine_thread_wakes_about_once_per_idle_wake_interval_not_every_advance_interval():
    pipeline, engine = started(DetectorConfig())
    try:
        time.sleep(1.5)
        # polling every ADVANCE_INTERVAL_S would have advanced about 15 times
        assert engine.advances <= 1.5 / IDLE_WAKE_S + 1 < 1.5 / ADVANCE_INTERVAL_S / 2
    finally:
        assert pipeline.stop(5.0)


def test_a_window_closes_by_grace_on_time_while_the_thread_sleeps_in_between():
    grace_s = 0.4
    pipeline, engine = started(DetectorConfig(window_grace_s=grace_s, window_steps=10))
    try:
        time.sleep(0.3)  # let the thread settle into its idle wait first
        advances_before = engine.advances
        submitted = time.monotonic()
        assert pipeline.submit(DecodedBatch(observations=[observation(0, 0, 0), observation(1, 0, 0)]))
        wait_for(lambda: engine.closed_at)
        # noticed at the first advance after the batch (within ADVANCE_INTERVAL_S), closed grace_s later
        delay = engine.closed_at[0] - submitted
        assert grace_s <= delay < grace_s + ADVANCE_INTERVAL_S + 0.25, delay
        # one advance to notice the rows, one at the deadline; polling would have made about five
        assert engine.advances - advances_before <= 3
    finally:
        assert pipeline.stop(5.0)


def test_spans_that_move_the_cohort_on_close_its_window_within_the_advance_interval():
    # max_export_lag_s: a short startup hold, as this test times the close after the second batch
    pipeline, engine = started(DetectorConfig(window_grace_s=3600.0, window_steps=10, max_export_lag_s=0.1))
    try:
        assert pipeline.submit(DecodedBatch(observations=[observation(rank, 0, 0) for rank in range(2)]))
        time.sleep(0.3)
        submitted = time.monotonic()
        assert pipeline.submit(DecodedBatch(observations=[observation(rank, 10, 1) for rank in range(2)]))
        wait_for(lambda: engine.closed_at)
        assert engine.closed_at[0] - submitted < ADVANCE_INTERVAL_S + 0.25
    finally:
        assert pipeline.stop(5.0)


def test_stop_wakes_a_sleeping_engine_thread_and_judges_what_is_open():
    pipeline, engine = started(DetectorConfig(window_grace_s=3600.0))
    assert pipeline.submit(DecodedBatch(observations=[observation(0, 0, 0)]))
    time.sleep(0.3)
    stopping = threading.Thread(target=pipeline.stop, args=(5.0,))
    began = time.monotonic()
    stopping.start()
    stopping.join(5.0)
    assert time.monotonic() - began < IDLE_WAKE_S / 2
    assert engine.stats()["windows_closed"] == 1  # drained


def test_the_first_late_spans_are_explained_once_in_the_log(caplog):
    """Late spans usually mean windows close before every rank's export burst arrives (fast
    steps): the first ones get one warning that says what to change; the counter has the rest."""
    config = DetectorConfig(window_steps=1, window_close_lag=1, min_cohort_size=2)
    driver = EngineDriver(Engine(config), IntakeCounters(), lambda verdicts: None)
    now = 10**18
    on_time = [observation(rank=rank, step=step, seq=step) for rank in range(3) for step in range(3)]
    driver.ingest(DecodedBatch(on_time, 0, 0), now)
    driver.advance(now)
    now += 10**9  # after the cohort's startup hold
    driver.advance(now)  # every rank is past window 0: it is judged
    with caplog.at_level(logging.WARNING, logger="otel_straggler.detector.driver"):
        driver.ingest(DecodedBatch([observation(rank=3, step=0)], 0, 0), now)
        driver.ingest(DecodedBatch([observation(rank=4, step=0)], 0, 0), now)
    assert driver.counters.snapshot()["spans"]["late"] == 2
    warnings = [record for record in caplog.records if "late" in record.getMessage()]
    assert len(warnings) == 1 and "--window-steps" in warnings[0].getMessage()


class BusyEngine(CountingEngine):
    """Ingests a batch holding step `busy_step` slowly, as a starved or stalled detector would."""

    def __init__(self, config: DetectorConfig, busy_step: int, busy_s: float) -> None:
        super().__init__(config)
        self.busy_step, self.busy_s = busy_step, busy_s

    def ingest_many(self, observations):
        if any(o.step == self.busy_step for o in observations):
            time.sleep(self.busy_s)
        return super().ingest_many(observations)


def test_spans_queued_while_the_engine_thread_was_busy_are_ingested_before_anyone_is_overdue():
    # two ranks deliver a window every 0.25 s (each one's wait: 2 x 0.25 + 1 s), then rank 0 reaches
    # window 6 in a batch whose ingest takes 2.5 s, and rank 1's next batch (steps 51 and 60) comes
    # meanwhile. Judged before that batch is taken, rank 1 would look overdue and step 51 be late
    config = DetectorConfig(window_grace_s=3600.0, window_steps=10, max_export_lag_s=5.0)
    engine = BusyEngine(config, busy_step=60, busy_s=2.5)
    pipeline = SpanPipeline(EngineDriver(engine, IntakeCounters(), lambda verdicts: None), config)
    pipeline.start()
    try:
        for window in range(6):
            assert pipeline.submit(DecodedBatch(observations=[observation(rank, 10 * window, window)
                                                              for rank in range(2)]))
            time.sleep(0.25)
        assert pipeline.submit(DecodedBatch(observations=[observation(0, 51, 6), observation(0, 60, 7)]))
        time.sleep(0.3)  # the engine thread is in the slow ingest now
        assert pipeline.submit(DecodedBatch(observations=[observation(1, 51, 6), observation(1, 60, 7)]))
        wait_for(lambda: engine.stats()["windows_closed"] == 6, timeout_s=10)
        stats = engine.stats()
    finally:
        assert pipeline.stop(5.0)
    assert stats["late"] == 0 and stats["accepted"] == 16
    assert stats["detector_stalls"] == 1  # 2.5 s without a look: more than IDLE_WAKE_S + 1 s


def test_a_detector_stall_does_not_make_ranks_overdue():
    def window_0_closed(stalled_ns: int) -> bool:
        engine = Engine(DetectorConfig(window_grace_s=3600.0, window_steps=10, max_export_lag_s=1.0))
        now = 10**18
        engine.ingest_many([observation(rank, 0, 0) for rank in range(2)])
        engine.advance(now)
        engine.ingest_many([observation(0, 10, 1)])
        engine.advance(now + 5 * 10**8)
        if stalled_ns:
            engine.detector_stalled(stalled_ns)
        engine.advance(now + 2 * 10**9)  # past the startup hold, and rank 1 past its 1 s wait
        return engine.stats()["windows_closed"] == 1

    assert window_0_closed(0)  # control: rank 1 is overdue, window 0 is judged without waiting more
    assert not window_0_closed(2 * 10**9)  # the detector did not look for 2 s of that
