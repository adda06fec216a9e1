"""StragglerCallback on a real Lightning Trainer: two gloo ranks, launched as torchrun would
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: Lightning then starts no processes of its
own), each fitting a small model under DDP with gradient accumulation, a validation every
optimizer step and Lightning's sanity check; the only other setting is OTEL_EXPORTER_OTLP_ENDPOINT,
pointing at an in-test OTLP/gRPC receiver. Each rank prints its counters as its last line. The
older package name, `pytorch_lightning`, alone: one process, no DDP.

Run as a script, this file is one rank (with the argument `pytorch_lightning`, that one process).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MAX_STEPS, GRAD_ACCUM, WORLD_SIZE, BATCH = 4, 2, 2, 4
RANK_TIMEOUT_S = 120.0
TRAINING_STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer", "ddp-grads-ready",
                   "ddp-grads-sync")
REPO = Path(__file__).resolve().parents[2]


# -- the ranks ------------------------------------------------------------------------------------

def one_rank() -> None:
    import lightning.pytorch as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import otel_straggler
    from otel_straggler.instrumentation import automatic
    from otel_straggler.integrations.lightning import StragglerCallback

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Handle(L.Callback):
        """Keeps the running instrumentation's handle, to read its counters after the fit."""

        def on_train_start(self, trainer, pl_module) -> None:
            self.handle = otel_straggler.current()

    def data(count: int) -> DataLoader:
        generator = torch.Generator().manual_seed(count)
        samples = TensorDataset(torch.randn(count, 8, generator=generator), torch.randn(count, 1, generator=generator))
        return DataLoader(samples, batch_size=BATCH)

    torch.set_num_threads(1)
    callback, handle = StragglerCallback(), Handle()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy="ddp", max_steps=MAX_STEPS,
                        accumulate_grad_batches=GRAD_ACCUM, val_check_interval=GRAD_ACCUM, check_val_every_n_epoch=None,
                        limit_val_batches=1, num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, handle])
    trainer.fit(Regression(), data(BATCH * GRAD_ACCUM * MAX_STEPS * WORLD_SIZE), data(BATCH * WORLD_SIZE))
    status = handle.handle.status()
    print(json.dumps({"callback": callback.counts(), "automatic": automatic.counts(),
                      "lost": status["lost"], "ddp": status["ddp"], "shut_down": status["shut_down"],
                      "running_after_fit": otel_straggler.current() is not None,
                      "backend": torch.distributed.get_backend()}), flush=True)


def one_process_on_pytorch_lightning() -> None:
    """A one-process fit with the older package alone (`lightning` made unimportable): the callback
    subclasses pytorch_lightning's Callback and records on an in-memory provider."""
    sys.modules["lightning"] = None  # type: ignore[assignment]
    import pytorch_lightning as pl
    import torch
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from torch.utils.data import DataLoader, TensorDataset

    from otel_straggler.integrations.lightning import Callback, StragglerCallback

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    callback = StragglerCallback(job_id="one-process", tracer_provider=provider, export_metrics=False,
                                 heartbeat_interval_ms=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=MAX_STEPS, accumulate_grad_batches=GRAD_ACCUM,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    count = BATCH * GRAD_ACCUM * MAX_STEPS
    trainer.fit(Regression(), DataLoader(TensorDataset(torch.randn(count, 8), torch.randn(count, 1)), batch_size=BATCH))
    spans = collections.Counter(f"{span.name} {span.attributes.get('training.step')}"
                                for span in exporter.get_finished_spans())
    print(json.dumps({"callback": callback.counts(), "base": Callback.__module__.split(".")[0], "spans": spans}),
          flush=True)


# -- the test side --------------------------------------------------------------------------------

def run_ranks(endpoint: str) -> list[dict]:
    from rank_processes import run_script_as_ranks

    return run_script_as_ranks(__file__, WORLD_SIZE, endpoint, str(REPO), RANK_TIMEOUT_S)


@pytest.fixture(scope="module")
def trained():
    """(each rank's counters, each rank's received spans as (name, attributes, start ns, end ns),
    each rank's resource)."""
    pytest.importorskip("lightning")
    from pipeline.otlp_sink import OtlpSink, attributes_of

    with OtlpSink() as sink:
        results = run_ranks(sink.endpoint)
        spans, resources = collections.defaultdict(list), {}
        for resource, span in sink.spans():
            resources[resource["training.rank"]] = resource
            spans[resource["training.rank"]].append(
                (span.name, attributes_of(span.attributes), span.start_time_unix_nano, span.end_time_unix_nano))
    return results, spans, resources


def named(spans: list, *names: str) -> list:
    return [span for span in spans if span[0] in names]


@pytest.mark.slow
def test_every_rank_exports_each_training_stage_bound_to_each_global_step(trained):
    results, spans, resources = trained
    assert sorted(spans) == list(range(WORLD_SIZE))
    for rank in range(WORLD_SIZE):
        steps = collections.defaultdict(set)
        for name, attributes, _, _ in spans[rank]:
            steps[name].add(attributes.get("training.step"))
        for stage in TRAINING_STAGES + ("train.step",):
            assert steps[stage] == set(range(MAX_STEPS)), f"rank {rank}, {stage}: steps {sorted(steps[stage])}"
        unbound = [name for name, attributes, _, _ in spans[rank] if "training.step" not in attributes]
        assert unbound == [], f"rank {rank}: spans bound to no step"
        assert resources[rank]["training.world_size"] == WORLD_SIZE
        assert resources[rank]["training.local_rank"] == rank
        assert results[rank]["backend"] == "gloo"
    assert len({resource["training.job.id"] for resource in resources.values()}) == 1


@pytest.mark.slow
def test_one_step_per_optimizer_update_however_many_micro_batches(trained):
    _, spans, _ = trained
    for rank in range(WORLD_SIZE):
        per_step = collections.Counter((name, attributes.get("training.step"))
                                       for name, attributes, _, _ in spans[rank])
        for step in range(MAX_STEPS):
            for stage, count in (("batch-generator", GRAD_ACCUM), ("forward-compute", GRAD_ACCUM),
                                 ("backward-compute", GRAD_ACCUM), ("ddp-grads-ready", GRAD_ACCUM),
                                 ("optimizer", 1), ("ddp-grads-sync", 1), ("train.step", 1)):
                assert per_step[stage, step] == count, f"rank {rank} step {step} {stage}: {per_step[stage, step]}"


@pytest.mark.slow
def test_the_optimizer_span_holds_none_of_the_closures_forward_and_backward(trained):
    _, spans, _ = trained
    for rank in range(WORLD_SIZE):
        for _, attributes, optimizer_start, _ in named(spans[rank], "optimizer"):
            step = attributes["training.step"]
            for name, other, start, end in named(spans[rank], "forward-compute", "backward-compute", "ddp-grads-sync"):
                if other["training.step"] == step:
                    assert end <= optimizer_start, f"rank {rank} step {step}: {name} ends in the optimizer span"


@pytest.mark.slow
def test_validation_is_timed_as_evaluate_and_its_fetches_not_as_training_data(trained):
    _, spans, _ = trained
    for rank in range(WORLD_SIZE):
        evaluations = collections.Counter(attributes["training.step"] for _, attributes, _, _ in
                                          named(spans[rank], "evaluate"))
        # the sanity check's in the first step, the validation after step n at the start of step n + 1,
        # the one after the last step in the last step
        expected = {step: 1 for step in range(MAX_STEPS)}
        expected[MAX_STEPS - 1] += 1
        assert evaluations == expected, f"rank {rank}: {dict(evaluations)}"
        # (the batch-generator and forward-compute counts per step above hold only the training batches)


@pytest.mark.slow
def test_no_hook_failed_and_train_end_shut_the_instrumentation_down(trained):
    results, _, _ = trained
    for rank, result in enumerate(results):
        assert result["callback"] == {"errors": 0, "steps": MAX_STEPS, "configured": False, "instrumented": False,
                                      "shut_down": True}, f"rank {rank}: {result}"
        assert result["automatic"]["errors"] == 0 and result["automatic"]["deferred_to_explicit"] == 0, result
        assert result["ddp"]["hook_errors"] == 0, f"rank {rank}: {result}"
        assert not any(result["lost"].values()), f"rank {rank}: {result}"
        assert result["shut_down"] and not result["running_after_fit"], f"rank {rank}: {result}"


def test_a_failing_hook_raises_nothing_and_train_end_still_turns_everything_off():
    pytest.importorskip("lightning")
    import torch
    from opentelemetry.sdk.trace import TracerProvider

    import otel_straggler
    from otel_straggler.instrumentation import automatic
    from otel_straggler.integrations.lightning import StragglerCallback

    class BrokenTrainer:
        global_rank, world_size, local_rank = 0, 1, 0

        @property
        def global_step(self) -> int:
            raise RuntimeError("no step today")

    assert otel_straggler.current() is None and not automatic.counts()["instrumented"]
    backward = torch.Tensor.backward
    callback = StragglerCallback(job_id="broken", tracer_provider=TracerProvider(), export_metrics=False,
                                 heartbeat_interval_ms=0)
    trainer = BrokenTrainer()
    callback.setup(trainer, None, "fit")
    assert otel_straggler.current() is not None and automatic.counts()["instrumented"]
    callback.on_train_batch_end(trainer, None, None, None, 0)
    callback.on_train_end(trainer, None)
    assert callback.counts() == {"errors": 2, "steps": 0, "configured": False, "instrumented": False,
                                 "shut_down": True}
    assert otel_straggler.current() is None
    assert torch.Tensor.backward is backward


@pytest.mark.slow
def test_the_older_package_name_alone_serves_as_well():
    pytest.importorskip("pytorch_lightning")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    output = subprocess.run([sys.executable, __file__, "pytorch_lightning"], capture_output=True, text=True, cwd=REPO,
                            env=environment, timeout=RANK_TIMEOUT_S)
    assert output.returncode == 0, output.stdout[-4000:] + output.stderr[-4000:]
    result = json.loads(output.stdout.strip().splitlines()[-1])
    assert result["base"] == "pytorch_lightning"
    assert result["callback"] == {"errors": 0, "steps": MAX_STEPS, "configured": False, "instrumented": False,
                                  "shut_down": True}
    for step in range(MAX_STEPS):
        for stage, count in (("batch-generator", GRAD_ACCUM), ("forward-compute", GRAD_ACCUM),
                             ("backward-compute", GRAD_ACCUM), ("optimizer", 1), ("train.step", 1)):
            assert result["spans"].get(f"{stage} {step}") == count, f"step {step} {stage}: {result['spans']}"


def test_importing_otel_straggler_does_not_import_lightning():
    probe = ("import sys, otel_straggler, otel_straggler.instrumentation.automatic, otel_straggler.integrations; "
             "print(sorted(name for name in ('lightning', 'pytorch_lightning', 'lightning_fabric') "
             "if name in sys.modules))")
    output = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO,
                            timeout=60).stdout
    assert output.strip() == "[]"


if __name__ == "__main__":
    one_process_on_pytorch_lightning() if sys.argv[1:] == ["pytorch_lightning"] else one_rank()
