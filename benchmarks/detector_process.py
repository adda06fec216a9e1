"""The live detector the rank-side benchmarks export to: `otel-straggler detect` as its own
process on free loopback ports, as a job runs it (rank_background.py, gpu_check.py), or a
DetectorService in the benchmark's own process (hot_path_in_situ.py, page_faults.py)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
from typing import Iterator


class DetectorProcess:
    def __init__(self, evidence_dir: str, *flags: str) -> None:
        """flags: more of the detector's own flags."""
        self.evidence_dir = evidence_dir
        self.process = subprocess.Popen(
            [sys.executable, "-m", "otel_straggler.cli", "detect", "--grpc-port", "0", "--http-port", "0",
             "--evidence-dir", evidence_dir, "--export-metrics", "false", *flags],
            # cwd: not a checkout, whose otel_straggler/ folder would shadow the installed package
            cwd=evidence_dir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        line = self.process.stdout.readline() if ready else ""
        found = re.search(r"OTLP/gRPC ([0-9.]+:[0-9]+), OTLP/HTTP ([0-9.]+:[0-9]+)", line)
        if not found:
            self.stop()
            raise RuntimeError(f"the detector did not start: {line!r}")
        self.endpoint, self.http_endpoint = found.group(1), found.group(2)  # host:port each

    def spans(self) -> dict:
        """The intake counters of its status.json (refreshed once a second)."""
        with open(os.path.join(self.evidence_dir, "status.json")) as status:
            return json.load(status)["spans"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(45)  # its shutdown may take its own 30 s budget, and a second more
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def detector_in_this_process(prefix: str) -> Iterator[str]:
    """A DetectorService in this process on free loopback ports, its evidence in a scratch folder
    removed afterwards: the live detector that in-process benchmarks' children export to. Yields
    its OTLP/gRPC endpoint (host:port)."""
    from otel_straggler.detector.config import DetectorConfig
    from otel_straggler.detector.service import DetectorService

    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        detector = DetectorService(DetectorConfig(grpc_port=0, http_port=0, export_metrics=False,
                                                  evidence_dir=os.path.join(scratch, "evidence")))
        detector.start()
        try:
            yield f"127.0.0.1:{detector.bound_ports[0]}"
        finally:
            detector.stop()
