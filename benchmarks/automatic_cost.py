"""Training-thread cost per step of the automatic stages (what `opentelemetry-instrument` turns on
for a script nobody edited), against the same loop bare and against the README's explicit calls.

    python benchmarks/automatic_cost.py [--rounds 12] [--models tiny,field]

Arms, measured in one process, interleaved in round-robin blocks (each round runs every arm once,
the order rotating from round to round) so that the machine's drift falls on every arm alike:
  bare       a plain single-process loop: a DataLoader fetch, the model's forward and loss,
             `loss.backward()`, `optimizer.step()`; the library not configured
  explicit   the same loop with `ots.step(n)` and a `with ots.stage(...)` around the fetch, the
             forward, the backward and the optimizer step, as the README shows
  automatic  the bare loop unchanged, with automatic.instrument() on
Both instrumented arms export to an endpoint that accepts nothing (the spans are built, their
export fails and is counted): the builder's and exporter's threads run as in a job. Every block
starts from its own configure() and ends with shutdown(): a process that called step() keeps
the automatic stages off for good (explicit calls win), so an automatic block after an explicit
one needs a fresh recorder, and the explicit arm gets the same treatment. A block's first steps are
discarded (warm-up; the automatic stages learn the outermost module until the first optimizer
step). Per model and arm, on two clocks: the training thread's CPU time per step (the hooks' own
cost, and robust to other processes on a shared machine) and wall time per step (also the waits
for the GIL or a core, which the library's background threads add): the median over all measured
steps, and the cost per step, median(arm) - median(bare), in microseconds and in % of the bare
step. The spread is the interquartile range of the rounds' own CPU differences (the arm's block
median minus the round's bare block median). Models: `tiny` (Linear 64->64, batch 8: the hooks'
cost is most of what changes) and `field` (benchmarks/field_job.py's model without its slowdowns,
batch 128: a step as a real job's, where the same cost is a small share, within the machine's
noise). No DDP here: the automatic DDP hooks are instrument_ddp's, which an explicitly
instrumented job adds too.
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import otel_straggler as ots
from otel_straggler.instrumentation import automatic, hot_path

BARE, EXPLICIT, AUTOMATIC = "bare", "explicit", "automatic"
ARMS = (BARE, EXPLICIT, AUTOMATIC)
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens
SHUTDOWN_TIMEOUT_S = 0.2  # the export to nowhere is given up at once, not retried for seconds


@dataclass(frozen=True)
class Model:
    name: str
    make: Callable[[], nn.Module]
    features: int
    outputs: int
    batch: int
    steps: int  # measured steps per block
    warmup: int  # discarded steps per block


MODELS = {
    "tiny": Model("tiny", lambda: nn.Linear(64, 64), features=64, outputs=64, batch=8, steps=1000, warmup=30),
    "field": Model("field", lambda: nn.Sequential(nn.Linear(1024, 1536), nn.ReLU(), nn.Linear(1536, 1536), nn.ReLU(),
                                                  nn.Linear(1536, 1)),
                   features=1024, outputs=1, batch=128, steps=10, warmup=3),
}


def batches(model: Model, count: int) -> Iterator:
    """An iterator over a DataLoader of `count` batches (default collate, loaded in this process)."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(count * model.batch, model.features, generator=generator),
                         torch.randn(count * model.batch, model.outputs, generator=generator))
    return iter(DataLoader(data, batch_size=model.batch))


def bare_step(number: int, batches: Iterator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, y = next(batches)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def explicit_step(number: int, batches: Iterator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ots.step(number)
    with ots.stage("batch-generator"):
        x, y = next(batches)
    with ots.stage("forward-compute"):
        loss = nn.functional.mse_loss(model(x), y)
    with ots.stage("backward-compute"):
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    with ots.stage("optimizer"):
        optimizer.step()


@dataclass
class Block:
    arm: str
    cpu_ns: list[int]  # the training thread's CPU time per measured step
    wall_ns: list[int]


def run_block(arm: str, spec: Model, model: nn.Module, optimizer: torch.optim.Optimizer) -> Block:
    steps = spec.warmup + spec.steps
    data = batches(spec, steps)
    handle = None
    if arm != BARE:
        handle = ots.configure(job_id="automatic-cost", rank=0, world_size=1, endpoint=UNREACHABLE,
                               device_timing="off", export_metrics=False)
    if arm == AUTOMATIC:
        automatic.instrument()
    step = explicit_step if arm == EXPLICIT else bare_step
    gc.collect()
    cpu_ns, wall_ns = [], []
    try:
        for number in range(steps):
            wall_started, cpu_started = time.perf_counter_ns(), time.thread_time_ns()
            step(number, data, model, optimizer)
            cpu_ns.append(time.thread_time_ns() - cpu_started)
            wall_ns.append(time.perf_counter_ns() - wall_started)
    finally:
        if arm == AUTOMATIC:
            checks = automatic.counts()
            automatic.uninstrument()
            handle.flush(SHUTDOWN_TIMEOUT_S)  # status() counts the intervals taken to be built
            if checks["errors"] or checks["deferred_to_explicit"] or not handle.status()["intervals"]:
                raise RuntimeError(f"the automatic stages did not time the block: {checks}")
        if handle is not None:
            handle.shutdown(SHUTDOWN_TIMEOUT_S)
    return Block(arm, cpu_ns[spec.warmup:], wall_ns[spec.warmup:])


def order(round_number: int) -> list[str]:
    """The arms of a round, rotated by one each round."""
    shift = round_number % len(ARMS)
    return list(ARMS[shift:] + ARMS[:shift])


@dataclass
class Cost:
    median_us: float
    cost_us: float  # median(arm) - median(bare)
    cost_pct: float
    spread_us: tuple[float, float]  # interquartile range of the rounds' differences to bare


def cost(rounds: list[dict[str, Block]], arm: str, clock: Callable[[Block], list[int]]) -> Cost:
    """The arm's median over all its measured steps, against bare's, on one clock."""
    def median_us(which: str) -> float:
        return statistics.median(ns for blocks in rounds for ns in clock(blocks[which])) / 1e3

    differences = [(statistics.median(clock(blocks[arm])) - statistics.median(clock(blocks[BARE]))) / 1e3
                   for blocks in rounds]
    quartiles = statistics.quantiles(differences, n=4) if len(differences) > 1 else differences * 3
    arm_us, bare_us = median_us(arm), median_us(BARE)
    return Cost(arm_us, arm_us - bare_us, 100 * (arm_us - bare_us) / bare_us, (quartiles[0], quartiles[-1]))


def measure(spec: Model, rounds: int) -> list[dict[str, Block]]:
    torch.manual_seed(0)
    model = spec.make()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for arm in ARMS:  # every arm once, unmeasured: torch's and the library's first-call costs
        run_block(arm, spec, model, optimizer)
    return [{block.arm: block for block in (run_block(arm, spec, model, optimizer) for arm in order(r))}
            for r in range(rounds)]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="blocks per arm and model")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(1)
    # the failed exports to nowhere are counted; their retry warnings are not the result
    logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.ERROR)

    print(f"{args.rounds} rounds of round-robin blocks per model, torch on 1 thread, hot path in "
          f"{hot_path.IMPLEMENTATION}")
    header = (f"{'model':<7} {'arm':<10} {'steps':>6} {'CPU us/step':>12} {'cost us':>8} {'cost %':>7} "
              f"{'IQR of rounds us':>18} {'wall us/step':>13} {'cost us':>8} {'cost %':>7}")
    print(header)
    print("-" * len(header))
    for name in names:
        spec = MODELS[name]
        rounds = measure(spec, args.rounds)
        for arm in ARMS:
            cpu, wall = cost(rounds, arm, lambda block: block.cpu_ns), cost(rounds, arm, lambda block: block.wall_ns)
            if arm == BARE:
                print(f"{name:<7} {arm:<10} {spec.steps * args.rounds:>6} {cpu.median_us:>12.1f} {'-':>8} {'-':>7} "
                      f"{'-':>18} {wall.median_us:>13.1f} {'-':>8} {'-':>7}")
                continue
            spread = f"{cpu.spread_us[0]:.1f} .. {cpu.spread_us[1]:.1f}"
            print(f"{name:<7} {arm:<10} {spec.steps * args.rounds:>6} {cpu.median_us:>12.1f} {cpu.cost_us:>8.1f} "
                  f"{cpu.cost_pct:>7.2f} {spread:>18} {wall.median_us:>13.1f} {wall.cost_us:>8.1f} "
                  f"{wall.cost_pct:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
