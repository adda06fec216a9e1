"""Our timers inside Megatron's own code: megatron-core's real schedule driving a tiny model on
the CPU (stand-ins for the GPU in megatron_on_cpu.py), and
`otel_straggler.integrations.megatron.install()`.

Megatron-LM's own training package (`megatron/training/`) ships only with megatron-core 0.19+,
which needs Python 3.12: install() runs against it, `training_log()` included, in
tests/megatron_lm (scripts/test_megatron_lm.sh). Here, on the main suite's megatron-core 0.16.1,
the stand-in below does the one thing install() relies on in it: `global_vars.py` does
`from megatron.core import Timers` and builds its global timers with
`Timers(args.timing_log_level, args.timing_log_option)` in `_set_timers`.
"""
from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")  # the torch-free check on the lowest Python has neither
import megatron.core  # noqa: E402  in the test extras wherever torch is
import megatron.core.timers  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

import otel_straggler  # noqa: E402
import otel_straggler.integrations.megatron  # noqa: E402
from otel_straggler.integrations import megatron_timers  # noqa: E402

from megatron_on_cpu import TorchOnCpu, one_rank_group, without_cuda  # noqa: E402


@pytest.fixture(scope="module")
def model_parallel():
    with one_rank_group():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


class TinyModel(torch.nn.Linear):
    """The least a megatron-core schedule asks of a model."""

    model_type = ModelType.encoder_or_decoder

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(8, 1)
        self.config = config

    def set_input_tensor(self, tensor) -> None:
        pass


def forward_step(data_iterator, model):
    output = model(next(data_iterator))

    def loss_func(output_tensor):
        loss = output_tensor.pow(2).mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def train_steps(timers, steps: int = 3, microbatches: int = 2) -> list:
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, timers=timers)
    model = TinyModel(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(4, 8) for _ in range(steps * microbatches)]
    forward_backward = get_forward_backward_func()
    for step in range(steps):
        otel_straggler.step(step)
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(data[step * microbatches:]),
                         model=model, num_microbatches=microbatches, seq_length=4, micro_batch_size=4)
        timers("optimizer", log_level=1).start(barrier=False)
        optimizer.step()
        timers("optimizer").stop()
    return [parameter.detach().clone() for parameter in model.parameters()]


@pytest.fixture
def on_cpu(monkeypatch, model_parallel):
    without_cuda(monkeypatch)
    monkeypatch.setattr(schedules, "torch", TorchOnCpu())


def test_megatron_cores_schedule_runs_with_our_timers_and_gives_nested_spans(on_cpu, in_memory):
    in_memory.configure(job_id="megatron-core-schedule")
    timers = megatron_timers.Timers(2, "minmax")
    ours = train_steps(timers)
    theirs = train_steps(megatron.core.timers.Timers(2, "minmax"))
    assert all(torch.equal(mine, their) for mine, their in zip(ours, theirs))  # timing changes nothing

    spans = in_memory.stage_spans()
    names = [span.name for span in spans]
    assert names.count("forward-backward") == 3 and names.count("optimizer") == 3
    assert names.count("forward-compute") == names.count("backward-compute") == 6
    by_id = {span.context.span_id: span for span in spans}
    for span in spans:
        if span.name in ("forward-compute", "backward-compute"):
            assert by_id[span.parent.span_id].name == "forward-backward"
    text = timers.get_all_timers_string()
    assert text.startswith("(min, max) time on rank 0 of 1 (this rank only, not gathered) (ms):")
    assert "forward-backward" in text and "backward-compute" in text


def stand_in_global_vars() -> types.ModuleType:
    """Megatron-LM's megatron/training/global_vars.py, as far as its timers go (module docstring)."""
    module = types.ModuleType("megatron.training.global_vars")
    exec(
        "from megatron.core import Timers\n"
        "_GLOBAL_TIMERS = None\n"
        "def _set_timers(args):\n"
        "    global _GLOBAL_TIMERS\n"
        "    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)\n"
        "def get_timers():\n"
        "    return _GLOBAL_TIMERS\n",
        module.__dict__)
    return module


@pytest.fixture
def megatron_lm(monkeypatch):
    """The stand-in installed where Megatron-LM's module would be; every name install() replaces
    is put back after the test."""
    global_vars = stand_in_global_vars()
    training = types.ModuleType("megatron.training")
    training.global_vars = global_vars
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    monkeypatch.setattr(megatron.core, "Timers", megatron.core.Timers)
    monkeypatch.setattr(megatron.core.timers, "Timers", megatron.core.timers.Timers)
    return global_vars


ARGS = types.SimpleNamespace(timing_log_level=1, timing_log_option="max")


@pytest.fixture
def shut_down_after():
    """install() turns the instrumentation on itself: it is shut down after the test."""
    yield
    handle = otel_straggler.current()
    if handle is not None:
        handle.shutdown(timeout_s=3.0)


def test_install_before_pretrain_makes_megatron_lms_global_timers_ours(megatron_lm, shut_down_after):
    handle = otel_straggler.integrations.megatron.install(job_id="megatron-lm-run")
    assert handle is otel_straggler.current() and handle.resource_attributes["training.job.id"] == "megatron-lm-run"
    megatron_lm._set_timers(ARGS)  # what pretrain() -> initialize_megatron() does
    timers = megatron_lm.get_timers()
    assert isinstance(timers, megatron_timers.Timers)
    assert (timers._log_level, timers._log_option) == (1, "max")
    assert megatron.core.Timers is megatron.core.timers.Timers is megatron_timers.Timers  # for megatron-core code too
    assert otel_straggler.integrations.megatron.install() is handle  # idempotent


def test_the_earlier_path_installs_the_same():
    import otel_straggler.megatron

    assert otel_straggler.megatron.install is otel_straggler.integrations.megatron.install


def test_install_after_the_timers_were_built_replaces_them(megatron_lm, shut_down_after):
    megatron_lm._set_timers(ARGS)
    assert isinstance(megatron_lm.get_timers(), megatron.core.timers.Timers)  # Megatron's own
    otel_straggler.integrations.megatron.install()
    timers = megatron_lm.get_timers()
    assert isinstance(timers, megatron_timers.Timers) and (timers._log_level, timers._log_option) == (1, "max")


def test_install_without_megatron_lm_covers_megatron_core(monkeypatch, shut_down_after):
    monkeypatch.setattr(megatron.core, "Timers", megatron.core.Timers)
    monkeypatch.setattr(megatron.core.timers, "Timers", megatron.core.timers.Timers)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", None)  # import fails: not installed
    otel_straggler.integrations.megatron.install()
    assert megatron.core.Timers is megatron_timers.Timers


def test_install_without_megatron_core_says_so_in_one_line(monkeypatch, shut_down_after):
    monkeypatch.setitem(sys.modules, "megatron.core.timers", None)
    with pytest.raises(ImportError,
                       match=r"^otel_straggler.integrations.megatron.install\(\): megatron-core is not importable"):
        otel_straggler.integrations.megatron.install()
