"""Heartbeats (CONTRACT §2b): what the training thread is in right now, sampled by the span
builder's thread every heartbeat interval whether or not training makes progress.

A sample reads only what the hot path keeps anyway: the recorder's list of open intervals
(start() appends, stop() removes, so it runs outermost first) and its binding (the step last
bound). Each is read in one step under the GIL (a list copied to a tuple, a tuple read whole),
so start() and stop() take no lock and do no work for it, in the Python and the C recorder alike.
The sampling thread needs the GIL for a moment: a training thread blocked in a collective, a
sleep or any C call that releases the GIL leaves it free, and the heartbeats go on. One that never
lets go of it (a frozen process, an endless call that keeps it) stops them, as a process that is
gone does: that is how the detector tells `rank_lost` from a rank waiting in a collective.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, NamedTuple, Optional

from otel_straggler.instrumentation.hot_path_reference import NAME, START_NS
from otel_straggler.instrumentation.span_builder import step_number


class HeartbeatSample(NamedTuple):
    time_ns: int  # host wall clock at the sample
    step: Optional[int]  # the step last bound by step(); None before the first
    open_stages: list[str]  # outermost first
    open_since_unix_nano: list[int]  # their start times, same order
    gpu: Mapping[str, Any]  # the GPU health sample's training.gpu.* attributes (gpu_health.py); empty when none


_NO_GPU: Mapping[str, Any] = {}


def sample(recorder: Any, gpu: Optional[Mapping[str, Any]] = None) -> HeartbeatSample:
    """The recorder's open stages and bound step, now, with the GPU sample taken just before.
    Runs off the training thread."""
    opened = tuple(recorder.open_intervals)  # one copy under the GIL: the list is never locked
    step = recorder.binding[0]
    now_ns = time.time_ns()
    if step is not None:
        try:
            step = step_number(step)
        except Exception:  # a step the spans cannot carry either (a GPU tensor): the heartbeat goes without
            step = None
    return HeartbeatSample(
        now_ns, step,
        [name if type(name) is str else str(name) for name in (interval[NAME] for interval in opened)],
        [int(interval[START_NS]) for interval in opened],
        gpu or _NO_GPU,
    )


class HeartbeatSchedule:
    """When the next heartbeat is due, on the monotonic clock: one interval after the pipeline
    started, then one interval after the last heartbeat was sent. Heartbeats are never closer than
    an interval, and one that came late (a long GIL hold, a slow build) brings no burst to catch up."""

    def __init__(self, interval_s: float, now: float) -> None:
        self.interval_s = interval_s
        self.next_due = now + interval_s

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def sent(self, now: float) -> None:
        self.next_due = now + self.interval_s
