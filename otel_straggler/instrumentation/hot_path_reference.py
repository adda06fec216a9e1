"""The training-thread hot path (docs/architecture.md, the training-thread budget), in Python: the
reference for the C extension _hot_path, which has the same IntervalRecorder, Stage, Step, install()
and use_clock() and is what runs where it was built (hot_path.py chooses). The layout of the records (INTERVAL, ...) is
defined here for both, and for the code that reads or appends them.

`start()` and `stop()` may only read the host clock, record a CUDA event from the pool, bind
the current step and workload, and append to a bounded queue. They build no span, take no lock,
log nothing, do no I/O and never raise. Everything else happens on the span builder's thread.

Records in `completed` are plain tuples (cheap to make, atomic to append):
  (INTERVAL, open_interval, end_ns, end_event, (step, tokens, samples))
  (STEP_BEGIN, step, time_ns, tokens, samples)
  (STEP_END, step, time_ns)
Span ids, the parent link's step check and the completion sequence number are the builder's
work: the training thread only keeps a reference to the innermost open interval.
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable, Literal, Optional

from otel_straggler.processors.device_events import EventPool

INTERVAL, STEP_BEGIN, STEP_END = 0, 1, 2
# Deeper nesting than this is stages entered and never exited: an interval opened beyond it is
# timed and recorded but not kept as a parent, so the open list (and the chain of enclosing
# intervals it holds) stays bounded; counted in untracked_open_intervals.
MAX_OPEN_INTERVALS = 256
_time_ns = time.time_ns

# an open interval: (name, collective, enclosing open interval or None, start step, start_ns, start_event)
OpenInterval = tuple
NAME, COLLECTIVE, ENCLOSING, START_STEP, START_NS, START_EVENT = range(6)


class IntervalRecorder:
    # slots: the hot path reads several attributes per call, and slot reads are the cheapest
    __slots__ = ("completed", "capacity", "event_pool", "open_intervals", "binding", "on_first_step",
                 "dropped_queue_full", "dropped_step_records", "internal_errors", "untracked_open_intervals")

    def __init__(self, capacity: int, event_pool: Optional[EventPool] = None) -> None:
        self.completed: collections.deque = collections.deque()
        self.capacity = capacity
        self.event_pool = event_pool
        self.open_intervals: list[OpenInterval] = []  # innermost last: the timers' nesting
        self.binding: tuple = (None, None, None)  # (step, tokens, samples), replaced whole
        # called once, at the first step(): the pipeline makes the event pool
        self.on_first_step: Optional[Callable[[], None]] = None
        self.dropped_queue_full = 0  # intervals
        self.dropped_step_records = 0  # step begin/end marks: their train.step spans are lost
        self.internal_errors = 0
        self.untracked_open_intervals = 0

    def start(self, name: str, collective: Optional[bool] = None) -> Optional[OpenInterval]:
        try:
            opened = self.open_intervals
            pool = self.event_pool
            # clock first, then the event: the event sits as close as it can to the stage's kernels
            interval = (name, collective, opened[-1] if opened else None, self.binding[0], _time_ns(),
                        None if pool is None else pool.record())
            if len(opened) < MAX_OPEN_INTERVALS:
                opened.append(interval)
            else:
                self.untracked_open_intervals += 1
            return interval
        except Exception:
            self.internal_errors += 1
            return None

    def stop(self, interval: OpenInterval) -> int:
        """Ends an interval; returns its host duration in ns (0 if it could not be timed)."""
        end_event = None
        try:
            if type(interval) is not tuple or len(interval) != 6:
                raise TypeError("not an interval start() returned")  # as the C recorder checks
            # an interval holds an event only once the pool is set, and the pool is never unset
            end_event = None if interval[5] is None else self.event_pool.record()  # type: ignore[union-attr]
            end_ns = _time_ns()
            duration = end_ns - interval[4]  # before it is queued: a failure here queues nothing
            opened = self.open_intervals
            if opened and opened[-1] is interval:
                opened.pop()
            elif interval in opened:  # timers may stop out of nesting order
                opened.remove(interval)
            completed = self.completed
            if len(completed) < self.capacity:
                completed.append((INTERVAL, interval, end_ns, end_event, self.binding))
                return duration
        except Exception:
            self.internal_errors += 1
            self._end_failed(interval, end_event)
            return 0
        except BaseException:  # KeyboardInterrupt (a signal's handler, a fake clock): cleaned up, then raised
            self._end_failed(interval, end_event)
            raise
        # the queue is full: the interval is dropped and its events go back, once (not again if
        # a release fails)
        self.dropped_queue_full += 1
        try:
            self._give_back(interval[5], end_event)
        except Exception:
            self.internal_errors += 1
            return 0
        return duration

    def begin_step(self, step: int, tokens: Any = None, samples: Any = None) -> None:
        try:
            if self.on_first_step is not None:
                make_event_pool, self.on_first_step = self.on_first_step, None
                make_event_pool()
            now = _time_ns()
            self.binding = (step, tokens, samples)
            if len(self.completed) < self.capacity:
                self.completed.append((STEP_BEGIN, step, now, tokens, samples))
            else:
                self.dropped_step_records += 1
        except Exception:
            self.internal_errors += 1

    def end_step(self, step: int) -> None:
        try:
            if len(self.completed) < self.capacity:
                self.completed.append((STEP_END, step, _time_ns()))
            else:
                self.dropped_step_records += 1
        except Exception:
            self.internal_errors += 1

    def _give_back(self, *events: Any) -> None:
        for event in events:
            if event is not None:  # there are events only once the pool is set, and it is never unset
                self.event_pool.release(event)  # type: ignore[union-attr]

    def _end_failed(self, interval: Any, end_event: Any) -> None:
        """After a failed stop(): the interval has ended all the same (left open, it would be the
        parent of every later stage), and as it is not queued its events go back to the pool (a
        failure must not drain it): the end event taken for this call, and the start event of an
        interval found among the open ones."""
        try:
            start_event = None
            opened = self.open_intervals
            for index in range(len(opened) - 1, -1, -1):
                if opened[index] is interval:  # one start() made, not a lookalike tuple
                    del opened[index]
                    start_event = interval[5]
                    break
            self._give_back(start_event, end_event)
        except Exception:
            pass  # no pool to give them to, or its release failed: they are lost to it, as before


# The recorder Stage and Step record on: set by install(), None while the instrumentation is off.
_installed: Optional[IntervalRecorder] = None


def install(recorder: Optional[IntervalRecorder]) -> None:
    global _installed
    _installed = recorder


def use_clock(clock: Optional[Callable[[], int]]) -> None:
    """Tests only: a callable returning ns stands in for the clock; None restores it."""
    global _time_ns
    _time_ns = time.time_ns if clock is None else clock


class Stage:
    """`stage(name, collective=None)`: times a stage, as `with stage("forward-compute"):` or
    `@stage("data")`.

    `collective=True` marks a blocking collective (its duration includes waiting for peers);
    left as None, Megatron's known names decide and anything else is not a collective.
    (otel_straggler.stage; the C extension's Stage has the same documentation.)
    """

    __slots__ = ("name", "collective", "_open")

    def __init__(self, name: str, collective: Optional[bool] = None) -> None:
        self.name = name
        self.collective = collective
        self._open: Optional[OpenInterval] = None

    def __enter__(self) -> "Stage":
        recorder = _installed
        if recorder is not None:
            self._open = recorder.start(self.name, self.collective)
        return self

    def __call__(self, *function: Callable, **unexpected: Any) -> Callable:
        if len(function) != 1 or unexpected:
            raise TypeError("a stage decorates one function: @stage(name)")
        return timed_by(Stage, self, function[0])

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> Literal[False]:
        opened = self._open
        if opened is not None:
            self._open = None
            recorder = _installed
            if recorder is not None:
                recorder.stop(opened)
        return False


def timed_by(make: Callable[..., Any], timer: Any, function: Callable) -> Callable:
    """`@stage(name)`: each call of `function` runs in a `with` of a new stage of the same name,
    made by `make` (the hot path's Stage type): one stage object times one block at a time, and
    calls may nest or run on several threads."""
    name, collective = timer.name, timer.collective

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with make(name, collective):
            return function(*args, **kwargs)

    return timed


class Step:
    """`step(n, tokens=None, samples=None)`: binds optimizer step `n` and this rank's workload to
    every interval that ENDS from now on, and starts the rank's `train.step` span. Call it at
    the start of each step, or use it as `with step(n, tokens=...):` to end the step span
    explicitly. `n` is an int or converts to one losslessly (a numpy integer, a 0-d integer
    tensor on the CPU: one on a GPU is not read, as that would wait for the device); anything
    else loses the step's spans, counted as `internal_error`. (otel_straggler.step; the C
    extension's Step has the same documentation.)
    """

    __slots__ = ("number",)

    def __init__(self, n: int, tokens: Any = None, samples: Any = None) -> None:
        self.number = n
        recorder = _installed
        if recorder is not None:
            recorder.begin_step(n, tokens, samples)

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, *exc_info: Any) -> Literal[False]:
        recorder = _installed
        if recorder is not None:
            recorder.end_step(self.number)
        return False
