"""The allocator's page faults in a CPU training step: what one costs, and how many a step takes
from one process to the next, running the same code.

    python benchmarks/page_faults.py [--processes 6] [--steps 60] [--json out.json]

The overhead benchmark's loop workload (the demo's MLP, hidden 1024, batch 256, one thread):
1. Cost per fault. In one process, library off, blocks of 15 steps alternate between malloc
   settings that give every freed tensor of 128 KiB or more back to the OS, so it is faulted in
   afresh each step (mallopt mmap and trim thresholds of 128 KiB, no top pad), and the
   kept-memory settings.
   The difference in the training thread's CPU per step over the difference in its page faults
   per step is the cost of one fault; blocks are paired, so the machine's drift cancels.
2. The spread. Fresh processes, OFF and ON (ON exporting over OTLP/gRPC to a live detector, as
   in the overhead benchmark), with glibc's default settings and with the overhead benchmark's
   kept-memory settings (benchmarks/allocators.py), each counting its training thread's page
   faults per step over --steps steps after a warm-up of 30. glibc's heuristics (a dynamic mmap
   threshold, trimming the heap's top) decide by where things lie in the address space.
The step is the overhead benchmark's harness's (demo_training.Training), at its loop workload's
sizes.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from allocators import ALLOCATORS, KEPT_MMAP_THRESHOLD, KEPT_TOP_PAD, KEPT_TRIM_THRESHOLD, allocator_environment
from demo_training import DEMO_RANK_ENVIRONMENT, Training
from detector_process import detector_in_this_process
from measured_on import describe, measured_on

WARMUP_STEPS = 30
BLOCK_STEPS, BLOCK_SETTLE_STEPS, BLOCK_PAIRS = 15, 3, 12
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)
MALLOPT_SETTINGS = {  # (mmap threshold, trim threshold, top pad)
    "faulting": (128 << 10, 128 << 10, 0),
    "kept": (KEPT_MMAP_THRESHOLD, KEPT_TRIM_THRESHOLD, KEPT_TOP_PAD),
}
# below this many more faults a step under the faulting settings, their cost cannot be read off
MIN_FAULT_DIFFERENCE = 50


def training_steps(hidden: int, batch_size: int):
    """A function running `count` more steps of the loop workload and returning the training
    thread's CPU ms and page faults per step over them."""
    import torch

    torch.set_num_threads(1)
    training = Training(argparse.Namespace(seed=0, hidden=hidden, batch_size=batch_size, world_size=1), rank=0)
    done = 0

    def steps(count: int) -> tuple[float, float]:
        nonlocal done
        cpu, faults = time.thread_time_ns(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for n in range(done, done + count):
            training.step(n)
        done += count
        return ((time.thread_time_ns() - cpu) / count / 1e6,
                (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults) / count)

    return steps


def fault_cost(hidden: int, batch_size: int) -> dict:
    libc = ctypes.CDLL("libc.so.6")
    steps = training_steps(hidden, batch_size)
    steps(WARMUP_STEPS)
    blocks: dict[str, list[tuple[float, float]]] = {name: [] for name in MALLOPT_SETTINGS}
    for pair in range(BLOCK_PAIRS):
        for name in (("faulting", "kept") if pair % 2 == 0 else ("kept", "faulting")):
            for parameter, value in zip((M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD), MALLOPT_SETTINGS[name]):
                if libc.mallopt(parameter, value) != 1:
                    raise SystemExit(f"page_faults.py: glibc refused mallopt({parameter}, {value})")
            steps(BLOCK_SETTLE_STEPS)
            blocks[name].append(steps(BLOCK_STEPS))
    result = {name: {"cpu_ms_per_step": statistics.mean(cpu for cpu, _ in values),
                     "faults_per_step": statistics.mean(faults for _, faults in values)} for name, values in blocks.items()}
    extra_faults = result["faulting"]["faults_per_step"] - result["kept"]["faults_per_step"]
    if extra_faults < MIN_FAULT_DIFFERENCE:
        raise SystemExit(f"page_faults.py: the faulting settings took only {extra_faults:.0f} more faults a step"
                         " than the kept ones, too few to cost them")
    result["us_per_fault"] = 1e3 * (result["faulting"]["cpu_ms_per_step"] - result["kept"]["cpu_ms_per_step"]) / extra_faults
    # the same from each pair of blocks, for its spread
    result["us_per_fault_by_pair"] = [1e3 * (cpu_f - cpu_k) / (faults_f - faults_k)
                                      for (cpu_f, faults_f), (cpu_k, faults_k) in zip(blocks["faulting"], blocks["kept"])
                                      if faults_f - faults_k >= MIN_FAULT_DIFFERENCE]
    return result


def one_process(arm: str, endpoint: str, hidden: int, batch_size: int, measured_steps: int) -> dict:
    handle = None
    if arm == "on":
        import otel_straggler as ots

        os.environ.update({**DEMO_RANK_ENVIRONMENT, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}"})
        handle = ots.configure(job_id=f"page-faults-{os.getpid()}", rank=0, world_size=1, device_timing="fake")
    steps = training_steps(hidden, batch_size)
    steps(WARMUP_STEPS)
    cpu_ms, faults = steps(measured_steps)
    result = {"cpu_ms_per_step": cpu_ms, "faults_per_step": faults}
    if handle is not None:
        handle.flush(30.0)
        status = handle.status()
        result.update(spans_exported=status["exported"], spans_lost=sum(status["lost"].values()))
        handle.shutdown(10.0)
    return result


def _spread(by_pair: list[float]) -> str:
    if not by_pair:
        return f"no single pair of blocks {MIN_FAULT_DIFFERENCE} faults a step apart"
    return f"by pair of blocks {min(by_pair):.2f} to {max(by_pair):.2f}"


def run_child(arguments: list[str], allocator: str) -> dict:
    output = subprocess.run([sys.executable, __file__, *arguments], check=True, stdout=subprocess.PIPE, text=True,
                            env=allocator_environment(allocator, os.environ)).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=6, help="fresh processes per allocator and arm")
    parser.add_argument("--steps", type=int, default=60, help="measured steps per process, after a warm-up of 30")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", choices=("fault-cost", "off", "on"), help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1 or args.steps < 1:
        parser.error("--processes and --steps must be at least 1")
    if args.child:
        result = (fault_cost(args.hidden, args.batch_size) if args.child == "fault-cost"
                  else one_process(args.child, args.endpoint, args.hidden, args.batch_size, args.steps))
        print(json.dumps(result))
        return 0

    from overhead import WORKLOADS  # the loop workload's sizes; imported here, never in the measured children

    loop = next(workload for workload in WORKLOADS if workload.world_size == 1)
    sizes = ["--hidden", str(loop.hidden), "--batch-size", str(loop.batch_size)]
    cost = run_child(["--child", "fault-cost", *sizes], "glibc-default")
    combinations = [(allocator, arm) for allocator in ALLOCATORS for arm in ("off", "on")]
    processes: dict[tuple[str, str], list[dict]] = {combination: [] for combination in combinations}
    with detector_in_this_process("page-faults-") as endpoint:
        for index in range(args.processes):
            for allocator, arm in (combinations if index % 2 == 0 else combinations[::-1]):
                processes[(allocator, arm)].append(run_child(
                    ["--child", arm, "--endpoint", endpoint, "--steps", str(args.steps), *sizes], allocator))
            print(f"processes {index + 1}/{args.processes} of each done", flush=True)

    report = {**measured_on(), "fault_cost": cost, "steps": args.steps,
              "processes": {f"{allocator}/{arm}": values for (allocator, arm), values in processes.items()}}
    print(f"\npage faults of the training thread — {describe(report)}")
    print(f"\ncost per fault, {BLOCK_PAIRS} pairs of {BLOCK_STEPS}-step blocks in one process, library off:"
          f" {cost['us_per_fault']:.2f} µs ({_spread(cost['us_per_fault_by_pair'])});"
          f" faulting settings {cost['faulting']['faults_per_step']:.0f} faults and {cost['faulting']['cpu_ms_per_step']:.2f} ms"
          f" a step, kept {cost['kept']['faults_per_step']:.0f} and {cost['kept']['cpu_ms_per_step']:.2f} ms")
    print(f"\n{args.processes} fresh processes each, {args.steps} steps after {WARMUP_STEPS} of warm-up:")
    print(f"{'allocator':15} {'arm':4} {'faults/step min':>16} {'median':>8} {'max':>8} {'ms of faults/step max':>22}"
          f" {'CPU ms/step median':>19}")
    for (allocator, arm), values in processes.items():
        faults = sorted(value["faults_per_step"] for value in values)
        print(f"{allocator:15} {arm:4} {faults[0]:16.1f} {statistics.median(faults):8.1f} {faults[-1]:8.1f}"
              f" {faults[-1] * cost['us_per_fault'] / 1e3:22.2f}"
              f" {statistics.median(value['cpu_ms_per_step'] for value in values):19.2f}")
    on = [value for (_, arm), values in processes.items() if arm == "on" for value in values]
    print(f"\nON processes: spans exported {sum(value['spans_exported'] for value in on)},"
          f" lost {sum(value['spans_lost'] for value in on)}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
