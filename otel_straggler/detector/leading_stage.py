"""Of a rank's stages slow at once, the ones that lead (explain the others): the onset is said once,
on the leading stage, the others named in `also_slow`."""
from __future__ import annotations

from typing import Optional

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.cohort_state import CohortVerdictState
from otel_straggler.detector.grouped import run_bounds
from otel_straggler.detector.intermittent import IntermittentJudgement
from otel_straggler.detector.window_entries import Entries, Rows


CONTAINED_SHARE = 0.8  # of a stage's intervals inside another's, for the other to contain it
CONTAINED_SLACK_NS = 20_000  # clock reads a few µs apart at nested starts and stops
CARRIED_SHARE = 0.5  # of the whole step's excess, for a stage within its noise to carry it
DOMINANT_FACTOR = 2.0  # of the other clearly-over stages' excess together, for one of several to carry it


def lead_intermittent_stages(stage_names: list, state: CohortVerdictState, entries: Entries,
                             intermittent: IntermittentJudgement, slow_named: np.ndarray, clearly_over: np.ndarray,
                             gap_ms: np.ndarray, codes_per_cohort: int) -> dict[int, tuple[str, ...]]:
    """lead_stages for the intermittent rule's onsets: on a rank whose whole step starts an intermittent
    alert, several named stages starting one too are a slowdown spread over the step, said once on
    `*`; one named stage starting one, or any other stage already alerted, explains the whole
    step's, which is then not said. Nor is it said when a named stage of the rank is slow in this
    window by the steady rule (`slow_named`): a slowdown that began in this window or the one
    before, whose stage the steady rule names once it persists (the whole step's evidence can reach
    the intermittent test first, a noisy step of an earlier window counting among its recurrences).
    Where no named stage is slow, one that carries the step's excess (carrier_stage) takes the whole
    step's onset, with its own evidence. The alerts not said are not kept; their evidence is.
    State is indexed by (code, the slot within the cohort), a cohort's codes `codes_per_cohort` from
    its whole step's (window_batch.py). Returns also_slow per entry."""
    also_slow: dict[int, tuple[str, ...]] = {}
    if not intermittent.onset.any():
        return also_slow
    alerts = state.intermittent.alert
    whole_step_code = entries.code - entries.local_code  # each entry's cohort's
    # named stages starting one on a rank whose whole step already holds one (spread): said there
    named_onset = (intermittent.onset & (entries.local_code >= 2)).nonzero()[0]
    whole_starting = set(entries.slot[intermittent.onset & (entries.local_code == 0)].tolist())
    spread = np.array([entry for entry in named_onset.tolist()
                       if alerts[whole_step_code[entry], entries.local_slot[entry]]
                       and int(entries.slot[entry]) not in whole_starting], dtype=np.int64)
    intermittent.onset[spread] = False
    alerts[entries.code[spread], entries.local_slot[spread]] = False
    whole = (intermittent.onset & (entries.local_code == 0)).nonzero()[0]
    for entry in whole.tolist():
        slot, local_slot = int(entries.slot[entry]), int(entries.local_slot[entry])
        whole_code = int(entries.code[entry])
        named_codes = slice(whole_code + 2, whole_code + codes_per_cohort)
        mine = (entries.slot == slot).nonzero()[0]
        named = mine[intermittent.onset[mine] & (entries.local_code[mine] >= 2)]
        names = tuple(stage_names[int(entries.code[other]) // 2] for other in named.tolist())
        other_alert = (bool(state.alert[named_codes, local_slot].any())
                       or alerts[named_codes, local_slot].sum() > named.size)
        steady_under_way = not named.size and bool(slow_named[mine].any())
        carrier = None if named.size or other_alert or steady_under_way else carrier_stage(
            entries, slot, entries.local_code == 0, clearly_over, gap_ms, mine)
        if steady_under_way:
            intermittent.onset[entry] = False
            alerts[whole_code, local_slot] = False
        elif carrier is not None:
            intermittent.onset[entry] = False
            alerts[whole_code, local_slot] = False
            intermittent.onset[carrier] = True
            alerts[entries.code[carrier], local_slot] = True
            also_slow[carrier] = (contract.WHOLE_STEP_STAGE,)
        elif named.size >= 2 and not other_alert:
            intermittent.onset[named] = False
            alerts[entries.code[named], local_slot] = False
            also_slow[entry] = names
        elif named.size or other_alert:
            intermittent.onset[entry] = False
            alerts[whole_code, local_slot] = False
            for other in named.tolist():
                also_slow[other] = (contract.WHOLE_STEP_STAGE,)
    return also_slow


def lead_stages(stage_names: list, entries: Entries, onset: np.ndarray, late_onset: np.ndarray,
                slow_compute: np.ndarray, late: np.ndarray, held: np.ndarray, clearly_over: np.ndarray,
                lateness: np.ndarray, gap_ms: np.ndarray) -> tuple[np.ndarray, dict[int, tuple[str, ...]], np.ndarray]:
    """(onsets moved to the leading stages, per leading entry the stages it explains, the entries
    explained by a leading stage).

    Of a rank's stages slow in one window (or holding an alert), one explains another when the
    other contains its time (the whole step `*` contains every stage; a stage whose intervals hold
    the first's, nested timers) or follows from it (a collective the rank is last to reach). The
    leading stages are the ones that no other explains: the innermost slow stage; `*` when there is
    none or several unrelated ones are slow (a slowdown spread over the step: `*` names them all);
    else the one collective it is latest to (time that no stage covers). Where `*` is slow and no
    named stage is, a named stage that is `clearly_over` (slower than its peers by the relative
    threshold and the floor, though within its own noise, which a noisy stage widens for windows)
    carries the step's time when it holds CARRIED_SHARE of the whole step's excess and, of the
    innermost such stages, DOMINANT_FACTOR times the others' excess together: the whole step's
    conviction says the rank is slow, the stages' excess says where.
    An onset of a stage that a leading one explains is that leading stage's onset, said once, with
    the others in `also_slow`; none when the leading stage already holds an alert. Only ranks with
    an onset in the window are looked at."""
    also_slow: dict[int, tuple[str, ...]] = {}
    explained_mask = np.zeros(onset.size, dtype=bool)
    candidates = slow_compute | late | held
    onset = onset.copy()
    if not onset.any():
        return onset, also_slow, explained_mask
    slots = np.unique(entries.slot[onset])
    for slot, mine in zip(slots.tolist(), _entries_of(entries.slot, slots), strict=True):
        carrier = carrier_stage(entries, slot, candidates, clearly_over, gap_ms, mine)
        if carrier is not None:
            candidates = candidates.copy()
            candidates[carrier] = True
        slow_here = mine[candidates[mine]]
        if slow_here.size < 2:
            continue
        codes = entries.local_code[slow_here]
        named = slow_here[((codes & 1) == 0) & (codes > 0)]
        whole = slow_here[codes == 0]
        collectives = slow_here[(codes & 1) == 1]
        rows = entries.rows_of_cohort(slot)
        contains = {(outer, inner): stage_contains(rows, slot, int(entries.code[outer]),
                                                   int(entries.code[inner]))
                    for outer in named.tolist() for inner in named.tolist() if outer != inner}
        leaders = [entry for entry in named.tolist()
                   if not any(contains[(entry, inner)] for inner in named.tolist() if inner != entry)]
        if not leaders or (len(leaders) > 1 and whole.size):
            # none, or several unrelated stages slow at once: a slowdown spread over the step
            leaders = whole.tolist()
        if not leaders:  # only collectives: the one it is latest to, an onset's first
            leaders = [max(collectives.tolist(), key=lambda entry: (late_onset[entry], lateness[entry]))]
        for leader in leaders:
            explained = [entry for entry in slow_here.tolist() if entry != leader and (
                leader in whole or entry in whole or entry in collectives or contains.get((entry, leader), False))]
            if not explained:
                continue
            explained.sort(key=lambda entry: -gap_ms[entry] if np.isfinite(gap_ms[entry]) else 0.0)
            if onset[explained].any() and not held[leader]:
                onset[leader] = True
            onset[explained] = False
            explained_mask[explained] = True
            also_slow[leader] = tuple(stage_names[int(entries.code[entry]) // 2] for entry in explained)
    return onset, also_slow, explained_mask


def _entries_of(entry_slots: np.ndarray, slots: np.ndarray) -> list[np.ndarray]:
    """The entries of each of `slots` (distinct, ascending, each with at least one entry), each rank's
    in ascending order: one pass over the entries, so a batch with many ranks starting an alert at
    once is not looked over once per rank."""
    wanted = np.zeros(int(entry_slots.max()) + 1, dtype=bool)
    wanted[slots] = True
    picked = wanted[entry_slots].nonzero()[0]
    picked = picked[np.argsort(entry_slots[picked], kind="stable")]
    starts, ends, _ = run_bounds(entry_slots[picked])  # one run per slot, in the slots' order
    return [picked[start:end] for start, end in zip(starts.tolist(), ends.tolist(), strict=True)]


def carrier_stage(entries: Entries, slot: int, candidates: np.ndarray, clearly_over: np.ndarray,
                  gap_ms: np.ndarray, mine: Optional[np.ndarray] = None) -> Optional[int]:
    """The named stage that carries the rank's slow whole step when no named stage is slow (see
    lead_stages), or None. mine: the rank's entries, ascending, where the caller has them."""
    if mine is None:
        mine = (entries.slot == slot).nonzero()[0]
    codes = entries.local_code[mine]
    named = ((codes & 1) == 0) & (codes > 0)
    chosen = candidates[mine]
    whole = mine[chosen & (codes == 0)]
    if whole.size == 0 or (chosen & named).any():
        return None
    over = mine[clearly_over[mine] & named].tolist()
    rows = entries.rows_of_cohort(slot) if len(over) > 1 else entries.rows
    innermost = [entry for entry in over if not any(
        stage_contains(rows, slot, int(entries.code[entry]), int(entries.code[inner]))
        for inner in over if inner != entry)]
    if not innermost:
        return None
    # the one that holds most of the excess carries it, when it holds CARRIED_SHARE of the whole
    # step's and DOMINANT_FACTOR times what the other clearly-over stages hold together: a slow
    # rank's short stages (its data fetch on a busy host, a few ms over) do not hide where its time
    # went, while two stages sharing the excess leave it to the whole step
    gaps = [float(gap_ms[entry]) for entry in innermost]
    best = int(np.argmax(gaps))
    whole_gap, gap = float(gap_ms[whole[0]]), gaps[best]
    if not np.isfinite(whole_gap) or gap < CARRIED_SHARE * whole_gap or gap < DOMINANT_FACTOR * (sum(gaps) - gap):
        return None
    return innermost[best]


def stage_contains(rows: Rows, slot: int, outer_code: int, inner_code: int) -> bool:
    """Whether, in this window, the rank's `outer_code` intervals hold most of its `inner_code` ones
    (same step, start no later, end no earlier)."""
    mine = rows.slot == slot
    outer = mine & (rows.code == outer_code)
    inner = mine & (rows.code == inner_code)
    if not outer.any() or not inner.any():
        return False
    outer_end, inner_end = rows.end_unix_nano[outer], rows.end_unix_nano[inner]
    outer_start = outer_end - (rows.host[outer] * 1e6).astype(np.int64)
    inner_start = inner_end - (rows.host[inner] * 1e6).astype(np.int64)
    held = ((rows.step[inner][:, None] == rows.step[outer][None, :])
            & (outer_start[None, :] <= inner_start[:, None] + CONTAINED_SLACK_NS)
            & (inner_end[:, None] <= outer_end[None, :] + CONTAINED_SLACK_NS)).any(axis=1)
    return bool(np.count_nonzero(held) >= CONTAINED_SHARE * held.size)
