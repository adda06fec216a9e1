"""Hangs and restarts with real gloo ranks (the demo trainer, or a torchrun-restarted job) sending
heartbeats and spans over OTLP/gRPC to a detector in this process: one rank blocks before the
all-reduce, one blocks there whose telemetry goes nowhere, one rank is frozen, every rank pauses
together, torchrun restarts every rank from a checkpoint, and a rank's first export comes seconds
after its peers'. Every wait has a deadline, and the ranks are stopped whatever happens."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from otel_straggler import contract
from otel_straggler.demo.straggler import BLOCK_FOR_GOOD_S, slow_rank_args
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.service import DetectorService
from otel_straggler.detector.windows import Cohort

from otel_straggler.testing import services
from .training import TrainingRanks, clean_environment

pytest.importorskip("torch")

RANKS = 4
HANG_TIMEOUT_S = 15.0
COLLECTIVE_TIMEOUT_S = 300  # the waiting ranks must still be waiting when the hang is declared
RESTART_TRAINER = Path(__file__).resolve().parent / "restart_trainer.py"


class Detector:
    """A detector service with a listener that keeps every verdict."""

    def __init__(self, tmp_path: Path, **changes) -> None:
        values = dict(grpc_port=0, http_port=0, evidence_dir=str(tmp_path / "evidence"), export_metrics=False,
                      flush_interval_s=0.1, window_steps=5, window_grace_s=5.0, max_export_lag_s=3.0,
                      hang_timeout_s=HANG_TIMEOUT_S)
        values.update(changes)
        self.service = DetectorService(DetectorConfig(**values))
        self.verdicts: list = []
        self._lock = threading.Lock()
        self.service.add_verdict_listener(self._keep)

    def liveness(self) -> str:
        """What the detector knows of each rank's liveness: for a failure's message."""
        engine = self.service._driver.engine
        now = time.time_ns()
        lines = []
        for (job_id, _), job in list(engine._liveness._jobs.items()):
            lines.append(f"job {job_id}: progress {(now - job.progress_ns) / 1e9:.1f} s ago")
            lines += [f"  rank {rank}: heartbeat {(now - record.heartbeat_ns) / 1e9:.1f} s ago, gap "
                      f"{record.gap_ns / 1e9:.1f} s, open {record.open_stages}"
                      for rank, record in sorted(job.ranks.items())]
        return "\n".join(lines)

    def heard_from(self, ranks: int) -> bool:
        """Every rank's heartbeat has reached the detector: only a rank it knows can be named."""
        jobs = list(self.service._driver.engine._liveness._jobs.values())
        return any(sum(1 for record in job.ranks.values() if record.heartbeat_ns) >= ranks for job in jobs)

    def _keep(self, verdict) -> None:
        with self._lock:
            self.verdicts.append(verdict)

    def of(self, kind: str) -> list:
        with self._lock:
            return [verdict for verdict in self.verdicts if verdict.verdict == kind]

    @property
    def endpoint(self) -> str:
        return f"{services.LOOPBACK}:{self.service.bound_ports[0]}"

    def __enter__(self) -> "Detector":
        self.service.start()
        return self

    def __exit__(self, *exc) -> None:
        self.service.stop(timeout_s=15.0)


def ranks(tmp_path: Path, detector: Detector, steps: int, rank_env=None, trainer_args=(), rank_args=None) -> TrainingRanks:
    return TrainingRanks(tmp_path / "ranks", RANKS, detector.endpoint, f"hang-{uuid.uuid4().hex[:8]}", steps,
                         rank_env=rank_env, rank_args=rank_args, env={"OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS": "1000",
                                                 "OTEL_STRAGGLER_EXPORT_METRICS": "false"},
                         trainer_args=("--batch-size", "64", "--hidden", "256", *trainer_args))


def pause_every_rank(from_step: int, seconds: float):
    """rank_args for every rank sitting `seconds` in the optimizer stage at `from_step`."""
    def pause(rank: int) -> tuple[str, ...]:
        return slow_rank_args(rank, "optimizer", from_step, block_s=seconds)
    return pause


def run_to_the_end(job: TrainingRanks, detector: Detector, timeout: float) -> tuple[list, float, dict]:
    """Waits for every rank to exit: their exit codes, the seconds that took, the detector's status."""
    started = time.monotonic()
    codes = job.wait(timeout=timeout)
    return codes, time.monotonic() - started, detector.service.status()


def wait_for_hang(detector: Detector, job: TrainingRanks, timeout_s: float) -> list:
    def found():
        return detector.of(contract.VERDICT_HANG)

    try:
        return services.wait_until(found, timeout_s, interval=0.2, what="a hang verdict")
    except TimeoutError as error:
        raise AssertionError(f"{error}; status {detector.service.status()['engine']}\n{job.log_tails()}") from None


def test_a_rank_that_never_reaches_the_all_reduce_is_named(tmp_path):
    block = slow_rank_args(1, "forward-compute", 15, block_s=BLOCK_FOR_GOOD_S)
    with Detector(tmp_path) as detector, ranks(tmp_path, detector, 10_000,
                                               trainer_args=("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), *block)) as job:
        job.wait_for_step(14, timeout=120)
        blocked_at = time.monotonic()
        hangs = wait_for_hang(detector, job, HANG_TIMEOUT_S + 30)
        said_after_s = time.monotonic() - blocked_at
        time.sleep(2)  # a second verdict, if any, would come now
        hangs = detector.of(contract.VERDICT_HANG)
    assert [(v.rank, v.reason, v.stage) for v in hangs] == [(1, contract.HANG_NEVER_ENTERED_COLLECTIVE, "forward-compute")]
    assert (hangs[0].host, hangs[0].local_rank) == (socket.gethostname(), 1)
    assert sorted(hangs[0].reference_ranks) == [0, 2, 3]
    assert HANG_TIMEOUT_S <= hangs[0].stalled_s and said_after_s < HANG_TIMEOUT_S + 15
    assert detector.of(contract.VERDICT_SILENT) == []


def test_a_rank_never_heard_from_is_named_from_the_world_size_its_peers_report(tmp_path):
    """Rank 1 exports to a port nothing listens on (its telemetry sent elsewhere) and blocks in
    forward at step 15: the detector knows only ranks 0, 2 and 3, all waiting in the all-reduce,
    and their world size of 4 names the one they wait for."""
    nowhere = f"http://{services.LOOPBACK}:{services.free_port()}"

    def rank_env(rank: int) -> dict:
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": nowhere} if rank == 1 else {}

    block = slow_rank_args(1, "forward-compute", 15, block_s=BLOCK_FOR_GOOD_S)
    with Detector(tmp_path) as detector, ranks(tmp_path, detector, 10_000, rank_env=rank_env,
                                               trainer_args=("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), *block)) as job:
        job.wait_for_step(14, timeout=120)
        hangs = wait_for_hang(detector, job, HANG_TIMEOUT_S + 30)
        known = detector.liveness()
        time.sleep(2)  # a second verdict, if any, would come now
        hangs = detector.of(contract.VERDICT_HANG)
    assert [(v.rank, v.reason, v.stage, v.host) for v in hangs] == [(1, contract.HANG_RANK_LOST, "*", None)], \
        f"{hangs}\n{known}"
    assert sorted(hangs[0].reference_ranks) == [0, 2, 3]


def test_a_frozen_rank_is_named_as_lost(tmp_path):
    with Detector(tmp_path) as detector, ranks(tmp_path, detector, 10_000,
                                               trainer_args=("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S))) as job:
        job.wait_for_step(25, timeout=120)
        services.wait_until(lambda: detector.heard_from(RANKS), 30, what="a heartbeat of every rank")
        frozen = job.processes[2]
        frozen.send_signal(signal.SIGSTOP)  # no spans, no heartbeats: the process is there but frozen
        try:
            hangs = wait_for_hang(detector, job, HANG_TIMEOUT_S + 30)
            known = detector.liveness()
            time.sleep(2)
            hangs = detector.of(contract.VERDICT_HANG)
        finally:
            frozen.send_signal(signal.SIGKILL)
    assert [(v.rank, v.reason) for v in hangs] == [(2, contract.HANG_RANK_LOST)], f"{hangs}\n{known}"
    assert (hangs[0].host, hangs[0].local_rank) == (socket.gethostname(), 2)


def test_a_pause_of_every_rank_shorter_than_the_timeout_is_no_hang(tmp_path, monkeypatch):
    # what the windows did, for the message of a failure: (time, closed window, its rows, each
    # rank's latest window), and the windows that late spans were for
    closes, late_for = [], set()
    real_close, real_open = Cohort._close, Cohort.open_window

    def close(cohort, window):
        rows = real_close(cohort, window)
        latest = {entry.rank: entry.latest_window for entry in cohort.slot_entries if entry is not None}
        closes.append((round(time.monotonic(), 2), window, len(rows), latest))
        return rows

    def open_window(cohort, window):
        rows = real_open(cohort, window)
        if rows is None:
            late_for.add(window)
        return rows

    monkeypatch.setattr(Cohort, "_close", close)
    monkeypatch.setattr(Cohort, "open_window", open_window)

    # every rank sits 20 s in the optimizer stage at step 15, as at a checkpoint; windows wait out
    # the pause (window_grace_s at its default, longer than it)
    with Detector(tmp_path, hang_timeout_s=60.0, window_grace_s=30.0) as detector, \
            ranks(tmp_path, detector, 40, rank_args=pause_every_rank(15, 20)) as job:
        codes, took_s, status = run_to_the_end(job, detector, timeout=180)
    assert codes == [0] * RANKS, job.log_tails()
    assert took_s > 20  # the pause happened
    assert status["spans"]["heartbeats"] > 20 * RANKS * 0.5  # and the detector heard the ranks through it
    assert detector.of(contract.VERDICT_HANG) == []
    # and the windows around it are judged whole: nothing late, no rank silent
    assert status["engine"]["late"] == 0 and detector.of(contract.VERDICT_SILENT) == [], \
        f"{status['engine']}\n{status['spans']}\nlate for windows {sorted(late_for)}; closes {closes}\n{job.log_tails()}"


def test_a_rank_whose_first_export_comes_seconds_after_its_peers_is_judged_not_late(tmp_path):
    """Rank 0's batch processor waits 8 s where its peers' wait 0.5 s. Every rank runs 45 steps
    (windows 0-8) in a second or two and then sits 12 s in the optimizer of its last step, so the
    peers' spans for those windows are in while rank 0's first export is still seconds away. The
    ranks report their world size, so those windows wait for the fourth rank (up to
    max_export_lag_s, 15 s as by default) instead of closing without it a second after the first
    data, its spans then late. (The job ends with the pause: after it, ranks starved of CPU would
    test how long windows wait for a rank's next burst, another rule.)"""
    def slow_first_export(rank: int) -> dict:
        return {"OTEL_BSP_SCHEDULE_DELAY": "8000"} if rank == 0 else {}

    with Detector(tmp_path, max_export_lag_s=15.0, window_grace_s=30.0) as detector, \
            ranks(tmp_path, detector, 46, rank_env=slow_first_export, rank_args=pause_every_rank(45, 12)) as job:
        codes, took_s, status = run_to_the_end(job, detector, timeout=120)
    assert codes == [0] * RANKS, job.log_tails()
    assert took_s > 12  # the pause happened, after rank 0's first export was due
    engine = status["engine"]
    assert engine["late"] == 0 and detector.of(contract.VERDICT_SILENT) == [], f"{engine}\n{job.log_tails()}"
    assert engine["windows_closed"] >= 9 and engine["coverage_gaps"] == 0, engine


def test_a_torchrun_restart_from_a_checkpoint_is_judged_again(tmp_path):
    checkpoints = tmp_path / "checkpoint"
    checkpoints.mkdir()
    with Detector(tmp_path, window_steps=5, max_export_lag_s=15.0) as detector:  # the default: no hang here
        env = {**clean_environment(), "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{detector.endpoint}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "training",
               "OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_STRAGGLER_EXPORT_METRICS": "false",
               "OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS": "1000", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
                   "--max-restarts=1", "--monitor-interval=1", str(RESTART_TRAINER), "--steps", "150",
                   "--checkpoint-dir", str(checkpoints), "--crash-rank", "3", "--crash-step", "55",
                   "--slow-rank", "2"]
        log = tmp_path / "torchrun.log"
        with open(log, "wb") as output:
            process = subprocess.Popen(command, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=output,
                                       stderr=subprocess.STDOUT, preexec_fn=services._die_with_parent)
        try:
            code = process.wait(timeout=300)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        time.sleep(2)
        stats = detector.service.status()["engine"]
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "incarnation 1 step 51/150" in text  # resumed from the step-50 checkpoint: steps 51-55 came again
    assert stats["incarnations"] == 1
    assert stats["late"] == 0 and stats["duplicates"] == 0, stats
    assert detector.of(contract.VERDICT_SILENT) == [], (stats, text[-3000:])
    onsets = detector.of(contract.VERDICT_STRAGGLER)
    assert {v.rank for v in onsets} == {2} and all(v.window >= 50 // 5 for v in onsets), onsets
