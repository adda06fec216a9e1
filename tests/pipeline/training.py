"""Real training ranks for the end-to-end tests: the demo trainer (gloo on CPU), one process per
rank, exporting over OTLP wherever the test points them.

    with TrainingRanks(workdir, world_size=4, endpoint=gateway.grpc_endpoint, job_id=job,
                       steps=40, rank_env=lambda rank: {...}, rank_args=lambda rank: (...)) as ranks:
        ranks.wait_for_step(10, timeout=120)
        ...
        codes = ranks.wait(timeout=240)
    ranks.statuses()   # each rank's final instrumentation counters (rank_main.py)

Each rank is `rank_main.py`: the trainer itself, then one `rank-status {json}` line. Output goes to
rank-N.log in the workdir. Every wait has a deadline; leaving the `with` block stops every rank
still running (SIGTERM, then SIGKILL), whatever happened inside.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

from otel_straggler.testing import services
from .rank_main import STATUS_PREFIX

RANK_MAIN = Path(__file__).resolve().parent / "rank_main.py"
PROGRESS = re.compile(r"^step (\d+)/(\d+) loss ")
STOP_GRACE_S = 5.0


def clean_environment() -> dict[str, str]:
    """This process's environment without OTel or otel-straggler settings a developer's shell
    may have exported (they would redirect or reshape the ranks' telemetry)."""
    return {name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "OTELCOL_"))}


class TrainingRanks:
    def __init__(self, workdir: Path, world_size: int, endpoint: str, job_id: str, steps: int,
                 rank_env: Optional[Callable[[int], Mapping[str, str]]] = None,
                 env: Optional[Mapping[str, str]] = None, trainer_args: tuple[str, ...] = (),
                 rank_args: Optional[Callable[[int], tuple[str, ...]]] = None) -> None:
        """endpoint: host:port of an OTLP/gRPC receiver; rank_env(rank) adds per-rank variables
        (cohort); env adds variables for every rank. trainer_args go to every rank's trainer,
        rank_args(rank) to that rank's only (a slowed rank's flags: slow_rank_args)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.world_size = world_size
        self.steps = steps
        self.common = clean_environment()
        self.common.update({
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_STRAGGLER_JOB_ID": job_id,
            "OTEL_SERVICE_NAME": "training",
            "OTEL_BSP_SCHEDULE_DELAY": "500",  # as the demo: spans leave a rank within half a second
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
            "MASTER_ADDR": services.LOOPBACK,
            "MASTER_PORT": str(services.free_port()),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        })
        self.common.update(env or {})
        self.rank_env = rank_env or (lambda rank: {})
        self.trainer_args = ("--steps", str(steps), "--log-every", "1", *trainer_args)
        self.rank_args = rank_args or (lambda rank: ())
        self.processes: list[subprocess.Popen] = []

    def log_path(self, rank: int) -> Path:
        return self.workdir / f"rank-{rank}.log"

    def start(self) -> "TrainingRanks":
        try:
            for rank in range(self.world_size):
                env = {**self.common, "RANK": str(rank), "LOCAL_RANK": str(rank), **self.rank_env(rank)}
                with open(self.log_path(rank), "wb") as log:
                    self.processes.append(subprocess.Popen(
                        [sys.executable, str(RANK_MAIN), *self.trainer_args, *self.rank_args(rank)], env=env,
                        cwd=self.workdir,
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        preexec_fn=services._die_with_parent))
        except BaseException:
            self.stop()
            raise
        return self

    def progress(self) -> int:
        """Steps rank 0 has finished, from its `step N/T loss X` lines."""
        done = 0
        for line in self._log_lines(0):
            match = PROGRESS.match(line)
            if match:
                done = int(match.group(1))
        return done

    def wait_for_step(self, step: int, timeout: float) -> int:
        """Waits until rank 0 has finished `step` steps; fails early when a rank exits."""
        def reached():
            failed = [(rank, p.returncode) for rank, p in enumerate(self.processes) if p.poll() not in (None, 0)]
            if failed:
                raise AssertionError(f"ranks exited with {failed} before step {step}\n{self.log_tails()}")
            return self.progress() >= step and self.progress()

        try:
            return services.wait_until(reached, timeout, interval=0.1, what=f"rank 0 at step {step}")
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{self.log_tails()}") from None

    def wait(self, timeout: float) -> list[int]:
        """Waits for every rank to exit; their exit codes. Ranks still running at the deadline are
        stopped and reported as None."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        codes = [process.poll() for process in self.processes]
        self.stop()
        return codes

    def statuses(self) -> list[Optional[dict]]:
        """Each rank's final instrumentation counters (None where the rank printed none)."""
        found: list[Optional[dict]] = []
        for rank in range(self.world_size):
            lines = [line for line in self._log_lines(rank) if line.startswith(STATUS_PREFIX)]
            found.append(json.loads(lines[-1][len(STATUS_PREFIX):]) if lines else None)
        return found

    def stop(self) -> None:
        live = [process for process in self.processes if process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in live:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_GRACE_S)

    def log_tails(self, lines: int = 8) -> str:
        return "\n".join(f"--- rank {rank} ---\n" + "\n".join(self._log_lines(rank)[-lines:])
                         for rank in range(self.world_size))

    def _log_lines(self, rank: int) -> list[str]:
        try:
            return self.log_path(rank).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []

    def __enter__(self) -> "TrainingRanks":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
