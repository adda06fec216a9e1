"""Straggler alerts a previous detector process left open, taken over by this one.

A restarted detector knows nothing of the alerts its predecessor raised; judged afresh, a rank still
slow would get a second onset and the first would never see its `recovered`. At start the service
reads the evidence file (verdicts.jsonl, append-only, CONTRACT §3a): a `straggler` verdict of a
(job, cohort, rank, stage) that no later `recovered` verdict of the same one ended is still open.
The engine marks each such alert as held once the cohort has that rank and stage again (the first
window judged after the restart), so a rank still slow raises no second onset, and one that has
recovered gets its `recovered` verdict, which closes the old onset. Hang verdicts are not taken over:
a hang is judged again from the heartbeats that keep coming, and its verdict names the culprit anew.

Bounded: at most MAX_OPEN alerts are taken over (the latest ones), and alerts that never find their
rank again stay pending, counted in status.json, until the process ends.
"""
from __future__ import annotations

import json
import logging
from typing import NamedTuple, Optional

from otel_straggler import contract

_log = logging.getLogger(__name__)
MAX_OPEN = 10_000


class AlertKey(NamedTuple):
    job_id: str
    cohort: str
    rank: int
    stage: str


def read_open_alerts(verdicts_path: str) -> tuple[dict[AlertKey, str], int]:
    """(the alerts the file leaves open, by key, with the reason of their onset; lines that could
    not be read). A missing file leaves none open."""
    open_alerts: dict[AlertKey, str] = {}
    unreadable = 0
    try:
        handle = open(verdicts_path, "rb")
    except FileNotFoundError:
        return open_alerts, 0
    with handle:
        for line in handle:
            try:
                record = json.loads(line)
                key = AlertKey(record["job_id"], record["cohort"], record["rank"], record["stage"])
                verdict, reason = record["verdict"], record["reason"]
                if not isinstance(key.rank, int) or not all(isinstance(part, str) for part in
                                                            (key.job_id, key.cohort, key.stage)):
                    continue  # job-level verdicts (rank null): no per-rank alert to take over
            except (ValueError, KeyError, TypeError):
                unreadable += 1
                continue
            if verdict == contract.VERDICT_STRAGGLER:
                open_alerts.pop(key, None)  # the latest onset last, so the bound keeps the latest
                open_alerts[key] = reason
            elif verdict == contract.VERDICT_RECOVERED:
                open_alerts.pop(key, None)
    if len(open_alerts) > MAX_OPEN:
        latest = list(open_alerts.items())[-MAX_OPEN:]
        _log.warning("%d straggler alerts were open in %s; taking over the latest %d", len(open_alerts),
                     verdicts_path, MAX_OPEN)
        open_alerts = dict(latest)
    return open_alerts, unreadable


class InheritedAlerts:
    """The open alerts of a previous process, until the engine finds their cohorts (one thread)."""

    def __init__(self, alerts: dict[AlertKey, str]) -> None:
        self._by_cohort: dict[tuple[str, str], dict[tuple[int, str], str]] = {}
        for key, reason in alerts.items():
            self._by_cohort.setdefault((key.job_id, key.cohort), {})[(key.rank, key.stage)] = reason
        self.taken_over = 0
        self.pending = len(alerts)

    def take_over(self, cohort) -> None:
        """Marks the alerts of `cohort` (windows.Cohort) whose rank and stage it has as held."""
        pending = self._by_cohort.get((cohort.job_id, cohort.name))
        if not pending:
            return
        state = cohort.verdict_state
        for (rank, stage), reason in list(pending.items()):
            slot: Optional[int] = cohort.slot_of(rank)
            index = cohort.stage_index(stage)
            if slot is None or index is None:
                continue
            # an arrival alert lives on the collective's code, the others on the stage's own
            code = 2 * index + (1 if reason == contract.REASON_LAST_TO_ARRIVE else 0)
            if reason == contract.REASON_INTERMITTENT:
                state.intermittent.alert[code, slot] = True
            else:
                state.alert[code, slot] = True
            del pending[(rank, stage)]
            self.taken_over += 1
            self.pending -= 1
        if not pending:
            del self._by_cohort[(cohort.job_id, cohort.name)]

    def counts(self) -> dict[str, int]:
        return {"taken_over": self.taken_over, "pending": self.pending}
