"""`otel-straggler demo`: its flags, the checks that fail in one line before anything starts, and
what is printed at the end (run.py does the run itself, the report package builds the report)."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import re
import shutil
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Mapping, Optional

from otel_straggler import contract
from otel_straggler.cli import UsageError
from otel_straggler.instrumentation.identity import parse_resource_attributes
from otel_straggler.report import evidence_files
from otel_straggler.report.report_command import matplotlib_installed
from otel_straggler.report.summary import summarize

# the trainer's non-collective stages
DEMO_STAGES = ("batch-generator", "forward-compute", "backward-compute", "optimizer")
RANKS_PER_CORE = 4  # beyond this, a rank waits for a core longer than it computes
RANK_MEMORY_BYTES = 600 * 1024 * 1024  # one rank: torch, the model, the OTel SDK
MIN_RANKS = 3  # a rank is judged against at least two peers (the detector's min_cohort_size)
DEMO_RUNS_KEPT = 10  # runs kept in the default output folder; older ones are removed at the next run
RUN_NAME = re.compile(r"\d{8}-\d{6}(-\d+)?")  # the default output folders' names: <date>-<time>[-n]
EXIT_RANK_FAILED = 1
DEMO_HANG_TIMEOUT_S = 30.0  # a --hang run takes about a minute; a real job's checkpoint pauses need the 120 s default


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="training processes to start (default 4)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps to train (default 120)")
    # 20 steps rather than the detector's 10: four CPU ranks sharing two cores are noisy, and the
    # median of 10 steps let scheduling alone push a healthy rank past the threshold
    parser.add_argument("--window-steps", type=int, default=20, help="steps per detector window (default 20)")
    parser.add_argument("--slow-rank", type=int, default=2, help="the rank to slow down (default 2)")
    parser.add_argument("--stage", default="forward-compute", choices=DEMO_STAGES,
                        help="the stage to slow down (default forward-compute)")
    parser.add_argument("--slowdown", type=float, default=0.3,
                        help="extra time in that stage, as a fraction of its own (default 0.3: +30%%)")
    parser.add_argument("--from-step", type=int, default=40, help="first slowed step (default 40)")
    parser.add_argument("--healthy", action="store_true", help="inject nothing: no rank should be flagged")
    parser.add_argument("--hang", action="store_true",
                        help="the --slow-rank blocks for good inside --stage from --from-step (its peers then wait "
                             "in the all-reduce); the demo ends once the detector names it")
    parser.add_argument("--simulate-gpu", action="store_true",
                        help="each rank's heartbeats carry a simulated GPU's health (no NVML here); the slowed "
                             "rank's reads thermally throttled (1410 of 1980 MHz, hw_thermal, 89 C) from --from-step")
    parser.add_argument("--hang-timeout-s", type=float, default=DEMO_HANG_TIMEOUT_S,
                        help=f"with --hang: the embedded detector's hang timeout (default {DEMO_HANG_TIMEOUT_S:g}; "
                             "the detector's own default is 120)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the report and evidence (default: a new folder in "
                             f"~/.cache/otel-straggler/demo-runs, which keeps the last {DEMO_RUNS_KEPT} runs)")
    parser.add_argument("--grpc-port", type=int, default=0,
                        help="OTLP/gRPC port of the embedded detector (default: any free port)")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    _check_demo_arguments(args)
    if not torch_installed():
        raise UsageError("torch is not installed; install it with: pip install torch")
    if args.grpc_port:
        _check_port_free(args.grpc_port)
    out_dir = _fresh_out_dir(args.out, demo_runs_dir(os.environ))

    from otel_straggler.demo.run import DemoSettings, run  # torch-free; imports the detector service

    settings = DemoSettings(
        ranks=args.ranks, steps=args.steps, window_steps=args.window_steps,
        injection=None if args.healthy else evidence_files.Injection(args.slow_rank, args.stage, args.from_step,
                                                                     args.slowdown, hang=args.hang),
        hang_timeout_s=args.hang_timeout_s, simulate_gpu=args.simulate_gpu,
        out_dir=out_dir, grpc_port=args.grpc_port, job_id=_given_job_id(os.environ) or f"demo-{uuid.uuid4().hex[:8]}",
        external_endpoint=_external_endpoint(),
    )
    # SIGTERM (a container stop, a job scheduler) ends the run like Ctrl-C: ranks stopped, evidence kept.
    signal.signal(signal.SIGTERM, _interrupt)
    result = run(settings, sys.stdout)
    if not result.embedded_detector:
        print(f"Spans went to {result.endpoint}; the verdicts are that detector's. Build the report from its "
              "evidence directory with: otel-straggler report EVIDENCE_DIR")
    elif matplotlib_installed():
        from otel_straggler.report import html_report

        built = html_report.build(result.evidence_dir, out_dir)
        print(f"\n{built.summary}\nreport: {built.html_path}")
    else:
        print(f"\n{summarize(result.record, evidence_files.load(result.evidence_dir).verdicts)}\n"
              f"No report: matplotlib is not installed (pip install matplotlib). Evidence: {result.evidence_dir}")
    if result.failure is not None:
        print(f"otel-straggler demo: {result.failure}", file=sys.stderr)
        return EXIT_RANK_FAILED
    return 0


def _check_demo_arguments(args: argparse.Namespace) -> None:
    limit = machine_rank_limit()
    if args.ranks < MIN_RANKS:
        raise UsageError(f"--ranks {args.ranks}: at least {MIN_RANKS} ranks are needed, a rank is judged against "
                         "its peers")
    if args.ranks > limit:
        raise UsageError(f"--ranks {args.ranks}: this machine can run at most {limit} ranks ({RANKS_PER_CORE} "
                         f"per core on {_usable_cores()} cores, {RANK_MEMORY_BYTES >> 20} MiB of free memory each)")
    if args.window_steps < 1:
        raise UsageError(f"--window-steps {args.window_steps}: must be at least 1")
    if args.steps < 5 * args.window_steps:
        raise UsageError(f"--steps {args.steps}: needs at least 5 windows of --window-steps {args.window_steps} "
                         "(2 warm-up windows, then 3 slow ones before an alert)")
    if not 0 <= args.grpc_port <= 65535:
        raise UsageError(f"--grpc-port {args.grpc_port}: must be 0 to 65535")
    if args.healthy and args.hang:
        raise UsageError("--hang and --healthy: pick one")
    if not 1 <= args.hang_timeout_s <= 3600:
        raise UsageError(f"--hang-timeout-s {args.hang_timeout_s:g}: must be 1 to 3600")
    if args.healthy:
        return
    if not 0 <= args.slow_rank < args.ranks:
        raise UsageError(f"--slow-rank {args.slow_rank}: must be a rank of the job, 0 to {args.ranks - 1}")
    if not 0 < args.slowdown <= 100:
        raise UsageError(f"--slowdown {args.slowdown:g}: must be above 0 and at most 100")
    if not 0 <= args.from_step < args.steps:
        raise UsageError(f"--from-step {args.from_step}: must be a step of the run, 0 to {args.steps - 1}")


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _check_port_free(port: int) -> None:
    """Fails before anything is created; the detector's own bind error still covers a race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise UsageError(f"--grpc-port {port}: cannot listen on it ({error.strerror}); "
                             "pick another port, or 0 for any free one") from None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _available_memory_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_rank_limit() -> int:
    limit = _usable_cores() * RANKS_PER_CORE
    memory = _available_memory_bytes()
    if memory is not None:
        limit = min(limit, memory // RANK_MEMORY_BYTES)
    return max(MIN_RANKS, limit)


def _given_job_id(environ: Mapping[str, str]) -> Optional[str]:
    """The job id set for the ranks (OTEL_STRAGGLER_JOB_ID, else training.job.id in
    OTEL_RESOURCE_ATTRIBUTES), which CONTRACT §1 lets a user give; None: the demo makes one."""
    return (environ.get("OTEL_STRAGGLER_JOB_ID")
            or parse_resource_attributes(environ.get("OTEL_RESOURCE_ATTRIBUTES", "")).get(contract.JOB_ID) or None)


def _external_endpoint() -> Optional[str]:
    """Where the ranks export when the user points OTLP somewhere: then no detector is embedded."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def demo_runs_dir(environ: Mapping[str, str]) -> Path:
    """Where runs without --out go: outside any checkout, beside the project's other caches."""
    cache = environ.get("OTEL_STRAGGLER_CACHE") or Path.home() / ".cache" / "otel-straggler"
    return Path(cache) / "demo-runs"


def _fresh_out_dir(requested: Optional[Path], runs_dir: Path) -> Path:
    if requested is not None:
        if requested.exists() and (not requested.is_dir() or any(requested.iterdir())):
            raise UsageError(f"--out {requested}: exists and is not an empty folder; pick a new one")
        try:
            requested.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--out {requested}: {error.strerror}") from None
        return requested.resolve()
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot create {runs_dir}: {error.strerror}; pass --out") from None
    _prune_old_runs(runs_dir, keep=DEMO_RUNS_KEPT - 1)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        candidate = runs_dir / (stamp + (f"-{attempt}" if attempt else ""))
        try:
            candidate.mkdir()
            return candidate.resolve()
        except FileExistsError:
            continue
        except OSError as error:
            raise UsageError(f"cannot create {candidate}: {error.strerror}; pass --out") from None
    raise UsageError(f"cannot find a free folder name in {runs_dir}; pass --out")


def _prune_old_runs(runs_dir: Path, keep: int) -> None:
    """Removes all but the newest `keep` earlier runs; only folders named as this command names them."""
    def age(path: Path):
        date, time, *attempt = path.name.split("-")
        return date, time, int(attempt[0]) if attempt else 0

    runs = sorted((path for path in runs_dir.iterdir() if path.is_dir() and RUN_NAME.fullmatch(path.name)),
                  key=age)
    for old_run in runs[:max(0, len(runs) - keep)]:
        shutil.rmtree(old_run, ignore_errors=True)
