"""CPU the rank's background threads spend per span, by span writer and OTLP protocol.

    python benchmarks/rank_background.py [--rounds 5] [--steps 1500] [--step-ms 4] [--schedule-delay-ms 500]
                                         [--json out.json]

A host loop (a step and four stages, 5 spans a step, fake device events, --step-ms a step) runs
with `ots.configure()` exporting to a live detector in another process: span building, device
timing, batching, encoding and export, as a rank does. It measures the CPU of every thread but
the loop's own, per span, from the process's clock, and each thread's by name (gRPC's own
threads by their kernel names); and how late the loop's sleep returns each step, which is when a
background thread holding the GIL delays the training thread. Arms, each in a fresh process, in an
order that alternates round by round (the machine is noisy):
  C writer, gRPC       spans written by the optional extension _otlp_write (the default where
                       built), over OTLP/gRPC (the default protocol)
  Python writer, gRPC  the same encoder with the extension (its span writer and its join of a
                       request's bytes) switched off (the reference: it is
                       what a rank installed without a C compiler runs, and what the extension
                       must equal)
  C writer, HTTP       over OTLP/HTTP (one kept-alive connection; no threads of its own)
  Python writer, HTTP  the same, without the extension
  stock, gRPC          the reference: the same spans, built the same way, through the SDK's own
                       BatchSpanProcessor and OTLPSpanExporter (its encoder, its transport)
  stock, HTTP          the same over the SDK's OTLP/HTTP exporter (a requests Session)
Our arms run our batching processor and exporters (batching.py, otlp_exporters.py).
A rank exports every 500 ms by default here (OTEL_BSP_SCHEDULE_DELAY, as the demo's ranks), so
the step time sets how many spans an export carries: at 4 ms about 600; at 75 ms, about a rank's
step in the overhead benchmark's 4-rank job, about 33, where the cost of each export itself shows.
`--schedule-delay-ms 5000` runs every arm at the SDK's default (what a rank gets when
OTEL_BSP_SCHEDULE_DELAY is not set): at 75 ms about 330 spans an export.
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
from measured_on import describe, measured_on
from thread_cpu import thread_cpu_ns, thread_cpu_since

ARMS = {"C writer, gRPC": "c,grpc", "Python writer, gRPC": "python,grpc", "stock, gRPC": "stock,grpc",
        "C writer, HTTP": "c,http/protobuf", "Python writer, HTTP": "python,http/protobuf",
        "stock, HTTP": "stock,http/protobuf"}
REFERENCE = {"grpc": "stock, gRPC", "http/protobuf": "stock, HTTP"}
BUILDER_THREAD = "otel-straggler-span-builder"
STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")


def arm(writer: str, protocol: str, steps: int, step_s: float, endpoints: dict[str, str],
        schedule_delay_ms: int = 500) -> dict:
    """One arm, run in this process (a fresh one per arm)."""
    os.environ.update({"OTEL_BSP_SCHEDULE_DELAY": str(schedule_delay_ms), "OTEL_STRAGGLER_EXPORT_METRICS": "false"})
    import otel_straggler as ots
    from otel_straggler.instrumentation import span_encoding

    if writer == "stock":
        _use_stock_export(protocol, endpoints[protocol])
    elif writer == "python":
        span_encoding._write_span, span_encoding._join = None, b"".join
    elif not span_encoding.writer_built():
        raise SystemExit("the C writer (otel_straggler.instrumentation._otlp_write) is not built here")
    handle = ots.configure(job_id="rank-background", rank=0, world_size=1, endpoint=f"http://{endpoints[protocol]}",
                           protocol=protocol, device_timing="fake")
    for n in range(20):  # warm-up: threads started, the first batch exported
        _step(ots, n, step_s, [])
    handle.flush(30.0)
    threads_before = thread_cpu_ns()
    process_before, main_before = time.process_time_ns(), time.thread_time_ns()
    woke_late_ns: list[int] = []
    for n in range(20, 20 + steps):
        _step(ots, n, step_s, woke_late_ns)
    handle.flush(60.0)  # everything the measured steps produced is built and exported
    background_ns = (time.process_time_ns() - process_before) - (time.thread_time_ns() - main_before)
    threads = thread_cpu_since(threads_before)
    threads.pop(threading.main_thread().name, None)  # the training thread: not background
    status = handle.status()
    handle.shutdown(10.0)
    spans = steps * (1 + len(STAGES))
    woke_late_ns.sort()
    return {"background_us_per_span": background_ns / spans / 1e3,
            "woke_late_us": {"median": statistics.median(woke_late_ns) / 1e3,
                             "p99": woke_late_ns[int(0.99 * (len(woke_late_ns) - 1))] / 1e3,
                             "max": woke_late_ns[-1] / 1e3},
            "threads_us_per_span": {name: ns / spans / 1e3 for name, ns in threads.items()},
            "exported": status["exported"], "lost": sum(status["lost"].values())}


def _use_stock_export(protocol: str, endpoint: str) -> None:
    """The pipeline made with the SDK's BatchSpanProcessor and OTLP span exporter in place of ours
    (the same builder, the same spans, the same counting wrapper around the exporter)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_straggler.instrumentation import rank_pipeline

    class StockBatchSpanProcessor(BatchSpanProcessor):
        dropped_queue_full = unexported_at_shutdown = 0  # what status() reads; the SDK does not count them
        shutdown_deadline = None

        def __init__(self, exporter, environ=None) -> None:
            super().__init__(exporter)

    def stock_exporter(endpoint_given, protocol_given, environ):
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint, insecure=True)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=f"http://{endpoint}/v1/traces")

    rank_pipeline.BatchingSpanProcessor = StockBatchSpanProcessor
    rank_pipeline.span_exporter = stock_exporter


def _step(ots, n: int, step_s: float, woke_late_ns: list[int]) -> None:
    ots.step(n, samples=256)
    for name in STAGES:
        with ots.stage(name):
            pass
    # how much later than asked the sleep returns: the OS's timer slack, plus the wait for the GIL
    # where a background thread holds it (a burst of the builder, an encode), as a training
    # thread waking from a device wait would
    asked = time.perf_counter_ns()
    time.sleep(step_s)
    woke_late_ns.append(time.perf_counter_ns() - asked - int(step_s * 1e9))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--step-ms", type=float, default=4.0,
                        help="the loop's sleep a step (default 4: no queue overflows, every span is exported)")
    parser.add_argument("--schedule-delay-ms", type=int, default=500,
                        help="OTEL_BSP_SCHEDULE_DELAY of every arm (default 500, as the demo's ranks; the SDK's is 5000)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arm", choices=sorted(ARMS.values()), help=argparse.SUPPRESS)  # one arm, in a child
    parser.add_argument("--endpoints", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.schedule_delay_ms <= 0:
        parser.error(f"--schedule-delay-ms must be positive, not {args.schedule_delay_ms}")
    if args.arm:
        writer, protocol = args.arm.split(",")
        print(json.dumps(arm(writer, protocol, args.steps, args.step_ms / 1e3, json.loads(args.endpoints),
                             args.schedule_delay_ms)))
        return 0
    results: dict[str, list[dict]] = {label: [] for label in ARMS}
    with tempfile.TemporaryDirectory(prefix="rank-background-") as scratch:
        detector = DetectorProcess(scratch)
        endpoints = json.dumps({"grpc": detector.endpoint, "http/protobuf": detector.http_endpoint})
        try:
            for round_number in range(args.rounds):
                order = list(ARMS) if round_number % 2 == 0 else list(reversed(ARMS))
                for label in order:
                    child = subprocess.run([sys.executable, __file__, "--arm", ARMS[label], "--steps", str(args.steps),
                                            "--step-ms", str(args.step_ms), "--endpoints", endpoints,
                                            "--schedule-delay-ms", str(args.schedule_delay_ms)],
                                           check=True, capture_output=True, text=True)
                    results[label].append(json.loads(child.stdout.strip().splitlines()[-1]))
        finally:
            detector.stop()
    print(f"\nrank background CPU per span: {args.rounds} rounds x {args.steps} steps x {1 + len(STAGES)} spans,"
          f" {args.step_ms:g} ms a step, an export every {args.schedule_delay_ms} ms at most, fake device events,"
          f" OTLP to a live detector; {describe(measured_on())}")
    print(f"\n{'arm':20} {'median µs/span':>15} {'min':>7} {'max':>7} {'vs stock':>9} {'builder':>8} {'rest':>6}"
          f"  threads µs/span")
    summary = {}
    for label, runs in results.items():
        per_span = [run["background_us_per_span"] for run in runs]
        median = statistics.median(per_span)
        threads = {name: statistics.median(run["threads_us_per_span"].get(name, 0.0) for run in runs)
                   for name in sorted({name for run in runs for name in run["threads_us_per_span"]})}
        summary[label] = {"median_us_per_span": median, "runs": runs, "threads_median_us_per_span": threads}
    for label, runs in results.items():
        median = summary[label]["median_us_per_span"]
        per_span = [run["background_us_per_span"] for run in runs]
        threads = summary[label]["threads_median_us_per_span"]
        builder = threads.get(BUILDER_THREAD, 0.0)
        reference = summary[REFERENCE[ARMS[label].split(",")[1]]]["median_us_per_span"]
        shown = ", ".join(f"{name} {value:.1f}" for name, value in threads.items() if value >= 0.05)
        print(f"{label:20} {median:15.1f} {min(per_span):7.1f} {max(per_span):7.1f} {median / reference:8.2f}x"
              f" {builder:8.1f} {median - builder:6.1f}  {shown}")
    print("\nbuilder: the span builder thread (building spans, and for our arms encoding them as they are"
          " queued); rest: every other background thread (batching, export, gRPC's own)")
    print(f"\n{'arm':20} {'woke late µs: median':>21} {'p99':>7} {'max':>7}")
    for label, runs in results.items():
        late = {key: statistics.median(run["woke_late_us"][key] for run in runs) for key in ("median", "p99", "max")}
        print(f"{label:20} {late['median']:21.0f} {late['p99']:7.0f} {late['max']:7.0f}")
    print("woke late: how much later than asked the loop's sleep returned each step (the OS's timer slack,"
          " plus any wait for the GIL held by a background thread), medians over the rounds")
    for writer in ("C writer", "Python writer"):
        protocols = [summary[f"{writer}, {name}"]["median_us_per_span"] for name in ("HTTP", "gRPC")]
        print(f"{writer}: over HTTP against over gRPC {protocols[0] / protocols[1]:.2f}x")
    lost = sum(run["lost"] for runs in results.values() for run in runs)
    print(f"\nspans lost in all arms: {lost}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
