"""The benchmarks in one table: what each measures, how long a default run takes, and the short
settings `make bench-all` runs it with.

    python benchmarks/catalog.py                  # the list (`make bench`)
    python benchmarks/catalog.py run NAME [ARGS]  # one, with its arguments (`make bench NAME=x ARGS=...`)
    python benchmarks/catalog.py all              # every CPU benchmark in turn, short settings (`make bench-all`)

A default run is described by the time the docs record for it (docs/overhead.md, docs/pipeline.md,
docs/detector.md), or else by its size. The short settings check that a benchmark still runs;
their figures are too small to quote. The modules not listed are what the benchmarks share
(HELPERS) or the training jobs they start (HARNESSES).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    name: str  # benchmarks/<name>.py
    measures: str
    default_run: str  # how long `python benchmarks/<name>.py` takes, or how much it runs
    short: Optional[str]  # the arguments of its short run in `all` (split on spaces); None: not run there
    needs: str = "CPU"  # CPU, GPU, valgrind, or services (scripts/services.sh build)


CATALOG = (
    Benchmark("hot_path", "training-thread cost of one interval, against a plain OTel SDK span",
              "7 rounds x 4 arms x 100,000 intervals", "--intervals 5000 --rounds 3 --burst 20000"),
    Benchmark("hot_path_in_situ", "the hot path inside a training loop (cold caches) against a tight loop",
              "4 rounds x 6 arms x 300 steps", "--rounds 1 --steps 40 --warmup 10 --hidden 256 --batch-size 64"),
    Benchmark("automatic_cost", "training-thread cost per step of the automatic (zero-code) stages",
              "12 rounds x 3 arms x 2 models", "--rounds 2 --models tiny"),
    Benchmark("launch_bound", "overhead on a launch-bound loop's CPU proxy, paired ON/OFF",
              "20 pairs x 2 arms x 300 steps", "--pairs 2 --steps 30 --warmup 10 --step-ops 2000"),
    Benchmark("rank_background", "CPU of the rank's background threads per span, by writer and protocol",
              "5 rounds x 6 arms x 1,500 steps", "--rounds 1 --steps 200"),
    Benchmark("span_builder_cpu", "CPU of the span builder thread alone per span, C writer against Python",
              "5 rounds x 2 writers x 10,000 spans", "--rounds 1 --steps 200"),
    Benchmark("export_transport", "CPU per OTLP export, by transport, same encoded request",
              "3 rounds x 4 arms, 20 sends 0.5 s apart", "--requests 20 --paced 2"),
    Benchmark("page_faults", "the allocator's page faults in a CPU training step and what one costs",
              "6 x 4 fresh processes x 60 steps", "--processes 2 --steps 10"),
    Benchmark("overhead", "training overhead ON against OFF, paired runs, two workloads",
              "about 1 h 30 min", "--quick"),
    Benchmark("engine_throughput", "engine observations per second on one core, and peak memory",
              "5 rounds at 1,024 ranks; 10,000 ranks",
              "--ranks 64 --steps 20 --rounds 1 --memory-ranks 64 --memory-steps 10"),
    Benchmark("detector_throughput", "OTLP requests to verdicts, spans per second on one core, and peak memory",
              "about five minutes", "--ranks 64 --steps 20 --rounds 1 --memory-ranks 64 --memory-steps 10"),
    Benchmark("detector_instructions", "instructions per span of the same work under valgrind, against parse only: "
              "decides small changes on a noisy machine", "about 3 minutes", "--ranks 64 --steps 20",
              needs="valgrind"),
    Benchmark("detector_idle", "CPU of an idle detector by thread, against one thread polling every 0.1 s",
              "22 s (2 + 10 + 10 s of waiting)", "--seconds 2"),
    Benchmark("late_spans", "spans that reach the detector after their window was judged, by step time and schedule",
              "6 cases x 20 s, about 3 minutes", "--seconds 2 --cases 5:500:1"),
    Benchmark("hostile", "legitimate exports served while hostile clients attack the detector",
              "5 phases x 8 s, then the engine cases", "--seconds 2"),
    Benchmark("detection_rates", "false positives and detection of the rules on seeded synthetic jobs",
              "10 seeds x 60 windows, 64 and 256 ranks", "--seeds 1 --windows 30 --ranks 16 --large-ranks 32"),
    Benchmark("field_precision", "who is flagged in real 4-rank gloo DDP jobs with one slow rank",
              "160 jobs (16 scenarios x 10)", "--runs 1 --steps 40 --from-step 20 --scenarios forward"),
    Benchmark("field_zero_code", "the same under opentelemetry-instrument and the framework callbacks",
              "320 jobs (4 paths x 8 x 10)", "--runs 1 --steps 40 --from-step 20 --paths plain --scenarios forward"),
    Benchmark("alert_latency", "evidence to a firing Prometheus alert through the real gateway and detector",
              "about 6 minutes", "--quick", needs="services"),
    Benchmark("gpu_check", "the checks that need a GPU: CUDA events, syncs, equivalence, overhead",
              "about 2 minutes on one GPU", None, needs="GPU"),
)
# imported by the benchmarks, not run on their own
HELPERS = ("allocators", "catalog", "detector_process", "measured_on", "paired_protocol", "thread_cpu")
# the training jobs benchmarks start (demo_training.py by overhead.py, field_job.py by field_precision.py)
HARNESSES = ("demo_training", "field_job")


def by_name(name: str) -> Benchmark:
    for benchmark in CATALOG:
        if benchmark.name == name:
            return benchmark
    raise SystemExit(f"no benchmark named {name!r}; the benchmarks: {', '.join(b.name for b in CATALOG)}")


def listing() -> str:
    width, run_width = max(len(b.name) for b in CATALOG), max(len(b.default_run) for b in CATALOG)
    lines = [f"{'name':<{width}}  {'needs':<8}  {'default run':<{run_width}}  measures"]
    lines += [f"{b.name:<{width}}  {b.needs:<8}  {b.default_run:<{run_width}}  {b.measures}" for b in CATALOG]
    lines += ["", "make bench NAME=hot_path ARGS='--rounds 3'   runs one (python benchmarks/NAME.py ARGS)",
              "make bench-all                               runs each CPU one with short settings, in turn"]
    return "\n".join(lines)


def command(benchmark: Benchmark, arguments: list[str]) -> list[str]:
    return [sys.executable, str(HERE / f"{benchmark.name}.py"), *arguments]


def run_all() -> int:
    """Every benchmark with short settings, one after another (they would disturb each other's
    timings side by side); a failure is reported and the rest still run."""
    failed, took = [], {}
    for benchmark in CATALOG:
        if benchmark.short is None:
            print(f"\n=== {benchmark.name}: needs a {benchmark.needs}, not run here", flush=True)
            continue
        print(f"\n=== {benchmark.name} {benchmark.short}", flush=True)
        started = time.monotonic()
        returncode = subprocess.run(command(benchmark, benchmark.short.split())).returncode
        took[benchmark.name] = time.monotonic() - started
        if returncode != 0:
            failed.append(f"{benchmark.name} (exit {returncode})")
    print("\n" + "\n".join(f"{name:<20} {seconds:7.1f} s" for name, seconds in took.items()))
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=("list", "run", "all"), default="list")
    parser.add_argument("name", nargs="?", help="with run: the benchmark")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="with run: its arguments")
    args = parser.parse_args(argv)
    if args.action == "list":
        print(listing())
        return 0
    if args.action == "all":
        return run_all()
    if not args.name:
        parser.error("run needs the benchmark's name")
    benchmark_command = command(by_name(args.name), args.arguments)
    os.execv(benchmark_command[0], benchmark_command)


if __name__ == "__main__":
    sys.exit(main())
