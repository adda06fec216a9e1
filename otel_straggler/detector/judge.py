"""Judging a closed window of a cohort (or of each cohort of a batch judged together, window_batch.py):
statistics, references, thresholds, alert state.

Everything is computed for all (stage, rank) pairs of the window at once with numpy; verdict objects
are built only for the few pairs whose state changes. Per pair and window:

- statistic: the median host duration and, where the rank has device durations, the median device
  duration of its intervals of that stage. The whole step (stage "*") is, per rank and step, the sum
  of its non-collective intervals (device sum only when every one of them has a device duration),
  then the median over the window's steps. Nested timers are summed too: every rank of a cohort
  nests the same way, so the comparison is unaffected.
- reference: see peer_reference.py (median of the comparable peers, the rank left out). Device
  durations are compared with peers that have device durations.
- slow: slowdown > 1 + rel_threshold AND gap > min_gap_ms AND slowdown - 1 beyond z x the stage's
  noise (stage_noise.py), on host or device; over the relative threshold but not the gap is
  `below_absolute_floor`, never slow. A stage that ends at a synchronization point
  (synchronization_points.py) is judged as a collective.
- usable: the rank has at least min_cohort_size - 1 comparable peers; otherwise
  `cohort_below_min_size` (the stage has too few ranks) or `workload_incomparable`.

Verdicts emitted (healthy windows emit nothing; the live slowdown gauge updates every window):
- `straggler`/`slow_vs_peers` when a pair is slow for persist_windows consecutive usable windows
  (a rank's first warmup_windows windows are not judged at all; an unusable window breaks a streak);
- `straggler`/`intermittent` for a pair slow in a share of its steps well beyond its peers' while
  its median does not move (intermittent.py), and its `recovered`/`within_tolerance`;
- `recovered`/`within_tolerance` at the first usable window back within the relative threshold
  while an alert is active; an unusable window, or one over the ratio but under the floor, holds it;
- `uncertain`/`recovery_evidence_insufficient` when an active alert meets an unusable window;
  `uncertain`/`cohort_below_min_size` or `workload_incomparable` for an unusable pair without alert;
  `uncertain`/`below_absolute_floor` once a pair has been over the ratio but under the floor for
  persist_windows consecutive windows. Each of these is noted once per pair until its next
  straggler or recovered verdict, so a jittery stage does not repeat itself every window;
- collective stages are never slow by their own duration: a pair whose wait is long for
  persist_windows windows gets one `uncertain`/`waiting_on_peer` (attribution `waiting_on_peer`);
- `silent`/`no_report` (stage "*") when a rank misses silent_windows consecutive closed windows
  and its peers' intervals end more than max_export_lag_s after its last one (_judge_presence).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.cohort_state import CohortVerdictState
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.intermittent import judge_intermittent, ring_length
from otel_straggler.detector.job_baseline import judge_pace, window_paces
from otel_straggler.detector.leading_stage import lead_intermittent_stages, lead_stages
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.peer_comparison import compare_to_peers
from otel_straggler.detector.stage_noise import consistently_late, late_beyond_noise
from otel_straggler.detector import stage_noise  # through the module: tests set its bound for every rule
from otel_straggler.detector.synchronization_points import SYNC_MIN_STEPS
from otel_straggler.detector.verdict_records import (VerdictContext, attribution_of, intermittent_evidence,
                                                     verdict_number)
from otel_straggler.detector.window_batch import WindowBatch
from otel_straggler.detector.window_entries import Entries, window_entries
from otel_straggler.detector.windows import Cohort, WindowRows

# the last uncertain reason noted per pair, as a small int (0: none), so each is noted once
_SMALL, _INCOMPARABLE, _INSUFFICIENT, _FLOOR = 1, 2, 3, 4
_UNCERTAIN_REASONS = {_SMALL: contract.REASON_COHORT_BELOW_MIN_SIZE,
                      _INCOMPARABLE: contract.REASON_WORKLOAD_INCOMPARABLE,
                      _INSUFFICIENT: contract.REASON_RECOVERY_EVIDENCE_INSUFFICIENT,
                      _FLOOR: contract.REASON_BELOW_ABSOLUTE_FLOOR}


@dataclass
class WindowJudgement:
    verdicts: list[Verdict] = field(default_factory=list)
    coverage_gaps: int = 0
    fell_silent: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    came_back: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    invalid_device_rows: int = 0
    quiet_below_floor: int = 0  # `below_absolute_floor` notices not emitted (config.report_below_floor off)


def judge_window(cohort: Cohort, rows: WindowRows, config: DetectorConfig, now_unix_nano: int) -> WindowJudgement:
    """Judges the closed window `rows` of `cohort` (windows.Cohort) and updates its verdict state."""
    return judge_windows(WindowBatch([cohort], [rows], ring_length(config.persist_windows)), config, now_unix_nano)[0]


def judge_windows(batch: WindowBatch, config: DetectorConfig, now_unix_nano: int) -> list[WindowJudgement]:
    """Judges one closed window of each cohort of `batch` (window_batch.py) and updates their
    verdict states; per cohort, what judging its window alone gives."""
    state: CohortVerdictState = batch.state
    with np.errstate(all="ignore"):  # inf/nan from hostile values are handled as unusable below
        entries, invalid_device_rows = window_entries(batch, config)
        # ranks with no rows here that have sent a later window's: alive, their rows of this one lost
        # on the way (an exporter's full queue while the detector was down); where they outnumber
        # the ranks present, the window is a backlog too thin to compare anyone in
        held, moved_on = batch.rosters()
        present = entries.present
        thin = (np.count_nonzero(batch.by_cohort(~present & moved_on), axis=1)
                > np.count_nonzero(batch.by_cohort(present), axis=1))
        judgements = _judge_entries(batch, entries, config, now_unix_nano, thin)
    paces = _judge_paces(batch, entries, config, now_unix_nano)
    _judge_presence(batch, entries, held, moved_on, config, now_unix_nano, judgements)
    for index, judgement in enumerate(judgements):
        judgement.invalid_device_rows = invalid_device_rows[index]
        judgement.verdicts += paces[index]
    state.windows_seen[:batch.slot_count][entries.present] += 1
    state.collective_seen[entries.code[(entries.code & 1) == 1]] = True  # for hangs: who waits where
    stages_per_cohort = batch.codes_per_cohort // 2
    for stage_index in np.bincount(entries.code // 2).nonzero()[0].tolist():
        index, own = divmod(stage_index, stages_per_cohort)
        if own:
            batch.cohorts[index].stage_seen(own, batch.windows[index])
    batch.write_back()
    return judgements


def _judge_entries(batch: WindowBatch, entries: Entries, config: DetectorConfig, now: int,
                   thin: np.ndarray) -> list[WindowJudgement]:
    state: CohortVerdictState = batch.state
    judgements = [WindowJudgement() for _ in range(batch.size)]
    count = entries.code.size
    if count == 0:
        return judgements
    # what is counted over a window is counted per cohort (a batch of one: the cohort)
    cohort_of = None if batch.size == 1 else entries.cohort
    everyone = np.arange(count)
    collective = (entries.code & 1) == 1
    # a collective absorbs every peer's arrival jitter; waiting counts only when it is a sizeable
    # part of the rank's step: over rel_threshold of its whole-step compute time as well as the floor
    step_compute_ms = np.full(state.windows_seen.size, np.nan)
    whole_step = entries.local_code == 0
    step_compute_ms[entries.slot[whole_step]] = entries.host[whole_step]
    floor_ms = np.where(collective, np.fmax(config.min_gap_ms, config.rel_threshold * step_compute_ms[entries.slot]),
                        config.min_gap_ms)
    flat = entries.pair
    host = compare_to_peers(everyone, entries.code, entries.host, entries.tokens, floor_ms, config, state.noise_var[0],
                            flat, state.last_offset[0].reshape(-1), cohort_of, batch.size)
    with_device = (~np.isnan(entries.device)).nonzero()[0]
    device = compare_to_peers(with_device, entries.code[with_device], entries.device[with_device],
                              entries.tokens[with_device], floor_ms[with_device], config, state.noise_var[1],
                              flat[with_device], state.last_offset[1].reshape(-1),
                              None if cohort_of is None else cohort_of[with_device], batch.size)

    # device comparisons scattered onto all entries
    device_usable = np.zeros(count, dtype=bool)
    device_usable[with_device] = device.usable
    device_over = np.zeros(count, dtype=bool)
    device_over[with_device] = device.over
    device_slow = np.zeros(count, dtype=bool)
    device_slow[with_device] = device.slow
    device_over_floor = np.zeros(count, dtype=bool)
    device_over_floor[with_device] = device.over_floor
    device_slowdown = np.full(count, np.nan)
    device_slowdown[with_device] = device.slowdown

    usable = host.usable
    slow = usable & (host.slow | device_slow)
    over = usable & (host.over | device_over)
    # over the ratio, under the absolute floor; over both but within the cohort's noise: neither
    floor = over & ~(host.over_floor | device_over_floor)
    within = usable & ~over
    # which duration the verdict reports: the one that convicted, else device where comparable
    host_flag = np.where(slow, host.slow, host.over)
    device_flag = np.where(slow, device_slow, device_over)
    use_device = device_flag | (device_usable & ~host_flag)
    slowdown = np.where(usable, np.where(use_device, device_slowdown, host.slowdown), np.nan)

    # at a collective (marked or found) the rank that arrives last waits least: its lateness is the
    # peers' wait minus its own, counted when over the collective floor and beyond the noise
    lateness = host.references.reference - entries.host
    if cohort_of is None:
        comparisons = [int(np.count_nonzero(usable))]
        z = stage_noise.noise_z(comparisons[0], config.false_alarm_rate)
    else:
        comparisons = np.bincount(cohort_of[usable], minlength=batch.size).tolist()
        z = stage_noise.per_cohort_z(comparisons, config.false_alarm_rate)[cohort_of]
    late = collective & usable & (lateness > floor_ms) & late_beyond_noise(
        entries.code, entries.host, lateness, step_compute_ms[entries.slot], collective & usable,
        state.arrival_var, z)
    for entry in late.nonzero()[0].tolist():
        late[entry] = consistently_late(int(entries.late_steps[entry]), int(entries.arrival_steps[entry]),
                                         comparisons[int(entries.cohort[entry])], config)

    state.slowdown.reshape(-1)[flat] = slowdown  # gauges update every window, warmup included
    # a window with under half the steps of the cohort's full ones (the job's last, say), or a
    # backlog's (`thin`), is too thin to start, end or break anything: it is not judged, and holds
    # every streak and alert
    partial = (2 * entries.steps < batch.full_window_steps) | thin  # per cohort
    batch.full_window_steps = np.maximum(batch.full_window_steps, entries.steps)
    judged = (state.windows_seen[entries.slot] >= config.warmup_windows) & ~partial[entries.cohort]
    compute = judged & ~collective
    waiting = judged & collective

    alert = state.alert.reshape(-1)[flat]
    slow_streak = np.where(slow, state.slow_streak.reshape(-1)[flat] + 1, 0)
    floor_streak = np.where(floor, state.floor_streak.reshape(-1)[flat] + 1, 0)
    unusable_reason = np.where(host.references.segment_size < config.min_cohort_size, _SMALL, _INCOMPARABLE)
    uncertain_reason = np.where(compute & ~usable, np.where(alert, _INSUFFICIENT, unusable_reason), 0)
    floor_reason = np.where(compute & floor & ~alert & (floor_streak >= config.persist_windows), _FLOOR, 0)
    last_notice = state.last_uncertain.reshape(-1)[flat]

    onset = compute & slow & ~alert & (slow_streak >= config.persist_windows)
    # recovery needs the rank back within the relative tolerance: a window under the floor but
    # still over the ratio holds the alert, so a gap hovering at the floor does not flap. The whole
    # step needs persist_windows such windows in a row: it sums whatever stages a window holds of
    # the rank, so one window that lacks a stage's spans (lost on the way) looks fast
    within_streak = np.where(compute & within, state.within_streak.reshape(-1)[flat] + 1, 0)
    recovery = compute & alert & within & ((entries.local_code != 0) | (within_streak >= config.persist_windows))
    uncertain_notice = (uncertain_reason != 0) & (uncertain_reason != last_notice)
    floor_notice = (floor_reason != 0) & (floor_reason != last_notice)
    if not config.report_below_floor:  # noise under the floor: counted, not said
        for judgement, quiet in zip(judgements, batch.per_cohort_count(entries.cohort[floor_notice]), strict=True):
            judgement.quiet_below_floor = quiet
        floor_notice = np.zeros_like(floor_notice)
    waiting_notice = waiting & slow & (slow_streak == config.persist_windows)
    # the arrival rule keeps its own streak; its alert lives in the collective code's alert state
    late_streak = np.where(late, state.late_streak.reshape(-1)[flat] + 1, 0)
    late_onset = waiting & late & ~alert & (late_streak >= config.persist_windows)
    # back in time at the collective, over enough steps to tell (a wait that turned longer in one
    # step says nothing)
    late_recovery = waiting & alert & usable & (lateness <= floor_ms) & (entries.arrival_steps >= SYNC_MIN_STEPS)
    onset = onset | late_onset
    recovery = recovery | late_recovery
    # several stages of one rank slow at once: the onset goes to the stage that explains the others
    held = alert & ~recovery & (compute | waiting)  # a leading stage holding its alert still explains
    # clearly slower than its peers (over the relative threshold and the floor), whether or not
    # beyond its own noise: where the whole step is convicted, such a stage can carry its time
    clearly_over = compute & usable & (host.over_floor | device_over_floor)
    onset, also_slow, explained = lead_stages(batch.stage_names, entries, onset, late_onset, compute & slow,
                                              waiting & late, held, clearly_over, lateness,
                                              entries.host - host.references.reference)
    late_onset = onset & waiting
    # an uncertain reason is noted once per pair, until its next straggler or recovered verdict
    notice = np.where(uncertain_reason != 0, uncertain_reason, np.where(floor_reason != 0, floor_reason, last_notice))
    notice = np.where(onset | recovery, 0, notice)

    update = flat[judged]
    state.alert.reshape(-1)[update] = ((alert | onset) & ~recovery)[judged]
    state.slow_streak.reshape(-1)[update] = slow_streak[judged]
    state.within_streak.reshape(-1)[update] = within_streak[judged]
    state.floor_streak.reshape(-1)[update] = floor_streak[judged]
    state.late_streak.reshape(-1)[update] = late_streak[judged]
    state.last_uncertain.reshape(-1)[update] = notice[judged]

    # intermittent stragglers (intermittent.py): tested where the steady rule holds no alert; its
    # alert, once it holds one, supersedes theirs. Slow windows are recorded (a streak broken by a
    # dip is evidence of neither rule otherwise) until a streak ends in an alert: its windows are
    # then that alert's evidence, and the pair's ring starts over, so a rank slow for
    # persist_windows windows in a row is the steady rule's, and not intermittent once it is back
    # the stages a leading stage explains count as under its alert: not tested on their own
    steady_alert = ((alert | onset) & ~recovery) | explained
    comparable = compute & usable  # compute: judged (past warmup) and not a collective
    started = (compute & (onset | explained)).nonzero()[0]
    state.intermittent.reset((entries.code[started], entries.local_slot[started]))
    # a thin window is no evidence for either rule
    if cohort_of is None:
        if not partial[0]:
            state.intermittent.record(config.persist_windows, entries.code, entries.local_slot, entries.slow_steps,
                                      comparable & ~steady_alert)
    else:
        state.intermittent.record(config.persist_windows, entries.code, entries.local_slot, entries.slow_steps,
                                  comparable & ~steady_alert, recording=~partial)
    intermittent = judge_intermittent(state.intermittent, entries.code, entries.local_slot, comparable,
                                      comparable & ~steady_alert,
                                      compute & steady_alert, state.alert, config.false_alarm_rate,
                                      config.persist_windows, cohort_of, batch.size)
    intermittent_also_slow = lead_intermittent_stages(batch.stage_names, state, entries, intermittent,
                                                      compute & slow & (entries.local_code >= 2), clearly_over,
                                                      entries.host - host.references.reference,
                                                      batch.codes_per_cohort)

    context = VerdictContext(batch, now, entries, host, device, use_device, slowdown)
    # a steady alert that ends as the intermittent one starts is handed over: one straggler verdict
    recovery_said = recovery & ~intermittent.onset
    for entry in (onset | recovery_said | uncertain_notice | floor_notice | waiting_notice).nonzero()[0].tolist():
        if late_onset[entry]:
            record = context.verdict(entry, contract.VERDICT_STRAGGLER, contract.REASON_LAST_TO_ARRIVE,
                                     contract.ATTRIBUTION_UNKNOWN, timing_host=True)
            # slowdown: its time to the collective over its whole-step compute, as its peers see it
            step_ms = step_compute_ms[int(entries.slot[entry])]
            judgements[int(entries.cohort[entry])].verdicts.append(dataclasses.replace(record,
                                                          slowdown=verdict_number(1.0 + lateness[entry] / step_ms),
                                                          also_slow=also_slow.get(entry, ())))
            continue
        if onset[entry]:
            verdict, reason = contract.VERDICT_STRAGGLER, contract.REASON_SLOW_VS_PEERS
        elif recovery_said[entry]:
            verdict, reason = contract.VERDICT_RECOVERED, contract.REASON_WITHIN_TOLERANCE
        elif waiting_notice[entry]:
            verdict, reason = contract.VERDICT_UNCERTAIN, contract.REASON_WAITING_ON_PEER
        else:
            notice_code = uncertain_reason[entry] or floor_reason[entry]
            verdict, reason = contract.VERDICT_UNCERTAIN, _UNCERTAIN_REASONS[notice_code]
        attribution = attribution_of(reason, host_flag[entry], device_flag[entry], device_usable[entry])
        record = context.verdict(entry, verdict, reason, attribution)
        if entry in also_slow and onset[entry]:
            record = dataclasses.replace(record, also_slow=also_slow[entry])
        judgements[int(entries.cohort[entry])].verdicts.append(record)
    for entry in (intermittent.onset | intermittent.recovery).nonzero()[0].tolist():
        onset_now = bool(intermittent.onset[entry])
        record = context.verdict(entry, contract.VERDICT_STRAGGLER if onset_now else contract.VERDICT_RECOVERED,
                                 contract.REASON_INTERMITTENT if onset_now else contract.REASON_WITHIN_TOLERANCE,
                                 contract.ATTRIBUTION_UNKNOWN, timing_host=True)
        judgements[int(entries.cohort[entry])].verdicts.append(dataclasses.replace(
            record, **intermittent_evidence(intermittent, entry), also_slow=intermittent_also_slow.get(entry, ())))
    return judgements


def _judge_presence(batch: WindowBatch, entries: Entries, held: np.ndarray, moved_on: np.ndarray,
                    config: DetectorConfig, now: int, judgements: list[WindowJudgement]) -> None:
    """Coverage gaps and `silent`: ranks of each cohort that had no rows in this window (`held`:
    the slots ranks hold; `moved_on`: their ranks have sent rows of a later window).

    A rank that misses silent_windows windows in a row falls silent at once (windows stop waiting
    for it), but its verdict waits until its peers' intervals, in the windows judged, end more than
    max_export_lag_s after its own last one: only then is the gap longer than any export delay. A
    rank that has already sent rows of a later window is alive whatever it lacks here (its exporter
    dropped them, as ranks do while a detector is down and a peer's backlog arrives later): a
    coverage gap, never a step towards silence. Ranks that all stop
    together, as torchrun stops the survivors of a crash before their last export, never get
    there, and a new incarnation replaces them without a `silent` verdict (CONTRACT §training.restart.count)."""
    state: CohortVerdictState = batch.state
    count = batch.slot_count
    present = entries.present
    silent = state.silent[:count]
    reported = state.silent_reported[:count]
    missed = state.missed_windows[:count]
    last_end = state.last_end_unix_nano[:count]
    np.maximum(last_end, entries.last_end_unix_nano, out=last_end)
    missing = held & ~present
    gaps = missing & ~silent
    missed[missing] += 1
    missed[present | moved_on] = 0
    fell_silent = gaps & (missed >= config.silent_windows)
    came_back = present & silent
    silent[fell_silent] = True
    silent[came_back] = reported[came_back] = False
    # by the judged windows' own rows (not what has arrived since), so that replay agrees with live
    by_cohort = batch.by_cohort(last_end)
    peers_moved_on = (by_cohort.max(axis=1, initial=0)[:, None] - by_cohort > int(config.max_export_lag_s * 1e9))
    confirmed = held & silent & ~reported & peers_moved_on.reshape(-1)
    reported[confirmed] = True
    for judgement, gap_count in zip(judgements, np.count_nonzero(batch.by_cohort(gaps), axis=1).tolist(), strict=True):
        judgement.coverage_gaps = gap_count
    per_cohort = count // batch.size
    for name, changed in (("fell_silent", fell_silent), ("came_back", came_back)):
        slots = changed.nonzero()[0]
        if slots.size:  # rare: ranks falling silent or coming back
            cohort_of = slots // per_cohort
            for index in np.unique(cohort_of).tolist():
                setattr(judgements[index], name, slots[cohort_of == index] - index * per_cohort)
    for slot in confirmed.nonzero()[0].tolist():
        index, own = divmod(slot, per_cohort)
        cohort, window = batch.cohorts[index], batch.windows[index]
        judgements[index].verdicts.append(Verdict(
            time_unix_nano=now, job_id=cohort.job_id, cohort=cohort.name, stage=contract.WHOLE_STEP_STAGE,
            rank=cohort.slot_entries[own].rank, window=window, verdict=contract.VERDICT_SILENT,
            reason=contract.REASON_NO_REPORT, slowdown=None, gap_ms=None, rank_ms=None, reference_ms=None,
            reference_ranks=(), timing=contract.TIMING_HOST, attribution=contract.ATTRIBUTION_UNKNOWN,
            workload_comparable=None))


def _judge_paces(batch: WindowBatch, entries: Entries, config: DetectorConfig, now: int) -> list[list[Verdict]]:
    """`job_slowdown` (job_baseline.py): each cohort's pace against its own baseline."""
    state: CohortVerdictState = batch.state
    tokens_by_slot = np.full(batch.slot_count, np.nan)
    tokens_by_slot[entries.slot] = entries.tokens
    stages = entries.local_code != 0
    alone = batch.size == 1
    paces = window_paces(entries.rows, batch.window_steps, batch.slot_count, tokens_by_slot, entries.present,
                         entries.code[stages], entries.host[stages], None if alone else batch.slots_per_cohort,
                         None if alone else batch.codes_per_cohort)
    # a straggler makes every rank wait: its own alert explains the slower steps
    # an intermittent one only for the whole step: slow steps of one stage are too small a share of
    # the step to explain the cohort's pace
    shape = (batch.size, batch.codes_per_cohort, batch.slots_per_cohort)
    blamed = np.asarray(state.alert.reshape(shape).any(axis=(1, 2))
                        | state.intermittent.alert.reshape(shape)[:, 0].any(axis=1)
                        | (state.slow_streak.reshape(shape)[:, 0::2] > 0).any(axis=(1, 2))
                        | (state.late_streak.reshape(shape) > 0).any(axis=(1, 2)))
    return [judge_pace(cohort.verdict_state.job, pace, bool(blame), cohort, window, config, now)
            for cohort, window, pace, blame in zip(batch.cohorts, batch.windows, paces, blamed.tolist(), strict=True)]
