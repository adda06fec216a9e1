"""Device-event backends: how a stage's GPU-side duration is measured without a device sync.

An interval records one event on the current stream when it starts and one when it stops (on
the training thread, from a pre-allocated pool). A background thread later asks `query()`
(non-blocking) and, once the end event has completed, `elapsed_ms()`.

`TorchCudaEvents` is the real backend; `FakeDeviceEvents` has the same interface with
completion under the test's control, so every CUDA path is tested on CPU.
"""
from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable, Iterable, Optional, Protocol


class DeviceEventBackend(Protocol):
    name: str

    def create_event(self) -> Any:
        """A timing-capable event; called only when the pool is filled."""

    def record(self, event: Any) -> None:
        """Enqueue the event on the current stream. Hot path: must not sync or block."""

    def query(self, event: Any) -> bool:
        """True once the device has passed the event. Never blocks."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Device time between two completed events, in milliseconds."""


class TorchCudaEvents:
    """Timing CUDA events, recorded on the current stream of the current device.

    Where torch has the device-generic `torch.Event` with `elapsed_time`, its events are used:
    their `record()` finds the current stream in C, in one call, where `torch.cuda.Event.record()`
    first builds a Python `Stream` through `torch.cuda.current_stream()` (several Python frames;
    that lookup was 5.2 of its 7.5 us on an H200 host, benchmarks/gpu_check.py). Both record on
    the same stream and time the same device work; older torch gets `torch.cuda.Event`.

    `torch.Event.elapsed_time` switches to the event's device and back to the calling thread's; on
    the reader thread, which never chose a device, "back" would be device 0, and setting it opens a
    CUDA context there. So the reader first adopts the device the pool's events were made on.
    """

    name = "cuda"

    def __init__(self) -> None:
        import torch  # lazy: the package works host-only without torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        self._cuda = torch.cuda
        # the device current when the pool's events were made: the training thread's (also where
        # GPU health sampling looks for the rank's GPU)
        self.device: Optional[int] = None
        self._reader = threading.local()  # per reading thread: the device it has adopted
        generic = getattr(torch, "Event", None)
        if generic is not None and hasattr(generic, "elapsed_time"):
            self.event_api = "torch.Event"
            self._new_event = functools.partial(generic, "cuda", enable_timing=True)
            # the C method itself: record(event), no Python frame (it stands in for the method below)
            self.record = generic.record  # type: ignore[method-assign]
        else:
            self.event_api = "torch.cuda.Event"
            self._new_event = functools.partial(torch.cuda.Event, enable_timing=True)

    def create_event(self) -> Any:
        self.device = self._cuda.current_device()  # the pool is made on the training thread
        return self._new_event()

    def record(self, event: Any) -> None:
        event.record()

    def query(self, event: Any) -> bool:
        return event.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.device is not None and getattr(self._reader, "device", None) != self.device:
            self._cuda.set_device(self.device)
            self._reader.device = self.device
        return start.elapsed_time(end)


class FakeEvent:
    __slots__ = ("event_id", "recorded", "completed", "device_time_ms", "fail")

    def __init__(self, event_id: int) -> None:
        self.event_id = event_id
        self.recorded = 0
        self.completed = False
        self.device_time_ms = 0.0
        self.fail = False


class FakeDeviceEvents:
    """A device whose progress the test drives.

    Each `record()` puts the event on a simulated stream. By default an event stays pending
    until the test calls `complete_next()`/`complete_all()`; `auto_complete=True` completes it
    at once. Device timestamps advance by `kernel_ms` per recorded event unless the test sets
    them, so `elapsed_ms` of a start/stop pair is a known number. `fail_next_query` makes the
    next query raise, like a CUDA error would.
    """

    name = "fake"

    def __init__(self, auto_complete: bool = False, kernel_ms: float = 1.0) -> None:
        self.auto_complete = auto_complete
        self.kernel_ms = kernel_ms
        self.fail_next_query = False
        self.created = 0
        self.recorded_events = 0
        self._device_clock_ms = 0.0
        self._stream: collections.deque[FakeEvent] = collections.deque()
        self._lock = threading.Lock()  # test-side only; never taken on the record path's hot loop

    def create_event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self.created)

    def record(self, event: FakeEvent) -> None:
        self._device_clock_ms += self.kernel_ms
        event.recorded += 1
        event.completed = self.auto_complete
        event.device_time_ms = self._device_clock_ms
        self.recorded_events += 1
        if not self.auto_complete:
            self._stream.append(event)

    def query(self, event: FakeEvent) -> bool:
        if self.fail_next_query:
            self.fail_next_query = False
            raise RuntimeError("fake device error")
        return event.completed

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        if not (start.completed and end.completed):
            raise RuntimeError("elapsed_ms on an incomplete event")
        return end.device_time_ms - start.device_time_ms

    # test controls
    def pending(self) -> int:
        return len(self._stream)

    def complete_next(self, count: int = 1) -> None:
        """Completes events in stream order, as a device does."""
        with self._lock:
            for _ in range(min(count, len(self._stream))):
                self._stream.popleft().completed = True

    def complete_all(self) -> None:
        self.complete_next(len(self._stream))

    def complete_event(self, event: FakeEvent) -> None:
        """Out-of-order completion (several streams)."""
        event.completed = True


class EventPool:
    """A fixed set of events handed out on the training thread and returned by the reader.

    `deque.pop`/`append` are atomic under the GIL, so neither side takes a lock. An empty
    pool means the interval is timed host-only (`pool_exhausted`), never that training waits.
    """

    def __init__(self, backend: DeviceEventBackend, size: int) -> None:
        self.backend = backend
        self.size = size
        self._free = collections.deque(backend.create_event() for _ in range(size))
        # record() as its two calls, for a caller that makes them itself: the C hot path, which
        # saves a Python frame an event this way (an empty pool: take() raises IndexError)
        self.take = self._free.pop
        self.record_event = backend.record
        # an event back to the pool: the deque's own append, one call of C for each event the
        # device-timing processor gives back (two a span)
        self.release: Callable[[Any], None] = self._free.append

    def record(self) -> Optional[Any]:
        """Takes a free event and records it on the current stream; None when exhausted."""
        try:
            event = self._free.pop()
        except IndexError:
            return None
        try:
            self.backend.record(event)
        except BaseException:
            self._free.append(event)  # not recorded: still the pool's (a failing record must not drain it)
            raise
        return event

    def free_count(self) -> int:
        return len(self._free)


def give_back(release_event: Callable[[Any], None], events: Iterable[Any]) -> None:
    """Device events not handed on (None ones skipped) back to the pool through `release_event`:
    the one way the span builder and the device-timing processor return them."""
    for event in events or ():
        if event is not None:
            release_event(event)


def make_backend(mode: str) -> Optional[DeviceEventBackend]:
    """`auto`: CUDA events when torch sees a GPU, else None; `cuda`: required; `off`: None;
    `fake`: the CPU test backend with auto-completing events."""
    if mode == "off":
        return None
    if mode == "fake":
        return FakeDeviceEvents(auto_complete=True)
    if mode == "cuda":
        try:
            return TorchCudaEvents()
        except Exception as error:  # required, so configure() fails: in one line that says why
            from otel_straggler.settings import ConfigError

            raise ConfigError(f"OTEL_STRAGGLER_DEVICE_TIMING (device_timing) is cuda, but no CUDA device can be "
                              f"timed here: {error}; auto falls back to host-only timing") from None
    try:
        return TorchCudaEvents()
    except Exception:  # no torch, no GPU, broken driver: host-only timing
        return None
