"""A drop-in for `megatron.core.timers` that records spans instead of synchronising.

The same classes (`Timers`, `Timer`, `DummyTimer`), methods, arguments, units and output formats
as Megatron's, private methods Megatron-LM calls included. Two differences, on purpose
(docs/megatron.md lists every detail):
- no `torch.cuda.synchronize()`, no barrier and no collective, ever: `barrier=True` is accepted
  and ignored, `elapsed()` is host wall time (device time travels on the spans), and whatever
  Megatron gathers from every rank (`log()` with `max`/`minmax`/`all`, `write()`,
  `_get_elapsed_time_all_ranks`) holds this rank's own values, and the text says so;
- fail open: where Megatron asserts on misuse (a timer started twice, a bad log level or
  option, a non-positive normalizer), ours counts it by kind (`misuse_counts()`, in the rank's
  `status()["timer_misuse"]`) and goes on.
Timers hold no threads, locks or queues (the running instrumentation is looked up at call
time), so `copy.deepcopy` and `pickle` give an inert, working copy.
"""
from __future__ import annotations

import collections
import logging
import sys
import time
from typing import Any, Iterable, Optional

from otel_straggler import contract
from otel_straggler.instrumentation import rank_state

# Megatron's own logger: Megatron-LM's logging setup applies to our lines as to its own.
logger = logging.getLogger("megatron.core.timers")

LOG_OPTIONS = ("max", "minmax", "all")
MAX_LOG_LEVEL = 2
_START_NS = 4  # where an open interval from the recorder keeps its start time (hot_path_reference.OpenInterval)
# What the text of log()/get_all_timers_string() says in place of Megatron's "across ranks".
THIS_RANK_ONLY = "this rank only, not gathered"

_said_rows_are_this_ranks = False
# Misuse Megatron asserts on, counted by kind instead (process-wide: timers may be deep-copied).
_misuse: collections.Counter = collections.Counter()


def misuse_counts() -> dict[str, int]:
    """Calls Megatron would have stopped training for, by kind, since the process started."""
    return dict(_misuse)


rank_state.add_status_section("timer_misuse", misuse_counts)


class DummyTimer:
    """What a timer above the configured log level is. Megatron raises on `elapsed()` and
    `active_time()` of it; ours returns 0.0 and counts `dummy_timer_read`."""

    def __init__(self) -> None:
        self.name = "dummy timer"

    def start(self, barrier: bool = False) -> None:
        return

    def stop(self, barrier: bool = False) -> None:
        return

    def reset(self) -> None:
        return

    def set_barrier_group(self, barrier_group: Any) -> None:
        return

    def set_elapsed(self, value: float) -> None:
        return

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        _misuse["dummy_timer_read"] += 1
        return 0.0

    def active_time(self) -> float:
        _misuse["dummy_timer_read"] += 1
        return 0.0


class Timer:
    """One named timer. Each start()/stop() interval is a span when the instrumentation is on;
    `elapsed()` and `active_time()` are seconds, as Megatron's."""

    __slots__ = ("name", "_open", "_started", "_started_ns", "_accounted_ns", "_elapsed_ns", "_elapsed_set",
                 "_active_ns", "_barrier_group")

    def __init__(self, name: str) -> None:
        self.name = name
        self._open: Optional[tuple] = None  # the recorder's open interval while running with the instrumentation on
        self._started = False
        self._started_ns = 0  # start of the running interval
        self._accounted_ns = 0  # of the running interval, what elapsed() already counted
        # elapsed seconds = _elapsed_ns / 1e9 + _elapsed_set: integers on the training thread
        self._elapsed_ns = 0
        self._elapsed_set = 0.0  # what set_elapsed() gave
        self._active_ns = 0
        self._barrier_group = None

    def set_barrier_group(self, barrier_group: Any) -> None:
        """Kept for Megatron's callers; no barrier is ever made."""
        self._barrier_group = barrier_group

    def start(self, barrier: bool = False) -> None:
        if self._started:
            _misuse["start_while_running"] += 1
            return
        recorder = rank_state.current_recorder()
        opened = self._open = recorder.start(self.name) if recorder is not None else None
        if opened is None:  # off (or the recorder failed): timed here, no span
            self._started_ns = time.time_ns()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        # start()/stop() run on the training thread, often: inlined, no helper calls but the state read
        if not self._started:
            _misuse["stop_while_stopped"] += 1
            return
        opened, self._open = self._open, None
        self._started = False
        recorder = rank_state.current_recorder()
        if opened is not None and recorder is not None:
            duration_ns = recorder.stop(opened)  # the span's own clock readings: no extra ones
        else:
            duration_ns = time.time_ns() - (self._started_ns if opened is None else opened[_START_NS])
        if self._accounted_ns:  # elapsed() read the running timer: that part is counted already
            duration_ns = max(0, duration_ns - self._accounted_ns)  # 0: it could not be timed
            self._accounted_ns = 0
        self._elapsed_ns += duration_ns
        self._active_ns += duration_ns

    def reset(self) -> None:
        """Elapsed back to 0; a running timer stops, as Megatron's does, without adding to
        `active_time()` (its span ends here: the stage did run until now)."""
        self._elapsed_ns, self._elapsed_set = 0, 0.0
        if self._started:
            opened, self._open = self._open, None
            self._started = False
            self._accounted_ns = 0
            recorder = rank_state.current_recorder()
            if opened is not None and recorder is not None:
                recorder.stop(opened)

    def set_elapsed(self, value: float) -> None:
        """Sets the elapsed seconds (Megatron-LM reports its start-up timestamps this way)."""
        self._elapsed_ns, self._elapsed_set = 0, value

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds since the last reset. A running timer goes on running in the same span (Megatron
        stops and restarts it, which would split the span in two)."""
        if self._started:
            opened = self._open
            run_ns = time.time_ns() - (self._started_ns if opened is None else opened[_START_NS])
            self._elapsed_ns += run_ns - self._accounted_ns
            self._active_ns += run_ns - self._accounted_ns
            self._accounted_ns = run_ns
        seconds = self._elapsed_ns / 1e9 + self._elapsed_set
        if reset:
            self._elapsed_ns, self._elapsed_set = 0, 0.0
        return seconds

    def active_time(self) -> float:
        """Seconds this timer has run in all, resets or not."""
        return self._active_ns / 1e9

    def __getstate__(self) -> dict:
        # An open interval belongs to the process that started it: copies start closed.
        return {"name": self.name, "elapsed_ns": self._elapsed_ns, "elapsed_set": self._elapsed_set,
                "active_ns": self._active_ns}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["name"])
        self._elapsed_ns, self._elapsed_set = state["elapsed_ns"], state["elapsed_set"]
        self._active_ns = state["active_ns"]


class Timers:
    """`Timers(log_level, log_option)` as Megatron's: timers asked for with a log level above
    `log_level` are `DummyTimer`s; `log_level` None enables every level."""

    def __init__(self, log_level: Optional[int] = MAX_LOG_LEVEL, log_option: str = "minmax") -> None:
        if log_option not in LOG_OPTIONS:
            _misuse["invalid_log_option"] += 1
            log_option = "minmax"
        self._log_level = MAX_LOG_LEVEL if log_level is None else log_level
        self._log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = MAX_LOG_LEVEL

    def __call__(self, name: str, log_level: Optional[int] = None) -> Any:
        timer = self._timers.get(name)
        if timer is not None:
            if log_level is not None and log_level != self._log_levels[name]:
                _misuse["log_level_mismatch"] += 1
            return timer
        if log_level is None:
            log_level = self._max_log_level
        elif log_level > self._max_log_level:
            _misuse["log_level_above_max"] += 1
            log_level = self._max_log_level
        if log_level > self._log_level:
            return self._dummy_timer
        timer = self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return timer

    # --- what Megatron gathers from every rank, from this rank alone -------------------------

    def _get_elapsed_time_all_ranks(self, names: Iterable[str], reset: bool, barrier: bool) -> Any:
        """A [world_size, len(names)] float tensor of seconds like Megatron's, on the CPU, with only
        this rank's row filled: every other row is 0, which Megatron's readers take as
        "no timing" (no all-gather is made)."""
        names = list(names)
        if not names:
            return None
        import torch

        global _said_rows_are_this_ranks
        if not _said_rows_are_this_ranks:  # a tensor cannot say it: the log does, once
            _said_rows_are_this_ranks = True
            logger.warning("otel-straggler timers: _get_elapsed_time_all_ranks() fills this rank's row only "
                           "(no gather); the other ranks' rows are 0, read as no timing")

        rank, world_size = _rank_and_world_size()
        rank = rank if rank is not None else 0
        times = torch.zeros((max(world_size or 1, rank + 1), len(names)), dtype=torch.float)
        for column, name in enumerate(names):
            if name in self._timers:
                times[rank, column] = self._timers[name].elapsed(reset=reset)
        return times

    def _get_global_min_max_time(self, names: Iterable[str], reset: bool, barrier: bool,
                                 normalizer: float) -> dict[str, tuple[float, float]]:
        """{name: (min, max)} of this rank's value over `normalizer`, for timers that ran."""
        values = self._elapsed_seconds(names, reset)
        return {name: (value / normalizer, value / normalizer) for name, value in values.items() if value > 0.0}

    def _get_global_min_max_time_string(self, names: Iterable[str], reset: bool, barrier: bool,
                                        normalizer: float, max_only: bool) -> Optional[str]:
        name_to_min_max_time = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not name_to_min_max_time:
            return None
        header = "max time" if max_only else "(min, max) time"
        lines = [f"{header} on {_this_rank_label()} (ms):"]
        for name, (min_time, max_time) in name_to_min_max_time.items():
            label = (name + " ").ljust(48, ".")
            lines.append(f"    {label}: {max_time:.2f}" if max_only
                         else f"    {label}: ({min_time:.2f}, {max_time:.2f})")
        return "\n".join(lines)

    def _get_all_ranks_time_string(self, names: Iterable[str], reset: bool, barrier: bool,
                                   normalizer: float) -> Optional[str]:
        rank = _rank_and_world_size()[0]
        values = {name: value for name, value in self._elapsed_seconds(names, reset).items() if value > 0}
        if not values:
            return None
        lines = [f"times on {_this_rank_label()} (ms):"]
        for name, value in values.items():
            lines += [f"  {name}:", f"     rank {rank or 0:2d}: {value / normalizer:.2f}"]
        return "\n".join(lines)

    def _elapsed_seconds(self, names: Iterable[str], reset: bool) -> dict[str, float]:
        return {name: self._timers[name].elapsed(reset=reset) for name in names if name in self._timers}

    # --- public output -----------------------------------------------------------------------

    def get_all_timers_string(self, names: Optional[Iterable[str]] = None, normalizer: float = 1.0,
                              reset: bool = True, barrier: bool = False) -> Optional[str]:
        """Megatron's text for its `log_option`, in ms over `normalizer`, from this rank alone."""
        if names is None:
            names = list(self._timers)
        if not _positive(normalizer):
            return None
        if self._log_option == "all":
            return self._get_all_ranks_time_string(names, reset, barrier, normalizer / 1000.0)
        return self._get_global_min_max_time_string(names, reset, barrier, normalizer / 1000.0,
                                                    self._log_option == "max")

    def log(self, names: Iterable[str], rank: Optional[int] = None, normalizer: float = 1.0,
            reset: bool = True, barrier: bool = False) -> None:
        """Logs the text (logger `megatron.core.timers`, INFO) on `rank`, by default the last."""
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        this_rank, world_size = _rank_and_world_size()
        if rank is None:
            rank = world_size - 1 if world_size is not None else this_rank
        if (this_rank is None or this_rank == rank) and text is not None:
            logger.info(text)

    def write(self, names: Iterable[str], writer: Any, iteration: int, normalizer: float = 1.0,
              reset: bool = True, barrier: bool = False) -> None:
        """Writes `name-time` = seconds over `normalizer` for each timer that ran: to a
        TensorBoard-style writer (`add_scalar`) or to wandb (`log`); with `writer=None` (Megatron-LM
        on every rank but the last) the values are read, and reset, all the same."""
        if not _positive(normalizer):
            return
        name_to_min_max_time = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is None:
            return
        add_scalar, log = getattr(writer, "add_scalar", None), getattr(writer, "log", None)
        for name, (_, max_time) in name_to_min_max_time.items():
            if add_scalar is not None:
                add_scalar(name + "-time", max_time, iteration)
            elif log is not None:
                log({name + "-time": max_time}, iteration)

    def __getstate__(self) -> dict:
        return {"log_level": self._log_level, "log_option": self._log_option,
                "timers": self._timers, "log_levels": self._log_levels}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["log_level"], state["log_option"])
        self._timers = state["timers"]
        self._log_levels = state["log_levels"]


def _positive(normalizer: float) -> bool:
    if normalizer > 0.0:
        return True
    _misuse["normalizer_not_positive"] += 1
    return False


def _rank_and_world_size() -> tuple[Optional[int], Optional[int]]:
    """This process's rank and world size: from the instrumentation's identity, else from an
    initialised torch.distributed, else (None, None) for a single process."""
    handle = rank_state.current()
    if handle is not None:
        attributes = handle.resource_attributes
        return attributes.get(contract.RANK), attributes.get(contract.WORLD_SIZE)
    distributed = getattr(sys.modules.get("torch"), "distributed", None)  # never imports torch
    try:
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            return distributed.get_rank(), distributed.get_world_size()
    except Exception:
        pass
    return None, None


def _this_rank_label() -> str:
    rank, world_size = _rank_and_world_size()
    if rank is None:
        return THIS_RANK_ONLY
    return f"rank {rank}{'' if world_size is None else f' of {world_size}'} ({THIS_RANK_ONLY})"
