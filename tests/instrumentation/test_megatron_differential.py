"""Ours against megatron-core's real `megatron.core.timers`: the same call sequences on both,
outputs compared value by value. Ours may differ only where docs/megatron.md says so: the header
of the text (this rank only, not "across ranks"), and misuse that Megatron asserts on.

Stand-ins, because this machine has no GPU (megatron_on_cpu.py): `torch.cuda.synchronize` is a
no-op and `torch.cuda.current_device()` is "cpu" (where Megatron puts its gather tensor); the
cross-rank gather runs for real in a one-process gloo group. Megatron writes only to an instance of
`torch.utils.tensorboard.SummaryWriter` or to the `wandb` module, so both names are replaced in
its module by recording stand-ins that ours is handed as well. Both sides read one fake clock.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import pickle
import types

import pytest

torch = pytest.importorskip("torch")  # the torch-free check on the lowest Python has neither
import megatron.core.timers as megatron  # noqa: E402  in the test extras wherever torch is

from otel_straggler.instrumentation import hot_path  # noqa: E402
from otel_straggler.integrations import megatron_timers as ours  # noqa: E402

from megatron_on_cpu import one_rank_group as one_process_group, without_cuda  # noqa: E402

THIS_RANK = "rank 0 of 1 (this rank only, not gathered)"


def documented(text):
    """Megatron's text with our one documented difference applied: whose values they are."""
    if text is None:
        return None
    for megatron_header, our_header in (("max time across ranks", f"max time on {THIS_RANK}"),
                                        ("(min, max) time across ranks", f"(min, max) time on {THIS_RANK}"),
                                        ("times across ranks", f"times on {THIS_RANK}")):
        if text.startswith(megatron_header):
            return our_header + text[len(megatron_header):]
    return text


class RecordingSummaryWriter:
    def __init__(self) -> None:
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 1_000 * 10**9  # small enough that float seconds stay exact to the ns

    def read_ns(self) -> int:
        return self.now_ns

    def advance(self, ms: float) -> None:
        self.now_ns += int(ms * 1_000_000)


@pytest.fixture(scope="module")
def one_rank_group():
    with one_process_group():
        yield


@pytest.fixture
def clock(monkeypatch, one_rank_group):
    fake = FakeClock()
    without_cuda(monkeypatch)
    monkeypatch.setattr(megatron, "time", types.SimpleNamespace(time=lambda: fake.now_ns / 1e9))
    monkeypatch.setattr(ours, "time", types.SimpleNamespace(time_ns=fake.read_ns))
    monkeypatch.setattr(megatron, "SummaryWriter", RecordingSummaryWriter)
    monkeypatch.setattr(megatron, "wandb", types.ModuleType("wandb"))
    hot_path.use_clock(fake.read_ns)
    yield fake
    hot_path.use_clock(None)


class Both:
    """Runs each call on Megatron's Timers and on ours; returns both results."""

    def __init__(self, clock: FakeClock, log_level=2, log_option="minmax") -> None:
        self.clock = clock
        self.megatron = megatron.Timers(log_level, log_option)
        self.ours = ours.Timers(log_level, log_option)

    def timer(self, name, log_level=None, action="start", *args):
        return [getattr(timers(name, log_level), action)(*args) for timers in (self.megatron, self.ours)]

    def run(self, name, ms, log_level=None):
        self.timer(name, log_level, "start")
        self.clock.advance(ms)
        self.timer(name, log_level, "stop")

    def call(self, method, *args, **kwargs):
        return [getattr(timers, method)(*args, **kwargs) for timers in (self.megatron, self.ours)]


def same_numbers(megatron_value, our_value):
    # Megatron's gathered values pass through a float32 tensor: equal to its precision
    assert our_value == pytest.approx(megatron_value, rel=1e-6, abs=1e-12)


def test_every_megatron_method_exists_in_ours_with_the_same_parameters():
    pairs = [(megatron.Timers, ours.Timers), (megatron.Timer, ours.Timer), (megatron.DummyTimer, ours.DummyTimer)]
    for theirs, mine in pairs:
        methods = {name for klass in inspect.getmro(theirs) if klass is not object
                   for name, value in vars(klass).items() if inspect.isfunction(value)}
        assert methods, theirs
        for name in sorted(methods):
            if name == "__init__" and theirs is not megatron.Timers:
                continue  # Timer(name) and DummyTimer() are made by Timers, not by callers
            assert hasattr(mine, name), f"{mine.__name__}.{name} is missing"
            their_parameters = list(inspect.signature(getattr(theirs, name)).parameters.values())
            our_parameters = list(inspect.signature(getattr(mine, name)).parameters.values())
            assert [p.name for p in our_parameters] == [p.name for p in their_parameters], f"{mine.__name__}.{name}"
            for their, our in zip(their_parameters, our_parameters):
                if their.default is not inspect.Parameter.empty:
                    assert our.default == their.default, f"{mine.__name__}.{name}({their.name})"


def test_elapsed_active_time_reset_and_set_elapsed_agree(clock):
    both = Both(clock)
    both.run("forward-compute", 10, log_level=2)
    both.run("forward-compute", 5)
    for reset in (False, True, True):
        same_numbers(*both.timer("forward-compute", None, "elapsed", reset))
    same_numbers(*both.timer("forward-compute", None, "active_time"))

    both.timer("interval-time", 0, "start")  # Megatron-LM reads it while it runs, every log interval
    clock.advance(7)
    same_numbers(*both.timer("interval-time", None, "elapsed", False))
    clock.advance(3)
    same_numbers(*both.timer("interval-time", None, "elapsed", True))
    clock.advance(2)
    both.timer("interval-time", None, "stop")
    same_numbers(*both.timer("interval-time", None, "elapsed"))
    same_numbers(*both.timer("interval-time", None, "active_time"))

    both.timer("batch-generator", 1, "start")  # reset while running: stopped, nothing added
    clock.advance(4)
    both.timer("batch-generator", None, "reset")
    same_numbers(*both.timer("batch-generator", None, "elapsed"))
    same_numbers(*both.timer("batch-generator", None, "active_time"))
    both.run("batch-generator", 1)  # and it starts again without complaint
    same_numbers(*both.timer("batch-generator", None, "elapsed"))

    both.timer("startup-time", 0, "set_elapsed", 3.25)
    same_numbers(*both.timer("startup-time", None, "elapsed"))
    both.timer("startup-time", None, "set_barrier_group", None)


@pytest.mark.parametrize("log_option", ["max", "minmax", "all"])
@pytest.mark.parametrize("normalizer", [1.0, 10.0])
def test_the_text_agrees_for_every_log_option(clock, log_option, normalizer):
    both = Both(clock, log_level=2, log_option=log_option)
    both.run("forward-compute", 12.5)
    both.run("a-timer-with-a-name-longer-than-the-forty-eight-column-label", 3)
    both.timer("never-run", 2, "reset")
    names = ["forward-compute", "never-run", "a-timer-with-a-name-longer-than-the-forty-eight-column-label",
             "not-a-timer"]
    theirs, mine = both.call("get_all_timers_string", names, normalizer, False)
    assert mine == documented(theirs)
    assert theirs is not None and THIS_RANK in mine
    theirs, mine = both.call("get_all_timers_string", None, normalizer)  # names=None: every timer, then reset
    assert mine == documented(theirs)
    assert both.call("get_all_timers_string") == [None, None]  # all 0 after the reset: nothing to say


def test_log_goes_to_megatrons_logger_on_the_chosen_rank(clock, caplog):
    both = Both(clock)
    both.run("forward-compute", 20)
    caplog.set_level(logging.INFO, logger="megatron.core.timers")
    messages = []
    for timers in (both.megatron, both.ours):
        caplog.clear()
        timers.log(["forward-compute"], rank=3, reset=False)  # not this rank: nothing
        timers.log(["forward-compute"], normalizer=4.0, reset=False)  # default: the last rank, this one
        messages.append([(record.name, record.levelno, record.getMessage()) for record in caplog.records])
    theirs, mine = messages
    assert len(theirs) == 1
    assert mine == [(name, level, documented(text)) for name, level, text in theirs]


@pytest.mark.parametrize("writer_kind", ["tensorboard", "wandb", "none"])
def test_write_agrees_for_tensorboard_wandb_and_no_writer(clock, writer_kind):
    both = Both(clock)
    both.run("forward-compute", 30)
    both.run("optimizer", 8, log_level=1)
    both.timer("never-run", 2, "reset")
    wandb_calls = []
    megatron.wandb.log = lambda values, step: wandb_calls.append((values, step))
    outputs = []
    for timers in (both.megatron, both.ours):
        writer = {"tensorboard": RecordingSummaryWriter(), "wandb": megatron.wandb, "none": None}[writer_kind]
        timers.write(["forward-compute", "optimizer", "never-run", "not-a-timer"], writer, 17, normalizer=2.0)
        outputs.append(writer.scalars if writer_kind == "tensorboard" else list(wandb_calls))
        wandb_calls.clear()
        # read and reset whatever the writer: the next interval starts at 0 on both
        assert timers("forward-compute").elapsed() == 0.0
    theirs, mine = outputs
    if writer_kind == "tensorboard":
        assert [tag for tag, _, _ in mine] == [tag for tag, _, _ in theirs] == ["forward-compute-time", "optimizer-time"]
        for (_, their_value, their_step), (_, our_value, our_step) in zip(theirs, mine):
            same_numbers(their_value, our_value)
            assert their_step == our_step == 17
    elif writer_kind == "wandb":
        assert [values for values, _ in mine] == [pytest.approx(values) for values, _ in theirs]
        assert [step for _, step in mine] == [step for _, step in theirs] == [17, 17]
    else:
        assert theirs == mine == []


def test_the_gathered_tensor_has_this_ranks_row(clock, caplog, monkeypatch):
    monkeypatch.setattr(ours, "_said_rows_are_this_ranks", False)
    both = Both(clock)
    both.run("forward-compute", 6)
    theirs, mine = both.call("_get_elapsed_time_all_ranks", ["forward-compute", "not-a-timer"], False, False)
    assert mine.shape == theirs.shape == (1, 2) and mine.dtype == theirs.dtype
    assert mine.flatten().tolist() == pytest.approx(theirs.flatten().tolist())
    assert [record.getMessage() for record in caplog.records if record.levelname == "WARNING"] == [
        "otel-straggler timers: _get_elapsed_time_all_ranks() fills this rank's row only (no gather); "
        "the other ranks' rows are 0, read as no timing"]  # said once, however often it is called
    assert both.call("_get_elapsed_time_all_ranks", [], True, False) == [None, None]
    theirs, mine = both.call("_get_global_min_max_time", ["forward-compute"], True, False, 2.0)
    assert list(mine) == list(theirs) == ["forward-compute"]
    for their_value, our_value in zip(theirs["forward-compute"], mine["forward-compute"]):
        same_numbers(their_value, our_value)
    ours_only = both.ours._get_elapsed_time_all_ranks(["forward-compute"], True, False)
    assert ours_only is not None
    assert len([record for record in caplog.records if record.levelname == "WARNING"]) == 1


def test_log_levels_filter_alike(clock):
    both = Both(clock, log_level=1)
    both.run("forward-backward", 5, log_level=0)
    both.run("optimizer", 5, log_level=1)
    both.run("params-all-gather", 5, log_level=2)  # above the level: the dummy timer on both
    assert [type(timers("params-all-gather")).__name__ for timers in (both.megatron, both.ours)] == ["DummyTimer"] * 2
    theirs, mine = both.call("get_all_timers_string", ["forward-backward", "optimizer", "params-all-gather"])
    assert mine == documented(theirs)


@dataclasses.dataclass
class ModelConfig:
    """Megatron keeps its timers on configs it deep-copies and pickles."""
    hidden_size: int
    timers: object


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))],
                         ids=["deepcopy", "pickle"])
def test_configs_holding_the_timers_copy_alike(clock, duplicate):
    both = Both(clock)
    both.run("forward-compute", 9)
    copies = [duplicate(ModelConfig(64, timers)).timers for timers in (both.megatron, both.ours)]
    same_numbers(*[timers("forward-compute").elapsed(reset=False) for timers in copies])
    for timers in copies:
        timers("backward-compute").start()
    clock.advance(4)
    for timers in copies:
        timers("backward-compute").stop()
    same_numbers(*[timers("backward-compute").elapsed() for timers in copies])


MISUSE = {
    # what Megatron asserts on (or raises for): kind counted by ours, and the call
    "start_while_running": lambda timers: (timers("t").start(), timers("t").start()),
    "stop_while_stopped": lambda timers: timers("t").stop(),
    "log_level_mismatch": lambda timers: (timers("t", 1), timers("t", 2)),
    "log_level_above_max": lambda timers: timers("t", 3),
    "normalizer_not_positive": lambda timers: timers.get_all_timers_string(["t"], normalizer=0.0),
    "dummy_timer_read": lambda timers: timers("t", 2).elapsed(),  # above level 0: the dummy timer
}


@pytest.mark.parametrize("kind", list(MISUSE))
def test_what_megatron_asserts_on_ours_counts_and_lets_pass(clock, kind):
    log_level = 0 if kind == "dummy_timer_read" else 2
    with pytest.raises(Exception):
        MISUSE[kind](megatron.Timers(log_level, "minmax"))
    before = ours.misuse_counts().get(kind, 0)
    MISUSE[kind](ours.Timers(log_level, "minmax"))
    assert ours.misuse_counts()[kind] == before + 1


def test_an_invalid_log_option_is_counted_where_megatron_asserts():
    with pytest.raises(AssertionError):
        megatron.Timers(2, "median")
    before = ours.misuse_counts().get("invalid_log_option", 0)
    assert ours.Timers(2, "median")._log_option == "minmax"
    assert ours.misuse_counts()["invalid_log_option"] == before + 1
