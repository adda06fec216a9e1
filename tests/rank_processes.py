"""One process per rank, each with its own command and environment, all waited for under one
deadline: the multi-rank tests' launcher. A rank still running at the deadline, or when anything
fails, is killed; a rank that exits non-zero fails the test with the tail of its output."""
from __future__ import annotations

import subprocess
import time


def run_rank_processes(launches: list[tuple[list[str], dict]], timeout_s: float) -> list[str]:
    """Starts `(argv, env)` per rank, waits for all and returns each rank's output (stdout and
    stderr together)."""
    ranks = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, env in launches]
    deadline = time.monotonic() + timeout_s
    try:
        outputs = [process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}:\n{output[-4000:]}"
    return outputs


def run_script_as_ranks(script: str, world_size: int, endpoint: str, repo: str, timeout_s: float) -> list[dict]:
    """Runs `script` once per rank as torchrun would start it (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT on a free port), exporting to the OTLP/gRPC `endpoint`, the repository on
    PYTHONPATH and no OTEL_* of the caller's; returns the JSON each rank prints last."""
    import json
    import os
    import sys

    from otel_straggler.demo.ports import free_port

    environment = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    environment.update(WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{endpoint}", OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([repo, environment.get("PYTHONPATH", "")]))
    outputs = run_rank_processes(
        [([sys.executable, script], {**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)})
         for rank in range(world_size)], timeout_s)
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]
