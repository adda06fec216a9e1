"""The Megatron `config.timers` drop-in: same call shapes, same log-level filter, nesting into
spans, and deepcopy/pickle giving inert working copies."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import time
import types
from typing import Iterator

import pytest

import otel_straggler
from otel_straggler.instrumentation import hot_path
from otel_straggler.integrations import megatron_timers
from otel_straggler.integrations.megatron_timers import Timer, Timers
from otel_straggler.instrumentation.span_builder import trace_id_for_step

REQUIRED = inspect.Parameter.empty

# Megatron-LM's megatron/core/timers.py signatures: (parameter, default) in order.
MEGATRON_SIGNATURES = {
    (Timers, "__init__"): [("log_level", REQUIRED), ("log_option", REQUIRED)],
    (Timers, "__call__"): [("name", REQUIRED), ("log_level", None)],
    (Timers, "log"): [("names", REQUIRED), ("rank", None), ("normalizer", 1.0), ("reset", True), ("barrier", False)],
    (Timers, "write"): [("names", REQUIRED), ("writer", REQUIRED), ("iteration", REQUIRED), ("normalizer", 1.0),
                        ("reset", True), ("barrier", False)],
    (Timers, "get_all_timers_string"): [("names", None), ("normalizer", 1.0), ("reset", True), ("barrier", False)],
    (Timer, "start"): [("barrier", False)],
    (Timer, "stop"): [("barrier", False)],
    (Timer, "reset"): [],
    (Timer, "elapsed"): [("reset", True), ("barrier", False)],
    (Timer, "active_time"): [],
    (Timer, "set_elapsed"): [("value", REQUIRED)],
    (Timer, "set_barrier_group"): [("barrier_group", REQUIRED)],
}
NO_OP_TIMER = megatron_timers.DummyTimer


@pytest.mark.parametrize("owner, method", list(MEGATRON_SIGNATURES))
def test_call_shapes_match_megatron(owner, method):
    for cls in (owner,) if owner is Timers else (Timer, NO_OP_TIMER):
        parameters = list(inspect.signature(getattr(cls, method)).parameters.values())[1:]  # past self
        assert [p.name for p in parameters] == [name for name, _ in MEGATRON_SIGNATURES[owner, method]], cls
        for parameter, (name, default) in zip(parameters, MEGATRON_SIGNATURES[owner, method]):
            if default is not REQUIRED:  # a Megatron default must be ours too; ours may add defaults
                assert parameter.default == default, (cls, name)


class FakeClock:
    """Stands in for the clocks the timers read (their own perf counter and, with the
    instrumentation on, the recorder's wall clock), so elapsed values are exact."""

    def __init__(self) -> None:
        self.now_ns = time.time_ns()

    def read_ns(self) -> int:
        return self.now_ns

    def advance(self, ms: float) -> None:
        self.now_ns += int(ms * 1_000_000)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(megatron_timers, "time", types.SimpleNamespace(time_ns=fake.read_ns))
    hot_path.use_clock(fake.read_ns)
    yield fake
    hot_path.use_clock(None)


def test_elapsed_reset_and_active_time_follow_megatron(clock):
    timers = Timers(2, "minmax")
    timer = timers("forward-compute", log_level=2)
    timer.start()
    clock.advance(10)
    timer.stop()
    timer.start(barrier=True)
    clock.advance(5)
    timer.stop(barrier=True)
    assert timer.elapsed(reset=False) == pytest.approx(0.015)
    assert timer.elapsed() == pytest.approx(0.015)  # resets by default
    assert timer.elapsed() == 0.0
    assert timer.active_time() == pytest.approx(0.015)  # not touched by resets

    timer.start()
    clock.advance(7)
    assert timer.elapsed(reset=True, barrier=False) == pytest.approx(0.007)  # read while running...
    clock.advance(3)
    timer.stop()  # ...and it kept running
    assert timer.elapsed(reset=False) == pytest.approx(0.003)
    timer.reset()
    assert timer.elapsed() == 0.0
    assert timer.active_time() == pytest.approx(0.025)
    assert timers("forward-compute") is timer


def test_start_twice_and_stop_unstarted_do_not_raise(clock):
    timer = Timers(2, "minmax")("batch-generator")
    timer.stop()
    timer.start()
    clock.advance(4)
    timer.start()  # Megatron asserts here; the drop-in keeps training going
    clock.advance(4)
    timer.stop()
    timer.stop()
    assert timer.elapsed() == pytest.approx(0.008)


def test_log_level_filter_makes_timers_above_the_level_no_ops(clock, in_memory):
    in_memory.configure()
    timers = Timers(log_level=1, log_option="minmax")
    kept = [timers("forward-backward", log_level=0), timers("forward-compute", log_level=1)]
    dropped = [timers("params-all-gather", log_level=2), timers("optimizer")]  # None means level 2
    otel_straggler.step(0)
    for timer in kept + dropped:
        timer.start(barrier=False)
        clock.advance(2)
        timer.stop(barrier=False)
    assert [timer.elapsed(reset=False) for timer in kept] == [pytest.approx(0.002)] * 2
    assert [timer.elapsed() for timer in dropped] == [0.0, 0.0]
    assert [timer.active_time() for timer in dropped] == [0.0, 0.0]
    assert sorted(span.name for span in in_memory.stage_spans()) == ["forward-backward", "forward-compute"]
    assert Timers(0, "minmax")("forward-compute", log_level=1).elapsed() == 0.0


def test_misuse_megatron_asserts_on_is_counted_and_training_goes_on(clock):
    before = megatron_timers.misuse_counts()
    timers = Timers(log_level=None, log_option="no-such-option")  # None: every level enabled
    timer = timers("forward-compute", log_level=2)
    assert timers("forward-compute", log_level=1) is timer
    assert isinstance(timers("deeper", log_level=3), Timer)  # above Megatron's max: kept at level 2
    timer.stop()
    timer.start()
    timer.start()
    clock.advance(2)
    timer.stop()
    assert timers.get_all_timers_string(["forward-compute"], normalizer=0.0, reset=False) is None
    assert Timers(0, "minmax")("optimizer").elapsed() == 0.0
    counted = {kind: count - before.get(kind, 0) for kind, count in megatron_timers.misuse_counts().items()}
    assert counted == {"invalid_log_option": 1, "log_level_mismatch": 1, "log_level_above_max": 1,
                       "stop_while_stopped": 1, "start_while_running": 1, "normalizer_not_positive": 1,
                       "dummy_timer_read": 1}
    assert timer.elapsed() == pytest.approx(0.002)
    assert Timers(3, "all")("any-level", log_level=2).elapsed() == 0.0  # Megatron accepts 3 too


def test_misuse_counts_are_in_the_ranks_status(clock, in_memory):
    handle = in_memory.configure()
    before = handle.status()["timer_misuse"].get("stop_while_stopped", 0)
    Timers(2, "minmax")("optimizer").stop()
    assert handle.status()["timer_misuse"]["stop_while_stopped"] == before + 1


def test_reset_stops_a_running_timer_and_elapsed_does_not_split_its_span(clock, in_memory):
    in_memory.configure()
    timers = Timers(2, "minmax")
    otel_straggler.step(0)
    interval = timers("interval-time", log_level=0)
    interval.start()
    clock.advance(4)
    assert interval.elapsed(reset=False) == pytest.approx(0.004)
    clock.advance(6)
    assert interval.elapsed() == pytest.approx(0.010)
    clock.advance(5)
    interval.stop()
    assert interval.elapsed() == pytest.approx(0.005)
    assert interval.active_time() == pytest.approx(0.015)
    (span,) = in_memory.stage_spans()
    assert (span.name, span.end_time - span.start_time) == ("interval-time", 15_000_000)  # one span

    running = timers("batch-generator")
    running.start()
    clock.advance(3)
    running.reset()  # Megatron: elapsed 0, the timer stopped, active_time not added to
    assert (running.elapsed(), running.active_time()) == (0.0, 0.0)
    running.start()  # no misuse: it is stopped
    clock.advance(1)
    running.stop()
    assert running.elapsed() == pytest.approx(0.001)


def test_set_elapsed_reports_a_given_value():
    timer = Timers(2, "minmax")("startup-time", log_level=0)
    timer.set_elapsed(12.5)
    timer.set_barrier_group(object())
    assert timer.elapsed() == 12.5


def test_log_writes_this_ranks_values_through_megatrons_logger_on_the_chosen_rank(clock, caplog, in_memory):
    in_memory.configure(rank=0, world_size=2)
    timers = Timers(2, "minmax")
    for name, ms in (("forward-compute", 10), ("backward-compute", 30)):
        timers(name).start()
        clock.advance(ms)
        timers(name).stop()
    caplog.set_level("INFO", logger="megatron.core.timers")

    timers.log(["forward-compute", "backward-compute"], normalizer=2.0, reset=False)  # Megatron: last rank logs
    assert caplog.records == []
    timers.log(["forward-compute", "backward-compute"], rank=0, normalizer=2.0, reset=True, barrier=True)
    (record,) = caplog.records
    assert record.name == "megatron.core.timers" and record.levelname == "INFO"
    assert record.getMessage() == (
        "(min, max) time on rank 0 of 2 (this rank only, not gathered) (ms):\n"
        "    forward-compute ................................: (5.00, 5.00)\n"
        "    backward-compute ...............................: (15.00, 15.00)")
    assert timers.get_all_timers_string(["forward-compute", "backward-compute"]) is None  # reset: 0 is left out
    assert timers.get_all_timers_string(["never-started"]) is None


@pytest.mark.parametrize("log_option, expected", [
    ("max", "max time on this rank only, not gathered (ms):\n    forward-compute ................................: 3.00"),
    ("all", "times on this rank only, not gathered (ms):\n  forward-compute:\n     rank  0: 3.00"),
])
def test_log_options_keep_megatrons_format(clock, log_option, expected):
    timers = Timers(2, log_option)
    timers("forward-compute").start()
    clock.advance(3)
    timers("forward-compute").stop()
    assert timers.get_all_timers_string() == expected


def test_write_gives_seconds_over_the_normalizer_to_tensorboard_and_wandb(clock):
    written, logged = [], []
    tensorboard = types.SimpleNamespace(add_scalar=lambda *args: written.append(args))
    wandb = types.SimpleNamespace(log=lambda *args: logged.append(args))
    timers = Timers(2, "minmax")
    timers("optimizer").start()
    clock.advance(8)
    timers("optimizer").stop()
    timers.write(["optimizer", "not-a-timer"], tensorboard, 7, normalizer=4.0, reset=False)
    timers.write(["optimizer"], wandb, 8, reset=False)
    timers.write(["optimizer"], None, 9)  # not the last rank: read and reset, nothing written
    timers.write(["optimizer"], tensorboard, 10, 1.0, True, False)  # 0 is left out, as Megatron does
    assert written == [("optimizer-time", pytest.approx(0.002), 7)]
    assert logged == [({"optimizer-time": pytest.approx(0.008)}, 8)]


def test_nested_timers_give_nested_spans_under_the_step(in_memory):
    in_memory.configure(job_id="nesting-job")
    timers = Timers(2, "minmax")
    otel_straggler.step(4)
    timers("forward-backward", log_level=1).start(barrier=False)
    timers("forward-compute", log_level=2).start()
    timers("forward-compute").stop()
    timers("backward-compute", log_level=2).start()
    timers("backward-compute").stop()
    timers("forward-backward").stop(barrier=False)
    timers("optimizer", log_level=1).start()
    timers("optimizer").stop()
    otel_straggler.step(5)

    by_name = {span.name: span for span in in_memory.spans()}
    step_span, outer = by_name["train.step"], by_name["forward-backward"]
    assert outer.parent.span_id == step_span.context.span_id
    assert by_name["forward-compute"].parent.span_id == outer.context.span_id
    assert by_name["backward-compute"].parent.span_id == outer.context.span_id
    assert by_name["optimizer"].parent.span_id == step_span.context.span_id
    assert {span.context.trace_id for span in by_name.values()} == {trace_id_for_step("nesting-job", 4)}
    assert outer.start_time <= by_name["forward-compute"].start_time <= by_name["backward-compute"].end_time \
        <= outer.end_time


@dataclasses.dataclass
class MegatronLikeConfig:
    """Megatron keeps its timers on a config object that it deep-copies and pickles."""
    hidden_size: int
    timers: Timers


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))],
                         ids=["deepcopy", "pickle"])
def test_copies_are_inert_and_working(duplicate, clock, in_memory):
    in_memory.configure()
    timers = Timers(2, "minmax")
    otel_straggler.step(0)
    timers("forward-compute").start()
    clock.advance(10)
    timers("forward-compute").stop()
    timers("interval-time", log_level=0).start()  # running while copied
    clock.advance(1)

    copied = duplicate(MegatronLikeConfig(hidden_size=64, timers=timers)).timers

    assert copied("forward-compute").elapsed(reset=False) == pytest.approx(0.010)
    running_copy = copied("interval-time")
    running_copy.stop()  # the copy starts closed: nothing to stop
    assert running_copy.elapsed(reset=False) == 0.0
    copied("forward-compute").reset()
    assert timers("forward-compute").elapsed(reset=False) == pytest.approx(0.010)  # independent
    copied("backward-compute").start()
    clock.advance(2)
    copied("backward-compute").stop()
    assert copied("backward-compute").elapsed() == pytest.approx(0.002)
    assert copied("params-all-gather", log_level=2).elapsed() == 0.0
    timers("interval-time").stop()

    names = sorted(span.name for span in in_memory.stage_spans())
    # the copy's interval was recorded; the running timer's interval was not duplicated
    assert names == ["backward-compute", "forward-compute", "interval-time"]


def test_a_running_timer_copies_closed(clock):
    timer = Timer("forward-compute")
    timer.start()
    clock.advance(5)
    copied = copy.deepcopy(timer)
    clock.advance(5)
    timer.stop()
    assert timer.elapsed() == pytest.approx(0.010)
    assert copied.elapsed() == 0.0
    copied.start()
    clock.advance(1)
    copied.stop()
    assert copied.elapsed() == pytest.approx(0.001)


def test_the_ready_made_timers_pickle(clock):
    restored = pickle.loads(pickle.dumps(otel_straggler.timers))
    assert isinstance(restored, Timers)
    restored("forward-compute").start()
    clock.advance(1)
    restored("forward-compute").stop()
    assert restored("forward-compute").active_time() == pytest.approx(0.001)
