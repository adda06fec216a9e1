"""CPU the rank's background threads spend per span on the default path, by span writer.

    python benchmarks/rank_background.py [--rounds 5] [--steps 1500] [--json out.json]

A host loop (a step and four stages, 5 spans a step, fake device events, a few ms a step) runs
with `ots.configure()` exporting OTLP/gRPC to a live detector in another process: span
building, device timing, batching, encoding and export, as a rank does by default. It measures
the CPU of every thread but the loop's own, per span, from the process's clock, and each
thread's by name (gRPC's own threads by their kernel names). Arms, each in a fresh process,
alternating round by round (the machine is noisy):
  C writer       spans written by the optional extension _otlp_write (the default where built)
  Python writer  the same encoder with the extension switched off (the reference: it is what a
                 rank installed without a C compiler runs, and what the extension must equal)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from detector_process import DetectorProcess
from thread_cpu import thread_cpu_ns, thread_cpu_since

ARMS = {"C writer": "c", "Python writer": "python"}
STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")
STEP_SLEEP_S = 0.004  # a few ms a step, so that no queue overflows and every span is exported


def arm(writer: str, steps: int, endpoint: str) -> dict:
    """One arm, run in this process (a fresh one per arm)."""
    os.environ.update({"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_STRAGGLER_EXPORT_METRICS": "false"})
    import otel_straggler as ots
    from otel_straggler.instrumentation import span_encoding

    if writer == "python":
        span_encoding._write_span = None
    elif not span_encoding.writer_built():
        raise SystemExit("the C writer (otel_straggler.instrumentation._otlp_write) is not built here")
    handle = ots.configure(job_id="rank-background", rank=0, world_size=1, endpoint=f"http://{endpoint}",
                           device_timing="fake")
    for n in range(20):  # warm-up: threads started, the first batch exported
        _step(ots, n)
    handle.flush(30.0)
    threads_before = thread_cpu_ns()
    process_before, main_before = time.process_time_ns(), time.thread_time_ns()
    for n in range(20, 20 + steps):
        _step(ots, n)
    handle.flush(60.0)  # everything the measured steps produced is built and exported
    background_ns = (time.process_time_ns() - process_before) - (time.thread_time_ns() - main_before)
    threads = thread_cpu_since(threads_before)
    threads.pop(threading.main_thread().name, None)  # the training thread: not background
    status = handle.status()
    handle.shutdown(10.0)
    spans = steps * (1 + len(STAGES))
    return {"background_us_per_span": background_ns / spans / 1e3,
            "threads_us_per_span": {name: ns / spans / 1e3 for name, ns in threads.items()},
            "exported": status["exported"], "lost": sum(status["lost"].values())}


def _step(ots, n: int) -> None:
    ots.step(n, samples=256)
    for name in STAGES:
        with ots.stage(name):
            pass
    time.sleep(STEP_SLEEP_S)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arm", choices=sorted(ARMS.values()), help=argparse.SUPPRESS)  # one arm, in a child
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        print(json.dumps(arm(args.arm, args.steps, args.endpoint)))
        return 0
    results: dict[str, list[dict]] = {label: [] for label in ARMS}
    with tempfile.TemporaryDirectory(prefix="rank-background-") as scratch:
        detector = DetectorProcess(scratch)
        endpoint = detector.endpoint
        try:
            for round_number in range(args.rounds):
                order = list(ARMS) if round_number % 2 == 0 else list(reversed(ARMS))
                for label in order:
                    child = subprocess.run([sys.executable, __file__, "--arm", ARMS[label], "--steps", str(args.steps),
                                            "--endpoint", endpoint], check=True, capture_output=True, text=True)
                    results[label].append(json.loads(child.stdout.strip().splitlines()[-1]))
        finally:
            detector.stop()
    print(f"\nrank background CPU per span: {args.rounds} rounds x {args.steps} steps x {1 + len(STAGES)} spans,"
          f" fake device events, OTLP/gRPC to a live detector; {os.cpu_count()} cores,"
          f" load average {os.getloadavg()[0]:.1f}")
    reference = statistics.median(run["background_us_per_span"] for run in results["Python writer"])
    print(f"\n{'arm':16} {'median µs/span':>15} {'min':>7} {'max':>7} {'vs Python writer':>17}  threads µs/span")
    summary = {}
    for label, runs in results.items():
        per_span = [run["background_us_per_span"] for run in runs]
        median = statistics.median(per_span)
        threads = {name: statistics.median(run["threads_us_per_span"].get(name, 0.0) for run in runs)
                   for name in sorted({name for run in runs for name in run["threads_us_per_span"]})}
        shown = ", ".join(f"{name} {value:.1f}" for name, value in threads.items() if value >= 0.05)
        print(f"{label:16} {median:15.1f} {min(per_span):7.1f} {max(per_span):7.1f} {median / reference:16.2f}x  {shown}")
        summary[label] = {"median_us_per_span": median, "runs": runs, "threads_median_us_per_span": threads}
    lost = sum(run["lost"] for runs in results.values() for run in runs)
    print(f"\nspans lost in all arms: {lost}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
