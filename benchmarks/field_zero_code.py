"""Field precision of the instrumentation a training script does not import: real 4-rank gloo DDP
jobs launched by torchrun, each against `otel-straggler detect` in its own process at its defaults.

    python benchmarks/field_zero_code.py [--paths plain,transformers] [--scenarios forward,healthy+hog]
        [--runs 10] [--steps 130] [--keep DIR] [--show-stages]

Paths (the job scripts in benchmarks/field_jobs/, each with the same slowdowns and command line):
- plain: torch_job.py, a plain PyTorch DDP loop with nothing of otel_straggler in it, under
  `opentelemetry-instrument torchrun ...` with OTEL_STRAGGLER_ENABLED=true;
- accumulate: the same script and launch with `--accumulate 4` (no_sync on 3 of 4 micro-batches; a
  backward slowdown in the first micro-batch only, forward and data ones in every micro-batch);
- transformers: transformers_job.py, a Hugging Face Trainer with the library's StragglerCallback,
  under plain torchrun;
- lightning: lightning_job.py, a Lightning Trainer (strategy ddp) with the library's
  StragglerCallback, under plain torchrun.
Scenarios per path: healthy, and rank 1 slower from --from-step in its forward, inside DDP's
backward or in its data loading, each again with a CPU hog on the machine: `plain:forward`,
`lightning:data+hog`; a bare name (`forward`) means that scenario on every path of --paths.
Every run is its own job: torchrun's rendezvous id (`field-<scenario>-<run>`) is the job id.
The columns and the targets are benchmarks/field_precision.py's: no verdict of any kind in a
healthy run, the slow rank alone in 9 of 10 runs (all, under 10 runs), its alert led by the stage
the work was added to and within 4 windows of the onset, no `recovered` while it stays slow, late
spans under 1%; a run whose spans never reached the detector misses them too. After the table, per
path: the healthy step time (wall time from the onset line to the slow rank's `done` line over the
steps between, median over the healthy runs without the hog), the wall time of a run (detector
start and stop included), and with --show-stages the stage names the detector received
(windows.jsonl) and the spans it rejected, by reason.
Exit status 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detector_process import DetectorProcess
from field_precision import (CAUSE, SLOW_RANK, WORLD_SIZE, RunResult, _kind, cpu_hog,
                             exact, summarize)

from otel_straggler.demo.ports import free_port

JOBS = Path(__file__).resolve().parent / "field_jobs"
BIN = Path(sys.executable).parent  # torchrun and opentelemetry-instrument of this environment


@dataclass(frozen=True)
class Launch:
    """How a path's job starts: its script and arguments, and whether under opentelemetry-instrument."""

    script: Path
    arguments: tuple[str, ...] = ()
    zero_code: bool = False


PATHS = {
    "plain": Launch(JOBS / "torch_job.py", zero_code=True),
    "accumulate": Launch(JOBS / "torch_job.py", ("--accumulate", "4"), zero_code=True),
    "transformers": Launch(JOBS / "transformers_job.py"),
    "lightning": Launch(JOBS / "lightning_job.py"),
}
KINDS = ("healthy", "forward", "backward", "data")
SCENARIOS = [f"{path}:{kind}{hog}" for path in PATHS for kind in KINDS for hog in ("", "+hog")]
# the stage a verdict on the slow rank should lead with: the one the work was added to, as in the
# README-instrumented loop
CAUSE_STAGE = {kind: CAUSE[("plain", kind)] for kind in ("forward", "backward", "data")}
RUN_TIMEOUT_S = 300
# the slow rank's lines; torchrun gives all ranks one stdout, where two lines may run together
ONSET = re.compile(rf"onset rank={SLOW_RANK} (\d+)")
DONE = re.compile(rf"done rank={SLOW_RANK}(?!\d)")


@dataclass
class ZeroCodeRun:
    result: RunResult
    stages: dict[str, bool]  # stage names in windows.jsonl -> collective
    step_ms: Optional[float]  # the slow rank's steps from the onset to its end, on average (wall time)
    rejections: dict
    wall_s: float


def _path(scenario: str) -> str:
    return scenario.split(":")[0]


def job_environment(endpoint: str, zero_code: bool) -> dict[str, str]:
    """The caller's environment without its OTEL_* settings, exporting to the detector."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_STRAGGLER_EXPORT_METRICS": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if zero_code:
        env["OTEL_STRAGGLER_ENABLED"] = "true"
    return env


def job_command(scenario: str, run: int, steps: int, from_step: int, extra_ms: float) -> list[str]:
    launch = PATHS[_path(scenario)]
    command = [str(BIN / "opentelemetry-instrument")] if launch.zero_code else []
    return command + [
        str(BIN / "torchrun"), "--nproc-per-node", str(WORLD_SIZE), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"field-{scenario.replace(':', '-')}-{run}",
        "--max-restarts", "0", str(launch.script), *launch.arguments, "--steps", str(steps),
        "--slow", _kind(scenario), "--slow-rank", str(SLOW_RANK), "--from-step", str(from_step),
        "--extra-ms", f"{extra_ms:g}", "--data-delay-ms", f"{extra_ms:g}"]


def run_job(command: list[str], env: dict[str, str], scenario: str, run: int) -> tuple[str, Optional[int]]:
    """Runs torchrun to its end: its ranks' combined output, and when the slow rank's `done` line
    came (unix ns). In its own session, so that a run out of time ends with every rank torchrun
    started."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    watchdog = threading.Timer(RUN_TIMEOUT_S, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    lines, done_ns = [], None
    try:
        for line in process.stdout:
            if done_ns is None and DONE.search(line):
                done_ns = time.time_ns()
            lines.append(line)
        process.wait()
    finally:
        watchdog.cancel()
    output = "".join(lines)
    if process.returncode != 0:
        reason = f"not done in {RUN_TIMEOUT_S} s" if process.returncode == -signal.SIGKILL else (
            f"torchrun exited {process.returncode}")
        raise RuntimeError(f"{scenario} run {run}: {reason}:\n{output[-3000:]}")
    return output, done_ns


def read_windows(evidence: Path) -> list[dict]:
    path = evidence / "windows.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_once(scenario: str, run: int, steps: int = 130, from_step: int = 60, extra_ms: float = 30.0,
             keep: Optional[Path] = None) -> ZeroCodeRun:
    launch = PATHS[_path(scenario)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="field-zero-code-") as scratch:
        evidence = Path(scratch) / "evidence"
        evidence.mkdir()
        detector = DetectorProcess(str(evidence))
        output, done_ns = "", None
        try:
            with cpu_hog(scenario.endswith("+hog")):
                command = job_command(scenario, run, steps, from_step, extra_ms)
                output, done_ns = run_job(command, job_environment(detector.endpoint, launch.zero_code), scenario, run)
        finally:
            detector.stop()
            if keep is not None:
                target = keep / f"{scenario.replace(':', '-')}-{run}"
                target.mkdir(parents=True, exist_ok=True)
                for name in ("verdicts.jsonl", "status.json", "windows.jsonl"):
                    if (evidence / name).exists():
                        (target / name).write_bytes((evidence / name).read_bytes())
                (target / "output.log").write_text(output)
        onset = ONSET.search(output)
        if onset is None:
            raise RuntimeError(f"{scenario} run {run}: no `onset rank={SLOW_RANK}` line in the output:\n"
                               + output[-3000:])
        verdicts = [json.loads(line) for line in (evidence / "verdicts.jsonl").read_text().splitlines()
                    if line.strip()]
        status = json.loads((evidence / "status.json").read_text())
        windows = read_windows(evidence)
    onset_ns = int(onset.group(1))
    step_ms = None if done_ns is None or steps <= from_step else (done_ns - onset_ns) / 1e6 / (steps - from_step)
    return ZeroCodeRun(result=summarize(verdicts, status, _kind(scenario), steps, from_step, onset_ns),
                       stages={w["stage"]: bool(w.get("collective")) for w in windows if w["stage"] != "*"},
                       step_ms=step_ms,
                       rejections={reason: count for reason, count in status.get("rejections", {}).items() if count},
                       wall_s=time.monotonic() - started)


HEADER = (f"{'scenario':<28} {'exact':>7} {'false/10k rank-win':>19} {'windows to alert':>17} "
          f"{'s to alert':>11} {'late spans':>11} {'leads with the cause':>21} {'recovered while slow':>21}")


def report_scenario(scenario: str, runs: list[ZeroCodeRun]) -> tuple[list[str], bool]:
    """The scenario's row of the table (and notes under it), and whether it met the targets."""
    kind = _kind(scenario)
    results = [run.result for run in runs]
    exact_runs = sum(exact(kind, r) and r.received > 0 for r in results)
    false_rate = 1e4 * sum(r.false_onsets for r in results) / max(1, sum(r.rank_windows for r in results))
    windows = [r.windows_to_alert for r in results if r.windows_to_alert is not None]
    seconds = [r.seconds_to_alert for r in results if r.seconds_to_alert is not None]
    late = sum(r.late for r in results) / max(1, sum(r.received for r in results))
    window_text = "-" if not windows else f"{statistics.median(windows):g} (max {max(windows)})"
    seconds_text = "-" if not seconds else f"{statistics.median(seconds):.1f}"
    cause = CAUSE_STAGE.get(kind)
    alerted = [r for r in results if r.leading_stage is not None]
    leading = sum(r.leading_stage == cause for r in alerted)
    leading_text = "-" if kind == "none" else f"{leading}/{len(alerted)} {cause}"
    recovered = sum(r.recovered_while_slow for r in results)
    lines = [f"{scenario:<28} {exact_runs:>3}/{len(results):<3} {false_rate:>19.1f} {window_text:>17} "
             f"{seconds_text:>11} {100 * late:>10.2f}% {leading_text:>21} {recovered:>21}"]
    silent = sum(r.received == 0 for r in results)
    if silent:
        lines.append(f"{'':<28} no spans reached the detector in {silent} of {len(results)} runs")
    flagged = [sorted(r.flagged) for r in results if r.received and not exact(kind, r)]
    if flagged:
        lines.append(f"{'':<28} not exact: flagged ranks {flagged}")
    led_otherwise = sorted({r.leading_stage for r in alerted if r.leading_stage != cause})
    if kind != "none" and led_otherwise:
        lines.append(f"{'':<28} led with {led_otherwise}")
    need = len(results) if kind == "none" or len(results) < 10 else len(results) - len(results) // 10
    missed = (silent > 0 or exact_runs < need or (windows and max(windows) > 4) or late >= 0.01
              or (kind != "none" and leading < need) or recovered > 0)
    return lines, bool(missed)


def report_path(path: str, runs: list[tuple[str, ZeroCodeRun]], show_stages: bool) -> list[str]:
    healthy = [run.step_ms for scenario, run in runs
               if _kind(scenario) == "none" and not scenario.endswith("+hog") and run.step_ms is not None]
    step_text = f"{statistics.median(healthy):.0f} ms" if healthy else "- (no healthy run without the hog)"
    lines = [f"{path}: healthy step {step_text}, {statistics.median(run.wall_s for _, run in runs):.0f} s a run"]
    if show_stages:
        stages: dict[str, bool] = {}
        rejections: dict[str, int] = {}
        for _, run in runs:
            stages.update(run.stages)
            for reason, count in run.rejections.items():
                rejections[reason] = rejections.get(reason, 0) + count
        names = [f"{name} (collective)" if collective else name for name, collective in stages.items()]
        lines.append(f"  stages received: {', '.join(names) if names else 'none'}")
        if rejections:
            lines.append(f"  spans rejected: {rejections}")
    return lines


def select_scenarios(parser: argparse.ArgumentParser, paths_text: str, scenarios_text: Optional[str]) -> list[str]:
    paths = [name.strip() for name in paths_text.split(",") if name.strip()]
    unknown = [name for name in paths if name not in PATHS]
    if unknown:
        parser.error(f"unknown path {unknown[0]!r}; choose from {', '.join(PATHS)}")
    if scenarios_text is None:
        return [scenario for scenario in SCENARIOS if _path(scenario) in paths]
    selected = []
    for name in (name.strip() for name in scenarios_text.split(",") if name.strip()):
        names = [name] if ":" in name else [f"{path}:{name}" for path in paths]
        unknown = [scenario for scenario in names if scenario not in SCENARIOS]
        if unknown:
            parser.error(f"unknown scenario {unknown[0]!r}; a path ({', '.join(PATHS)}), a colon and one of "
                         f"{', '.join(KINDS)}, optionally +hog")
        selected += [scenario for scenario in names if scenario not in selected]
    return selected


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS), help="paths to run (a bare scenario name runs on each)")
    parser.add_argument("--scenarios", help="scenarios, `plain:forward` or `forward` (default: all of the paths')")
    parser.add_argument("--runs", type=int, default=10, help="runs per scenario")
    parser.add_argument("--steps", type=int, default=130)
    parser.add_argument("--from-step", type=int, default=60, help="onset of the slowdown")
    parser.add_argument("--extra-ms", type=float, default=30.0, help="the slow rank's extra time per step")
    parser.add_argument("--keep", type=Path, help="copy each run's evidence and torchrun's output here")
    parser.add_argument("--show-stages", action="store_true", help="list the stage names the detector received")
    args = parser.parse_args(argv)
    scenarios = select_scenarios(parser, args.paths, args.scenarios)
    missing = sorted({str(PATHS[_path(s)].script) for s in scenarios if not PATHS[_path(s)].script.exists()})
    if missing:
        parser.error(f"missing job script {missing[0]}")

    print(f"{WORLD_SIZE} gloo DDP ranks under torchrun, {args.steps} steps, onset at step {args.from_step}, "
          f"+{args.extra_ms:g} ms on rank {SLOW_RANK}, {args.runs} runs per scenario, {os.cpu_count()} CPUs")
    print(HEADER)
    print("-" * len(HEADER))
    missed = []
    by_path: dict[str, list[tuple[str, ZeroCodeRun]]] = {}
    for scenario in scenarios:
        runs = [run_once(scenario, run, args.steps, args.from_step, args.extra_ms, args.keep)
                for run in range(args.runs)]
        by_path.setdefault(_path(scenario), []).extend((scenario, run) for run in runs)
        lines, scenario_missed = report_scenario(scenario, runs)
        print("\n".join(lines), flush=True)
        if scenario_missed:
            missed.append(scenario)
    print()
    for path, runs in by_path.items():
        print("\n".join(report_path(path, runs, args.show_stages)))
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
