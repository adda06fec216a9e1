"""One demo run: the embedded detector, the ranks and the live view, until the ranks finish or
one fails. The output folder:

    out/
      report.html, *.png         the report, written afterwards (report/html_report.py)
      evidence/                  verdicts.jsonl, status.json, windows.jsonl (the detector); demo.json (the demo)
      ranks/rank-N.log           each rank's output
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, TextIO

from otel_straggler import contract
from otel_straggler.cli import UsageError
from otel_straggler.demo.launcher import LaunchPlan, RankFailure, RankGroup
from otel_straggler.demo.live_view import LiveView
from otel_straggler.demo.straggler import BLOCK_FOR_GOOD_S, slow_rank_args
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.service import DetectorService
from otel_straggler.report import evidence_files
from otel_straggler.report.evidence_files import Injection, RunRecord, WindowMedian

# Detection rules of the embedded detector, set here rather than taken from OTEL_STRAGGLER_* so
# the demo behaves the same everywhere. The persistence rules are the detector's defaults.
WARMUP_WINDOWS = 2
PERSIST_WINDOWS = 3
REL_THRESHOLD = 0.05
MIN_GAP_MS = 5.0
WINDOW_GRACE_S = 5.0  # the last window closes this long after the last span, not 30 s
SPAN_EXPORT_DELAY_MS = 500  # the ranks' batch span export period (OTEL_BSP_SCHEDULE_DELAY; SDK default 5 s)
HEARTBEAT_INTERVAL_MS = 1000  # the ranks' heartbeats (OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS; default 5 s)
HANG_LINGER_S = 2.0  # after the hang verdict: the live view shows it before the ranks are ended
STALL_SHOWN_S = 3.0  # a pause in progress longer than this shows in the live view
POLL_INTERVAL_S = 0.25
DETECTOR_STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class DemoSettings:
    ranks: int
    steps: int
    window_steps: int
    injection: Optional[Injection]
    out_dir: Path
    grpc_port: int
    job_id: str
    external_endpoint: Optional[str]  # set: the ranks export there and no detector is embedded
    hang_timeout_s: float = 120.0
    # every rank's heartbeats carry a simulated GPU (OTEL_STRAGGLER_GPU_HEALTH=fake); the slowed
    # rank's reads thermally throttled from its first slowed step
    simulate_gpu: bool = False


def detector_config(settings: DemoSettings, evidence_dir: Path) -> DetectorConfig:
    return DetectorConfig(
        window_steps=settings.window_steps, warmup_windows=WARMUP_WINDOWS, persist_windows=PERSIST_WINDOWS,
        rel_threshold=REL_THRESHOLD, min_gap_ms=MIN_GAP_MS, window_grace_s=WINDOW_GRACE_S,
        hang_timeout_s=settings.hang_timeout_s,
        listen_address="127.0.0.1", grpc_port=settings.grpc_port, http_port=0, evidence_dir=str(evidence_dir),
        flush_interval_s=0.2, export_metrics=False,
    )


def rank_environment(settings: DemoSettings, endpoint: Optional[str], environ: Mapping[str, str]) -> dict[str, str]:
    """What every rank gets on top of this process's environment `environ`. `endpoint` is the
    embedded detector's; None leaves the user's OTEL_EXPORTER_OTLP_* in charge."""
    env = {"OTEL_STRAGGLER_JOB_ID": settings.job_id,
           "OTEL_SERVICE_NAME": environ.get("OTEL_SERVICE_NAME") or "training"}  # CONTRACT §1 default
    if "OTEL_BSP_SCHEDULE_DELAY" not in environ:
        env["OTEL_BSP_SCHEDULE_DELAY"] = str(SPAN_EXPORT_DELAY_MS)
    if "OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS" not in environ:
        env["OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS"] = str(HEARTBEAT_INTERVAL_MS)
    if endpoint is not None:
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                    "OTEL_STRAGGLER_EXPORT_METRICS": "false"})  # the embedded detector takes spans only
    if settings.simulate_gpu:
        env["OTEL_STRAGGLER_GPU_HEALTH"] = "fake"
    return env


def trainer_arguments(settings: DemoSettings, collective_timeout_s: Optional[float] = None) -> tuple[str, ...]:
    """The trainer's flags, the same for every rank: the injection is the trainer's own slowed rank
    (straggler.py), slow in its own code as a real straggler is."""
    arguments: tuple[str, ...] = ("--steps", str(settings.steps), "--log-every", "1")
    if collective_timeout_s is not None:
        arguments += ("--collective-timeout-s", f"{collective_timeout_s:g}")
    injection = settings.injection
    if injection is not None:
        arguments += slow_rank_args(injection.rank, injection.stage, injection.from_step,
                                    0.0 if injection.hang else injection.slowdown,
                                    BLOCK_FOR_GOOD_S if injection.hang else 0.0)
    return arguments


def header(settings: DemoSettings, endpoint: str) -> str:
    injection = settings.injection
    slowed = ("healthy: nothing injected" if injection is None else
              f"rank {injection.rank} blocks for good in {injection.stage} at step {injection.from_step} (hang "
              f"timeout {settings.hang_timeout_s:g} s)" if injection.hang else
              f"injecting +{injection.slowdown:.0%} in {injection.stage} on rank {injection.rank} "
              f"from step {injection.from_step}")
    destination = (f"spans of job {settings.job_id} to {endpoint}" if settings.external_endpoint is None else
                   f"spans of job {settings.job_id} to {endpoint} (OTEL_EXPORTER_OTLP_*ENDPOINT is set: no detector "
                   f"embedded, the verdicts are that detector's)")
    if settings.simulate_gpu:
        slowed += (", its simulated GPU thermally throttled from then on" if injection is not None else
                   "; simulated GPUs")
    return (f"otel-straggler demo: {settings.ranks} ranks x {settings.steps} steps (gloo on CPU), {slowed}\n"
            f"{destination}, windows of {settings.window_steps} steps; output in {settings.out_dir}")


def medians_by_rank(medians: list[WindowMedian]) -> dict[int, dict[int, dict[str, float]]]:
    """window -> rank -> stage -> median ms, as the live view takes them."""
    by_window: dict[int, dict[int, dict[str, float]]] = {}
    for median in medians:
        by_window.setdefault(median.window, {}).setdefault(median.rank, {})[median.stage] = median.median_ms
    return by_window


@dataclass
class RunResult:
    record: RunRecord
    evidence_dir: Path
    embedded_detector: bool  # False: spans went to the user's OTLP endpoint, verdicts are elsewhere
    endpoint: str
    failure: Optional[str]  # why the run stopped early; None when it completed


def _start_detector(settings: DemoSettings, evidence_dir: Path) -> tuple[DetectorService, str]:
    config = detector_config(settings, evidence_dir)
    service = DetectorService(config)
    try:
        service.start()
    except OSError as error:
        raise UsageError(f"--grpc-port {settings.grpc_port}: cannot listen on it ({error.strerror or error}); "
                         "pick another port, or 0 for any free one") from None
    return service, f"http://127.0.0.1:{service.bound_ports[0]}"


def busy_machine_note() -> Optional[str]:
    """A warning when other work keeps the cores busy: it slows ranks unevenly."""
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if load <= cores:
        return None
    return (f"note: load average {load:.1f} on {cores} cores; other work on this machine slows some ranks "
            "more than others, and a rank slowed for long enough is flagged")


def run(settings: DemoSettings, stream: TextIO) -> RunResult:
    """Trains to the end or until a rank fails; the detector has judged every window on return."""
    evidence_dir = settings.out_dir / "evidence"
    evidence_dir.mkdir(parents=True, exist_ok=True)
    hang_run = settings.injection is not None and settings.injection.hang
    record = RunRecord(job_id=settings.job_id, ranks=settings.ranks, steps=settings.steps,
                       window_steps=settings.window_steps, rel_threshold=REL_THRESHOLD, min_gap_ms=MIN_GAP_MS,
                       injection=settings.injection, started_unix_nano=time.time_ns(),
                       hang_timeout_s=settings.hang_timeout_s if hang_run else None)
    evidence_files.write_run(evidence_dir, record)

    service, endpoint = None, settings.external_endpoint
    if endpoint is None:
        service, endpoint = _start_detector(settings, evidence_dir)
    # every rank runs here: the node roll-up counts them against this host
    view = LiveView(stream, settings.steps, settings.window_steps, header(settings, endpoint),
                    host_ranks={socket.gethostname(): settings.ranks})
    note = busy_machine_note()
    if note is not None:
        view.message(note)
    hang_declared = threading.Event()

    def on_verdict(verdict) -> None:
        view.on_verdict(verdict.to_dict())
        if verdict.verdict == contract.VERDICT_HANG:
            hang_declared.set()

    def on_window(medians: list[WindowMedian]) -> None:  # each window the detector judged, as it wrote it
        for window, ranks in sorted(medians_by_rank(medians).items()):
            view.on_window(window, ranks)

    if service is not None:
        service.add_verdict_listener(on_verdict)
        if service.window_record is not None:
            service.window_record.add_listener(on_window)

    def on_progress(steps_done: int, loss: Optional[float]) -> None:
        if steps_done > len(record.step_end_unix_nano):
            record.step_end_unix_nano.append(time.time_ns())
            if loss is not None:
                record.losses.append(loss)
        view.on_progress(steps_done, loss)

    # a --hang run waits for the detector: its ranks' collectives, and the launcher's patience with
    # a stall, outlast the hang timeout
    collective_timeout_s: Optional[float] = None
    launch_options: dict[str, Any] = {}
    if hang_run:
        patience_s = settings.hang_timeout_s + 60.0
        collective_timeout_s = patience_s + 60
        launch_options["stall_timeout_s"] = patience_s
    plan = LaunchPlan(ranks=settings.ranks,
                      trainer_args=trainer_arguments(settings, collective_timeout_s),
                      env=rank_environment(settings, None if service is None else endpoint, os.environ),
                      log_dir=settings.out_dir / "ranks",
                      **launch_options)
    group = RankGroup(plan, on_progress)
    failure: Optional[str] = None
    try:
        group.start()
        view.message(f"started {settings.ranks} ranks (pids {' '.join(map(str, group.pids))}); "
                     f"their output: {plan.log_dir}/rank-N.log")
        declared_at: Optional[float] = None
        while not group.poll():
            stalled = group.seconds_without_progress()
            view.on_stall(stalled if stalled > STALL_SHOWN_S else None)
            view.refresh()
            if hang_declared.is_set():
                declared_at = declared_at or time.monotonic()
                if time.monotonic() - declared_at >= HANG_LINGER_S:
                    view.message("the detector named the hang; ending the ranks")
                    break
            time.sleep(POLL_INTERVAL_S)
    except RankFailure as error:
        failure = str(error)
    except KeyboardInterrupt:
        failure = "interrupted"
        raise
    finally:
        group.stop()
        if service is not None:
            service.stop(DETECTOR_STOP_TIMEOUT_S)  # judges the windows still open
        view.close()
        record.outcome = failure or ("hang declared" if hang_declared.is_set() else "completed")
        evidence_files.write_run(evidence_dir, record)
    return RunResult(record, evidence_dir, service is not None, endpoint, failure)
