"""`otel-straggler replay FILE...`: the detector offline over OTLP JSON-lines files.

The input is what the OTel collector's `file` exporter writes (format: json): one
ExportTraceServiceRequest-shaped JSON object per line, optionally gzip-compressed (by name `.gz` or
by content). Lines holding metrics or logs instead of spans are skipped and counted. Lines are
decoded and ingested in file order by the same decode and engine code as the live service; the
clock given to the engine is the latest span end time seen so far (heartbeats included), so windows
close and hangs are declared as they would have been live, and everything still open is judged at the end (drain).
A cohort's first windows wait max_export_lag_s for ranks not seen yet (Engine's patient_start): a
line's recorded times precede its arrival by up to the rank's export delay. Verdicts, status and window medians
go to the same evidence files as `detect` writes (verdicts.jsonl and windows.jsonl are appended to,
never rewritten).
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.decode import MalformedPayload, decode_json_request
from otel_straggler.detector.emit import VerdictEmitter, status_record
from otel_straggler.detector.evidence import EvidenceFiles
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.driver import EngineDriver, IntakeCounters
from otel_straggler.detector.engine_interface import DetectorEngine
from otel_straggler.detector.telemetry import DetectorTelemetry
from otel_straggler.detector.window_record import WindowRecord, detector_engine

_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class ReplaySummary:
    lines: int
    status: dict


def _open_lines(path: str) -> Iterator[bytes]:
    with open(path, "rb") as raw:
        compressed = path.endswith(".gz") or raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        yield from gzip.GzipFile(fileobj=raw) if compressed else raw


def replay(
    paths: Sequence[str],
    config: DetectorConfig,
    export_telemetry: bool = False,
    listener: Optional[Callable[[Verdict], None]] = None,
    engine: Optional[DetectorEngine] = None,
) -> ReplaySummary:
    """Runs the files through decode and the engine; writes evidence to config.evidence_dir.
    Raises OSError for a file that cannot be read (nothing is half-replayed silently)."""
    for path in paths:
        if not os.path.isfile(path):
            raise OSError(f"{path}: no such file")
    windows = WindowRecord.from_config(config) if engine is None else None  # a custom engine records none
    if engine is None:
        engine = detector_engine(config, windows, patient_start=True)
    counters = IntakeCounters()
    telemetry: Optional[DetectorTelemetry] = None
    # driver and emitter are assigned below, before anything can call these closures
    def deliver(verdicts: list[Verdict]) -> None:
        if listener is not None:
            for verdict in verdicts:
                listener(verdict)
        emitter.submit(verdicts)

    def status() -> dict:
        return {"mode": "replay", "files": list(paths), **status_record(driver, emitter, telemetry),
                **({"windows": windows.counts()} if windows is not None else {})}

    if export_telemetry:
        telemetry = DetectorTelemetry(config, status, lambda: driver.rank_state(), export_otlp=True,
                                      hang_states=lambda: driver.hang_state())
    driver = EngineDriver(engine, counters, deliver, telemetry.record_ingest_lag if telemetry else None)
    emitter = VerdictEmitter(EvidenceFiles(config.evidence_dir, config.max_evidence_bytes), config.flush_interval_s,
                             status, telemetry)
    emitter.start()
    if windows is not None:
        windows.start()
    clock = 0
    lines = 0
    try:
        for path in paths:
            for line in _open_lines(path):
                if not line.strip():
                    continue
                lines += 1
                try:
                    request = json.loads(line)
                except (ValueError, RecursionError):  # RecursionError: nested too deep, e.g. a line of '['
                    counters.add_request("malformed")
                    continue
                if not isinstance(request, dict) or "resourceSpans" not in request:
                    counters.add_request("not_traces")  # metrics or logs lines of the same file
                    continue
                try:
                    batch = decode_json_request(request)
                except MalformedPayload:
                    counters.add_request("malformed")
                    continue
                except Exception:  # noqa: BLE001 - a decoder failure: counted as the receivers count it
                    counters.add_request("malformed")
                    counters.add_error("decode")
                    continue
                counters.add_request("partial" if batch.malformed else "ok")
                driver.count_decoded(batch)
                # heartbeats move the clock too, so a recorded hang is declared as it was live
                clock = max(clock, max((observation.end_unix_nano for observation in batch.observations), default=0),
                            max((heartbeat.time_unix_nano for heartbeat in batch.heartbeats), default=0))
                driver.ingest(batch, clock)
                driver.advance(clock)
        driver.drain(clock)
    finally:
        if windows is not None:  # before the emitter, whose last status.json counts its windows
            windows.stop(timeout_s=60.0)
        emitter.stop(timeout_s=60.0)
        if telemetry is not None:
            telemetry.shutdown()
    return ReplaySummary(lines, status())
