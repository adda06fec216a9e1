"""Real DDP ranks on gloo for the instrument_ddp tests: one process per rank, a file rendezvous.

    results = run_ranks(["plain", "instrumented"], tmp_path, world_size=2, slow_rank=1)
    results[rank][arm] -> {"parameters": [tensor, ...], "spans": [...], "hook_errors": n, "lost": {...}}

Each arm trains a fresh small model from the same seed for STEPS steps on this rank's own data,
with the instrumentation configured on an in-memory TracerProvider; arm `a`'s steps are numbered
from a * STEP_BASE on, so its spans are told apart by step. Every wait has a deadline, and the
ranks are killed if anything goes wrong.

Arms: `plain` (DDP's own all-reduce), `instrumented` (instrument_ddp), `fp16` / `fp16-instrumented`
(fp16_compress_hook alone / through instrument_ddp), `accumulate` / `accumulate-instrumented`
(two micro-batches per step, the first under no_sync), `failing-instrumented` (instrument_ddp
whose clock raises in every hook), `slow-backward` (instrument_ddp; the slow rank sleeps inside
one layer's backward), `accumulate-slow` (instrument_ddp, two micro-batches; the slow rank sleeps
in the backward of the first, under no_sync, only), `fetch-between` (instrument_ddp; the slow rank
sleeps between forward and backward, as a loop fetching its next batch there would).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# 16: the timing checks' medians are over 14 steps; a step's wait moves by about 10 ms on 2 cores
STEPS = 16
STEP_BASE = 1000
# timing checks leave out each arm's first WARMUP_STEPS steps: DDP builds its buckets and gloo its
# pairs there, and the ranks come out of them apart (the fast rank's first waits were 0.7-17 ms
# where its later ones were 34-129 ms, in 4 of 6 runs of the slow-backward arm), not yet in step
WARMUP_STEPS = 2
SLOW_BACKWARD_S = 0.04
RANK_TIMEOUT_S = 60.0


def run_ranks(arms: list[str], workdir: Path, world_size: int = 2, slow_rank: int = -1) -> list[dict]:
    """Runs the arms on `world_size` ranks and returns each rank's results by arm."""
    import torch

    rendezvous = workdir / "rendezvous"
    environment = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), environment.get("PYTHONPATH", "")])
    from rank_processes import run_rank_processes

    run_rank_processes(
        [([sys.executable, __file__, *arms, "--rank", str(rank), "--world-size", str(world_size), "--rendezvous",
           str(rendezvous), "--out", str(workdir), "--slow-rank", str(slow_rank)], environment)
         for rank in range(world_size)], RANK_TIMEOUT_S)
    results = []
    for rank in range(world_size):
        record = json.loads((workdir / f"rank-{rank}.json").read_text())
        parameters = torch.load(workdir / f"rank-{rank}.pt")
        results.append({arm: {**record[arm], "parameters": parameters[arm]} for arm in arms})
    return results


# -- one rank --------------------------------------------------------------------------------------

def build_model(slow):
    """`slow`: a bool, or a one-item list whose item says, at each backward, whether it is slow."""
    import torch
    from torch import nn

    slow_now = slow if isinstance(slow, list) else [slow]

    class SlowBackward(torch.autograd.Function):
        """The identity, whose backward takes SLOW_BACKWARD_S longer on the slow rank."""

        @staticmethod
        def forward(context, inputs):
            return inputs.view_as(inputs)

        @staticmethod
        def backward(context, gradient):
            if slow_now[0]:
                time.sleep(SLOW_BACKWARD_S)
            return gradient

    class SlowLayer(nn.Module):
        def forward(self, inputs):
            return SlowBackward.apply(inputs)

    torch.manual_seed(0)
    # three buckets (bucket_cap_mb below): only the last one of each iteration is timed
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), SlowLayer(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def train(arm: str, first_step: int, rank: int, slow_rank: int) -> list:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import otel_straggler as ots
    from otel_straggler.integrations import ddp

    slow_rank_here = rank == slow_rank
    slow_backward = [arm == "slow-backward" and slow_rank_here]
    model = DistributedDataParallel(build_model(slow=slow_backward), bucket_cap_mb=0.01)
    if arm == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif arm == "fp16-instrumented":
        ots.instrument_ddp(model, hook=default_hooks.fp16_compress_hook)
    elif arm.endswith("instrumented") or arm in ("slow-backward", "accumulate-slow", "fetch-between"):
        ots.instrument_ddp(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    micro_batches = 2 if arm.startswith("accumulate") else 1
    clock = ddp._time_ns
    if arm == "failing-instrumented":
        ddp._time_ns = failing_clock
    try:
        for step in range(STEPS):
            ots.step(first_step + step)
            optimizer.zero_grad()
            for micro_batch in range(micro_batches):
                inputs = torch.randn(16, 32, generator=data)
                targets = torch.randn(16, 8, generator=data)
                if arm == "accumulate-slow":
                    slow_backward[0] = slow_rank_here and micro_batch == 0
                if micro_batch < micro_batches - 1:
                    with model.no_sync():
                        torch.nn.functional.mse_loss(model(inputs), targets).backward()
                else:
                    loss = torch.nn.functional.mse_loss(model(inputs), targets)
                    if arm == "fetch-between" and slow_rank_here:
                        time.sleep(SLOW_BACKWARD_S)  # the next batch's fetch, say: no backward in it
                    loss.backward()
            optimizer.step()
    finally:
        ddp._time_ns = clock
    dist.barrier()
    return [parameter.detach().clone() for parameter in model.parameters()]


def failing_clock() -> int:
    raise RuntimeError("the clock failed")


def span_record(span) -> dict:
    return {"name": span.name, "start_ns": span.start_time, "end_ns": span.end_time,
            "parent": span.parent.span_id if span.parent is not None else None, "span_id": span.context.span_id,
            "attributes": dict(span.attributes)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("arms", nargs="+")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--slow-rank", type=int, default=-1)
    options = parser.parse_args()

    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_straggler as ots

    dist.init_process_group("gloo", init_method=f"file://{options.rendezvous}", rank=options.rank,
                            world_size=options.world_size, timeout=timedelta(seconds=30))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handle = ots.configure(job_id="ddp-test", rank=options.rank, world_size=options.world_size,
                           tracer_provider=provider, build_interval_ms=5.0, export_metrics=False, device_timing="off")
    records, parameters = {}, {}
    for index, arm in enumerate(options.arms):
        errors_before = handle.status()["ddp"]["hook_errors"]
        parameters[arm] = train(arm, index * STEP_BASE, options.rank, options.slow_rank)
        assert handle.flush(timeout_s=10.0)
        status = handle.status()
        spans = [span_record(span) for span in exporter.get_finished_spans()
                 if index * STEP_BASE <= span.attributes.get("training.step", -1) < (index + 1) * STEP_BASE]
        records[arm] = {"spans": spans, "hook_errors": status["ddp"]["hook_errors"] - errors_before,
                        "lost": status["lost"]}
    handle.shutdown()
    dist.destroy_process_group()
    torch.save(parameters, Path(options.out) / f"rank-{options.rank}.pt")
    (Path(options.out) / f"rank-{options.rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
