"""The detector's log line for malformed spans, so that a misconfigured job shows within a minute.

A job whose ranks send no `training.job.id` has every span rejected, and no verdict ever comes; the
counts (status.json `rejections`, `straggler.detector.rejections{reason}`) say so to whoever looks,
this log says so to whoever reads the detector's log. The first rejection of each kind is logged at
once, with its reason, an example span and what is known of its sender, and what to change; after
that at most one line per kind per LOG_INTERVAL_S, counting the rejections since the last one. A
bad sender never floods the log, and a quiet one is not repeated.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Mapping, Optional

from otel_straggler.detector import decode
from otel_straggler.detector.decode import RejectedSpan

_log = logging.getLogger(__name__)
LOG_INTERVAL_S = 60.0
_SHOWN_CHARS = 80  # of a span name or job id in the log: a hostile sender's 1 MiB name stays out

_SET_JOB_ID = ("Every rank of a job must send the same training.job.id: set OTEL_STRAGGLER_JOB_ID (unset, it is "
               "TORCHELASTIC_RUN_ID, else SLURM_JOB_ID, else MASTER_ADDR:MASTER_PORT)")
_SET_RANK = "Set RANK or SLURM_PROCID in the rank's environment, or training.rank in OTEL_RESOURCE_ATTRIBUTES"
_NOT_OURS = "These spans do not follow CONTRACT §2: made by other code, or changed on the way (a collector processor?)"
ADVICE = {  # what to change, by kind; the kinds of sender-side mistakes
    decode.MISSING_JOB_ID.kind: _SET_JOB_ID,
    decode.BAD_JOB_ID.kind: _SET_JOB_ID,
    decode.MISSING_RANK.kind: _SET_RANK,
    decode.BAD_RANK.kind: _SET_RANK,
    decode.BAD_EPOCH.kind: "OTEL_STRAGGLER_TOPOLOGY_EPOCH (training.topology.epoch) must be an int >= 0",
    decode.BAD_COHORT.kind: "OTEL_STRAGGLER_COHORT (training.cohort) must be a string",
    decode.BAD_STAGE.kind: _NOT_OURS,
    decode.MISSING_STEP.kind: _NOT_OURS,
    decode.BAD_STEP.kind: _NOT_OURS,
    decode.MISSING_SEQ.kind: _NOT_OURS,
    decode.BAD_SEQ.kind: _NOT_OURS,
    decode.BAD_TIMESTAMPS.kind: _NOT_OURS,
    decode.BAD_ATTRIBUTES_KIND: "The OTLP/JSON sender writes attributes that are not a list of {key, value}",
}


def _shown(value: Any) -> str:
    if value is None:
        return "unknown"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


class RejectionLog:
    """Thread-safe: receivers note what they decoded, the engine thread calls `log_due` as it advances."""

    def __init__(self, logger: logging.Logger = _log, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        # by kind, since its last line: how many, and the first of them (None: no example known)
        self._pending: dict[str, tuple[int, Optional[RejectedSpan]]] = {}
        self._last_line_at: dict[str, float] = {}

    def note(self, counts: Mapping[str, int], examples: Mapping[str, RejectedSpan]) -> None:
        """Counts rejections by kind, `examples` holding a span of each kind where one is known (its
        span_name None when only the reason is). Logs what is due."""
        if not any(counts.values()):
            return
        with self._lock:
            for kind, count in counts.items():
                if count:
                    pending, example = self._pending.get(kind, (0, None))
                    self._pending[kind] = (pending + count, example or examples.get(kind))
        self.log_due()

    def log_due(self) -> None:
        """Logs each kind rejected since its last line, once that line is LOG_INTERVAL_S old."""
        if not self._pending:  # read without the lock: a note() racing this logs for itself
            return
        now = self._clock()
        with self._lock:
            due = [(kind, *self._pending.pop(kind), now - self._last_line_at.get(kind, -math.inf))
                   for kind in list(self._pending)
                   if now - self._last_line_at.get(kind, -math.inf) >= self._interval_s]
            for kind, *_ in due:
                self._last_line_at[kind] = now
        for kind, count, example, since_s in due:
            self._logger.warning("%s", self._line(kind, count, example, since_s))

    def _line(self, kind: str, count: int, example: Optional[RejectedSpan], since_s: float) -> str:
        if math.isinf(since_s):
            text = f"{count} span(s) rejected as malformed ({kind})"
        else:
            text = f"{count} more span(s) rejected as malformed ({kind}) in the {since_s:.0f} s since the last line"
        if example is not None:
            text += f": {example.rejection.reason}"
            if example.span_name is not None:
                text += (f"; e.g. span {_shown(example.span_name)} of job {_shown(example.job_id)}, "
                         f"rank {_shown(example.rank)}, host {_shown(example.host)}")
        advice = ADVICE.get(kind)
        if advice:
            text += f". {advice}"
        return text + (f". Counted in status.json rejections and straggler.detector.rejections; at most one line per "
                       f"kind per {self._interval_s:.0f} s")
