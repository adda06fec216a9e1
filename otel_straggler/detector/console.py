"""What `otel-straggler detect` prints on its console (stderr) while it runs: one line per alert,
recovery, hang, job slowdown and silent rank (`console_verdicts`), and a status line every
`console_status_interval_s` (docs/detector.md, What it prints).

A verdict line is the demo's (demo/live_view.py, so an alert reads the same in both places), then
what on-call needs to find the rank: job, host, local rank, reason, and the numbers the demo's
wording leaves out. `uncertain` verdicts get none: status.json and the metrics count them. Names a
sender chose (job id, host, stage) are shown cut short and without control characters.

The engine thread only queues the verdict (bounded: beyond that it is dropped and counted); a thread
of the console's own formats and writes, so a console that blocks (a full pipe) or fails never
holds up or stops the engine. Every failure is counted in status.json `errors` (`console_*`).
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Optional, TextIO

from otel_straggler import contract
from otel_straggler.demo.live_view import verdict_line
from otel_straggler.detector.gpu_evidence import describe
from otel_straggler.detector.next_step import next_step
from otel_straggler.detector.observation import Verdict

PRINTED_VERDICTS = frozenset({contract.VERDICT_STRAGGLER, contract.VERDICT_RECOVERED, contract.VERDICT_HANG,
                              contract.VERDICT_JOB_SLOWDOWN, contract.VERDICT_SILENT})
MAX_PENDING_VERDICTS = 10_000  # waiting for the console; beyond it dropped, counted as console_dropped
MAX_SHOWN_CHARS = 80  # of a name a sender chose: a 1 MiB job id stays off the console
MAX_ALSO_SLOW = 8  # stage names after "also slow:"
MAX_KINDS = 4  # reasons listed per count in the status line
MAX_JOBS_NAMED = 3  # jobs without stages named in the status line (status.json names more)
# request results that are not refusals: taken (some spans rejected, for partial), or another signal
_NOT_REFUSED = ("ok", "partial", "other_signal")


def shown(value: Any) -> str:
    """A sender's name as the console shows it: printable, at most MAX_SHOWN_CHARS."""
    text = str(value)
    cut = "".join(char if char.isprintable() else "?" for char in text[:MAX_SHOWN_CHARS])
    return cut + "..." if len(text) > MAX_SHOWN_CHARS else cut


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def verdict_text(verdict: Verdict) -> Optional[str]:
    """The console line of a verdict (without the command's prefix); None for one that gets none.

    'ALERT: straggler rank 2 in forward-compute at window 4 (1.30x its peers, +9.0 ms); also slow:
    ddp-grads-ready, *; job train-42, host node-3, local rank 2, reason slow_vs_peers; GPU: SM clock
    1410 MHz vs 1980 at its peers; hw_thermal throttling; 89 °C; next: GPU ... runs at reduced clocks: ...'
    A straggler's and a hang culprit's line ends with what its GPU showed and what to look at first."""
    if verdict.verdict not in PRINTED_VERDICTS:
        return None
    record = verdict.to_dict()
    for key in ("job_id", "cohort", "stage", "host"):
        if record.get(key) is not None:
            record[key] = shown(record[key])
    also_slow = [shown(stage) for stage in record.get("also_slow") or ()]
    if len(also_slow) > MAX_ALSO_SLOW:
        also_slow[MAX_ALSO_SLOW:] = [f"{len(also_slow) - MAX_ALSO_SLOW} more"]
    record["also_slow"] = also_slow
    line = verdict_line(record)
    if line is None:
        return None
    if also_slow and "also slow:" not in line:  # the demo's alert wording names them; other lines get them here
        line += "; also slow: " + ", ".join(also_slow)
    line = f"{line}; {', '.join(_details(record))}"
    if record["verdict"] in (contract.VERDICT_STRAGGLER, contract.VERDICT_HANG) and record.get("rank") is not None:
        words = describe(record.get("gpu"))
        line += (f"; GPU: {words}" if words else "") + f"; next: {next_step(record)}"
    return line


def _details(record: dict) -> list[str]:
    kind = record["verdict"]
    details = [f"job {record['job_id']}"]
    if record.get("host") is not None and kind != contract.VERDICT_HANG:  # a hang's line names it already
        details.append(f"host {record['host']}")
    if record.get("local_rank") is not None:
        details.append(f"local rank {record['local_rank']}")
    if record["reason"] == contract.HANG_PROGRESS_RESUMED:  # the only line that does not say the stage
        details.append(f"stage {record['stage']}")
    details.append(f"reason {shown(record['reason'])}")
    # the numbers the demo's wording leaves out: an alert's line has both, a job slowdown's its ratio
    if kind not in (contract.VERDICT_STRAGGLER, contract.VERDICT_JOB_SLOWDOWN) and _finite(record.get("slowdown")):
        details.append(f"slowdown {record['slowdown']:.2f}x")
    if kind != contract.VERDICT_STRAGGLER and _finite(record.get("gap_ms")):
        details.append(f"gap {record['gap_ms']:+.1f} ms")
    return details


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _by_kind(counts: Optional[dict]) -> str:
    """' (missing_job_id 10, bad_rank 2)': the largest first, at most MAX_KINDS; '' for none."""
    kinds = sorted(((count, kind) for kind, count in (counts or {}).items() if count),
                   key=lambda item: (-item[0], item[1]))
    if not kinds:
        return ""
    listed = ", ".join(f"{shown(kind)} {count}" for count, kind in kinds[:MAX_KINDS])
    return f" ({listed}{', ...' if len(kinds) > MAX_KINDS else ''})"


def status_text(status: dict, previous: Optional[dict], alerts_active: Optional[int]) -> str:
    """The periodic status line from a DetectorService.status() record (what status.json holds):
    jobs and ranks the engine judges, accepted stage spans per second since `previous` (the record of
    the last line; None: since the start), straggler alerts active, then the totals since the start
    of late, malformed (by kind), dropped spans, refused requests and errors (by kind), and the jobs
    that send heartbeats but no stage spans.

    'status: 2 jobs, 16 ranks, 1250 spans/s, 1 alert active; since start: 0 late, 3 malformed
    (missing_job_id 3); jobs without stages: job-x (4 ranks, 75 s)'"""
    engine = status.get("engine") or {}
    spans = status.get("spans") or {}
    now = status.get("time_unix_nano") or 0
    if previous is not None:
        since, before = previous.get("time_unix_nano"), (previous.get("spans") or {}).get("accepted", 0)
    else:
        since, before = status.get("started_unix_nano"), 0
    seconds = (now - since) / 1e9 if since is not None else 0.0
    rate = (spans.get("accepted", 0) - before) / seconds if seconds > 0 else 0.0
    parts = [_plural(engine.get("jobs", 0), "job"), _plural(engine.get("ranks", 0), "rank"), f"{rate:.0f} spans/s"]
    if alerts_active is not None:
        parts.append(f"{_plural(alerts_active, 'alert')} active")
    totals = [f"{spans.get('late', 0)} late",
              f"{spans.get('malformed', 0)} malformed{_by_kind(status.get('rejections'))}"]
    if spans.get("dropped"):
        totals.append(f"{spans['dropped']} dropped")
    refused = {result: count for result, count in (status.get("requests") or {}).items() if result not in _NOT_REFUSED}
    if any(refused.values()):
        totals.append(f"{_plural(sum(refused.values()), 'request')} refused{_by_kind(refused)}")
    errors = status.get("errors") or {}
    if any(errors.values()):
        totals.append(f"{_plural(sum(errors.values()), 'error')}{_by_kind(errors)}")
    line = f"status: {', '.join(parts)}; since start: {', '.join(totals)}"
    stageless = status.get("jobs_without_stages") or {}
    if stageless.get("count"):
        named = [f"{shown(job['job_id'])} ({_plural(job['ranks'], 'rank')}, {job['seconds']:.0f} s)"
                 for job in stageless.get("jobs", [])[:MAX_JOBS_NAMED]]
        more = stageless["count"] - len(named)
        line += f"; jobs without stages: {', '.join(named)}{f' and {more} more' if more > 0 else ''}"
    return line


class DetectorConsole:
    """Writes verdict lines (fed by `on_verdict`, a verdict listener) and, every `status_interval_s`
    (0: never), a status line to `stream`, each line after `prefix`, from a thread of its own.

    `status` returns DetectorService.status(); `alerts_active` the number of straggler alerts active
    (None: not shown); `count_error(kind, count)` counts a failure (DetectorService.count_error)."""

    def __init__(self, stream: TextIO, status: Callable[[], dict],
                 alerts_active: Optional[Callable[[], int]] = None, status_interval_s: float = 60.0,
                 count_error: Callable[[str, int], None] = lambda kind, count: None,
                 prefix: str = "otel-straggler detect: ") -> None:
        self._stream = stream
        self._status = status
        self._alerts_active = alerts_active
        self._status_interval_s = status_interval_s
        self._count_error = count_error
        self._prefix = prefix
        self._pending: list[Verdict] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._previous_status: Optional[dict] = None
        self._thread: Optional[threading.Thread] = None

    def on_verdict(self, verdict: Verdict) -> None:
        """Called on the engine thread: queues the verdict, never waits for the console."""
        if verdict.verdict not in PRINTED_VERDICTS:
            return
        with self._wake:
            queued = len(self._pending) < MAX_PENDING_VERDICTS
            if queued:
                self._pending.append(verdict)
                self._wake.notify()
        if not queued:
            self._failed("console_dropped")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="straggler-console", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Writes the verdicts queued so far, then ends the thread; False when that took too long
        (the stream blocks): the daemon thread is left behind."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        interval_s = self._status_interval_s
        next_status = time.monotonic() + interval_s if interval_s > 0 else None
        while True:
            with self._wake:
                while not self._pending and not self._stopping:
                    wait_s = None if next_status is None else next_status - time.monotonic()
                    if wait_s is not None and wait_s <= 0:
                        break
                    self._wake.wait(wait_s)
                verdicts, self._pending = self._pending, []
                stopping = self._stopping
            for verdict in verdicts:
                self._write_verdict(verdict)
            if stopping:
                return
            if next_status is not None and time.monotonic() >= next_status:
                self._write_status()
                next_status = time.monotonic() + interval_s

    def _write_verdict(self, verdict: Verdict) -> None:
        try:
            text = verdict_text(verdict)
        except Exception:  # noqa: BLE001 - a line missed, counted; the next one comes
            self._failed("console_format")
            return
        if text is not None:
            self._write(text)

    def _write_status(self) -> None:
        try:
            status = self._status()
            alerts = self._alerts_active() if self._alerts_active is not None else None
            text = status_text(status, self._previous_status, alerts)
            self._previous_status = status
        except Exception:  # noqa: BLE001
            self._failed("console_status")
            return
        self._write(text)

    def _write(self, text: str) -> None:
        try:
            self._stream.write(f"{self._prefix}{text}\n")
            self._stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stderr: counted, the detector goes on
            self._failed("console_write")

    def _failed(self, kind: str) -> None:
        try:
            self._count_error(kind, 1)
        except Exception:  # noqa: BLE001
            pass
