"""CPU of an idle detector, by thread, against the cost of one thread polling every 0.1 s.

    python benchmarks/detector_idle.py [--seconds 10] [--json detector_idle.json]

A detector mostly waits: between a job's exports, and for good between jobs. What it spends then
is wake-ups, and on a VM a wake-up is not free. The reference, measured in the same run: a thread
that does nothing but `time.sleep(0.1)`, i.e. the cost of polling ten times a second. The detector
runs as `otel-straggler detect` runs it (gRPC and HTTP receivers, engine and emitter threads,
status.json every second), without OTLP export of its own metrics.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from measured_on import describe, measured_on
from thread_cpu import thread_cpu_ns, thread_cpu_since

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.service import DetectorService

POLL_INTERVAL_S = 0.1


def cpu_by_thread(seconds: float) -> dict[str, float]:
    """ms of CPU per second of each thread of this process over `seconds`, by thread name."""
    before, started = thread_cpu_ns(), time.monotonic()
    time.sleep(seconds)
    spent, elapsed = thread_cpu_since(before), time.monotonic() - started
    return {name: cpu / 1e6 / elapsed for name, cpu in spent.items()}


def polling_reference(seconds: float) -> dict[str, float]:
    """CPU of a thread that only sleeps POLL_INTERVAL_S in a loop: per wake-up and per second."""
    result: dict[str, float] = {}

    def poll() -> None:
        wakeups, cpu_before, started = 0, time.thread_time_ns(), time.monotonic()
        while time.monotonic() - started < seconds:
            time.sleep(POLL_INTERVAL_S)
            wakeups += 1
        cpu_ns = time.thread_time_ns() - cpu_before
        result.update(us_per_wakeup=cpu_ns / wakeups / 1e3, ms_per_s=cpu_ns / 1e6 / (time.monotonic() - started))

    thread = threading.Thread(target=poll, name="reference-poller")
    thread.start()
    thread.join()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measurement")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="detector-idle-") as scratch:
        detector = DetectorService(DetectorConfig(grpc_port=0, http_port=0, export_metrics=False,
                                                  evidence_dir=os.path.join(scratch, "evidence")))
        detector.start()
        try:
            time.sleep(2.0)  # past start-up: imports, first status.json
            threads = cpu_by_thread(args.seconds)
        finally:
            detector.stop()
    reference = polling_reference(args.seconds)
    report = {**measured_on(), "seconds": args.seconds, "detector_ms_cpu_per_s": threads,
              "detector_total_ms_cpu_per_s": sum(threads.values()), "reference": reference}
    print(f"\nidle detector, CPU by thread — {describe(report)}, {args.seconds:.0f} s each")
    print(f"\n{'thread':36} {'ms CPU/s':>9}")
    for name, ms in sorted(threads.items(), key=lambda item: -item[1]):
        print(f"{name:36} {ms:9.3f}")
    print(f"{'detector, all threads':36} {report['detector_total_ms_cpu_per_s']:9.3f}")
    print(f"{'reference: one thread polling every 0.1 s':36} {reference['ms_per_s']:9.3f}"
          f"   ({reference['us_per_wakeup']:.0f} µs a wake-up)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
