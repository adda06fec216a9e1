"""The demo trainer's slowed rank (otel_straggler/demo/straggler.py): inert unless its flags target
this rank; then the chosen stage is stretched by about the given fraction from the given step on,
inside the stage (the instrumentation times the extra time as the stage's), or blocks once; and a
simulated GPU reads throttled from that step on."""
from __future__ import annotations

import statistics
import threading
import time
from types import SimpleNamespace

import pytest

from otel_straggler.demo.straggler import Straggler, slow_rank_args
from otel_straggler.instrumentation import hot_path
from otel_straggler.instrumentation.fake_nvml import FakeNvml

STAGE_S = 0.02
STAGES = ("forward-compute", "backward-compute")


def flags(**changes) -> SimpleNamespace:
    values = dict(slow_rank=0, slow_stage="forward-compute", from_step=3, slowdown=1.0, block_s=0.0)
    return SimpleNamespace(**{**values, **changes})


@pytest.fixture
def recorder():
    """The hot path the instrumentation runs, recording on its own: what the stages' spans are made of."""
    recording = hot_path.IntervalRecorder(1024)
    hot_path.install(recording)
    yield recording
    hot_path.install(None)


def durations_s(recorder) -> dict:
    """(stage, step) -> host duration in seconds of each interval recorded."""
    return {(record[1][0], record[4][0]): (record[2] - record[1][4]) / 1e9
            for record in recorder.completed if record[0] == 0}


def train(straggler: Straggler, steps: int = 6) -> None:
    for number in range(steps):
        hot_path.Step(number)
        straggler.begin_step(number)
        for name in STAGES:
            with hot_path.Stage(name), straggler.inside(name):
                time.sleep(STAGE_S)


@pytest.mark.parametrize("untargeted", [dict(slow_rank=1), dict(slow_rank=-1), dict(slowdown=0.0)])
def test_inert_unless_it_targets_this_rank(untargeted):
    straggler = Straggler.from_args(flags(**untargeted), rank=0)
    straggler.begin_step(10)
    assert straggler.stage is None
    assert all(straggler.inside(name) is straggler.inside("optimizer") for name in STAGES)  # the one no-op


def test_the_targeted_stage_is_stretched_from_the_chosen_step(recorder):
    train(Straggler.from_args(flags(), rank=0))

    durations: dict = {}
    for (name, step), seconds in durations_s(recorder).items():
        durations.setdefault((name, "before" if step < 3 else "after"), []).append(seconds)
    median = {key: statistics.median(values) for key, values in durations.items()}

    assert median["forward-compute", "before"] < 1.5 * STAGE_S + 0.01
    slowdown = median["forward-compute", "after"] / median["forward-compute", "before"]
    assert 1.6 < slowdown < 2.6  # +100% asked for; generous margins for a loaded machine
    untouched = median["backward-compute", "after"] / median["backward-compute", "before"]
    assert 0.6 < untouched < 1.5


def test_a_block_holds_the_stage_open_once(recorder):
    """--block-s (the demo's --hang, the tests' pauses): the stage stays open while it blocks, and
    only its first interval from the step on blocks."""
    straggler = Straggler("save", from_step=3, block_s=0.3)

    def save(step: int) -> float:
        hot_path.Step(step)
        straggler.begin_step(step)
        started = time.monotonic()
        with hot_path.Stage("save"), straggler.inside("save"):
            pass
        return time.monotonic() - started

    assert save(2) < 0.2  # before the step: no block
    seen_open = []
    watcher = threading.Timer(0.15, lambda: seen_open.append([interval[0] for interval in recorder.open_intervals]))
    watcher.start()
    blocked_s = save(3)
    watcher.join()
    assert blocked_s >= 0.3 and seen_open == [["save"]]
    assert save(4) < 0.2 and len(durations_s(recorder)) == 3


def test_the_slowed_ranks_simulated_gpu_reads_throttled_from_its_first_slowed_step():
    nvml = FakeNvml()
    straggler = Straggler("forward-compute", from_step=5, slowdown=0.01, gpu=nvml)
    straggler.begin_step(4)
    assert (nvml.gpus[0].sm_clock_mhz, nvml.gpus[0].clock_event_reasons) == (1980, 0)
    straggler.begin_step(5)
    assert (nvml.gpus[0].sm_clock_mhz, nvml.gpus[0].clock_event_reasons, nvml.gpus[0].temperature_c) == (1410, 0x40, 89)


def test_the_demos_flags_are_the_trainers():
    pytest.importorskip("torch")
    from otel_straggler.demo.trainer import parse_args

    args = parse_args(["--steps", "5", *slow_rank_args(2, "optimizer", 7, 0.25)])
    assert (args.slow_rank, args.slow_stage, args.from_step, args.slowdown, args.block_s) == (2, "optimizer", 7, 0.25, 0.0)
    straggler = Straggler.from_args(args, rank=2)
    assert (straggler.stage, straggler.from_step, straggler.slowdown) == ("optimizer", 7, 0.25)
