"""Training-thread cost of one interval (start + stop), against a plain OTel SDK span.

    python benchmarks/hot_path.py [--intervals 100000] [--rounds 7] [--json out.json]

Arms, measured in the same run and interleaved round by round (the machine is noisy):
  stage() host-only       `with ots.stage(name):` with device timing off
  Megatron timer          `timers(name).start(); .stop()` with device timing off
  stage() fake events     the CUDA-event path on the CPU fake backend (pool record + stop)
  plain SDK span          `tracer.start_span(name).end()` on a TracerProvider with a
                          BatchSpanProcessor feeding a no-op exporter (the reference)
During the timed loop the background builder is held back (a long build interval and a queue
that holds every interval), so the figure is the training thread's own cost; the builder's cost
per span, paid on its thread afterwards, is timed separately ("background" column). A second part sends a 1,000,000-interval burst
with the exporter unreachable and reports resident memory and what was counted as lost.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import otel_straggler as ots
from otel_straggler.processors.cuda_event_span_processor import CudaEventSpanProcessor
from otel_straggler.processors.device_events import FakeDeviceEvents


class NoOpExporter(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def time_loop(body, intervals: int) -> float:
    """ns per interval of `body`, which runs `intervals` intervals."""
    gc.collect()
    start = time.perf_counter_ns()
    body(intervals)
    return (time.perf_counter_ns() - start) / intervals


def stage_loop(count: int) -> None:
    stage = ots.stage
    for i in range(count):
        if i % 64 == 0:
            ots.step(i // 64, tokens=4096)
        with stage("forward-compute"):
            pass


def timer_loop(count: int) -> None:
    timer = ots.timers("forward-compute")
    for i in range(count):
        if i % 64 == 0:
            ots.step(i // 64, tokens=4096)
        timer.start()
        timer.stop()


def configure(device: bool):
    provider = TracerProvider()
    batch = BatchSpanProcessor(NoOpExporter(), max_queue_size=65536)
    processor = None
    if device:
        processor = CudaEventSpanProcessor(batch, FakeDeviceEvents(auto_complete=True))
        provider.add_span_processor(processor)
    else:
        provider.add_span_processor(batch)
    handle = ots.configure(job_id="bench", rank=0, world_size=1, tracer_provider=provider,
                           device_processor=processor, device_timing="off", export_metrics=False,
                           build_interval_ms=60_000, queue_size=1 << 22)
    return handle


BACKGROUND_NS: dict = {}


def instrumented_arm(name: str, loop, device: bool):
    def run(count: int) -> float:
        handle = configure(device)
        try:
            ots.step(0)
            loop(1000)  # warm-up, and the event pool is made at the first step
            handle.flush(60.0)
            per_interval = time_loop(loop, count)
            started = time.perf_counter_ns()
            handle.flush(120.0)  # the builder's and exporter's share, paid off the training thread
            BACKGROUND_NS.setdefault(name, []).append((time.perf_counter_ns() - started) / count)
            return per_interval
        finally:
            handle.shutdown(10.0)

    return run


def sdk_span_arm(count: int) -> float:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(NoOpExporter(), max_queue_size=65536))
    tracer = provider.get_tracer("bench")

    def body(n: int) -> None:
        for _ in range(n):
            tracer.start_span("forward-compute").end()

    body(1000)
    try:
        return time_loop(body, count)
    finally:
        provider.shutdown()


def burst(intervals: int) -> dict:
    """The exporter is down (closed port) and training records a burst far beyond every queue."""
    handle = ots.configure(job_id="burst", rank=0, world_size=1, endpoint="127.0.0.1:9", device_timing="off",
                           export_metrics=False)
    before = rss_mib()
    peak = before
    try:
        stage = ots.stage
        for i in range(intervals):
            if i % 1000 == 0:
                ots.step(i // 1000)
                peak = max(peak, rss_mib())
            with stage("forward-compute"):
                pass
        peak = max(peak, rss_mib())
        status = handle.status()
    finally:
        handle.shutdown(2.0)
    return {"intervals": intervals, "rss_before_mib": round(before, 1), "rss_peak_mib": round(peak, 1),
            "queue_size": handle.options["queue_size"], "lost": status["lost"], "spans_built": status["spans_built"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--burst", type=int, default=1_000_000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    arms = {
        "stage() host-only": instrumented_arm("stage() host-only", stage_loop, device=False),
        "Megatron timer host-only": instrumented_arm("Megatron timer host-only", timer_loop, device=False),
        "stage() fake CUDA events": instrumented_arm("stage() fake CUDA events", stage_loop, device=True),
        "plain OTel SDK span (reference)": sdk_span_arm,
    }
    samples = {name: [] for name in arms}
    for round_index in range(args.rounds):
        order = list(arms) if round_index % 2 == 0 else list(reversed(arms))
        for name in order:
            samples[name].append(arms[name](args.intervals))
    reference = statistics.median(samples["plain OTel SDK span (reference)"])

    print(f"hot path, ns per interval (start+stop), median of {args.rounds} rounds x {args.intervals} intervals,"
          f" python {sys.version.split()[0]}")
    print(f"{'arm':34} {'median ns':>10} {'min ns':>10} {'max ns':>10} {'x cheaper than SDK span':>24}"
          f" {'background ns':>14}")
    results = {}
    for name, values in samples.items():
        median = statistics.median(values)
        background = statistics.median(BACKGROUND_NS[name]) if name in BACKGROUND_NS else None
        results[name] = {"median_ns": median, "min_ns": min(values), "max_ns": max(values),
                         "sdk_span_over_this": reference / median, "background_ns_per_span": background}
        background_text = f"{background:14.0f}" if background is not None else f"{'-':>14}"
        print(f"{name:34} {median:10.0f} {min(values):10.0f} {max(values):10.0f} {reference / median:24.1f}"
              f" {background_text}")

    burst_result = burst(args.burst)
    print(f"\nburst of {burst_result['intervals']:,} intervals, exporter unreachable:"
          f" RSS {burst_result['rss_before_mib']} -> peak {burst_result['rss_peak_mib']} MiB,"
          f" queue bound {burst_result['queue_size']:,}, spans built {burst_result['spans_built']:,},"
          f" lost {burst_result['lost']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"arms": results, "burst": burst_result}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
