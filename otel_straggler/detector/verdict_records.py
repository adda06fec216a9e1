"""Verdict records of a judged window: the numbers a verdict carries, its attribution, an intermittent
straggler's evidence, and the `recovered` verdicts that end a cohort's alerts at once."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.cohort_state import CohortVerdictState
from otel_straggler.detector.intermittent import IntermittentJudgement
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.peer_comparison import Comparison
from otel_straggler.detector.peer_reference import WORKLOAD_COMPARABLE, WORKLOAD_NOT_REPORTED
from otel_straggler.detector.window_batch import WindowBatch
from otel_straggler.detector.window_entries import Entries
from otel_straggler.detector.windows import Cohort


def intermittent_evidence(judgement: IntermittentJudgement, entry: int) -> dict:
    """The verdict's numbers for an intermittent straggler: its slow steps over the windows tested
    (count, share, the peers' share), and their mean time against the mean median of the same
    steps (null without slow steps, as at a recovery)."""
    slow, steps = int(judgement.slow[entry]), int(judgement.steps[entry])
    counts = {"slow": slow, "steps": steps, "share": verdict_number(slow / steps if steps else 0.0)}
    peer_share = verdict_number(judgement.peer_share[entry])
    if peer_share is not None:  # null where no peer had steps: an event attribute has no null
        counts["peer_share"] = peer_share
    evidence: dict[str, object] = {"slow_steps": counts, "rank_ms": None, "reference_ms": None, "gap_ms": None,
                                   "slowdown": None}
    if slow:
        rank_ms, reference_ms = float(judgement.slow_ms[entry]), float(judgement.slow_reference_ms[entry])
        evidence.update(rank_ms=verdict_number(rank_ms), reference_ms=verdict_number(reference_ms),
                        gap_ms=verdict_number(rank_ms - reference_ms),
                        slowdown=verdict_number(rank_ms / reference_ms if reference_ms > 0 else math.nan))
    return evidence


def attribution_of(reason: str, host_flag: bool, device_flag: bool, device_usable: bool) -> str:
    if reason == contract.REASON_WAITING_ON_PEER:
        return contract.ATTRIBUTION_WAITING
    if (reason not in (contract.REASON_SLOW_VS_PEERS, contract.REASON_BELOW_ABSOLUTE_FLOOR)
            or not (host_flag or device_flag)):
        return contract.ATTRIBUTION_UNKNOWN
    if device_flag:
        return contract.ATTRIBUTION_GPU
    return contract.ATTRIBUTION_HOST if device_usable else contract.ATTRIBUTION_UNKNOWN


class VerdictContext:
    """Builds the few verdict records of a batch's windows (window_batch.py) from its comparison arrays."""

    def __init__(self, batch: WindowBatch, now: int, entries: Entries, host: Comparison,
                 device: Comparison, use_device: np.ndarray, slowdown: np.ndarray) -> None:
        self.batch, self.now, self.entries = batch, now, entries
        self.host, self.device, self.use_device, self.slowdown = host, device, use_device, slowdown
        self.device_row = np.full(entries.code.size, -1, dtype=np.int64)
        self.device_row[device.entries] = np.arange(device.entries.size)

    def verdict(self, entry: int, verdict: str, reason: str, attribution: str, timing_host: bool = False) -> Verdict:
        uses_device = bool(self.use_device[entry]) and not timing_host
        comparison, row = (self.device, int(self.device_row[entry])) if uses_device else (self.host, entry)
        peers = comparison.entries[comparison.references.peers(row)]
        index = int(self.entries.cohort[entry])
        cohort = self.batch.cohorts[index]
        slot = int(self.entries.local_slot[entry])
        code = int(self.entries.local_code[entry])
        workload = int(comparison.references.workload[row])
        if reason == contract.REASON_WORKLOAD_INCOMPARABLE:
            workload_comparable: Optional[bool] = False
        elif workload == WORKLOAD_NOT_REPORTED:
            workload_comparable = None
        else:
            workload_comparable = workload == WORKLOAD_COMPARABLE
        reference = float(comparison.references.reference[row])
        rank_ms = float(comparison.median[row])
        return Verdict(
            time_unix_nano=self.now,
            job_id=cohort.job_id,
            cohort=cohort.name,
            stage=cohort.stage_name(code // 2),
            rank=cohort.rank_in(slot),
            window=self.batch.windows[index],
            verdict=verdict,
            reason=reason,
            slowdown=verdict_number(self.slowdown[entry]),
            gap_ms=verdict_number(rank_ms - reference),
            rank_ms=verdict_number(rank_ms),
            reference_ms=verdict_number(reference),
            reference_ranks=tuple(cohort.rank_in(int(s)) for s in self.entries.local_slot[peers]),
            timing=contract.TIMING_DEVICE if uses_device else contract.TIMING_HOST,
            attribution=attribution,
            workload_comparable=workload_comparable,
        )


def verdict_number(value) -> Optional[float]:
    """Verdict numbers: 4 decimals (the medians carry float32 precision); null when not finite."""
    value = float(value)
    return round(value, 4) if math.isfinite(value) else None


def ended_alert_verdicts(cohort: Cohort, now: int, reason: str) -> list[Verdict]:
    """`recovered`/`reason` for each alert still active in a cohort whose alerts all end at once: a new
    incarnation replaces it (contract.REASON_RESTARTED), or its ranks stopped reporting here
    (contract.REASON_COHORT_DEPARTED, departure.py)."""
    state: CohortVerdictState = cohort.verdict_state
    slot_count = len(cohort.slot_entries)
    verdicts = []
    codes = state.alert.shape[0]
    active = state.alert[:, :slot_count] | state.intermittent.alert[:codes, :slot_count]
    for code, slot in zip(*(index.tolist() for index in np.nonzero(active)), strict=True):
        entry, stage = cohort.slot_entries[slot], cohort.stage_names[code // 2]
        if entry is None or stage is None:
            continue
        verdicts.append(Verdict(
            time_unix_nano=now, job_id=cohort.job_id, cohort=cohort.name, stage=stage, rank=entry.rank,
            window=cohort.latest_judged_window(),
            verdict=contract.VERDICT_RECOVERED, reason=reason, slowdown=None, gap_ms=None, rank_ms=None,
            reference_ms=None, reference_ranks=(), timing=contract.TIMING_HOST,
            attribution=contract.ATTRIBUTION_UNKNOWN, workload_comparable=None))
    return verdicts
