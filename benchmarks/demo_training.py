"""The demo job's training loop, run arm by arm, reporting what the overhead benchmark and the
training-equivalence tests look at: host time of each step, the loss of each step, a sha256 of
every tensor of the final model and optimizer state, CPU time by thread, and optionally how
often a device sync or a collective was called.

    python benchmarks/demo_training.py --schedule off,on --steps 20 --out DIR [--world-size 4]
        [--warmup 0 | --warmup 5,5,9,9] [--hidden H] [--batch-size B] [--endpoint 127.0.0.1:4317]
        [--protocol grpc | --protocol http/protobuf]
        [--count-calls] [--hot-path-intervals 0]

It mirrors otel_straggler/demo/trainer.py: the same model, data, optimizer, stages and gradient
all-reduce (imported from there), one gloo process per rank started as the demo starts them;
with --world-size 1 it is a single process without the all-reduce stage. The process runs
its schedule of arms in order, each from the same seed, so every arm computes the same numbers:
  off  the library is not configured: ots.step()/ots.stage() are no-ops;
  on   ots.configure(device_timing="fake") exporting over OTLP (--protocol, gRPC as the demo's
       ranks by default) to --endpoint, set up as the demo sets up its ranks
       (OTEL_BSP_SCHEDULE_DELAY=500, no rank metrics); flushed
       (everything built and exported) at the end of the arm, then shut down.
Each rank writes DIR/rank-N.json. Linux only (per-thread CPU clocks).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import functools
import gc
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import otel_straggler as ots
from otel_straggler.demo.launcher import free_port
from otel_straggler.demo import trainer
from otel_straggler.demo.trainer import average_gradients, make_model, synthetic_batches
from thread_cpu import thread_cpu_ns, thread_cpu_since

ARMS = ("off", "on")
# How the demo sets up its ranks' export (otel_straggler/demo/run.py), for the `on` arm.
DEMO_RANK_ENVIRONMENT = {"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                         "OTEL_STRAGGLER_EXPORT_METRICS": "false", "OTEL_SERVICE_NAME": "otel-straggler-overhead"}
SYNC_CALLS = ("synchronize",)
COLLECTIVE_CALLS = ("barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor",
                    "all_gather_object", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
                    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
                    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", required=True, help="arms in the order they run, e.g. off,on,on,off")
    parser.add_argument("--steps", type=int, required=True, help="measured steps per arm")
    parser.add_argument("--warmup", default="0",
                        help="steps per arm run before the measured ones: one number, or one per arm (comma-separated)")
    parser.add_argument("--out", type=Path, required=True, help="folder for rank-N.json")
    parser.add_argument("--world-size", type=int, default=1)
    demo = trainer.parse_args([])  # the demo job's own defaults
    parser.add_argument("--hidden", type=int, default=demo.hidden)
    parser.add_argument("--batch-size", type=int, default=demo.batch_size)
    parser.add_argument("--seed", type=int, default=demo.seed)
    parser.add_argument("--endpoint", default="127.0.0.1:4317", help="OTLP endpoint (host:port) of the `on` arm")
    parser.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc",
                        help="the `on` arm's OTLP protocol (default: grpc, as the demo's ranks)")
    parser.add_argument("--job-prefix", default="demo-training", help="the `on` arm's job id is PREFIX-armN")
    parser.add_argument("--count-calls", action="store_true", help="count device syncs and collectives per arm")
    parser.add_argument("--hot-path-intervals", type=int, default=0,
                        help="after the arms, time this many start/stop intervals (benchmarks/hot_path.py)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="launcher: give up on the ranks after this")
    args = parser.parse_args(argv)
    args.schedule = args.schedule.split(",")
    try:
        warmups = [int(steps) for steps in args.warmup.split(",")]
    except ValueError:
        parser.error(f"--warmup: {args.warmup!r} is not a number or a comma-separated list of numbers")
    if len(warmups) not in (1, len(args.schedule)) or min(warmups) < 0:
        parser.error(f"--warmup: give one count of steps (>= 0), or one per arm of --schedule ({len(args.schedule)})")
    args.warmups = warmups * len(args.schedule) if len(warmups) == 1 else warmups
    unknown = set(args.schedule) - set(ARMS)
    if unknown:
        parser.error(f"--schedule: unknown arms {sorted(unknown)}; use {', '.join(ARMS)}")
    return args


# -- what a rank measures ------------------------------------------------------------------------

def gc_collections() -> list[int]:
    return [generation["collections"] for generation in gc.get_stats()]


def state_sha256(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of the bytes of every tensor of the model's state dict and the optimizer's state."""
    tensors = dict(model.state_dict())
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optimizer.{index}.{key}": value for key, value in state.items()
                        if isinstance(value, torch.Tensor)})
    return {name: hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for name, tensor in tensors.items()}


class CallCounter:
    """Counts calls of torch.cuda's synchronizing functions and of every torch.distributed
    collective, whoever calls them (training code or the library's threads)."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self._install(torch.cuda, SYNC_CALLS, "torch.cuda")
        for owner in (torch.cuda.Event, torch.cuda.Stream):
            self._install(owner, SYNC_CALLS, f"torch.cuda.{owner.__name__}")
        # the same functions are reachable under both modules: wrap once, install in both
        c10d = dist.distributed_c10d
        for name in COLLECTIVE_CALLS:
            if hasattr(c10d, name):
                counted = self._counted(getattr(c10d, name), f"torch.distributed.{name}")
                setattr(c10d, name, counted)
                setattr(dist, name, counted)

    def _install(self, owner, names: tuple[str, ...], prefix: str) -> None:
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, self._counted(getattr(owner, name), f"{prefix}.{name}"))

    def _counted(self, function: Callable, label: str) -> Callable:
        @functools.wraps(function)
        def counted(*args, **kwargs):
            self.calls[label] += 1
            return function(*args, **kwargs)

        return counted


# -- one rank ------------------------------------------------------------------------------------

class Training:
    """Model, optimizer and data of one arm, made from the seed as the demo trainer makes them."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        torch.manual_seed(args.seed)  # same initial weights on every rank and in every arm
        self.model = make_model(args.hidden)
        self.parameters = list(self.model.parameters())
        self.optimizer = torch.optim.SGD(self.parameters, lr=0.05, momentum=0.9)
        self.batches = synthetic_batches(args.seed, rank, args.batch_size)
        self.batch_size = args.batch_size
        self.world_size = args.world_size

    def step(self, n: int) -> float:
        """One optimizer step, staged as the demo trainer stages it; returns the loss."""
        ots.step(n, samples=self.batch_size)
        with ots.stage("batch-generator"):
            inputs, labels = next(self.batches)
        with ots.stage("forward-compute"):
            loss = F.cross_entropy(self.model(inputs), labels)
        with ots.stage("backward-compute"):
            self.optimizer.zero_grad()
            loss.backward()
        if self.world_size > 1:
            with ots.stage("all-grads-sync", collective=True):
                average_gradients(self.parameters, self.world_size)
        with ots.stage("optimizer"):
            self.optimizer.step()
        return loss.item()


def run_arm(args: argparse.Namespace, rank: int, arm: str, index: int, counter: Optional[CallCounter]) -> dict:
    calls_before = collections.Counter(counter.calls) if counter else None
    process_before_arm = time.process_time_ns()
    handle = (ots.configure(job_id=f"{args.job_prefix}-arm{index}", rank=rank, world_size=args.world_size,
                            device_timing="fake") if arm == "on" else None)
    training = Training(args, rank)
    losses, step_seconds = [], []
    warmup = args.warmups[index]
    for n in range(warmup + args.steps):
        if n == warmup:
            threads_before, process_before, main_before = thread_cpu_ns(), time.process_time_ns(), time.thread_time_ns()
            usage_before = resource.getrusage(resource.RUSAGE_THREAD)
            collections_before = gc_collections()
        started = time.perf_counter()
        losses.append(training.step(n))
        step_seconds.append(time.perf_counter() - started)
    main_cpu_ns = time.thread_time_ns() - main_before
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    status = None
    if handle is not None:
        handle.flush(60.0)  # whatever the measured steps left to build and export is counted below
        status = handle.status()
    threads, process_after, collections_after = thread_cpu_since(threads_before), time.process_time_ns(), gc_collections()
    if handle is not None:
        handle.shutdown(30.0)
    record = {
        "arm": arm, "index": index, "rank": rank,
        "step_s": step_seconds[warmup:], "warmup_step_s": step_seconds[:warmup],
        "losses": losses, "state_sha256": state_sha256(training.model, training.optimizer),
        # CPU over the measured steps and the final flush; threads that ended meanwhile are in
        # the process's figure only
        "training_thread_cpu_ns": main_cpu_ns,
        # minor page faults of the training thread's steps: memory the allocator gave back to the
        # OS and took again (1.4-1.7 us each on the 2-core VM; docs/overhead.md)
        "training_thread_page_faults": usage.ru_minflt - usage_before.ru_minflt,
        # how often the training thread blocked (for the GIL, a collective, a lock) and how often
        # it was preempted (a core wanted by another thread)
        "training_thread_context_switches": {"voluntary": usage.ru_nvcsw - usage_before.ru_nvcsw,
                                             "involuntary": usage.ru_nivcsw - usage_before.ru_nivcsw},
        "process_cpu_ns": process_after - process_before,
        "thread_cpu_ns": threads,
        # garbage collections by generation: a full one (2) stops every thread of the process
        "gc_collections": [after - before for after, before in zip(collections_after, collections_before)],
        # the whole arm, configure() and warm-up included
        "arm_process_cpu_ns": process_after - process_before_arm,
        "status": status,
    }
    if counter is not None:
        record["calls"] = dict(counter.calls - calls_before)
    return record


def hot_path(intervals: int) -> dict:
    """The training thread's cost of one interval with fake device events, and the builder's
    cost per span, from benchmarks/hot_path.py; median of three rounds."""
    import hot_path as bench

    run = bench.instrumented_arm(bench.stage_loop, device=True)
    rounds = [run(intervals, min(intervals, 1000)) for _ in range(3)]
    return {"ns_per_interval": sorted(ns for ns, _ in rounds)[1],
            "background_ns_per_span": sorted(background for _, background in rounds)[1],
            "intervals": intervals, "rounds": 3}


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores, as in the demo trainer
    rank = int(os.environ.get("RANK", "0"))
    if args.world_size > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    os.environ.update({**DEMO_RANK_ENVIRONMENT, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{args.endpoint}",
                       "OTEL_EXPORTER_OTLP_PROTOCOL": args.protocol})
    counter = CallCounter() if args.count_calls else None
    arms = []
    for index, arm in enumerate(args.schedule):
        if args.world_size > 1:
            dist.barrier()  # every rank starts the arm together; outside the counted and timed part
        arms.append(run_arm(args, rank, arm, index, counter))
    result = {"rank": rank, "world_size": args.world_size, "arms": arms,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.hot_path_intervals:
        result["hot_path"] = hot_path(args.hot_path_intervals)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{rank}.json").write_text(json.dumps(result))
    if args.world_size > 1:
        dist.destroy_process_group()


# -- launcher ------------------------------------------------------------------------------------

def launch(argv: list[str], world_size: int, timeout_s: float, log_dir: Path) -> None:
    """Starts one process per rank as the demo's launcher does (RANK / WORLD_SIZE / MASTER_*
    set) and waits for all of them; raises RuntimeError naming a failed rank."""
    log_dir.mkdir(parents=True, exist_ok=True)
    common = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"}
    processes = []
    for rank in range(world_size):
        with (log_dir / f"rank-{rank}.log").open("w") as log:
            process = subprocess.Popen([sys.executable, __file__, *argv],
                                       env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        processes.append(process)
    deadline = time.monotonic() + timeout_s
    try:
        for rank, process in enumerate(processes):
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                tail = (log_dir / f"rank-{rank}.log").read_text()[-2000:]
                raise RuntimeError(f"rank {rank} exited with code {code}; its log ends with:\n{tail}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.world_size > 1 and "RANK" not in os.environ:
        launch(argv, args.world_size, args.timeout_s, args.out / "logs")
    else:
        rank_main(args)


if __name__ == "__main__":
    main()
