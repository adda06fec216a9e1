"""A Lightning training script on gloo, as people write it, with otel_straggler's callback in the
Trainer's list (and its import) as the only addition. Launched under torchrun, which Lightning
detects (it then starts no processes of its own; devices must equal --nproc-per-node):

    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
        torchrun --nproc-per-node 4 benchmarks/field_jobs/lightning_job.py --steps 130 \\
        --slow forward --slow-rank 1 --from-step 60 --extra-ms 30

The model and data are torch_job.py's (1024 -> 1536 -> 1536 -> 1, MSE, SGD, a batch of 128 a rank;
Lightning's DistributedSampler gives each rank its share of one data set), with the slowdowns of
slowdowns.py from optimizer step --from-step on rank --slow-rank:
- forward: extra matrix products in the model's forward (each micro-batch's);
- backward: extra matrix products inside autograd's backward, so under DDP they sit inside
  `loss.backward()` together with the gradient all-reduce (first micro-batch only, see below);
- data: the DataLoader's collate function sleeps --data-delay-ms more (each batch it makes).
`--accumulate K`: `accumulate_grad_batches=K`, K micro-batches of a K-th of the batch per optimizer
step; a `backward` slowdown is in the first micro-batch's backward only, one that does not
synchronize. `--val-every N`: a validation loop every N optimizer steps (and Lightning's sanity
check before training); 0, the default, none. `--no-callback`: the same job uninstrumented.
Every rank prints `onset rank=<RANK> <unix ns>` when it starts step --from-step and
`done rank=<RANK>` at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from job_common import Samples, job_arguments, say
from slowdowns import SlowBackward, SlowData, SlowForward, Slowdowns, SlowSwitch

FEATURES, HIDDEN, BATCH = 1024, 1536, 128
BATCHES_PER_EPOCH = 64  # of the whole data set; each rank gets its share



class Regression(L.LightningModule):
    def __init__(self, forward_switch: SlowSwitch, backward_switch: SlowSwitch) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), SlowForward(forward_switch),
                                 nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), SlowBackward(backward_switch),
                                 nn.Linear(HIDDEN, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Onset(L.Callback):
    """Switches the slowdown on at optimizer step `from_step` (this job's own callback)."""

    def __init__(self, args: argparse.Namespace, rank: int, forward_switch: SlowSwitch,
                 backward_switch: SlowSwitch, data_source: SlowData) -> None:
        self.args, self.rank = args, rank
        self.slow_here = args.slow != "none" and rank == args.slow_rank
        self.forward_switch, self.backward_switch, self.data_source = forward_switch, backward_switch, data_source
        self.slowed = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.args.from_step and not self.slowed and batch_idx % self.args.accumulate == 0:
            say(f"onset rank={self.rank} {time.time_ns()}")
            self.slowed = True
            if self.slow_here:
                self.forward_switch.on = True
                if self.args.slow == "data":
                    self.data_source.delay_s = self.args.data_delay_ms / 1000
        self.backward_switch.on = self.slowed and self.slow_here and batch_idx % self.args.accumulate == 0



def main() -> None:
    parser = job_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--val-every", type=int, default=0, help="optimizer steps between validations (0: none)")
    parser.add_argument("--no-callback", action="store_true", help="leave out StragglerCallback")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # torchrun's RANK; under Lightning's own launcher (one node) the children's LOCAL_RANK, the parent's 0
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    slow_here = args.slow != "none" and rank == args.slow_rank
    slowdowns = Slowdowns(args.slow, slow_here, args.extra_ms)
    forward_switch, backward_switch, data_source = slowdowns.forward, slowdowns.backward, slowdowns.data

    micro_batch = BATCH // args.accumulate
    train_loader = DataLoader(Samples(BATCH * BATCHES_PER_EPOCH, FEATURES, seed=1234), batch_size=micro_batch, shuffle=True,
                              collate_fn=slowdowns.collate, drop_last=True)
    validation_settings, validation_data = {}, {}
    if args.val_every:  # val_check_interval counts micro-batches, across epochs
        validation_settings = {"limit_val_batches": 2, "val_check_interval": args.val_every * args.accumulate,
                               "check_val_every_n_epoch": None}
        validation_data = {"val_dataloaders": DataLoader(Samples(BATCH * 8, FEATURES, seed=4321), batch_size=BATCH)}
    callbacks = [Onset(args, rank, forward_switch, backward_switch, data_source)]
    if not args.no_callback:
        from otel_straggler.integrations.lightning import StragglerCallback

        callbacks.append(StragglerCallback())
    # devices: torchrun's --nproc-per-node (Lightning requires them equal)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "4")), num_nodes=1,
                        strategy="ddp", max_steps=args.steps, accumulate_grad_batches=args.accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, **validation_settings)
    trainer.fit(Regression(forward_switch, backward_switch), train_loader, **validation_data)
    say(f"done rank={rank}")


if __name__ == "__main__":
    sys.exit(main())
