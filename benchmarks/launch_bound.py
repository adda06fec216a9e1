"""A launch-bound training loop's proxy on the CPU: what otel-straggler costs a training thread
whose step is short, GIL-bound Python work, with the library's background threads working.

    python benchmarks/launch_bound.py [--pairs 20] [--steps 300] [--step-ops 40000] [--protocol http/protobuf]

A step is `--step-ops` tiny Python operations (what a launch-bound loop does between kernel
launches: attribute reads, small arithmetic, dict and list work; about 4 ms on a 2-core VM), in a
step and four stages (5 spans a step). OFF: the library not configured. ON: `ots.configure()`
with fake device events, span building, batching and OTLP export every 500 ms to a live detector
in another process. Every arm runs in a fresh process; pairs alternate OFF-ON / ON-OFF, each pair's
warm-up drawn at random (seeded) for both its arms, as in benchmarks/paired_protocol.py, whose
estimator and bootstrap this uses: per pair 100 x (mean ON / mean OFF - 1) of step time, the mean
over pairs with its 95% interval. Target: a mean under 0.5%.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from detector_process import DetectorProcess
from measured_on import describe, measured_on
from paired_protocol import OFF, ON, Protocol, pair_estimates, bootstrap_ci

STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")


def tiny_ops(count: int) -> int:
    """`count` small GIL-bound operations, as a launch loop's Python between kernels."""
    state = {"step": 0, "scale": 1.0}
    items: list[int] = []
    total = 0
    for index in range(count):
        state["step"] = index
        total += index & 7
        if index % 4 == 0:
            items.append(total)
        elif items:
            total ^= items[-1]
        if len(items) > 32:
            items.clear()
    return total


def arm(on: bool, warmup: int, steps: int, step_ops: int, endpoint: str, protocol: str) -> dict:
    os.environ.update({"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_STRAGGLER_EXPORT_METRICS": "false"})
    import otel_straggler as ots

    handle = None
    if on:
        handle = ots.configure(job_id="launch-bound", rank=0, world_size=1, endpoint=f"http://{endpoint}",
                               protocol=protocol, device_timing="fake")
    ops_per_stage = step_ops // len(STAGES)
    times = []
    for number in range(warmup + steps):
        started = time.perf_counter()
        ots.step(number, samples=8)
        for name in STAGES:
            with ots.stage(name):
                tiny_ops(ops_per_stage)
        times.append(time.perf_counter() - started)
    status = None
    if handle is not None:
        handle.flush(30.0)
        status = handle.status()
        handle.shutdown(10.0)
    measured = times[warmup:]
    return {"mean_s": statistics.fmean(measured), "exported": status and status["exported"],
            "lost": status and sum(status["lost"].values())}


def target_verdict(low: float, high: float, target_pct: float = 0.5) -> str:
    """Met when the whole 95% interval is under the target, missed when all of it is over it;
    otherwise `unresolved`, as paired_protocol.verdict says of the GPU runs: a point estimate
    under the target on a noisy machine is not a result."""
    if high < target_pct:
        return "met"
    if low > target_pct:
        return "missed"
    return "unresolved"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300, help="measured steps per arm")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--step-ops", type=int, default=40000)
    parser.add_argument("--protocol", default="http/protobuf", choices=("grpc", "http/protobuf"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # "on,warmup,endpoint": one arm, in a child
    args = parser.parse_args(argv)
    if args.arm:
        on, warmup, endpoint = args.arm.split(",")
        print(json.dumps(arm(on == ON, int(warmup), args.steps, args.step_ops, endpoint, args.protocol)))
        return 0
    # the warm-up spread over more than a build interval's steps (see paired_protocol)
    protocol = Protocol(pairs=args.pairs, warmup_steps=args.warmup, steps_per_arm=args.steps, warmup_extra_steps=50)
    schedule, warmups = protocol.schedule(), protocol.warmups()
    results = []
    with tempfile.TemporaryDirectory(prefix="launch-bound-") as scratch:
        detector = DetectorProcess(scratch)
        endpoint = detector.endpoint if args.protocol == "grpc" else detector.http_endpoint
        try:
            for which, warmup in zip(schedule, warmups):
                child = subprocess.run([sys.executable, __file__, "--arm", f"{which},{warmup},{endpoint}",
                                        "--steps", str(args.steps), "--step-ops", str(args.step_ops),
                                        "--protocol", args.protocol], check=True, capture_output=True, text=True)
                results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        finally:
            detector.stop()
    means = [run["mean_s"] for run in results]
    estimates = pair_estimates(schedule, means)
    low, high = bootstrap_ci(estimates, protocol)
    mean = statistics.fmean(estimates)
    off = [m for which, m in zip(schedule, means) if which == OFF]
    on_runs = [run for which, run in zip(schedule, results) if which == ON]
    print(f"\nlaunch-bound proxy on the CPU: {protocol.describe()}; {args.step_ops} tiny ops a step, 5 spans a step,"
          f" OTLP ({args.protocol}) to a live detector every 500 ms; {describe(measured_on())}")
    print(f"\n{'OFF ms/step':>12} {'ON ms/step':>11} {'overhead % [95% CI]':>28} {'per-pair spread':>16}"
          f" {'target < 0.5%':>14}")
    on_means = [m for which, m in zip(schedule, means) if which == ON]
    print(f"{statistics.median(off) * 1e3:12.3f} {statistics.median(on_means) * 1e3:11.3f}"
          f" {f'{mean:+.3f} [{low:+.3f}, {high:+.3f}]':>28} {statistics.stdev(estimates):15.2f}%"
          f" {target_verdict(low, high):>14}")
    print(f"\nspans exported in ON arms: {sum(run['exported'] for run in on_runs)}, lost:"
          f" {sum(run['lost'] for run in on_runs)}")
    if args.json:
        args.json.write_text(json.dumps({"protocol": protocol.as_dict(), "runs": results, "per_pair_pct": estimates,
                                         "mean_pct": mean, "ci95_pct": [low, high]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
