"""Late spans at fast steps: how many spans reach the detector after their window was judged, by
step time, export schedule and --window-steps.

    python benchmarks/late_spans.py [--ranks 4] [--seconds 20] [--cases 5:500:10:1,20:5000:10:1] [--json out.json]

Each case runs a fresh `otel-straggler detect --window-steps W` (its own process) and R rank
processes. Every rank calls `ots.configure()` (fake device events, OTLP/gRPC, the export schedule
OTEL_BSP_SCHEDULE_DELAY of the case) and runs a host loop of a step and four stages (5 spans a
step) for --seconds in lockstep by the wall clock: step n of every rank starts at the same instant, as the
collectives of synchronous training align them. A case may start the ranks' processes up to S
seconds apart (a job whose ranks come up at different times); they still step together from the
last one's start, as they would after their first collective, but their export timers stay out of
phase. After the last step every rank flushes and exits, and the detector's intake counters say
how many spans came `late` (after their window was judged: counted, never judged).

A case is STEP_MS:DELAY_MS:WINDOW_STEPS[:START_SPREAD_S]. The default cases check the sizing
advice of docs/detector.md ("Fast steps"). A rank holds its spans for up to its 1 s build interval
and then until its batch processor exports: at its schedule, or sooner once a batch of 512 spans
(OTEL_BSP_MAX_EXPORT_BATCH_SIZE) is full. A cohort keeps at most max_open_windows (32) windows
open and closes the oldest early beyond that, so spans come late when 32 x window steps x step time
is shorter than that hold. Here 5 spans a step: 5 ms steps fill a batch in about 0.5 s (a hold
of about 1.5 s at either schedule) and 20 ms steps in about 2 s (about 3 s at the 5 s schedule).
The cases: 5 ms steps with 10- and 2-step windows (1.6 and 0.32 s of open windows) at the demo's
500 ms schedule, 5 ms steps with 10-step windows at the SDK's default 5 s, 20 ms steps with 10- and
2-step windows at 5 s (6.4 and 1.28 s), and 100 ms steps at 5 s with ranks started up to 5 s apart.
The fast cases start the ranks up to 1 s apart, so their export timers are out of phase as a real
job's are.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from detector_process import DetectorProcess
from measured_on import describe, measured_on

STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")
SPANS_PER_STEP = 1 + len(STAGES)
DEFAULT_CASES = "5:500:10:1,5:500:2:1,5:5000:10:1,20:5000:10:1,20:5000:2:1,100:5000:10:5"
SETTLE_S = 3.0  # after the ranks exit: status.json is rewritten once a second


@dataclass(frozen=True)
class Case:
    step_ms: float
    delay_ms: int
    window_steps: int
    start_spread_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Case":
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"a case is STEP_MS:DELAY_MS:WINDOW_STEPS[:START_SPREAD_S], not {text!r}")
        return cls(float(parts[0]), int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) == 4 else 0.0)

    def label(self) -> str:
        spread = f", started up to {self.start_spread_s:g} s apart" if self.start_spread_s else ""
        return f"{self.step_ms:g} ms steps, export every {self.delay_ms} ms, {self.window_steps}-step windows{spread}"


def rank_main(rank: int, world_size: int, endpoint: str, steps: int, step_s: float, first_step_at: float) -> int:
    """One rank, in a child process whose environment carries the case's export schedule."""
    import otel_straggler as ots

    handle = ots.configure(job_id="late-spans", rank=rank, world_size=world_size, endpoint=f"http://{endpoint}",
                           protocol="grpc", device_timing="fake")
    stage_s = step_s / (len(STAGES) + 1)  # the rest of the step is outside any stage, as a collective's wait
    for n in range(steps):
        step_start = first_step_at + n * step_s
        _sleep_until(step_start)
        ots.step(n, samples=64)
        for index, name in enumerate(STAGES):
            with ots.stage(name):
                _sleep_until(step_start + (index + 1) * stage_s)
    handle.flush(30.0)
    status = handle.status()
    handle.shutdown(10.0)
    print(json.dumps({"exported": status["exported"], "lost": sum(status["lost"].values())}), flush=True)
    return 0


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.time()
    if delay > 0:
        time.sleep(delay)


def run_case(case: Case, ranks: int, seconds: float) -> dict:
    steps = max(1, round(seconds * 1e3 / case.step_ms))
    with tempfile.TemporaryDirectory(prefix="late-spans-") as scratch:
        detector = DetectorProcess(scratch, "--window-steps", str(case.window_steps))
        try:
            start = time.time() + 2.0  # time for the first process to start
            first_step_at = start + case.start_spread_s + 3.0  # every rank configured, whatever its start
            children = []
            for rank in range(ranks):
                _sleep_until(start + (case.start_spread_s * rank / max(1, ranks - 1)))
                env = dict(os.environ, OTEL_BSP_SCHEDULE_DELAY=str(case.delay_ms),
                           OTEL_STRAGGLER_EXPORT_METRICS="false")
                children.append(subprocess.Popen(
                    [sys.executable, __file__, "--rank", str(rank), "--ranks", str(ranks), "--steps", str(steps),
                     "--step-s", repr(case.step_ms / 1e3), "--first-step-at", repr(first_step_at),
                     "--endpoint", detector.endpoint],
                    env=env, stdout=subprocess.PIPE, text=True))
            reports = []
            for child in children:
                out, _ = child.communicate(timeout=first_step_at - time.time() + steps * case.step_ms / 1e3 + 120)
                if child.returncode != 0:
                    raise RuntimeError(f"a rank exited with {child.returncode}")
                reports.append(json.loads(out.strip().splitlines()[-1]))
            time.sleep(SETTLE_S)
            intake = detector.spans()
        finally:
            detector.stop()
    sent = ranks * steps * SPANS_PER_STEP
    return {"case": case.__dict__, "label": case.label(), "steps": steps, "sent": sent,
            "exported": sum(report["exported"] for report in reports),
            "lost_at_ranks": sum(report["lost"] for report in reports),
            "late": intake.get("late", 0), "accepted": intake.get("accepted", 0)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0, help="training time per case (default: %(default)s)")
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="comma-separated STEP_MS:DELAY_MS:WINDOW_STEPS[:START_SPREAD_S] (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # one rank, in a child
    parser.add_argument("--step-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--first-step-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        return rank_main(args.rank, args.ranks, args.endpoint, args.steps, args.step_s, args.first_step_at)
    try:
        cases = [Case.parse(text) for text in args.cases.split(",") if text.strip()]
    except ValueError as error:
        parser.error(str(error))
    if args.ranks < 2 or args.seconds <= 0:
        parser.error("--ranks must be at least 2 and --seconds above 0")

    context = measured_on()
    print(f"{args.ranks} rank processes, {args.seconds:g} s of steps a case, {SPANS_PER_STEP} spans a step (a step "
          f"and {len(STAGES)} stages); {describe(context)}")
    header = f"{'case':<78} {'late spans':>22} {'lost at ranks':>14}"
    print(header)
    print("-" * len(header))
    results = []
    for case in cases:
        result = run_case(case, args.ranks, args.seconds)
        results.append(result)
        late = f"{result['late']:,} of {result['sent']:,} ({result['late'] / result['sent']:.0%})"
        print(f"{result['label']:<78} {late:>22} {result['lost_at_ranks']:>14,}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"context": context, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
