"""A plain PyTorch DDP training job on gloo, instrumented the way the README shows: the rank
process field_precision.py launches (one per rank, torchrun-style env: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT, OTEL_* for the exporter, OTEL_STRAGGLER_JOB_ID).

    python benchmarks/field_job.py --steps 160 --slow forward --slow-rank 1 --from-step 60

The slowdowns are real work in the job's own code (field_jobs/slowdowns.py):
- forward: extra matrix products inside the model's forward on the slow rank;
- backward: extra matrix products inside autograd's backward (a custom Function), so under DDP
  they sit inside `loss.backward()` together with the gradient all-reduce;
- data: the DataLoader's collate function sleeps `--data-delay-ms` more on the slow rank.
`--extra-ms` sizes the forward/backward work in CPU time of the rank's thread, calibrated once at
start-up, before training (each rank runs torch on one thread).
`--shape` is the loop's shape:
- plain: the README's loop (a stage around each of fetch, forward, backward and optimizer);
- accumulate: gradient accumulation over 4 micro-batches of a quarter of the batch, DDP's
  `no_sync()` on all but the last, no stage around backward (instrument_ddp times each one); a
  `backward` slowdown is in the first micro-batch's backward only, one that does not synchronize;
- fetch-between: the next batch is fetched between forward and backward (inside its own
  `batch-generator` stage), as many real loops do, no stage around backward.
Each rank prints `onset <unix ns>` when the slow rank reaches --from-step (the others too, for the
runner's timing), and `done` at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import otel_straggler as ots

from field_jobs.job_common import Samples
from field_jobs.slowdowns import SlowBackward, SlowForward, SlowSwitch

FEATURES, HIDDEN, BATCH = 1024, 1536, 128
SHAPES = ("plain", "accumulate", "fetch-between")
MICRO_BATCHES = 4  # per optimizer step, in the accumulate shape


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--slow", choices=("none", "forward", "backward", "data"), default="none")
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--from-step", type=int, default=60)
    parser.add_argument("--extra-ms", type=float, default=30.0)
    parser.add_argument("--data-delay-ms", type=float, default=30.0)
    parser.add_argument("--no-ddp-hook", action="store_true", help="leave out ots.instrument_ddp")
    parser.add_argument("--shape", choices=SHAPES, default="plain", help="the loop's shape (see above)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    slow_here = args.slow != "none" and rank == args.slow_rank
    forward_switch, backward_switch = SlowSwitch(), SlowSwitch()
    data_delay_s = [0.0]
    if slow_here and args.slow == "forward":
        forward_switch.calibrate(args.extra_ms)
    if slow_here and args.slow == "backward":
        backward_switch.calibrate(args.extra_ms)

    def collate(samples):
        if data_delay_s[0]:
            time.sleep(data_delay_s[0])
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), SlowForward(forward_switch),
                          nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), SlowBackward(backward_switch),
                          nn.Linear(HIDDEN, 1))
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    micro_batches = MICRO_BATCHES if args.shape == "accumulate" else 1
    data = Samples(BATCH * 64, FEATURES, seed=1234 + int(os.environ.get("RANK", "0")))
    loader = DataLoader(data, batch_size=BATCH // micro_batches, shuffle=True, collate_fn=collate)

    telemetry = ots.configure()
    if not args.no_ddp_hook:
        ots.instrument_ddp(model)
    batches = iter(loader)

    def next_batch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(loader)
            return next(batches)

    slowed = False
    for step_number in range(args.steps):
        if step_number == args.from_step:
            print(f"onset {time.time_ns()}", flush=True)
            slowed = slow_here
            forward_switch.on = backward_switch.on = slowed
            if slow_here and args.slow == "data":
                data_delay_s[0] = args.data_delay_ms / 1000
        ots.step(step_number, samples=BATCH)
        if args.shape == "plain":  # the README's loop, as a user would write it
            with ots.stage("batch-generator"):
                x, y = next_batch()
            with ots.stage("forward-compute"):
                loss = nn.functional.mse_loss(model(x), y)
            with ots.stage("backward-compute"):
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
        elif args.shape == "accumulate":  # no_sync on all micro-batches but the last
            optimizer.zero_grad(set_to_none=True)
            for micro_batch in range(micro_batches):
                backward_switch.on = slowed and micro_batch == 0
                with ots.stage("batch-generator"):
                    x, y = next_batch()
                # DDP decides at the forward whether the backward synchronizes: both in no_sync()
                with model.no_sync() if micro_batch < micro_batches - 1 else contextlib.nullcontext():
                    with ots.stage("forward-compute"):
                        loss = nn.functional.mse_loss(model(x), y) / micro_batches
                    loss.backward()
        else:  # fetch-between: the next batch is fetched while the loss waits for its backward
            if step_number == 0:
                x, y = next_batch()
            with ots.stage("forward-compute"):
                loss = nn.functional.mse_loss(model(x), y)
            with ots.stage("batch-generator"):
                x, y = next_batch()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with ots.stage("optimizer"):
            optimizer.step()
    telemetry.shutdown()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
