"""The hot path inside a training loop, where caches are cold, against the same calls in a tight loop.

    python benchmarks/hot_path_in_situ.py [--rounds 4] [--steps 300] [--arms off,on,...] [--json out.json]

benchmarks/hot_path.py times stage()/step() back to back, with the interpreter's and the
recorder's code and data hot in the caches. In training, each call comes after milliseconds of
matmuls that evicted them. This benchmark runs the overhead benchmark's loop workload (the demo's
MLP, hidden 1024, batch 256, one thread, four stages and a step() a step) and times each of the
nine calls of a step with perf_counter_ns (step(); each stage's construction with its __enter__;
its __exit__), in six arms: `off` (library not configured: the calls are no-ops), `on` (fake
device events), `on-host` (device timing off), `on-python` (as `on`, with the Python reference
hot path instead of the C extension) and `on-deferred` (as `on`, with a 60 s build interval: the
library's threads do no work during the measured steps, the records wait in the queue for the
flush after them) and `on-one-burst` (as `on`, with each build taking every record queued in one
burst, as before the builder thread paused between bursts of rank_pipeline.BUILD_BURST_S
each; the few that arrive during it follow after a pause), all exporting over
OTLP/gRPC to a live detector in this process, as the
overhead benchmark's ON arm does. Each arm runs in a fresh process, arms alternating over rounds.
Per arm: the median over steps of the nine calls' time, in the loop and in a tight loop of the
same nine calls after it (the reference); the timer's own cost is in every arm alike, so the
figure to read is an arm's minus `off`'s. Also per arm: the training thread's waiting, the mean
over steps of a step's wall time minus the thread's own CPU time (for the GIL or a core), which
`on-deferred` against `on` splits into what the library's threads working costs and what their
mere presence does, and `on-one-burst` against `on` shows what the pauses between bursts save.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from measured_on import describe, measured_on

ARMS = ("off", "on", "on-host", "on-python", "on-deferred", "on-one-burst")
DEVICE_TIMING = {"on": "fake", "on-host": "off", "on-python": "fake", "on-deferred": "fake", "on-one-burst": "fake"}
# on-deferred: a build interval longer than an arm, so nothing is built before the flush; its
# records hold their device events and the flush hands the export queue all of an arm's ~3,000
# spans at once: room for both, so it loses nothing
DEFERRED = {"build_interval_ms": 60_000.0, "event_pool_size": 16_384}
DEFERRED_EXPORT_QUEUE = "8192"
STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")
TIGHT_LOOP_STEPS = 300  # its 1,500 spans fit the batch processor's queue (2,048): nothing dropped


def timed_steps(steps: int, warmup: int, hidden: int, batch_size: int) -> tuple[list[int], list[int], list[int]]:
    """ns spent in the nine calls of each measured step, in training and then in a tight loop,
    and ns the training thread waited in each measured training step."""
    import torch
    import torch.nn.functional as F

    import otel_straggler as ots
    from otel_straggler.demo.trainer import make_model, synthetic_batches

    torch.manual_seed(0)
    model = make_model(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = synthetic_batches(0, 0, batch_size)
    clock = time.perf_counter_ns
    work = (lambda: next(batches), lambda data: F.cross_entropy(model(data[0]), data[1]),
            lambda loss: (optimizer.zero_grad(), loss.backward()), lambda _: optimizer.step())

    def step(n: int, train: bool) -> int:
        spent = 0
        step_began, cpu_began = clock(), time.thread_time_ns()
        began = step_began
        ots.step(n, samples=batch_size)
        spent += clock() - began
        value = None
        for name, action in zip(STAGES, work):
            began = clock()
            timer = ots.stage(name)
            timer.__enter__()
            spent += clock() - began
            if train:
                value = action() if value is None else action(value)
            began = clock()
            timer.__exit__(None, None, None)
            spent += clock() - began
        waited.append((clock() - step_began) - (time.thread_time_ns() - cpu_began))
        return spent

    waited: list[int] = []
    in_training = [step(n, True) for n in range(warmup + steps)][warmup:]
    waiting = waited[warmup:]
    tight = [step(n, False) for n in range(warmup + steps, warmup + steps + TIGHT_LOOP_STEPS)]
    return in_training, tight, waiting


def run_arm(args: argparse.Namespace) -> None:
    if args.arm == "on-python":  # as where the extension is not built: its import fails
        sys.modules["otel_straggler.instrumentation._hot_path"] = None
    import torch

    import otel_straggler as ots
    from otel_straggler.instrumentation import hot_path

    torch.set_num_threads(1)
    if args.arm == "on-one-burst":
        from otel_straggler.instrumentation import rank_pipeline

        rank_pipeline.BUILD_BURST_S = float("inf")  # each build takes every record queued, in one go
    handle = None
    if args.arm != "off":
        from demo_training import DEMO_RANK_ENVIRONMENT  # the overhead benchmark's ON arm, as the demo's ranks

        os.environ.update({**DEMO_RANK_ENVIRONMENT, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{args.endpoint}"})
        if args.arm == "on-deferred":
            os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = DEFERRED_EXPORT_QUEUE
        handle = ots.configure(job_id=f"in-situ-{args.arm}", rank=0, world_size=1,
                               device_timing=DEVICE_TIMING[args.arm],
                               **(DEFERRED if args.arm == "on-deferred" else {}))
    in_training, tight, waiting = timed_steps(args.steps, args.warmup, args.hidden, args.batch_size)
    lost = 0
    if handle is not None:
        handle.flush(30.0)
        lost = sum(handle.status()["lost"].values())
        handle.shutdown(10.0)
    print(json.dumps({"arm": args.arm, "hot_path": hot_path.IMPLEMENTATION, "in_training_ns": in_training,
                      "tight_loop_ns": tight, "waiting_ns": waiting, "spans_lost": lost}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the arms, order alternating")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS)} (off is always run)")
    parser.add_argument("--steps", type=int, default=300, help="measured training steps per arm")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child process
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    arms = tuple(arm for arm in ARMS if arm == "off" or arm in args.arms.split(","))
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"--arms: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ARMS)}")
    if args.arm:
        run_arm(args)
        return 0

    from detector_process import detector_in_this_process

    records: dict[str, list[dict]] = {arm: [] for arm in arms}
    with detector_in_this_process("in-situ-") as endpoint:
        for round_index in range(args.rounds):
            for arm in (arms if round_index % 2 == 0 else arms[::-1]):
                output = subprocess.run(
                    [sys.executable, __file__, "--arm", arm, "--endpoint", endpoint,
                     "--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
                     "--batch-size", str(args.batch_size)], check=True, capture_output=True, text=True).stdout
                records[arm].append(json.loads(output.strip().splitlines()[-1]))
                print(f"round {round_index + 1}/{args.rounds}: {arm} done", flush=True)

    def median_us(arm: str, key: str) -> float:
        return statistics.median(ns for record in records[arm] for ns in record[key]) / 1e3

    results = {arm: {"in_training_us_per_step": median_us(arm, "in_training_ns"),
                     "tight_loop_us_per_step": median_us(arm, "tight_loop_ns"),
                     "waiting_us_per_step": statistics.mean(ns for record in records[arm] for ns in record["waiting_ns"]) / 1e3,
                     "waiting_us_per_step_by_round": [statistics.mean(record["waiting_ns"]) / 1e3 for record in records[arm]],
                     "spans_lost": sum(record["spans_lost"] for record in records[arm]),
                     "hot_path": sorted({record["hot_path"] for record in records[arm]})} for arm in arms}
    report = {**measured_on(), "rounds": args.rounds, "steps": args.steps, "arms": results}
    off = results["off"]
    print(f"\nhot path in situ — {describe(report)};"
          f" {args.rounds} rounds x {args.steps} steps per arm; median per step of step() + 4 x stage() made, entered and exited,"
          f" timer included; waiting: mean per step of wall minus the training thread's CPU")
    print(f"\n{'arm':20} {'hot path':9} {'in training µs':>15} {'minus off':>10} {'tight loop µs':>14} {'minus off':>10}"
          f" {'ratio':>6} {'waiting µs':>11}  by round")
    for arm, result in results.items():
        in_training = result["in_training_us_per_step"] - off["in_training_us_per_step"]
        tight = result["tight_loop_us_per_step"] - off["tight_loop_us_per_step"]
        ratio = f"{in_training / tight:6.1f}" if arm != "off" and tight > 0 else f"{'':6}"
        print(f"{arm:20} {'/'.join(result['hot_path']):9} {result['in_training_us_per_step']:15.1f} {in_training:10.1f}"
              f" {result['tight_loop_us_per_step']:14.1f} {tight:10.1f} {ratio} {result['waiting_us_per_step']:11.1f}"
              f"  {' '.join(f'{us:.1f}' for us in result['waiting_us_per_step_by_round'])}")
    lost = ", ".join(f"{arm} {result['spans_lost']}" for arm, result in results.items() if arm != "off")
    print(f"\nspans lost: {lost}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
