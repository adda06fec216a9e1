"""StragglerCallback on a real Hugging Face Trainer: two gloo ranks, launched as torchrun would
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), each training a tiny GPT-2 made from its
config for two epochs of two optimizer updates, each of two micro-batches, evaluating at the start
and at each epoch's end and saving a checkpoint mid-epoch; the only other setting is
OTEL_EXPORTER_OTLP_ENDPOINT, pointing at an in-test OTLP/gRPC receiver. Each rank prints its
callback's counters and when it evaluated and saved, as its last line.

Run as a script, this file is one rank.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

EPOCHS, UPDATES_PER_EPOCH, GRAD_ACCUM, SAVE_STEPS, WORLD_SIZE = 2, 2, 2, 3, 2
MAX_STEPS = EPOCHS * UPDATES_PER_EPOCH
BATCH = 4
RANK_TIMEOUT_S = 120.0
TRAINING_STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer", "ddp-grads-ready",
                   "ddp-grads-sync")
REPO = Path(__file__).resolve().parents[2]


# -- the ranks ------------------------------------------------------------------------------------

def one_rank() -> None:
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from otel_straggler.instrumentation import automatic
    from otel_straggler.integrations.transformers import StragglerCallback

    class RandomTokens(Dataset):
        def __init__(self, count: int) -> None:
            self.tokens = torch.randint(64, (count, 16), generator=torch.Generator().manual_seed(count))

        def __len__(self) -> int:
            return len(self.tokens)

        def __getitem__(self, index: int) -> dict:
            return {"input_ids": self.tokens[index], "labels": self.tokens[index]}

    class Marks(TrainerCallback):
        """(what, global step, time on the spans' clock) of each evaluation batch and each save."""

        def __init__(self) -> None:
            self.marks: list = []

        def on_prediction_step(self, args, state, control, **kwargs):
            self.marks.append(("predict", state.global_step, time.time_ns()))

        def on_save(self, args, state, control, **kwargs):
            self.marks.append(("save", state.global_step, time.time_ns()))

    torch.set_num_threads(1)
    callback, marks = StragglerCallback(), Marks()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
            gradient_accumulation_steps=GRAD_ACCUM, num_train_epochs=EPOCHS, eval_strategy="epoch",
            eval_on_start=True, save_strategy="steps", save_steps=SAVE_STEPS, logging_steps=1000, report_to=[],
            use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=arguments,
                          train_dataset=RandomTokens(BATCH * GRAD_ACCUM * UPDATES_PER_EPOCH * WORLD_SIZE),
                          eval_dataset=RandomTokens(2 * BATCH * WORLD_SIZE), callbacks=[marks, callback])
        trainer.train()
    print(json.dumps({"callback": callback.counts(), "automatic": automatic.counts(),
                      "backend": torch.distributed.get_backend(), "marks": marks.marks}), flush=True)


# -- the test side --------------------------------------------------------------------------------

def run_ranks(endpoint: str) -> list[dict]:
    from rank_processes import run_script_as_ranks

    return run_script_as_ranks(__file__, WORLD_SIZE, endpoint, str(REPO), RANK_TIMEOUT_S)


@pytest.fixture(scope="module")
def trained():
    """(each rank's counters, each rank's received spans but heartbeats as (name, attributes, start
    ns, end ns), the job ids the ranks sent)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from pipeline.otlp_sink import OtlpSink, attributes_of

    with OtlpSink() as sink:
        results = run_ranks(sink.endpoint)
        received = sink.spans()
    spans = collections.defaultdict(list)
    for resource, span in received:
        if span.name != "train.heartbeat":
            spans[resource["training.rank"]].append(
                (span.name, attributes_of(span.attributes), span.start_time_unix_nano, span.end_time_unix_nano))
    return results, spans, {resource.get("training.job.id") for resource, _ in received}


@pytest.mark.slow
def test_every_rank_exports_each_training_stage_bound_to_each_global_step(trained):
    results, spans, job_ids = trained
    assert sorted(spans) == list(range(WORLD_SIZE))
    assert len(job_ids) == 1 and None not in job_ids, "one job id, found from the rendezvous address"
    for rank in range(WORLD_SIZE):
        steps = collections.defaultdict(set)
        for name, attributes, _, _ in spans[rank]:
            if "training.step" in attributes:
                steps[name].add(attributes["training.step"])
        for stage in TRAINING_STAGES + ("train.step",):
            assert steps[stage] == set(range(MAX_STEPS)), f"rank {rank}, {stage}: steps {sorted(steps[stage])}"
        # without a step: only the evaluation at the start, before the first step
        first_step_starts = min(start for name, _, start, _ in spans[rank] if name == "train.step")
        unbound = [(name, end) for name, attributes, _, end in spans[rank] if "training.step" not in attributes]
        assert all(end <= first_step_starts for _, end in unbound), f"rank {rank}: {unbound}"
        assert results[rank]["backend"] == "gloo"


@pytest.mark.slow
def test_one_step_per_optimizer_update_however_many_micro_batches(trained):
    _, spans, _ = trained
    for rank in range(WORLD_SIZE):
        per_step = collections.Counter((name, attributes.get("training.step")) for name, attributes, _, _ in spans[rank]
                                       if name in TRAINING_STAGES)
        for step in range(MAX_STEPS):
            assert per_step["forward-compute", step] == GRAD_ACCUM, f"rank {rank} step {step}"
            assert per_step["backward-compute", step] == GRAD_ACCUM, f"rank {rank} step {step}"
            assert per_step["optimizer", step] == 1, f"rank {rank} step {step}"
            assert per_step["ddp-grads-sync", step] == 1, f"rank {rank} step {step}"
        step_spans = [attributes["training.step"] for name, attributes, _, _ in spans[rank] if name == "train.step"]
        assert sorted(step_spans) == list(range(MAX_STEPS)), "one train.step span per optimizer update"
        assert per_step["forward-compute", None] == per_step["backward-compute", None] == 0


@pytest.mark.slow
def test_evaluations_and_saves_lie_between_steps_in_neither(trained):
    results, spans, _ = trained
    for rank in range(WORLD_SIZE):
        step_spans = {attributes["training.step"]: (start, end)
                      for name, attributes, start, end in spans[rank] if name == "train.step"}
        marks = results[rank]["marks"]
        # at the start, at the first epoch's end, mid-epoch, at the end
        assert {(what, global_step) for what, global_step, _ in marks} >= {
            ("predict", 0), ("predict", UPDATES_PER_EPOCH), ("save", SAVE_STEPS), ("predict", MAX_STEPS)}
        for what, global_step, at in marks:
            # after update n the global step is n + 1: what the Trainer does then is after step n, before n + 1
            if global_step > 0:
                assert step_spans[global_step - 1][1] <= at, f"rank {rank}: {what} at {global_step}"
            if global_step < MAX_STEPS:
                assert at <= step_spans[global_step][0], f"rank {rank}: {what} at {global_step}"


@pytest.mark.slow
def test_no_hook_failed_and_train_end_shut_the_instrumentation_down(trained):
    results, _, _ = trained
    for rank, result in enumerate(results):
        assert result["callback"]["errors"] == 0, f"rank {rank}: {result}"
        assert result["callback"]["shut_down"], f"rank {rank}: {result}"
        assert result["callback"]["steps"] == MAX_STEPS
        assert result["automatic"]["errors"] == 0, f"rank {rank}: {result}"
        assert result["automatic"]["deferred_to_explicit"] == 0, f"rank {rank}: {result}"


def test_a_failing_hook_is_counted_and_logged_once_and_raises_nothing(monkeypatch, caplog):
    pytest.importorskip("transformers")
    from otel_straggler.instrumentation import automatic
    from otel_straggler.integrations.transformers import StragglerCallback

    def failing(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(automatic, "instrument", failing)
    monkeypatch.setattr(automatic, "begin_step", failing)
    callback = StragglerCallback()
    state, control = types.SimpleNamespace(global_step=0, epoch=0.0), types.SimpleNamespace()
    assert callback.on_step_begin(None, state, control) is None
    assert callback.on_step_end(None, state, control) is None  # a control without the Trainer's flags
    assert callback.counts()["errors"] == 3
    assert [record.getMessage() for record in caplog.records] == [
        "otel-straggler: StragglerCallback.__init__ failed (RuntimeError: broken); training goes on without it there"]


def test_importing_otel_straggler_does_not_import_transformers():
    probe = ("import sys, otel_straggler, otel_straggler.instrumentation.automatic, otel_straggler.integrations; "
             "print(sorted(name for name in ('transformers', 'accelerate') if name in sys.modules))")
    output = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO,
                            timeout=60).stdout
    assert output.strip() == "[]"


if __name__ == "__main__":
    one_rank()
