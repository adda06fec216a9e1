"""A Hugging Face `Trainer` job on CPU (gloo), as people write one, with otel-straggler's one-line
addition: `callbacks=[StragglerCallback()]`. The exporter is set from outside alone:

    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
        torchrun --nproc-per-node 4 benchmarks/field_jobs/transformers_job.py --steps 130 \\
        --slow forward --slow-rank 1 --from-step 60 --extra-ms 30

The model is a small GPT-2 made from its config (no download): 2 layers, 128 wide, 4 heads, a
1000-token vocabulary, 64-token sequences of random tokens, 8 sequences a rank per micro-batch.
The slowdowns of slowdowns.py run from --from-step on rank --slow-rank:
- forward: extra matrix products in the model's forward, after its last layer norm (each micro-batch);
- backward: extra matrix products inside autograd's backward at the same place, so under DDP they
  sit inside `loss.backward()` together with the gradient all-reduce (each micro-batch);
- data: the DataLoader's collate function sleeps --data-delay-ms more (each batch it makes).
`--grad-accum K` accumulates K micro-batches per optimizer step. `--no-callback` trains the same
job without the callback.
Every rank prints `onset rank=<RANK> <unix ns>` when step --from-step begins, `step_ms rank=<RANK>
median=<ms>` (the median time between optimizer steps) and `done rank=<RANK>` at the end.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from job_common import job_arguments, say
from slowdowns import SlowBackward, SlowData, SlowForward, SlowSwitch

VOCAB, SEQUENCE, BATCH = 1000, 64, 8


class RandomTokens(Dataset):
    """`count` sequences of random tokens, each made from its index (the same on every run)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(VOCAB, (SEQUENCE,), generator=torch.Generator().manual_seed(index))


class Onset(TrainerCallback):
    """Switches the slowdown on when step --from-step begins, and times the steps."""

    def __init__(self, from_step: int, rank: int, switch_on) -> None:
        self.from_step = from_step
        self.rank = rank
        self.switch_on = switch_on
        self.step_ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.from_step:
            say(f"onset rank={self.rank} {time.time_ns()}")
            self.switch_on()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.perf_counter())

    def median_step_ms(self) -> float:
        gaps = [later - earlier for earlier, later in zip(self.step_ends, self.step_ends[1:])]
        return statistics.median(gaps) * 1000 if gaps else float("nan")



def main() -> None:
    parser = job_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--no-callback", action="store_true", help="train without StragglerCallback")
    args = parser.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # else accelerate sets torch's threads to the cores a rank has
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    slow_here = args.slow != "none" and rank == args.slow_rank
    switch, data_source = SlowSwitch(), SlowData()
    if slow_here and args.slow in ("forward", "backward"):
        switch.calibrate(args.extra_ms)

    def slow_down() -> None:
        if slow_here:
            switch.on = True
            data_source.delay_s = args.data_delay_ms / 1000 if args.slow == "data" else 0.0

    def collate(sequences: list) -> dict:
        data_source.sleep()
        tokens = torch.stack(sequences)
        return {"input_ids": tokens, "labels": tokens}

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=128, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    slowdown = {"forward": SlowForward, "backward": SlowBackward}.get(args.slow)
    if slowdown is not None:
        model.transformer.ln_f = nn.Sequential(model.transformer.ln_f, slowdown(switch))

    onset = Onset(args.from_step, rank, slow_down)
    callbacks = [onset]
    if not args.no_callback:
        from otel_straggler.integrations.transformers import StragglerCallback

        callbacks.append(StragglerCallback())

    with tempfile.TemporaryDirectory(prefix="transformers-job-") as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=args.grad_accum,
            max_steps=args.steps, learning_rate=3e-4, logging_steps=10_000, save_strategy="no", report_to=[],
            use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
        sequences = args.steps * args.grad_accum * BATCH * world_size
        trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(sequences),
                          data_collator=collate, callbacks=callbacks)
        if rank == 0:
            backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
            say(f"start world_size={world_size} backend={backend} callback={not args.no_callback}")
        trainer.train()
    say(f"step_ms rank={rank} median={onset.median_step_ms():.1f}")
    say(f"done rank={rank}")


if __name__ == "__main__":
    sys.exit(main())
