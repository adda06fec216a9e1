"""Starts the training ranks as local processes and watches them, the way torchrun does on
one node: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT per process, each rank's output in its
own log file, rank 0's progress lines parsed for the live view.

Every wait is bounded: a rank that dies, a job that stops making progress, or ranks that do
not exit after finishing end the run with one clear message, and the other ranks are stopped.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from otel_straggler.demo.ports import free_port

PROGRESS_LINE = re.compile(r"^step (\d+)/(\d+) loss (\S+)")
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long


class RankFailure(Exception):
    """The job cannot finish; the message says which rank and why, in one line."""


@dataclass(frozen=True)
class LaunchPlan:
    ranks: int
    trainer_args: tuple[str, ...]
    env: dict[str, str]  # added to this process's environment for every rank
    log_dir: Path
    startup_timeout_s: float = 120.0  # until rank 0 reports its first step
    # longest time between two progress lines; under the trainer's collective timeout (60 s), so
    # a stuck rank is reported as a stall rather than as its peers' failed all-reduce
    stall_timeout_s: float = 45.0
    exit_timeout_s: float = 30.0  # after one rank finished, the others must exit within this
    trainer_module: str = "otel_straggler.demo.trainer"  # run as `python -m` in each rank


def parse_progress(line: str) -> Optional[tuple[int, Optional[float]]]:
    """(steps done, loss) from one of rank 0's `step N/T loss X` lines, else None."""
    match = PROGRESS_LINE.match(line)
    if match is None:
        return None
    try:
        loss: Optional[float] = float(match.group(3))
    except ValueError:
        loss = None
    return int(match.group(1)), loss


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankGroup:
    """The rank processes of one run. start(), then poll() until it returns True (all ranks
    finished) or raises RankFailure; stop() is always safe to call."""

    def __init__(self, plan: LaunchPlan, on_progress: Callable[[int, Optional[float]], None]) -> None:
        self.plan = plan
        self._on_progress = on_progress
        self._processes: list[subprocess.Popen] = []
        self._readers: list[threading.Thread] = []
        self._last_progress = time.monotonic()
        self._steps_done = 0
        self._first_exit_at: Optional[float] = None

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def seconds_without_progress(self) -> float:
        """Since rank 0's last progress line (0 before its first)."""
        return time.monotonic() - self._last_progress if self._steps_done else 0.0

    def log_path(self, rank: int) -> Path:
        return self.plan.log_dir / f"rank-{rank}.log"

    def start(self) -> None:
        self.plan.log_dir.mkdir(parents=True, exist_ok=True)
        common = {**os.environ, **self.plan.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                  "WORLD_SIZE": str(self.plan.ranks), "LOCAL_WORLD_SIZE": str(self.plan.ranks),
                  "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "otel_straggler.demo.rank_process", str(os.getpid()),
                   self.plan.trainer_module, *self.plan.trainer_args]
        self._last_progress = time.monotonic()
        for rank in range(self.plan.ranks):
            process = subprocess.Popen(
                command, env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            )
            self._processes.append(process)
            reader = threading.Thread(target=self._copy_output, args=(rank, process), daemon=True,
                                      name=f"rank-{rank}-output")
            reader.start()
            self._readers.append(reader)

    def _copy_output(self, rank: int, process: subprocess.Popen) -> None:
        """Tees the rank's output into its log; rank 0's progress lines also go to the view."""
        assert process.stdout is not None  # started with stdout=PIPE
        with self.log_path(rank).open("w", encoding="utf-8") as log:
            for line in process.stdout:
                log.write(line)
                log.flush()
                progress = parse_progress(line) if rank == 0 else None
                if progress is not None:
                    self._steps_done = progress[0]
                    self._last_progress = time.monotonic()
                    self._on_progress(*progress)

    def poll(self) -> bool:
        codes = [process.poll() for process in self._processes]
        failed = {rank: code for rank, code in enumerate(codes) if code is not None and code != 0}
        if failed:
            # A killed rank takes its peers down with it (their collectives fail): blame the
            # one a signal ended, if any, and name the others.
            culprit = next((rank for rank, code in failed.items() if code < 0), next(iter(failed)))
            others = [rank for rank in failed if rank != culprit]
            also = f" (ranks {others} failed too)" if others else ""
            raise RankFailure(f"rank {culprit} {describe_exit(failed[culprit])} after step {self._steps_done}{also}; "
                              f"{self._log_hint(culprit)}")
        if all(code == 0 for code in codes):
            self._drain_output(range(len(self._readers)))
            return True
        now = time.monotonic()
        if any(code == 0 for code in codes):
            self._first_exit_at = self._first_exit_at or now
            if now - self._first_exit_at > self.plan.exit_timeout_s:
                stuck = [rank for rank, code in enumerate(codes) if code is None]
                raise RankFailure(
                    f"ranks {stuck} did not exit {self.plan.exit_timeout_s:g} s after the others finished")
        waited = now - self._last_progress
        if self._steps_done == 0 and waited > self.plan.startup_timeout_s:
            raise RankFailure(f"no training step within {self.plan.startup_timeout_s:g} s of starting; "
                              f"{self._log_hint(0)}")
        if self._steps_done > 0 and waited > self.plan.stall_timeout_s and self._first_exit_at is None:
            raise RankFailure(f"no progress for {self.plan.stall_timeout_s:g} s after step {self._steps_done}; "
                              f"a rank may be stuck (logs in {self.plan.log_dir})")
        return False

    def _log_hint(self, rank: int) -> str:
        if self._processes[rank].poll() is not None:
            self._drain_output([rank])
        try:
            text = self.log_path(rank).read_text(encoding="utf-8")
            lines = [line.strip() for line in text.splitlines() if line.strip()]
        except OSError:
            lines = []
        last = f"its last output: {lines[-1][:200]!r}; " if lines else ""
        return f"{last}log: {self.log_path(rank)}"

    def _drain_output(self, ranks: Iterable[int]) -> None:
        """Waits (briefly) until the output of these exited ranks is all in their logs."""
        for rank in ranks:
            self._readers[rank].join(timeout=1.0)

    def stop(self) -> None:
        """SIGTERM to every live rank, SIGKILL to any still alive after the grace period."""
        live = [process for process in self._processes if process.poll() is None]
        for process in live:
            process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in live:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_GRACE_S)
        self._drain_output(range(len(self._readers)))
