"""Verdicts out, off the ingest path: the engine thread only appends to a bounded list; a writer thread
wakes every flush interval and sends what accumulated to the evidence file, then to telemetry
(counter and events), then refreshes status.json.

A SIGTERM is turned by the service into stop(), which flushes everything; a SIGKILL loses at most
the verdicts of the last flush interval, never part of a line (see evidence.py). Each flush ends with
an fsync, so a machine crash loses about as little: at most one fsync per interval, on this thread.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Callable, Optional

from otel_straggler.detector.evidence import CARRIED_SECTIONS, EvidenceFiles, verdict_line
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.periodic_writer import PeriodicWriter
from otel_straggler.detector.driver import EngineDriver
from otel_straggler.detector.telemetry import DetectorTelemetry

_log = logging.getLogger(__name__)
MAX_PENDING_VERDICTS = 200_000  # about one flush interval of a very large job; beyond it, counted and dropped


class VerdictEmitter(PeriodicWriter):
    def __init__(
        self,
        evidence: EvidenceFiles,
        flush_interval_s: float,
        status: Callable[[], dict],
        telemetry: Optional[DetectorTelemetry] = None,
    ) -> None:
        super().__init__("straggler-emitter", flush_interval_s)
        self._evidence = evidence
        self._status = status
        self._telemetry = telemetry
        self._pending: list[Verdict] = []
        self._counts_lock = threading.Lock()
        self._dropped: Counter[str] = Counter()  # verdicts not written to verdicts.jsonl, by reason
        self._errors: Counter[str] = Counter()
        self._verdicts: Counter[str] = Counter()  # emitted, by verdict kind
        self._logged: set[str] = set()

    def submit(self, verdicts: list[Verdict]) -> None:
        """Called on the engine thread; never blocks on I/O."""
        with self._wake:
            room = MAX_PENDING_VERDICTS - len(self._pending)
            self._pending.extend(verdicts[:max(0, room)])
        if len(verdicts) > room:
            self._count(self._dropped, "queue_full", len(verdicts) - max(0, room))

    def close(self) -> None:
        """At stop(), after the last flush (which wrote the last status.json)."""
        self._evidence.close()

    def counts(self) -> dict:
        with self._counts_lock:
            return {"verdicts": dict(self._verdicts), "verdicts_dropped": dict(self._dropped),
                    "errors": dict(self._errors)}

    def evidence_counts(self) -> dict:
        return {"path": self._evidence.verdicts_path, "bytes": self._evidence.size,
                "lines_written": self._evidence.lines_written,
                "torn_bytes_repaired": self._evidence.torn_bytes_repaired}

    def flush(self) -> None:
        with self._wake:
            verdicts, self._pending = self._pending, []
        if verdicts:
            before = self._evidence.lines_dropped_file_full
            failure: Optional[OSError] = None
            try:
                self._evidence.append(verdict_line(verdict) for verdict in verdicts)
            except OSError as error:
                failure = error
            full = self._evidence.lines_dropped_file_full - before  # left out before the write: not failed too
            self._count(self._dropped, "file_full", full)
            if failure is not None:
                self._failed("write_failed", len(verdicts) - full, "cannot append to verdicts.jsonl", failure)
            if self._telemetry is not None:
                try:
                    self._telemetry.record_verdicts(verdicts)
                except Exception as error:  # noqa: BLE001 - telemetry must not stop the evidence file
                    self._failed("telemetry", 1, "recording verdict telemetry failed", error)
            # counted once written and recorded, so a reader who sees the count in status.json
            # finds the verdicts in the evidence file and in the metrics too
            with self._counts_lock:
                self._verdicts.update(verdict.verdict for verdict in verdicts)
        try:
            self._evidence.write_status(self._status())
        except Exception as error:  # noqa: BLE001
            self._failed("status_file", 1, "cannot write status.json (it keeps its last contents; the "
                         "Prometheus endpoint and OTLP metrics have the current counters)", error)

    def _failed(self, reason: str, count: int, message: str, error: BaseException) -> None:
        self._count(self._dropped if reason == "write_failed" else self._errors, reason, count)
        if reason not in self._logged:  # once per reason: a full disk would otherwise flood the log
            self._logged.add(reason)
            # an OSError says which (ENOSPC: the disk is full); anything else is a bug: its traceback
            if isinstance(error, OSError):
                _log.error("%s: %s (counted as %s, logged once)", message, error, reason)
            else:
                _log.error("%s (counted as %s, logged once)", message, reason, exc_info=error)

    def _count(self, counter: Counter, key: str, amount: int) -> None:
        if amount > 0:
            with self._counts_lock:
                counter[key] += amount


def status_record(driver: EngineDriver, emitter: VerdictEmitter, telemetry: Optional[DetectorTelemetry],
                  carried: Optional[dict] = None) -> dict:
    """The counters part of status.json, shared by the live service and replay. `carried`: what
    earlier processes counted in the same evidence directory (evidence.carried_counters), added in."""
    counts = driver.counters.snapshot()
    emitted = emitter.counts()
    errors = Counter(counts["errors"])
    errors.update(emitted["errors"])
    record = {
        "spans": counts["spans"],
        "rejections": counts["rejections"],
        "requests": counts["requests"],
        "errors": dict(errors),
        "engine": driver.stats(),
        "jobs_without_stages": driver.jobs_without_stages(),
        # hosts that had a rank alerted: its ranks slow now, its ranks of the job, degraded (nodes.py)
        "nodes": [node.to_dict() for node in driver.node_state()],
        "verdicts": emitted["verdicts"],
        "verdicts_dropped": emitted["verdicts_dropped"],
        "evidence": emitter.evidence_counts(),
        "export_failures": dict(telemetry.export_failures) if telemetry is not None else {},
        "events_dropped": dict(telemetry.events_dropped) if telemetry is not None else {},
    }
    if carried:
        for section in CARRIED_SECTIONS:
            total = Counter(carried.get(section, {}))
            total.update(record[section])
            record[section] = dict(total)
    return record
