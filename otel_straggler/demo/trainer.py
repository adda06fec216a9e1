"""A small, real data-parallel training job instrumented with otel_straggler.

This is the example to copy: the only straggler-specific lines are `ots.configure()`,
`ots.step(...)` at the top of each optimizer step, and one `with ots.stage(...)` around each
part of the step. Everything else is plain PyTorch, except the `straggler` lines: the demo's rank
made slow on purpose (straggler.py, the flags from --slow-rank on), to leave out when copying.

`otel-straggler demo` starts it once per rank; it also runs on its own under torchrun:

    otel-straggler detect --evidence-dir evidence &
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_STRAGGLER_EXPORT_METRICS=false \\
        OTEL_STRAGGLER_JOB_ID=my-run torchrun --nproc-per-node 4 -m otel_straggler.demo.trainer --steps 100
"""
from __future__ import annotations

import argparse
import datetime
from typing import Iterator, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

import otel_straggler as ots
from otel_straggler.demo import straggler as slow_rank

INPUT_FEATURES = 128
CLASSES = 10
STAGES = ("batch-generator", "forward-compute", "backward-compute", "all-grads-sync", "optimizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the MLP's hidden layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 prints the loss every this many steps")
    parser.add_argument("--collective-timeout-s", type=float, default=60.0,
                        help="a collective waiting longer than this for a peer fails instead of hanging")
    slow_rank.add_arguments(parser, STAGES)
    return parser.parse_args(argv)


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(INPUT_FEATURES, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


def synthetic_batches(seed: int, rank: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of this rank's shard of a learnable task: labels come from a fixed
    random teacher shared by all ranks, inputs are drawn per rank (like a distributed sampler)."""
    teacher = torch.randn(INPUT_FEATURES, CLASSES, generator=torch.Generator().manual_seed(seed))
    inputs_generator = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
    while True:
        inputs = torch.randn(batch_size, INPUT_FEATURES, generator=inputs_generator)
        yield inputs, (inputs @ teacher).argmax(dim=1)


def average_gradients(parameters: list[torch.nn.Parameter], world_size: int) -> None:
    """One all-reduce over all gradients flattened together, as DDP's buckets do. The sync is
    explicit (not DDP's hooks, which overlap it with backward) so that compute and
    communication are separate stages, as in Megatron's timers."""
    # every parameter has its gradient once backward ran
    grads = cast(list[torch.Tensor], [parameter.grad for parameter in parameters])
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    flat /= world_size
    for grad, averaged in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
        grad.copy_(averaged.view_as(grad))


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Job id, rank, world size and the OTLP endpoint come from the environment.
    telemetry = ots.configure()

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = make_model(args.hidden)
    parameters = list(model.parameters())
    optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
    batches = synthetic_batches(args.seed, rank, args.batch_size)
    straggler = slow_rank.Straggler.from_args(args, rank, telemetry)

    for step in range(args.steps):
        ots.step(step, samples=args.batch_size)
        straggler.begin_step(step)
        with ots.stage("batch-generator"), straggler.inside("batch-generator"):
            inputs, labels = next(batches)
        with ots.stage("forward-compute"), straggler.inside("forward-compute"):
            loss = F.cross_entropy(model(inputs), labels)
        with ots.stage("backward-compute"), straggler.inside("backward-compute"):
            optimizer.zero_grad()
            loss.backward()
        # waits for the slowest rank
        with ots.stage("all-grads-sync", collective=True), straggler.inside("all-grads-sync"):
            average_gradients(parameters, world_size)
        with ots.stage("optimizer"), straggler.inside("optimizer"):
            optimizer.step()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)

    telemetry.flush()
    telemetry.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    train(parse_args())
