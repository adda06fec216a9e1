"""Training-thread cost of one interval (start + stop), against a plain OTel SDK span.

    python benchmarks/hot_path.py [--intervals 100000] [--rounds 7] [--drain-every 1000] [--json out.json]

Arms, measured in the same run and interleaved round by round (the machine is noisy):
  stage() host-only       `with ots.stage(name):` with device timing off
  Megatron timer          `timers(name).start(); .stop()` with device timing off
  stage() fake events     the CUDA-event path on the CPU fake backend (pool record + stop)
  plain SDK span          `tracer.start_span(name).end()` on a TracerProvider with a
                          BatchSpanProcessor feeding a no-op exporter (the reference)
The timed loop runs in chunks of --drain-every intervals. During a chunk the background builder
is held back (a long build interval and a queue that holds every interval), so the figure is the
training thread's own cost; between chunks, untimed, the builder drains the queue, as it does
once per build interval in a job (1,000 intervals is one second of a job recording 1,000 a
second). The builder's cost per span is timed separately ("background" column). The SDK arm is
chunked the same way, its BatchSpanProcessor flushed between chunks. A queue never drained would
keep every record alive and let the garbage collector's passes over them dominate: the
"undrained" column times one unchunked loop of the same length, for comparison. A second part sends a 1,000,000-interval burst
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
from typing import Optional

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import otel_straggler as ots
from otel_straggler.instrumentation import hot_path
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


def time_loop(body, intervals: int, chunk: int, drain) -> float:
    """ns per interval of `body(n)`, which runs n intervals: `intervals` of them in chunks of
    `chunk`, with `drain()` run untimed after each chunk."""
    gc.collect()
    elapsed = 0
    for done in range(0, intervals, chunk):
        count = min(chunk, intervals - done)
        start = time.perf_counter_ns()
        body(count)
        elapsed += time.perf_counter_ns() - start
        drain()
    return elapsed / intervals


STAGES_PER_STEP = 64  # a step mark every 64 intervals: the step's share is counted, but small


def stage_loop(count: int) -> None:
    stage, step = ots.stage, ots.step
    for number, first in enumerate(range(0, count, STAGES_PER_STEP)):
        step(number, tokens=4096)
        for _ in range(min(STAGES_PER_STEP, count - first)):
            with stage("forward-compute"):
                pass


def timer_loop(count: int) -> None:
    timer, step = ots.timers("forward-compute"), ots.step
    for number, first in enumerate(range(0, count, STAGES_PER_STEP)):
        step(number, tokens=4096)
        for _ in range(min(STAGES_PER_STEP, count - first)):
            timer.start()
            timer.stop()


def configure(device: bool, events=None):
    """`events`: the device-event backend when `device` (default: the CPU fake, auto-completing)."""
    provider = TracerProvider()
    batch = BatchSpanProcessor(NoOpExporter(), max_queue_size=65536)
    processor = None
    if device:
        processor = CudaEventSpanProcessor(batch, events if events is not None else FakeDeviceEvents(auto_complete=True))
        provider.add_span_processor(processor)
    else:
        provider.add_span_processor(batch)
    handle = ots.configure(job_id="bench", rank=0, world_size=1, tracer_provider=provider,
                           device_processor=processor, device_timing="off", export_metrics=False,
                           build_interval_ms=60_000, queue_size=1 << 22)
    return handle


def instrumented_arm(loop, device: bool, events_factory=None, statuses: Optional[list] = None):
    """`events_factory`: makes the device-event backend of each run (benchmarks/gpu_check.py
    passes the real CUDA one); default, the fake. `statuses`: each run's handle.status() is
    appended there, for a caller that checks what was timed and lost."""
    def run(count: int, chunk: int) -> tuple[float, float]:
        handle = configure(device, events_factory() if events_factory else None)
        try:
            ots.step(0)
            loop(1000)  # warm-up, and the event pool is made at the first step
            handle.flush(60.0)
            background_ns = 0

            def drain() -> None:  # the builder's and exporter's share, paid off the training thread
                nonlocal background_ns
                started = time.perf_counter_ns()
                handle.flush(120.0)
                background_ns += time.perf_counter_ns() - started

            per_interval = time_loop(loop, count, chunk, drain)
            if statuses is not None:
                statuses.append(handle.status())
            return per_interval, background_ns / count
        finally:
            handle.shutdown(10.0)

    return run


def sdk_span_arm(count: int, chunk: int) -> tuple[float, None]:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(NoOpExporter(), max_queue_size=65536))
    tracer = provider.get_tracer("bench")

    def body(n: int) -> None:
        for _ in range(n):
            tracer.start_span("forward-compute").end()

    body(1000)
    provider.force_flush()
    try:
        return time_loop(body, count, chunk, provider.force_flush), None
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
        handle.flush(5.0)  # bounded: the builder drains the queue into the exporter's, which cannot send
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
    parser.add_argument("--drain-every", type=int, default=1000,
                        help="intervals per timed chunk; the queue is drained, untimed, between chunks")
    parser.add_argument("--burst", type=int, default=1_000_000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    arms = {
        "stage() host-only": instrumented_arm(stage_loop, device=False),
        "Megatron timer host-only": instrumented_arm(timer_loop, device=False),
        "stage() fake CUDA events": instrumented_arm(stage_loop, device=True),
        "plain OTel SDK span (reference)": sdk_span_arm,
    }
    drained = {name: [] for name in arms}
    undrained = {name: [] for name in arms}
    background = {name: [] for name in arms}
    for round_index in range(args.rounds):
        order = list(arms) if round_index % 2 == 0 else list(reversed(arms))
        for name in order:
            per_interval, background_ns = arms[name](args.intervals, args.drain_every)
            drained[name].append(per_interval)
            if background_ns is not None:
                background[name].append(background_ns)
            undrained[name].append(arms[name](args.intervals, args.intervals)[0])
    reference = statistics.median(drained["plain OTel SDK span (reference)"])

    print(f"hot path, ns per interval (start+stop), median of {args.rounds} rounds x {args.intervals} intervals"
          f" drained every {args.drain_every}, python {sys.version.split()[0]}, hot path in {hot_path.IMPLEMENTATION}")
    print(f"{'arm':34} {'median ns':>10} {'min ns':>10} {'max ns':>10} {'x cheaper than SDK span':>24}"
          f" {'background ns':>14} {'undrained ns':>13}")
    results = {}
    for name, values in drained.items():
        median = statistics.median(values)
        background_ns = statistics.median(background[name]) if background[name] else None
        undrained_ns = statistics.median(undrained[name])
        results[name] = {"median_ns": median, "min_ns": min(values), "max_ns": max(values),
                         "sdk_span_over_this": reference / median, "background_ns_per_span": background_ns,
                         "undrained_median_ns": undrained_ns}
        background_text = f"{background_ns:14.0f}" if background_ns is not None else f"{'-':>14}"
        print(f"{name:34} {median:10.0f} {min(values):10.0f} {max(values):10.0f} {reference / median:24.1f}"
              f" {background_text} {undrained_ns:13.0f}")

    burst_result = burst(args.burst)
    print(f"\nburst of {burst_result['intervals']:,} intervals, exporter unreachable:"
          f" RSS {burst_result['rss_before_mib']} -> peak {burst_result['rss_peak_mib']} MiB,"
          f" queue bound {burst_result['queue_size']:,}, spans built {burst_result['spans_built']:,},"
          f" lost {burst_result['lost']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"hot_path": hot_path.IMPLEMENTATION, "arms": results, "burst": burst_result}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
