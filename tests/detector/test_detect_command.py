"""`otel-straggler detect` as a process: start-up line, one-line errors, and what SIGTERM and SIGKILL
leave in the evidence directory."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.decode import ProtobufDecoder
from otel_straggler.detector.engine import Engine

from otel_straggler.testing.otlp_spans import (eventful_observations, per_step_requests, request_bytes, verdict_records,
                                               without_time)

FLUSH_INTERVAL_S = 0.5
# a short startup hold (max-export-lag-s bounds it): these tests time what comes after the first spans
ENGINE_FLAGS = ("--window-steps", "5", "--window-grace-s", "3600", "--max-export-lag-s", "0.1")
STARTED = re.compile(r"OTLP/gRPC 127\.0\.0\.1:(\d+), OTLP/HTTP 127\.0\.0\.1:(\d+)")


def start_detect(evidence: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_EXPORTER_OTLP")}
    process = subprocess.Popen(
        [sys.executable, "-m", "otel_straggler", "detect", "--grpc-port", "0", "--http-port", "0",
         "--evidence-dir", str(evidence), "--flush-interval-s", str(FLUSH_INTERVAL_S), *ENGINE_FLAGS, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()
    started = STARTED.search(line)
    assert started, (line, process.stderr.read() if process.poll() is not None else "")
    assert "allocator: " in line, line  # what the detector did to the process's allocator (allocator.py)
    return process, int(started.group(1))


def send(grpc_port: int, requests) -> int:
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True, timeout=10)
    for spans in requests:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    return sum(len(spans) for spans in requests)


def engine_verdicts(requests, drain: bool) -> list[dict]:
    """What the engine makes of the same spans in-process, with or without the final drain."""
    engine = Engine(DetectorConfig(window_steps=5, window_grace_s=3600, max_export_lag_s=0.1))
    decoder = ProtobufDecoder()
    verdicts = []
    now = 0
    for spans in requests:
        batch = decoder.decode(request_bytes(spans))
        engine.ingest_placements(batch.placements)
        engine.ingest_many(batch.observations)
        now += 10**9  # a second per request: past the startup hold, short of any idle close
        verdicts += engine.advance(now)
    if drain:
        verdicts += engine.drain(now)
    return [verdict.to_dict() for verdict in verdicts]


def wait_for_status(evidence: Path, accepted: int, timeout_s: float = 20.0, processes: int = 1) -> dict:
    """The status.json of the `processes`-th detector on `evidence` once it counts `accepted` spans
    (counting since the first: the counters carry on across restarts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = json.loads((evidence / "status.json").read_text())
            if status["spans"]["accepted"] == accepted and status["history"]["processes"] == processes:
                return status
        except (OSError, ValueError, KeyError):
            pass  # not written yet; a half-written one would be a failure, caught by json below
        time.sleep(0.05)
    raise AssertionError(f"status.json never showed {accepted} accepted spans")


def test_sigterm_judges_every_open_window_and_flushes_all_evidence(tmp_path):
    evidence = tmp_path / "evidence"
    requests = per_step_requests(eventful_observations())
    process, grpc_port = start_detect(evidence)
    send(grpc_port, requests)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0, process.stderr.read()
    written = verdict_records(evidence / "verdicts.jsonl")
    assert without_time(written) == without_time(engine_verdicts(requests, drain=True))
    status = json.loads((evidence / "status.json").read_text())
    assert status["spans"]["accepted"] == sum(len(spans) for spans in requests)
    assert status["evidence"]["lines_written"] == len(written)


def test_sigkill_loses_at_most_the_last_flush_interval_and_never_tears_a_line(tmp_path):
    evidence = tmp_path / "evidence"
    requests = per_step_requests(eventful_observations())
    process, grpc_port = start_detect(evidence)
    total = send(grpc_port, requests)
    wait_for_status(evidence, total)
    # the engine thread closes windows within 0.1 s of ingest; one flush interval later they are on disk
    time.sleep(0.1 + FLUSH_INTERVAL_S + 0.5)  # + scheduling slack on a busy machine
    process.kill()
    process.wait(30)
    raw = (evidence / "verdicts.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    written = [json.loads(line) for line in raw.splitlines()]
    expected = engine_verdicts(requests, drain=False)
    assert expected and without_time(written) == without_time(expected)

    # a torn tail (as a kill in mid-write could leave) is cut when the next detector starts
    with open(evidence / "verdicts.jsonl", "ab") as handle:
        handle.write(b'{"time_unix_nano": 17')
    process, _ = start_detect(evidence)
    try:
        deadline = time.monotonic() + 20
        while (evidence / "verdicts.jsonl").read_bytes() != raw:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status = wait_for_status(evidence, total, processes=2)  # nothing new: the first one's count
        assert status["evidence"]["torn_bytes_repaired"] == len(b'{"time_unix_nano": 17')
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_bad_settings_are_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "otel_straggler", "detect", "--min-gap-ms", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "otel-straggler detect: --min-gap-ms: must be >= 0, got -1"
    done = subprocess.run([sys.executable, "-m", "otel_straggler", "detect", "--grpc-port", "0", "--http-port", "0",
                           "--evidence-dir", str(tmp_path), "--auth-token-file", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--auth-token-file" in done.stderr


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run(
            [sys.executable, "-m", "otel_straggler", "detect", "--grpc-port", "0",
             "--http-port", str(taken.getsockname()[1]), "--evidence-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Address already in use" in done.stderr


def test_the_console_shows_a_line_per_alert_recovery_and_silence_and_a_status_line(tmp_path):
    evidence = tmp_path / "evidence"
    requests = per_step_requests(eventful_observations())
    process, grpc_port = start_detect(evidence, "--console-status-interval-s", "0.3")
    try:
        wait_for_status(evidence, send(grpc_port, requests))
        time.sleep(0.8)  # a status line or two after the spans
    finally:
        process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    lines = process.stderr.read().splitlines()
    written = verdict_records(evidence / "verdicts.jsonl")
    shown = {"straggler": "ALERT: straggler", "recovered": "RECOVERED:", "silent": "SILENT:"}
    for kind, start in shown.items():
        expected = [record for record in written if record["verdict"] == kind]
        printed = [line for line in lines if line.startswith(f"otel-straggler detect: {start}")]
        assert expected and len(printed) == len(expected), (kind, lines)
    alert = next(line for line in lines if "ALERT: straggler" in line)
    assert alert.startswith("otel-straggler detect: ALERT: straggler rank 3 in ")
    assert "; job job-1, host node-0, reason slow_vs_peers" in alert
    assert not any("uncertain" in line or "below_absolute_floor" in line for line in lines)
    assert any(line.startswith("otel-straggler detect: status: 1 job, 8 ranks, ") for line in lines), lines
