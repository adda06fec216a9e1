"""A plain PyTorch DDP training script on gloo, as people write it: nothing of otel_straggler in it.
Instrumented from outside only, by the zero-code launch:

    OTEL_STRAGGLER_ENABLED=true opentelemetry-instrument \\
        torchrun --nproc-per-node 4 benchmarks/field_jobs/torch_job.py --steps 130 --slow forward

The model is benchmarks/field_job.py's (1024 -> 1536 -> 1536 -> 1, a batch of 128 a rank), with the
slowdowns of slowdowns.py from --from-step on rank --slow-rank:
- forward: extra matrix products in the model's forward (each micro-batch's);
- backward: extra matrix products inside autograd's backward, so under DDP they sit inside
  `loss.backward()` together with the gradient all-reduce (first micro-batch only, see below);
- data: the DataLoader's collate function sleeps --data-delay-ms more (each batch it makes).
`--accumulate K`: K micro-batches of a K-th of the batch per optimizer step, DDP's `no_sync()` on
all but the last; a `backward` slowdown is in the first micro-batch's backward only, one that does
not synchronize.
Every rank prints `onset rank=<RANK> <unix ns>` when it starts step --from-step and
`done rank=<RANK>` at the end.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from job_common import Samples, job_arguments, say
from slowdowns import SlowBackward, SlowForward, Slowdowns

FEATURES, HIDDEN, BATCH = 1024, 1536, 128
BATCHES_PER_EPOCH = 64




def main() -> None:
    parser = job_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow_here = args.slow != "none" and rank == args.slow_rank
    slowdowns = Slowdowns(args.slow, slow_here, args.extra_ms)
    forward_switch, backward_switch, data_source = slowdowns.forward, slowdowns.backward, slowdowns.data

    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), SlowForward(forward_switch),
                          nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), SlowBackward(backward_switch),
                          nn.Linear(HIDDEN, 1))
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    micro_batch = BATCH // args.accumulate
    loader = DataLoader(Samples(BATCH * BATCHES_PER_EPOCH, FEATURES, seed=1234 + rank), batch_size=micro_batch, shuffle=True,
                        collate_fn=slowdowns.collate, drop_last=True)

    slowed = False

    def on_step_start(step: int) -> None:
        nonlocal slowed
        if step == args.from_step:
            say(f"onset rank={rank} {time.time_ns()}")
            slowed = slow_here
            forward_switch.on = slowed
            if slowed and args.slow == "data":
                data_source.delay_s = args.data_delay_ms / 1000

    step = 0
    on_step_start(step)
    while step < args.steps:
        for index, (x, y) in enumerate(loader):
            last_micro_batch = (index + 1) % args.accumulate == 0
            backward_switch.on = slowed and index % args.accumulate == 0
            if not last_micro_batch:
                # gradients accumulate here; the last micro-batch synchronizes them. DDP decides at
                # the forward whether the backward synchronizes, so both run in no_sync()
                with model.no_sync():
                    loss = nn.functional.mse_loss(model(x), y) / args.accumulate
                    loss.backward()
                continue
            loss = nn.functional.mse_loss(model(x), y) / args.accumulate
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == args.steps:
                break
            on_step_start(step)
    dist.destroy_process_group()
    say(f"done rank={rank}")


if __name__ == "__main__":
    sys.exit(main())
