"""A training job that torchrun restarts: the demo trainer's model and stages, with a checkpoint.

    python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 1 \\
        restart_trainer.py --steps 120 --checkpoint-dir DIR --crash-rank 3 --crash-step 50 --slow-rank 2

Rank 0 writes the step reached every --checkpoint-every steps (the step only: the test is about the
spans, not the weights). In the first incarnation (TORCHELASTIC_RESTART_COUNT 0) --crash-rank exits
with an error at --crash-step, and torchrun restarts every rank; the new ones resume from the last
checkpoint, so steps the detector judged already come again, and --slow-rank is slowed by
--slow-ms in forward-compute from then on.
"""
from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import otel_straggler as ots
from otel_straggler.demo.trainer import average_gradients, make_model, synthetic_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--crash-rank", type=int, default=3)
    parser.add_argument("--crash-step", type=int, default=50)
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--slow-ms", type=float, default=40.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # a file rendezvous of its own per incarnation: gloo's full-mesh connect through the agent's
    # store can pick up an address of the incarnation before (seen on one machine), which is not
    # what this test is about
    dist.init_process_group("gloo", init_method=f"file://{args.checkpoint_dir}/rendezvous-{incarnation}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    telemetry = ots.configure()
    checkpoint = args.checkpoint_dir / "step"
    first_step = int(checkpoint.read_text()) if checkpoint.exists() else 0

    torch.manual_seed(0)
    model = make_model(256)
    parameters = list(model.parameters())
    optimizer = torch.optim.SGD(parameters, lr=0.05)
    batches = synthetic_batches(0, rank, 64)
    for step in range(first_step, args.steps):
        ots.step(step, samples=64)
        with ots.stage("batch-generator"):
            inputs, labels = next(batches)
        with ots.stage("forward-compute"):
            loss = F.cross_entropy(model(inputs), labels)
            if incarnation > 0 and rank == args.slow_rank:
                time.sleep(args.slow_ms / 1000)
        with ots.stage("backward-compute"):
            optimizer.zero_grad()
            loss.backward()
        with ots.stage("all-grads-sync", collective=True):
            average_gradients(parameters, world_size)
        with ots.stage("optimizer"):
            optimizer.step()
        if rank == 0:
            print(f"incarnation {incarnation} step {step + 1}/{args.steps}", flush=True)
            if (step + 1) % args.checkpoint_every == 0:
                checkpoint.write_text(str(step + 1))
        if incarnation == 0 and rank == args.crash_rank and step + 1 == args.crash_step:
            telemetry.flush()  # what it did is exported, as a crash after a periodic export would leave it
            os._exit(17)
    telemetry.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
