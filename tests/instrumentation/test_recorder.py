"""The recorder's hot path, both implementations side by side: the Python reference
(hot_path_reference.py) and the C extension (_hot_path) must record the same records for the same calls,
and both must fail open: an error in the event pool, the clock or the caller's arguments is
counted and the call returns as if untimed; only a non-Exception (Ctrl-C) goes on to the caller."""
from __future__ import annotations

import collections
import itertools
import os
import types
from typing import Any, Iterator

import pytest

from otel_straggler.instrumentation import hot_path_reference as python_hot_path
from otel_straggler.processors.device_events import EventPool, FakeDeviceEvents

try:
    from otel_straggler.instrumentation import _hot_path as c_hot_path
except ImportError:
    c_hot_path = None

IMPLEMENTATIONS = {"python": python_hot_path, "c": c_hot_path}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def hot_path(request) -> Iterator[types.ModuleType]:
    module = IMPLEMENTATIONS[request.param]
    if module is None:
        if os.environ.get("CI") == "true":
            pytest.fail("otel_straggler.instrumentation._hot_path is not built", pytrace=False)
        pytest.skip("the C extension is not built here")
    ticks = itertools.count(1_000_000_000, 1_000)  # a clock that moves 1 µs a reading
    module.use_clock(lambda: next(ticks))
    yield module
    module.install(None)
    module.use_clock(None)


class RaisingPool:
    """An event pool whose record() fails with `error` from the `fail_from`-th call on."""

    def __init__(self, error: BaseException, fail_from: int = 0) -> None:
        self.error, self.fail_from, self.calls, self.released = error, fail_from, 0, []

    def record(self) -> Any:
        self.calls += 1
        if self.calls > self.fail_from:
            raise self.error
        return f"event-{self.calls}"

    def release(self, event: Any) -> None:
        self.released.append(event)


def scripted_training(hot_path: types.ModuleType, recorder: Any) -> list:
    """The same calls on either implementation: steps, nested stages, a timer stopped out of
    order, a collective flag, workloads; returns what was queued."""
    hot_path.install(recorder)
    durations = []
    for number in range(3):
        with hot_path.Step(number, tokens=4096 * (number + 1), samples=4):
            with hot_path.Stage("forward-compute"):
                with hot_path.Stage("all-grads-sync", collective=True):
                    pass
            outer = recorder.start("forward-backward")
            inner = recorder.start("backward-compute", False)
            durations.append(recorder.stop(outer))  # out of nesting order, as timers may be
            durations.append(recorder.stop(inner))
    hot_path.install(None)
    with hot_path.Stage("after-uninstall"):  # records nothing
        pass
    return [durations, list(recorder.completed), recorder.open_intervals, recorder.internal_errors]


def comparable(value: Any) -> Any:
    """Records with their events as event ids, so the two implementations' pools compare."""
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(item) for item in value)
    if hasattr(value, "event_id"):
        return ("event", value.event_id)
    return value


@pytest.mark.parametrize("device_events", [False, True], ids=["host-only", "fake-events"])
def test_both_implementations_queue_the_same_records(device_events):
    if c_hot_path is None:
        pytest.skip("the C extension is not built here")
    results = []
    for module in (python_hot_path, c_hot_path):
        ticks = itertools.count(1_000_000_000, 1_000)
        module.use_clock(lambda: next(ticks))
        try:
            pool = EventPool(FakeDeviceEvents(auto_complete=True), 64) if device_events else None
            results.append(comparable(scripted_training(module, module.IntervalRecorder(128, pool))))
        finally:
            module.use_clock(None)
    python_result, c_result = results
    assert c_result == python_result
    durations, records, still_open, errors = python_result
    assert durations == [2_000, 2_000] * 3  # from the clock's readings: 1 µs apart
    assert len(records) == 3 * (2 + 4) and still_open == [] and errors == 0


def test_records_have_the_documented_shapes(hot_path):
    pool = EventPool(FakeDeviceEvents(auto_complete=True), 8)
    recorder = hot_path.IntervalRecorder(16, pool)
    recorder.begin_step(7, 100, 2)
    opened = recorder.start("optimizer")
    assert recorder.stop(opened) == 1_000  # the clock's next reading
    recorder.end_step(7)
    step_begin, interval, step_end = recorder.completed
    assert step_begin == (python_hot_path.STEP_BEGIN, 7, 1_000_000_000, 100, 2)
    name, collective, enclosing, start_step, start_ns, start_event = interval[1]
    assert (interval[0], name, collective, enclosing, start_step, start_ns) == (
        python_hot_path.INTERVAL, "optimizer", None, None, 7, 1_000_001_000)
    assert interval[2:] == (1_000_002_000, interval[3], (7, 100, 2)) and interval[3] is not start_event
    assert step_end == (python_hot_path.STEP_END, 7, 1_000_003_000)
    assert pool.free_count() == 6


def test_a_failing_event_pool_is_counted_and_the_interval_left_untimed(hot_path):
    recorder = hot_path.IntervalRecorder(16, RaisingPool(RuntimeError("cuda error")))
    assert recorder.start("forward-compute") is None
    assert recorder.internal_errors == 1 and recorder.open_intervals == [] and not recorder.completed

    recorder = hot_path.IntervalRecorder(16, RaisingPool(RuntimeError("cuda error"), fail_from=1))
    opened = recorder.start("forward-compute")  # its start event recorded; the end event fails
    assert recorder.stop(opened) == 0 and recorder.internal_errors == 1 and not recorder.completed


def test_stop_with_what_start_did_not_return_is_counted(hot_path):
    recorder = hot_path.IntervalRecorder(16)
    for garbage in (None, 42, ("too", "short"), "forward-compute"):
        assert recorder.stop(garbage) == 0
    assert recorder.internal_errors == 4 and not recorder.completed

    pool = EventPool(FakeDeviceEvents(auto_complete=True), 4)
    recorder = hot_path.IntervalRecorder(16, pool)
    for garbage in ("forward-compute", ("a", "tuple", "of", "six", "strs", "!")):  # indexable, not intervals
        assert recorder.stop(garbage) == 0
    assert not recorder.completed and pool.free_count() == 4


def test_a_failing_clock_is_counted_everywhere(hot_path):
    recorder = hot_path.IntervalRecorder(16)
    opened = recorder.start("forward-compute")

    def broken_clock() -> int:
        raise OSError("no clock")

    hot_path.use_clock(broken_clock)
    assert recorder.start("backward-compute") is None
    assert recorder.stop(opened) == 0
    recorder.begin_step(1)
    recorder.end_step(1)
    assert recorder.internal_errors == 4 and not recorder.completed


def test_a_full_queue_drops_counts_and_gives_the_events_back(hot_path):
    pool = RaisingPool(RuntimeError("unused"), fail_from=1_000)
    recorder = hot_path.IntervalRecorder(16, pool)
    for number in range(20):
        recorder.stop(recorder.start(f"stage-{number}"))
    recorder.begin_step(0)
    recorder.end_step(0)
    assert len(recorder.completed) == 16
    assert recorder.dropped_queue_full == 4 and recorder.dropped_step_records == 2
    assert pool.released == [f"event-{n}" for n in range(33, 41)]  # both events of each dropped interval
    assert recorder.internal_errors == 0


def test_a_non_exception_reaches_the_caller(hot_path):
    recorder = hot_path.IntervalRecorder(16, RaisingPool(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        recorder.start("forward-compute")
    hot_path.install(recorder)
    with pytest.raises(KeyboardInterrupt):
        with hot_path.Stage("forward-compute"):
            pass
    assert recorder.internal_errors == 0


def test_the_first_step_runs_its_hook_once_and_a_failing_hook_is_counted(hot_path):
    recorder = hot_path.IntervalRecorder(16)
    calls = collections.Counter()
    recorder.on_first_step = lambda: calls.update(["made"])
    for number in range(3):
        recorder.begin_step(number)
    assert calls == {"made": 1} and recorder.on_first_step is None

    recorder = hot_path.IntervalRecorder(16)
    recorder.on_first_step = lambda: 1 / 0
    recorder.begin_step(0)
    recorder.begin_step(1)
    assert recorder.internal_errors == 1 and recorder.binding == (1, None, None)


def test_stage_and_step_record_only_while_a_recorder_is_installed(hot_path):
    recorder = hot_path.IntervalRecorder(16)
    with hot_path.Step(0):
        with hot_path.Stage("forward-compute") as timer:
            assert timer.name == "forward-compute" and timer.collective is None
            assert timer._open is None  # not installed: nothing opened
    assert len(recorder.completed) == 0
    hot_path.install(recorder)
    with hot_path.Step(1, tokens=8, samples=1) as step:
        with hot_path.Stage("forward-compute", collective=True) as timer:
            opened = timer._open
        assert timer._open is None and step.number == 1
    kinds = [record[0] for record in recorder.completed]
    assert kinds == [python_hot_path.STEP_BEGIN, python_hot_path.INTERVAL, python_hot_path.STEP_END]
    assert recorder.completed[1][1] is opened and opened[1] is True


def test_a_stage_uninstalled_while_open_is_left_alone(hot_path):
    recorder = hot_path.IntervalRecorder(16)
    hot_path.install(recorder)
    with hot_path.Stage("forward-compute"):
        hot_path.install(None)  # the instrumentation shut down inside the block
    assert not recorder.completed and recorder.internal_errors == 0


def test_an_exhausted_event_pool_times_host_only_without_an_error(hot_path):
    pool = EventPool(FakeDeviceEvents(auto_complete=True), 3)
    recorder = hot_path.IntervalRecorder(16, pool)
    first = recorder.start("forward-compute")
    second = recorder.start("backward-compute")  # the third event: its end finds the pool empty
    recorder.stop(second)
    recorder.stop(first)
    starts = {record[1][0]: (record[1][5], record[3]) for record in recorder.completed}
    assert starts["forward-compute"][0] is not None and starts["forward-compute"][1] is None
    assert None not in starts["backward-compute"]
    assert recorder.start("optimizer")[5] is None
    assert recorder.internal_errors == 0


def test_a_failing_device_backend_behind_an_event_pool_is_counted(hot_path):
    backend = FakeDeviceEvents(auto_complete=True)
    pool = EventPool(backend, 8)
    recorder = hot_path.IntervalRecorder(16, pool)
    backend.record = lambda event: 1 / 0  # as a CUDA error in cudaEventRecord would
    pool.record_event = backend.record
    recorder.event_pool = pool  # takes the pool's calls again
    assert recorder.start("forward-compute") is None
    assert recorder.internal_errors == 1 and recorder.open_intervals == []


def test_a_failed_interval_gives_its_events_back_to_the_pool(hot_path):
    """A record() that fails (a CUDA error), or a stop() that fails after recording, must not
    drain the pool: later stages stay device-timed."""
    backend = FakeDeviceEvents(auto_complete=True)
    pool = EventPool(backend, 8)
    recorder = hot_path.IntervalRecorder(16, pool)
    working = backend.record

    def use(record) -> None:
        backend.record = record
        pool.record_event = record
        recorder.event_pool = pool  # takes the pool's calls again

    use(lambda event: 1 / 0)
    for _ in range(20):
        assert recorder.start("forward-compute") is None
    assert pool.free_count() == 8

    use(working)
    opened = recorder.start("forward-compute")
    assert pool.free_count() == 7
    use(lambda event: 1 / 0)
    assert recorder.stop(opened) == 0  # its end event fails: the start event comes back
    assert pool.free_count() == 8

    ticks = itertools.count(2_000_000_000, 1_000)

    def stop_reading_a_clock_that_raises(opened, error: BaseException) -> int:
        def clock() -> int:
            raise error

        hot_path.use_clock(clock)  # stop() reads the clock after it records the end event
        try:
            return recorder.stop(opened)
        finally:
            hot_path.use_clock(lambda: next(ticks))

    use(working)
    opened = recorder.start("forward-compute")
    # both events recorded, the interval not queued
    assert stop_reading_a_clock_that_raises(opened, RuntimeError("after the end event was recorded")) == 0
    assert pool.free_count() == 8
    assert recorder.internal_errors == 22 and not recorder.completed and recorder.open_intervals == []

    opened = recorder.start("forward-compute")
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C there: raised, after the same cleanup
        stop_reading_a_clock_that_raises(opened, KeyboardInterrupt())
    assert pool.free_count() == 8 and recorder.open_intervals == [] and recorder.internal_errors == 22


def test_a_full_queue_whose_pool_fails_a_release_gives_no_event_back_twice(hot_path):
    pool = EventPool(FakeDeviceEvents(auto_complete=True), 4)
    recorder = hot_path.IntervalRecorder(0, pool)  # every interval finds the queue full
    opened = recorder.start("forward-compute")
    release, calls = pool.release, []

    def release_failing_second(event) -> None:
        calls.append(event)
        if len(calls) == 2:
            raise RuntimeError("release failed")
        release(event)

    pool.release = release_failing_second
    assert recorder.stop(opened) == 0
    assert recorder.dropped_queue_full == 1 and recorder.internal_errors == 1
    free = list(pool._free)
    assert len(free) == 3 and len({id(event) for event in free}) == 3  # the end event lost, none doubled


def test_nesting_beyond_the_bound_is_timed_but_not_kept_as_a_parent(hot_path):
    assert hot_path.MAX_OPEN_INTERVALS == python_hot_path.MAX_OPEN_INTERVALS
    bound = hot_path.MAX_OPEN_INTERVALS
    recorder = hot_path.IntervalRecorder(16)
    hot_path.install(recorder)
    never_exited = [hot_path.Stage(f"leaked-{n}").__enter__() for n in range(bound + 10)]
    assert len(recorder.open_intervals) == bound and recorder.untracked_open_intervals == 10
    deepest_tracked = recorder.open_intervals[-1]
    with hot_path.Stage("inner"):
        pass
    (record,) = recorder.completed
    assert record[1][0] == "inner" and record[1][2] is deepest_tracked  # its parent: the deepest kept
    never_exited[-1].__exit__(None, None, None)  # an untracked one ending is recorded like any other
    assert len(recorder.completed) == 2 and recorder.internal_errors == 0
