"""The automatic stages (automatic.py): a training loop nobody edited gets `batch-generator`,
`forward-compute`, `backward-compute` and `optimizer` spans bound to one step per optimizer step;
evaluation forwards are `evaluate`; DDP models get instrument_ddp's hooks, a script's own
communication hook included; collectives are collective stages; explicit stages and steps win;
uninstrument() restores every function it patched; nothing raises into training.

Real torch throughout (a one-rank gloo group for DDP and collectives); the spans come from an
in-memory TracerProvider. Real multi-rank jobs under `opentelemetry-instrument torchrun` are in
tests/benchmarks/test_field_zero_code.py.
"""
from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data import dataloader as dataloader_module  # noqa: E402

import otel_straggler as ots  # noqa: E402
from megatron_on_cpu import one_rank_group  # noqa: E402
from otel_straggler.instrumentation import automatic, rank_state  # noqa: E402


@pytest.fixture
def auto(in_memory):
    """The automatic stages on, over the in-memory spans; off again after the test."""
    assert automatic._state is None, "a previous test left the automatic stages on"
    in_memory.configure()
    automatic.instrument()
    yield in_memory
    automatic.uninstrument()


def model_and_data(batch: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    return model, DataLoader(data, batch_size=batch), torch.optim.SGD(model.parameters(), lr=0.01)


def stages_by_step(spans) -> dict[int, list[str]]:
    steps: dict[int, list[str]] = collections.defaultdict(list)
    for span in sorted(spans, key=lambda span: span.start_time):
        if span.name not in ("train.step", "train.heartbeat"):
            steps[span.attributes["training.step"]].append(span.name)
    return dict(steps)


def train(model, loader, optimizer, steps: int, micro_batches: int = 1, evaluate: bool = False) -> None:
    batches = iter(loader)
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(micro_batches):
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x), y) / micro_batches
            loss.backward()
        optimizer.step()
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()


def test_a_plain_loop_gets_its_stages_one_step_per_optimizer_step(auto):
    model, loader, optimizer = model_and_data()
    train(model, loader, optimizer, steps=4, evaluate=True)
    steps = stages_by_step(auto.spans())
    assert sorted(steps) == [0, 1, 2, 3]
    for stages in steps.values():
        assert stages == ["batch-generator", "forward-compute", "backward-compute", "optimizer", "evaluate"]
    step_spans = [span for span in auto.spans() if span.name == "train.step"]
    assert sorted(span.attributes["training.step"] for span in step_spans) == [0, 1, 2, 3]
    assert automatic.counts()["errors"] == 0
    # only the model is learned as outermost: its layers are not stages
    assert automatic.counts()["roots"] == 1


def test_gradient_accumulation_is_one_step_with_each_micro_batch_timed(auto):
    model, loader, optimizer = model_and_data()
    train(model, loader, optimizer, steps=3, micro_batches=4)
    steps = stages_by_step(auto.spans())
    assert sorted(steps) == [0, 1, 2]
    for stages in steps.values():
        assert stages == ["batch-generator", "forward-compute", "backward-compute"] * 4 + ["optimizer"]


def test_the_optimizer_stage_starts_after_the_closure(auto):
    """Lightning's automatic optimization: forward and backward run inside optimizer.step(closure)."""
    model, loader, optimizer = model_and_data()
    for x, y in list(loader)[:3]:
        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    spans = {(span.name, span.attributes.get("training.step")): span for span in auto.stage_spans()}
    for step in (1, 2):
        optimizer_span = spans[("optimizer", step)]
        assert optimizer_span.start_time >= spans[("backward-compute", step)].end_time
        assert optimizer_span.parent is None or optimizer_span.parent.span_id != spans[("forward-compute", step)].context.span_id


def test_a_loss_module_called_at_top_level_is_forward_too(auto):
    model, loader, optimizer = model_and_data()
    criterion = nn.MSELoss()
    batches = iter(loader)
    for _ in range(3):
        x, y = next(batches)
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert stages_by_step(auto.spans())[2] == ["batch-generator", "forward-compute", "forward-compute",
                                                "backward-compute", "optimizer"]
    assert automatic.counts()["roots"] == 2


def test_activation_checkpointing_recompute_is_part_of_the_backward(auto):
    from torch.utils.checkpoint import checkpoint

    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = inner, nn.Linear(8, 1)

        def forward(self, x):
            return self.head(checkpoint(self.inner, x, use_reentrant=False))

    model = Checkpointed()
    _, loader, _ = model_and_data()
    train(model, loader, torch.optim.SGD(model.parameters(), lr=0.01), steps=3)
    for stages in stages_by_step(auto.spans()).values():
        assert stages == ["batch-generator", "forward-compute", "backward-compute", "optimizer"]


def test_explicit_steps_and_stages_win(auto):
    model, loader, optimizer = model_and_data()
    batches = iter(loader)
    for n in range(3):
        ots.step(100 + n)
        with ots.stage("batch-generator"):
            x, y = next(batches)
        with ots.stage("forward-compute"):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    names = [(span.name, span.attributes["training.step"]) for span in auto.stage_spans()]
    assert names == [(name, 100 + n) for n in range(3) for name in ("batch-generator", "forward-compute")]
    assert automatic.counts()["deferred_to_explicit"] == 1


def test_an_explicit_stage_around_an_automatic_one_switches_them_off(auto):
    model, loader, optimizer = model_and_data()
    train(model, loader, optimizer, steps=2)
    x, y = next(iter(loader))
    with ots.stage("forward-compute"):  # the script's own stage from here on
        model(x)
    spans = auto.stage_spans()
    assert [span.name for span in spans].count("forward-compute") == 3
    # the automatic forward did not open inside the script's stage: no stage has another as parent
    ids = {span.context.span_id for span in spans}
    assert not [span for span in spans if span.parent is not None and span.parent.span_id in ids]
    assert automatic.counts()["deferred_to_explicit"] == 1


def test_ddp_models_get_the_arrival_hooks_and_a_scripts_own_comm_hook_still_runs(auto):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    called = []

    def my_hook(state, bucket):
        called.append(state)
        return default_hooks.allreduce_hook(None, bucket)

    with one_rank_group():
        model, loader, optimizer = model_and_data()
        model = DistributedDataParallel(model)
        model.register_comm_hook("my-state", my_hook)  # after ours: it replaces DDP's default inside the timing
        assert ots.instrument_ddp(model) is model  # explicit instrument_ddp on a hooked model: nothing doubled
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        train(model, loader, optimizer, steps=4)
        with pytest.raises(RuntimeError, match="only be called once"):
            model.register_comm_hook(None, my_hook)
    steps = stages_by_step(auto.spans())
    for step in (1, 2, 3):
        assert sorted(steps[step]) == sorted(["batch-generator", "forward-compute", "backward-compute",
                                              "ddp-grads-ready", "ddp-grads-sync", "optimizer"])
    assert called and set(called) == {"my-state"}
    assert automatic.counts()["models_instrumented"] == 1


def test_collectives_are_collective_stages_async_ones_to_their_completion(auto):
    with one_rank_group():
        model, loader, optimizer = model_and_data()
        train(model, loader, optimizer, steps=1)
        ots_tensor = torch.ones(4)
        dist.all_reduce(ots_tensor)
        dist.barrier()
        work = dist.all_reduce(ots_tensor, async_op=True)
        work.wait()
    spans = {span.name: span for span in auto.stage_spans()}
    for name in ("all-reduce", "barrier"):
        assert spans[name].attributes["training.stage.collective"] is True
        assert spans[name].attributes["training.stage.group"] == "communication"
    assert len([span for span in auto.stage_spans() if span.name == "all-reduce"]) == 2


def test_uninstrument_restores_every_function_and_instrumenting_twice_changes_nothing(in_memory):
    originals = {
        "Tensor.backward": torch.Tensor.backward, "autograd.backward": torch.autograd.backward,
        "__next__": dataloader_module._BaseDataLoaderIter.__next__, "all_reduce": dist.all_reduce,
        "DDP.__init__": DistributedDataParallel.__init__,
        "register_comm_hook": DistributedDataParallel.register_comm_hook,
    }
    in_memory.configure()
    assert automatic.instrument() and automatic.instrument()
    assert len(automatic._state.patches) == len({(id(o), n) for o, n, _, _ in automatic._state.patches})
    assert torch.Tensor.backward is not originals["Tensor.backward"]
    automatic.uninstrument()
    now = {
        "Tensor.backward": torch.Tensor.backward, "autograd.backward": torch.autograd.backward,
        "__next__": dataloader_module._BaseDataLoaderIter.__next__, "all_reduce": dist.all_reduce,
        "DDP.__init__": DistributedDataParallel.__init__,
        "register_comm_hook": DistributedDataParallel.register_comm_hook,
    }
    assert all(now[name] is originals[name] for name in originals)
    model, loader, optimizer = model_and_data()
    train(model, loader, optimizer, steps=2)
    assert in_memory.stage_spans() == []


def test_failures_of_our_own_are_counted_and_training_goes_on(auto, monkeypatch):
    class Broken:
        open_intervals = property(lambda self: 1 / 0)
        binding = (None, None, None)

    model, loader, optimizer = model_and_data()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    monkeypatch.setattr(rank_state, "_recorder", Broken())
    train(model, loader, optimizer, steps=3)
    monkeypatch.undo()
    assert automatic.counts()["errors"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_training_is_unchanged_by_the_automatic_stages(in_memory):
    def trained() -> list:
        model, loader, optimizer = model_and_data()
        train(model, loader, optimizer, steps=5, micro_batches=2)
        return [parameter.detach().clone() for parameter in model.parameters()]

    bare = trained()
    in_memory.configure()
    automatic.instrument()
    try:
        timed = trained()
    finally:
        automatic.uninstrument()
    assert all(torch.equal(a, b) for a, b in zip(bare, timed))


SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    import otel_straggler
    from otel_straggler.instrumentation import automatic
    handle = otel_straggler.current()
    status = handle.status() if handle is not None and handle.flush(10) else {}
    print("configured", handle is not None, "stages", status.get("spans_built", 0), "steps", status.get("steps_built", 0))
""")


def run_instrumented(tmp_path, env_extra: dict) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_STRAGGLER_JOB_ID": "t",
                "OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS": "0", "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none", **env_extra})
    command = [os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument"), sys.executable, str(script)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.child_processes
def test_opentelemetry_instrument_times_an_unchanged_script(tmp_path):
    result = run_instrumented(tmp_path, {"OTEL_STRAGGLER_ENABLED": "true"})
    assert result.returncode == 0, result.stderr
    assert "configured True stages 9 steps 3" in result.stdout, result.stdout + result.stderr


@pytest.mark.child_processes
def test_opentelemetry_instrument_with_a_bad_setting_says_so_once_and_trains(tmp_path):
    result = run_instrumented(tmp_path, {"OTEL_STRAGGLER_ENABLED": "true", "OTEL_STRAGGLER_QUEUE_SIZE": "lots"})
    assert result.returncode == 0, result.stderr
    assert "configured False" in result.stdout
    lines = [line for line in result.stderr.splitlines() if "otel-straggler" in line]
    assert len(lines) == 1 and "QUEUE_SIZE" in lines[0], result.stderr


@pytest.mark.parametrize("argv, helper", [
    (["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "4", "train.py"], True),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "4", "train.py"], True),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
      "--multiprocessing-fork"], True),
    (["python", "-c", "from multiprocessing.forkserver import main; main(8, 9, ['__main__'])"], True),
    (["python", "train.py", "--run", "torchrun"], False),
    (["python", "-m", "my_package.train"], False),
])
def test_torchruns_agent_and_multiprocessing_children_configure_only_when_they_train(argv, helper):
    from otel_straggler.instrumentation.autoinstrument import _launcher_or_child

    assert _launcher_or_child(argv) is helper


def test_a_collective_inside_a_training_step_splits_it_so_the_wait_is_the_collectives(auto):
    """A metric all-reduced inside the training step (Lightning's self.log(sync_dist=True)): the
    forward's time per step is its own work on both sides of the collective, the wait is not in it."""

    class LogsAMetric(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def forward(self, x):
            out = self.net(x)
            metric = out.detach().mean().reshape(1)
            dist.all_reduce(metric)
            return out * 2

    with one_rank_group():
        model = LogsAMetric()
        _, loader, _ = model_and_data()
        train(model, loader, torch.optim.SGD(model.parameters(), lr=0.01), steps=3)
    steps = stages_by_step(auto.spans())
    assert steps[1] == ["batch-generator", "forward-compute", "all-reduce", "forward-compute", "backward-compute",
                        "optimizer"]
    spans = [span for span in auto.stage_spans() if span.attributes["training.step"] == 1]
    forwards = [span for span in spans if span.name == "forward-compute"]
    collective = next(span for span in spans if span.name == "all-reduce")
    assert forwards[0].end_time <= collective.start_time <= collective.end_time <= forwards[1].start_time
    assert automatic.counts()["errors"] == 0


def test_a_ddp_wrapper_left_in_eval_mode_still_times_training_forwards(auto):
    """Lightning's validation puts DDP's wrapper in eval mode and restores only the module inside."""
    with one_rank_group():
        model, loader, optimizer = model_and_data()
        model = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model.eval()
        model.module.train()
        train(model, loader, optimizer, steps=2)
    assert stages_by_step(auto.spans())[1].count("forward-compute") == 1


def test_micro_batches_under_no_sync_are_timed_and_only_the_last_synchronizes(auto):
    with one_rank_group():
        model, loader, _ = model_and_data()
        model = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = iter(loader)
        for _ in range(3):
            for micro_batch in range(4):
                x, y = next(batches)
                with model.no_sync() if micro_batch < 3 else contextlib.nullcontext():
                    nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for stages in stages_by_step(auto.spans()).values():
        counts = collections.Counter(stages)
        assert counts["forward-compute"] == counts["backward-compute"] == counts["ddp-grads-ready"] == 4
        assert counts["ddp-grads-sync"] == counts["optimizer"] == 1


def test_a_ddp_model_made_after_the_first_optimizer_step_is_timed_too(auto):
    """A second fit() in one process: its DDP model was not among the modules learned as outermost."""
    with one_rank_group():
        model, loader, optimizer = model_and_data()
        train(model, loader, optimizer, steps=2)
        second, loader, _ = model_and_data()
        second = DistributedDataParallel(second)
        train(second, loader, torch.optim.SGD(second.parameters(), lr=0.01), steps=2)
    steps = stages_by_step(auto.spans())
    assert steps[3].count("forward-compute") == 1 and "ddp-grads-ready" in steps[3]


def test_a_framework_callback_over_zero_code_takes_the_steps_and_nothing_is_doubled(auto):
    model, loader, optimizer = model_and_data()
    train(model, loader, optimizer, steps=1)  # zero code: step 0 bound at the optimizer step
    assert automatic.instrument(steps="framework")  # a callback made now: its steps from here on
    batches = iter(loader)
    for global_step in (7, 8):
        automatic.begin_step(global_step)
        x, y = next(batches)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        automatic.end_step()
    model(x)  # between the framework's steps: not timed
    steps = stages_by_step(auto.spans())
    assert sorted(steps) == [0, 7, 8]
    for step in (7, 8):
        assert steps[step] == ["batch-generator", "forward-compute", "backward-compute", "optimizer"]
    assert automatic.counts()["deferred_to_explicit"] == 0
