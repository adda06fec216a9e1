"""CPU the span builder spends per span, alone: records through the real builder, device-timing
processor, batching processor and span encoding, with an export that sends nothing.

    python benchmarks/span_builder_cpu.py [--steps 2000] [--rounds 5] [--writer c|python] [--profile]

Without --writer both writers run, each round in a fresh process, in an order that alternates
round by round, and the table gives the C writer against the Python one (the reference: what a rank
without a C compiler runs) from the same run.

A loop records a step and four stages (5 spans a step, fake device events that are complete at
once) with the builder thread idle (a build interval of a minute), then this thread builds them
all, timed with its own CPU clock (time.thread_time_ns): what the builder thread spends a span,
without the machine's other work or the export. The batching processor's worker encodes and
drops each batch meanwhile, on its own thread (not counted). --profile prints cProfile's view of
one round instead. rank_background.py measures the whole background, over a real export.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time
from typing import Any

STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")


class _DroppingExporter:
    """Encodes as the OTLP exporters do (prewrite on the builder thread, a request on the worker),
    sends nothing."""

    prewrite_many: Any

    def __init__(self) -> None:
        from otel_straggler.instrumentation.span_encoding import SpanEncoder

        self.encoder = SpanEncoder()
        self.prewrite = self.encoder.prewrite
        self.prewrite_many = getattr(self.encoder, "prewrite_many", None)

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.encoder.encode(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _drop(completed, pool) -> None:
    from otel_straggler.instrumentation.hot_path_reference import INTERVAL, START_EVENT

    while completed:
        record = completed.popleft()
        if record[0] == INTERVAL:
            for event in (record[1][START_EVENT], record[3]):
                if event is not None:
                    pool.release(event)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--writer", choices=("c", "python"), help="one writer in this process (default: both, compared)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--record-only", action="store_true",
                        help="drop the records unbuilt (their events back to the pool): the recording's own cost,"
                             " for a count of instructions (valgrind) to subtract")
    args = parser.parse_args(argv)
    if args.writer is None and not args.profile and not args.record_only:
        return compare_writers(args.steps, args.rounds)
    os.environ.update({"OTEL_BSP_MAX_QUEUE_SIZE": str(10 * (args.steps * 5 + 64)),
                       "OTEL_STRAGGLER_EXPORT_METRICS": "false"})
    import otel_straggler as ots
    from otel_straggler.instrumentation import rank_pipeline, span_encoding

    if args.writer == "python":
        span_encoding._write_span, span_encoding._join = None, b"".join
    rank_pipeline.span_exporter = lambda endpoint, protocol, environ: _DroppingExporter()
    handle = ots.configure(job_id="span-builder-cpu", rank=0, world_size=1, endpoint="http://127.0.0.1:9",
                           device_timing="fake", build_interval_ms=60_000, heartbeat_interval_ms=0,
                           no_stage_warning_s=0, queue_size=args.steps * 5 + 64,
                           event_pool_size=args.steps * 8 + 64)
    pipeline = handle._pipeline
    step = 0
    per_span_us = []
    for round_number in range(args.rounds + 1):  # the first round: a warm-up
        for _ in range(args.steps):
            ots.step(step, samples=256)
            for name in STAGES:
                with ots.stage(name):
                    pass
            step += 1
        records = len(handle.recorder.completed)
        profile = cProfile.Profile(time.thread_time) if args.profile and round_number == 1 else None
        before = time.thread_time_ns()
        if profile is not None:
            profile.enable()
        if args.record_only:
            _drop(handle.recorder.completed, pipeline.event_pool)
        else:
            pipeline._build()
        if profile is not None:
            profile.disable()
        spent = time.thread_time_ns() - before
        if round_number:
            per_span_us.append(spent / records / 1e3)
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        handle.flush(30.0)
    status = handle.status()
    handle.shutdown(10.0)
    if args.record_only:
        print(f"recorded only: {status['device_timed']} device timed, {status['spans_built']} built")
        return 0
    lost = sum(status["lost"].values())
    print(f"span builder, {args.writer or 'c'} writer: {statistics.median(per_span_us):.2f} µs/span median of {args.rounds}"
          f" (min {min(per_span_us):.2f}, max {max(per_span_us):.2f}); {args.steps * 5} spans a round;"
          f" device_timed {status['device_timed']}, lost {lost}")
    return 0


def compare_writers(steps: int, rounds: int) -> int:
    """Each writer a round at a time in a fresh process (one round after a warm-up), alternating."""
    figures: dict[str, list[float]] = {"c": [], "python": []}
    for round_number in range(rounds):
        order = ("c", "python") if round_number % 2 == 0 else ("python", "c")
        for writer in order:
            out = subprocess.run([sys.executable, __file__, "--writer", writer, "--steps", str(steps), "--rounds", "1"],
                                 capture_output=True, text=True, check=True).stdout
            figures[writer].append(float(out.split(": ")[1].split(" ")[0]))
    print(f"span builder CPU per span, {rounds} rounds x {steps * 5} spans, a fresh process per writer and round")
    print(f"{'writer':<16} {'median µs/span':>15} {'min':>7} {'max':>7} {'vs Python':>10}")
    reference = statistics.median(figures["python"])
    for writer, title in (("c", "C writer"), ("python", "Python writer")):
        values = figures[writer]
        print(f"{title:<16} {statistics.median(values):>15.2f} {min(values):>7.2f} {max(values):>7.2f}"
              f" {statistics.median(values) / reference:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
