"""Switching the instrumentation on changes nothing about training: with fixed seeds on CPU,
the demo job gives bit-identical losses and final state (sha256 of every tensor of the model's
state dict and the optimizer's state) with the library ON and OFF, and ON calls no device
sync, barrier or collective that OFF does not (spied on in the rank processes).

The job is run by benchmarks/demo_training.py, the harness of the overhead benchmark: the demo
trainer's model, data, stages and all-reduce at its default sizes, one process per rank. ON is the full path (fake
device events, span building, batching, OTLP/gRPC export) to a live detector in this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.service import DetectorService

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_training.py"
STEPS = 20


@pytest.fixture(scope="module")
def detector_endpoint(tmp_path_factory):
    service = DetectorService(DetectorConfig(grpc_port=0, http_port=0, export_metrics=False,
                                             evidence_dir=str(tmp_path_factory.mktemp("evidence"))))
    service.start()
    yield f"127.0.0.1:{service.bound_ports[0]}"
    service.stop(timeout_s=10)


def train(arm: str, world_size: int, endpoint: str, out: Path) -> list[dict]:
    """Each rank's record of one run of the job with the library `arm` (on/off)."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "RANK"))}
    environment["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), environment.get("PATH", "")])
    subprocess.run([sys.executable, str(HARNESS), "--schedule", arm, "--steps", str(STEPS), "--world-size",
                    str(world_size), "--endpoint", endpoint,
                    "--job-prefix", f"equivalence-{arm}-{world_size}", "--count-calls", "--out", str(out)],
                   env=environment, check=True, timeout=300)
    return [json.loads((out / f"rank-{rank}.json").read_text())["arms"][0] for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 3], ids=["single-process", "3-rank-gloo"])
def test_on_and_off_train_bit_identically_with_the_same_calls(world_size: int, detector_endpoint: str, tmp_path: Path):
    off = train("off", world_size, detector_endpoint, tmp_path / "off")
    on = train("on", world_size, detector_endpoint, tmp_path / "on")

    for rank in range(world_size):
        assert len(off[rank]["losses"]) == STEPS
        assert on[rank]["losses"] == off[rank]["losses"], f"rank {rank}: losses differ"
        assert on[rank]["state_sha256"] == off[rank]["state_sha256"], f"rank {rank}: final state differs"
        assert on[rank]["calls"] == off[rank]["calls"], f"rank {rank}: ON called syncs or collectives OFF did not"
        # the spy sees the job's own all-reduce, one per step, and no device sync anywhere
        assert off[rank]["calls"] == ({"torch.distributed.all_reduce": STEPS} if world_size > 1 else {})

        status = on[rank]["status"]  # ON really was on: every interval built and exported, none lost
        assert status["spans_built"] == STEPS * (5 if world_size > 1 else 4)
        assert status["exported"] == status["spans_built"] + status["steps_built"] + status["heartbeats"]
        assert status["device_timed"] == status["spans_built"]
        assert not any(status["lost"].values())
        assert off[rank]["status"] is None

    # ranks train different shards but end with the same averaged weights
    assert len({json.dumps(record["state_sha256"], sort_keys=True) for record in on}) == 1
