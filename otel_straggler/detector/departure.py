"""Cohorts that stopped reporting to this detector while one of their alerts was active: the job
ended, or the gateway's load_balancing ring moved the cohort to another detector shard (a shard was
added or removed). Either way this detector no longer sees the ranks, so it can no longer say they
are slow: each active alert ends with `recovered`/`cohort_departed`, and the cohort's ranks start
their warmup again should it come back (as the shard that gained it judges it after its warmup).

"Stopped" is the test that tells a finished job from a hung one (liveness.py): every rank's
heartbeats stopped (or, for a rank that never sent one, its spans). A hung job's ranks keep sending
heartbeats, so its alerts stay, and its hang is judged as before; a cohort whose ranks are alive
elsewhere gets no `hang`, `silent` or `rank_lost` here, since nothing of it arrives to be judged.
The cohort's state itself stays, bounded, until it is evicted like any idle cohort."""
from __future__ import annotations

from otel_straggler import contract
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.verdict_records import ended_alert_verdicts

CHECK_INTERVAL_NS = 1_000_000_000  # cohorts with active alerts are looked at this often


def has_active_alert(cohort) -> bool:
    state = cohort.verdict_state
    slots = len(cohort.slot_entries)
    codes = state.alert.shape[0]
    return bool(state.alert[:, :slots].any() or state.intermittent.alert[:codes, :slots].any())


def departed_verdicts(cohort, now: int) -> list[Verdict]:
    """`recovered`/`cohort_departed` for each active alert of the cohort, whose ranks then warm up
    again: their state here says nothing of what they did elsewhere."""
    ended = ended_alert_verdicts(cohort, now, contract.REASON_COHORT_DEPARTED)
    for slot in range(len(cohort.slot_entries)):
        cohort.verdict_state.reset_slot(slot)
    return ended
