"""A drop-in for Megatron-LM's `config.timers` that records spans instead of synchronising.

Same call shapes: `timers(name, log_level=None)` returns a timer with `start(barrier=False)`,
`stop(barrier=False)`, `reset()`, `elapsed(reset=True, barrier=False)`, `active_time()`;
`timers.log(...)` and `timers.write(...)` take Megatron's arguments. Differences, on purpose:
- no `torch.cuda.synchronize()` and no barrier, ever (`barrier=True` is accepted and ignored),
  so `elapsed()` is host wall time; device time travels on the spans;
- `log()`/`write()` report this rank's own values and never gather across ranks: the
  cross-rank comparison is the detector's job.
Timers hold no threads, locks or queues (the running instrumentation is looked up at call
time), so `copy.deepcopy` and `pickle` give an inert, working copy.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Optional

from otel_straggler.instrumentation import api


class _NoOpTimer:
    """What a timer above the configured log level is: every call does nothing."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        return 0.0

    def active_time(self) -> float:
        return 0.0


class Timer:
    __slots__ = ("name", "_open", "_started_ns", "_elapsed_ns", "_active_ns")

    def __init__(self, name: str) -> None:
        self.name = name
        self._open = None
        self._started_ns: Optional[int] = None
        self._elapsed_ns = 0
        self._active_ns = 0

    def start(self, barrier: bool = False) -> None:
        if self._started_ns is not None:
            return  # Megatron asserts here; a profiler must not stop training for it
        recorder = api._recorder
        if recorder is not None:
            self._open = recorder.start(self.name)
        self._started_ns = 0 if self._open is not None else time.perf_counter_ns()

    def stop(self, barrier: bool = False) -> None:
        if self._started_ns is None:
            return
        opened, self._open = self._open, None
        recorder = api._recorder
        if opened is not None and recorder is not None:
            duration_ns = recorder.stop(opened)  # the span's own clock readings: no extra ones
        else:
            duration_ns = time.perf_counter_ns() - self._started_ns if self._started_ns else 0
        self._elapsed_ns += duration_ns
        self._active_ns += duration_ns
        self._started_ns = None

    def reset(self) -> None:
        self._elapsed_ns = 0

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated since the last reset; a running timer keeps running."""
        running = self._started_ns is not None
        if running:
            self.stop()
        seconds = self._elapsed_ns / 1e9
        if reset:
            self.reset()
        if running:
            self.start()
        return seconds

    def active_time(self) -> float:
        return self._active_ns / 1e9

    def __getstate__(self) -> dict:
        # An open interval belongs to the process that started it: copies start closed.
        return {"name": self.name, "elapsed_ns": self._elapsed_ns, "active_ns": self._active_ns}

    def __setstate__(self, state: dict) -> None:
        self.name = state["name"]
        self._open = None
        self._started_ns = None
        self._elapsed_ns = state["elapsed_ns"]
        self._active_ns = state["active_ns"]


class Timers:
    """`Timers(log_level, log_option)` like Megatron's; timers asked for with a log level above
    `log_level` are no-ops (log_level None means the most detailed level, 2)."""

    max_log_level = 2

    def __init__(self, log_level: int = 2, log_option: str = "minmax") -> None:
        if log_level not in (0, 1, 2):
            raise ValueError(f"log_level must be 0, 1 or 2, got {log_level!r}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._no_op = _NoOpTimer()

    def __call__(self, name: str, log_level: Optional[int] = None) -> Any:
        timer = self._timers.get(name)
        if timer is not None:
            return timer
        if log_level is None:
            log_level = self.max_log_level
        if log_level > self._log_level:
            return self._no_op
        timer = self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return timer

    def _elapsed_ms(self, names: Iterable[str], reset: bool, normalizer: float) -> dict[str, float]:
        if normalizer <= 0:
            raise ValueError("normalizer must be positive")
        return {name: self._timers[name].elapsed(reset=reset) * 1000.0 / normalizer
                for name in names if name in self._timers}

    def get_all_timers_string(self, names: Optional[Iterable[str]] = None, normalizer: float = 1.0,
                              reset: bool = True, barrier: bool = False) -> Optional[str]:
        names = list(self._timers) if names is None else list(names)
        values = self._elapsed_ms(names, reset, normalizer)
        if not values:
            return None
        rank = _this_rank()
        lines = [f"(this rank{'' if rank is None else f' {rank}'}) times (ms):"]
        lines += [f"    {name} ...: {value:.2f}" for name, value in values.items()]
        return "\n".join(lines)

    def log(self, names: Optional[Iterable[str]] = None, rank: Optional[int] = None, normalizer: float = 1.0,
            reset: bool = True, barrier: bool = False) -> None:
        """Prints this rank's timers on `rank` (Megatron's default: the last rank)."""
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        if text is None:
            return
        this_rank = _this_rank()
        if rank is None:
            world = _world_size()
            rank = world - 1 if world is not None else this_rank
        if this_rank is None or this_rank == rank:
            print(text, flush=True)

    def write(self, names: Iterable[str], writer: Any, iteration: int, normalizer: float = 1.0,
              reset: bool = True, barrier: bool = False) -> None:
        """`writer.add_scalar(name + '-time', ms, iteration)` for this rank's values."""
        for name, value in self._elapsed_ms(names, reset, normalizer).items():
            writer.add_scalar(name + "-time", value, iteration)

    def __getstate__(self) -> dict:
        return {"log_level": self._log_level, "log_option": self._log_option,
                "timers": self._timers, "log_levels": self._log_levels}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["log_level"], state["log_option"])
        self._timers = state["timers"]
        self._log_levels = state["log_levels"]


def _this_rank() -> Optional[int]:
    handle = api.current()
    if handle is not None:
        return handle.resource_attributes.get("training.rank")
    return None


def _world_size() -> Optional[int]:
    handle = api.current()
    if handle is not None:
        return handle.resource_attributes.get("training.world_size")
    return None
