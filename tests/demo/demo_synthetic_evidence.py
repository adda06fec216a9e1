"""Hand-made evidence for the demo's pure parts: a run record, verdicts and window medians."""
from __future__ import annotations

from typing import Any, Optional

from otel_straggler.report.evidence_files import Injection, RunRecord, WindowMedian

JOB = "job-1"
COHORT = "default"
STAGES = ("forward-compute", "backward-compute", "all-grads-sync")


def run_record(injection: Optional[Injection] = Injection(2, "forward-compute", 20, 0.3), steps_done: int = 70,
               step_seconds: float = 0.2) -> RunRecord:
    started = 1_000_000_000_000
    return RunRecord(
        job_id=JOB, ranks=4, steps=70, window_steps=10, rel_threshold=0.05, min_gap_ms=5.0, injection=injection,
        started_unix_nano=started,
        step_end_unix_nano=[started + int((step + 1) * step_seconds * 1e9) for step in range(steps_done)],
        losses=[2.3, 1.1],
    )


def verdict(rank: int, window: int, kind: str = "straggler", stage: str = "forward-compute",
            made_unix_nano: int = 0, **fields: Any) -> dict[str, Any]:
    record = {
        "time_unix_nano": made_unix_nano, "job_id": JOB, "cohort": COHORT, "stage": stage, "rank": rank,
        "window": window, "verdict": kind, "reason": "slow_vs_peers", "slowdown": 1.3, "gap_ms": 9.0,
        "rank_ms": 39.0, "reference_ms": 30.0, "reference_ranks": [0, 1, 3], "timing": "host",
        "attribution": "host_only_stall", "workload_comparable": True,
    }
    record.update(fields)
    return record


def window_medians(windows: int = 7, slow_rank: int = 2, slow_from_window: int = 2) -> list[WindowMedian]:
    """Four ranks; `slow_rank` takes 30% longer in forward-compute from `slow_from_window` on,
    and the others wait for it in all-grads-sync."""
    medians = []
    for window in range(windows):
        slow = window >= slow_from_window
        for rank in range(4):
            forward = 30.0 + rank * 0.2 + (9.0 if slow and rank == slow_rank else 0.0)
            sync = 20.0 + (9.0 if slow and rank != slow_rank else 0.0)
            for stage, value, collective in (("forward-compute", forward, False),
                                             ("backward-compute", 60.0 + rank * 0.1, False),
                                             ("all-grads-sync", sync, True)):
                medians.append(WindowMedian(JOB, COHORT, rank, stage, window, value, 10, collective))
    return medians
