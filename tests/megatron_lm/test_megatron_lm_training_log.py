"""`otel_straggler.integrations.megatron.install()` against Megatron-LM's real training package
(`megatron/training/`, shipped in megatron-core 0.19.2, Python 3.12+), on the CPU.

What runs is Megatron-LM's own code: `arguments.parse_args()` and `validate_args()` on a minimal
command line, `global_vars.set_global_variables(args, build_tokenizer=False)` (which builds the
global timers in `_set_timers(args)`), and `training.training_log()` with
`--log-timers-to-tensorboard`, on a world of one rank (so that rank is the last and gets the
writer). The stand-ins, all for the missing GPU or for what is left out of a real run:
- a one-process gloo group (megatron_on_cpu.py) and megatron-core's model-parallel state
  initialised on it (training_log all-reduces the learning rate over the model-parallel group);
- `torch.cuda.synchronize` a no-op and `torch.cuda.current_device()` "cpu" (the all-reduce above
  puts its tensor on the current device);
- `torch.tensor(..., device="cuda")` made on the CPU, for `megatron.training.training` only: its
  loss accumulator (`total_loss_dict.get(key, torch.tensor([0.0], device='cuda'))`) is made on the
  GPU unconditionally;
- `args.padded_vocab_size`, which the tokenizer build sets (left out here) and the FLOPs estimate
  behind the throughput reads;
- a TensorBoard writer that records its `add_scalar` calls, set as the global writer
  (`--tensorboard-dir` would build a real SummaryWriter).
The timed work is `time.sleep`: our timers measure host wall time, so each recorded `*-time`
scalar can be checked against the seconds the test measured itself. The loop calls
`otel_straggler.step()` each iteration, as install()'s wrapper of `train_step` does in a real run
(tested on its own below), so that the spans nest per step.

The main suite runs on Python 3.11 with megatron-core 0.16.1, which has no `megatron.training`:
this module skips there; scripts/test_megatron_lm.sh runs it in its own virtualenv.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
import types
import warnings

import pytest


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:  # no megatron at all
        return False


# Skipped only where the package is absent: where it is there, an import that fails is an error.
if not _has_megatron_training():
    pytest.skip("Megatron-LM's training package ships with megatron-core 0.19.2 (Python 3.12): "
                "run by scripts/test_megatron_lm.sh", allow_module_level=True)

import torch  # noqa: E402

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed", at import
    warnings.simplefilter("ignore")
    import megatron.core  # noqa: E402
    import megatron.core.timers  # noqa: E402
    from megatron.core import parallel_state  # noqa: E402
    from megatron.training import arguments, global_vars, training  # noqa: E402

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import otel_straggler  # noqa: E402
import otel_straggler.integrations.megatron  # noqa: E402
from otel_straggler.integrations import megatron_timers  # noqa: E402

from megatron_on_cpu import TorchOnCpu, one_rank_group, without_cuda  # noqa: E402

# Megatron's own noise: argparse's FileType deprecation (Python 3.12) in its parser, and its rank
# guess in the tests without a process group.
pytestmark = [pytest.mark.filterwarnings("ignore:'type' is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning")]
LOG_INTERVAL = 2
# The least command line parse_args() and validate_args() accept (a one-layer GPT) plus the
# timing flags under test.
ARGV = ["pretrain_gpt.py", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
        "--seq-length", "4", "--max-position-embeddings", "4", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "10", "--log-interval", str(LOG_INTERVAL),
        "--log-timers-to-tensorboard", "--timing-log-level", "2", "--timing-log-option", "max"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch):
    """No OTEL_*/rank variables from outside; Megatron's Timers back in place and its global
    variables unset after each test; the instrumentation shut down after each test."""
    for name in list(os.environ):
        if name.startswith(("OTEL_", "SLURM_", "TORCHELASTIC_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    assert otel_straggler.current() is None, "a previous test left the instrumentation on"
    assert global_vars._GLOBAL_TIMERS is None and global_vars._GLOBAL_ARGS is None
    for home in (megatron.core.timers, megatron.core, global_vars):
        monkeypatch.setattr(home, "Timers", megatron.core.timers.Timers)
    monkeypatch.setattr(training, "train_step", training.train_step)  # install() wraps it
    yield
    global_vars.unset_global_variables()
    handle = otel_straggler.current()
    if handle is not None:
        handle.shutdown(timeout_s=3.0)
    assert otel_straggler.current() is None


@pytest.fixture(scope="module")
def one_rank_world():
    with one_rank_group():
        yield


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch, one_rank_world):
    without_cuda(monkeypatch)
    monkeypatch.setattr(training, "torch", TorchOnCpu())
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


class RecordingWriter:
    """A TensorBoard SummaryWriter as far as training_log uses it."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.scalars.append((tag, float(value), step))

    def at(self, step: int) -> dict[str, float]:
        return {tag: value for tag, value, at in self.scalars if at == step}


def megatron_args(monkeypatch: pytest.MonkeyPatch, *flags: str) -> types.SimpleNamespace:
    """Megatron-LM's own argument parsing and validation of ARGV (+ flags)."""
    monkeypatch.setattr(sys, "argv", ARGV + list(flags))
    args = arguments.parse_args(ignore_unknown_args=True)
    arguments.validate_args(args)
    return args


def test_install_before_set_global_variables_makes_megatron_lms_global_timers_ours(monkeypatch):
    handle = otel_straggler.integrations.megatron.install(job_id="megatron-lm-run", export_metrics=False)
    assert handle is otel_straggler.current() and handle.resource_attributes["training.job.id"] == "megatron-lm-run"
    assert global_vars.Timers is megatron.core.Timers is megatron.core.timers.Timers is megatron_timers.Timers
    args = megatron_args(monkeypatch, "--timing-log-level", "1", "--timing-log-option", "minmax")
    global_vars.set_global_variables(args, build_tokenizer=False)  # what initialize_megatron() does
    timers = global_vars.get_timers()
    assert isinstance(timers, megatron_timers.Timers)
    assert (timers._log_level, timers._log_option) == (1, "minmax")
    assert isinstance(timers("forward-compute", log_level=2), megatron_timers.DummyTimer)  # above level 1
    assert isinstance(timers("forward-backward", log_level=1), megatron_timers.Timer)
    assert otel_straggler.integrations.megatron.install() is handle and global_vars.get_timers() is timers  # idempotent


def test_install_after_the_global_timers_were_built_replaces_them(monkeypatch):
    args = megatron_args(monkeypatch, "--timing-log-level", "0", "--timing-log-option", "all")
    global_vars._set_timers(args)
    megatrons = global_vars.get_timers()
    assert type(megatrons) is megatron.core.timers.Timers  # Megatron's own
    otel_straggler.integrations.megatron.install(export_metrics=False)
    timers = global_vars.get_timers()
    assert timers is not megatrons and isinstance(timers, megatron_timers.Timers)
    assert (timers._log_level, timers._log_option) == (0, "all")
    assert global_vars.Timers is megatron_timers.Timers


def timed(timers, name: str, log_level: int, seconds: float) -> float:
    """Runs `name` around a sleep, as the training loop does around its work; returns the
    seconds measured around start() and stop()."""
    began = time.perf_counter()
    timers(name, log_level=log_level).start()
    time.sleep(seconds)
    timers(name).stop()
    return time.perf_counter() - began


@pytest.fixture
def in_memory():
    """A TracerProvider that keeps the spans our timers record (no collector)."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield provider, spans
    provider.shutdown()


def test_training_log_writes_our_timers_to_tensorboard_in_seconds_over_log_interval(monkeypatch, on_cpu, caplog,
                                                                                  in_memory):
    provider, spans = in_memory
    handle = otel_straggler.integrations.megatron.install(job_id="megatron-lm-training-log", rank=0,
                                                          tracer_provider=provider, export_metrics=False)
    args = megatron_args(monkeypatch)
    args.padded_vocab_size = 128  # set by the tokenizer build, which is left out
    global_vars.set_global_variables(args, build_tokenizer=False)
    writer = RecordingWriter()
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", writer)
    timers = global_vars.get_timers()
    assert isinstance(timers, megatron_timers.Timers) and args.log_timers_to_tensorboard
    assert training.get_timers() is timers

    measured = {"forward-backward": 0.0, "forward-compute": 0.0, "optimizer": 0.0}
    total_loss_dict: dict = {}
    caplog.set_level(logging.INFO, logger="megatron.core.timers")
    began = time.perf_counter()
    timers("interval-time", log_level=0).start(barrier=True)  # as train() does before its loop
    for iteration in range(1, LOG_INTERVAL + 1):
        otel_straggler.step(iteration)  # the user's step() (README), which the spans' nesting is per
        forward_backward_began = time.perf_counter()
        timers("forward-backward", log_level=1).start()
        measured["forward-compute"] += timed(timers, "forward-compute", 2, 0.02)
        time.sleep(0.01)
        timers("forward-backward").stop()
        measured["forward-backward"] += time.perf_counter() - forward_backward_began
        measured["optimizer"] += timed(timers, "optimizer", 1, 0.01)
        if iteration == LOG_INTERVAL:
            interval = time.perf_counter() - began
        report_memory_flag = training.training_log(
            {"lm loss": torch.tensor([0.5 * iteration])}, total_loss_dict, 0.1, iteration, 1.0,
            False, 0, 1.0, None, None, None)
        assert report_memory_flag is False
    after = time.perf_counter() - began
    since_read = timers("interval-time").elapsed(reset=False)

    logged = writer.at(LOG_INTERVAL)
    times = {tag: value for tag, value in logged.items() if tag.endswith("-time")}
    # every timer that ran, and only those, in seconds over log_interval (Megatron writes the max
    # over ranks; ours, this rank's value)
    assert set(times) == {"iteration-time", "forward-backward-time", "forward-compute-time", "optimizer-time"}
    for name, seconds in measured.items():
        assert times[name + "-time"] == pytest.approx(seconds / LOG_INTERVAL, abs=2e-3), name
    assert times["forward-compute-time"] >= 0.02 and times["optimizer-time"] >= 0.01
    assert times["forward-backward-time"] >= 0.03
    # interval-time read inside training_log, over the iterations since the last log
    assert interval / LOG_INTERVAL <= times["iteration-time"] <= after / LOG_INTERVAL
    assert not any(tag.endswith("-time") for tag in writer.at(1))  # iteration 1 is not a log step
    assert logged["lm loss"] == 1.0 and logged["learning-rate"] == pytest.approx(0.1)

    # the stdout text: Megatron's format of log option "max", from this rank, then reset
    text = "\n".join(record.getMessage() for record in caplog.records if record.name == "megatron.core.timers")
    assert text.startswith("max time on rank 0 of 1 (this rank only, not gathered) (ms):")
    line = next(line for line in text.splitlines() if line.strip().startswith("forward-compute "))
    assert float(line.rsplit(":", 1)[1]) == pytest.approx(1000.0 * measured["forward-compute"] / LOG_INTERVAL, abs=2.0)
    assert timers("forward-backward").elapsed(reset=False) == 0.0
    assert since_read < after - interval + 1e-3  # interval-time was reset by training_log's read

    # and each timer that ran recorded a span per iteration, forward-compute inside forward-backward
    assert handle.flush(timeout_s=5.0)
    finished = list(spans.get_finished_spans())
    names = [span.name for span in finished]
    assert [names.count(name) for name in measured] == [LOG_INTERVAL] * len(measured)
    by_id = {span.context.span_id: span for span in finished}
    assert all(by_id[span.parent.span_id].name == "forward-backward"
               for span in finished if span.name == "forward-compute")


def test_install_binds_each_train_step_to_its_iteration(monkeypatch, in_memory):
    """Megatron-LM's train() calls train_step(..., iteration=iteration) from its module: after
    install() what the step records carries that iteration. The train_step underneath is a
    recording stand-in (its real body needs a model and an optimizer); the wrapping is ours."""
    provider, spans = in_memory
    calls = []

    def recorded_train_step(*args, **kwargs):
        calls.append((args, kwargs))
        with otel_straggler.stage("forward-compute"):
            pass
        return "result"

    monkeypatch.setattr(training, "train_step", recorded_train_step)
    handle = otel_straggler.integrations.megatron.install(job_id="megatron-lm-steps", rank=0,
                                                          tracer_provider=provider, export_metrics=False)
    wrapped = training.train_step
    assert wrapped is not recorded_train_step
    otel_straggler.integrations.megatron.install()
    assert training.train_step is wrapped  # idempotent: wrapped once
    for iteration in (7, 8):
        assert training.train_step("forward_step_func", "data", iteration=iteration) == "result"
    assert calls == [(("forward_step_func", "data"), {"iteration": 7}), (("forward_step_func", "data"), {"iteration": 8})]
    assert handle.flush(5.0)
    steps = sorted(span.attributes["training.step"] for span in spans.get_finished_spans()
                   if span.name == "forward-compute")
    assert steps == [7, 8]
