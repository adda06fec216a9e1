"""`job_slowdown`: a cohort slower than its own baseline, every rank alike, nobody to blame.

Per judged window, the cohort's pace is the median over its ranks of each rank's step period: the
time between the ends of its consecutive steps in the window (divided by the steps between them
when one is missing), so untimed work and waits count, nesting does not, and one pause (a
checkpoint) moves a median little. With one step per window the period is the time its intervals
cover. Where every rank reports tokens, the pace is time per token instead, so a change of batch
size is no slowdown.

The baseline is the median pace of the cohort's first BASELINE_WINDOWS windows after warmup, then
follows the cohort slowly (BASELINE_WEIGHT per window) through windows within the threshold only:
a drift of a few percent is absorbed and never fires, a step change is not. A new incarnation or
topology epoch is a new cohort, so a restart or re-shard starts a new baseline; so does a switch
between step time and time per token.

A window is over when pace > baseline x (1 + job_slowdown_threshold). `job_slowdown` after
persist_windows consecutive windows over with no rank to blame (no straggler alert active, no
rank slow or last to arrive in the window: one slow rank makes every rank wait, and its own
alert says more) whose steps took at least job_slowdown_min_s together: a job compared with its
own past, unlike a rank compared with its peers at the same moment, sees every swing of its host's
load, and with fast steps a few windows last seconds, within such a swing.
`recovered`/`back_to_baseline` at the first window back within the threshold.
The verdict names the stage whose per-interval median (over ranks) grew most over its own
baseline when it holds at least half of the growth, else `*`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.grouped import grouped_medians, grouped_medians_signed
from otel_straggler.detector.observation import Verdict

BASELINE_WINDOWS = 5  # windows whose median pace is the first baseline
BASELINE_WEIGHT = 0.1  # how far each window within the threshold moves the baseline
STAGE_SHARE = 0.5  # share of the stages' growth one stage must hold to be named


@dataclass
class JobBaseline:
    """One cohort's pace baseline and job_slowdown alert."""
    per_token: Optional[bool] = None  # the baseline's unit: time per token, or step time
    windows: int = 0  # windows with a pace, warmup included
    # the first windows' paces, until the baseline forms from them (None from then on)
    first: Optional[list[Pace]] = field(default_factory=list)
    baseline: float = float("nan")
    stage_baseline: dict = field(default_factory=dict)  # stage code -> ms
    streak: int = 0
    streak_s: float = 0.0  # the time the streak's windows' steps took
    active: bool = False
    ratio: Optional[float] = None  # latest window's pace over the baseline (straggler.job.slowdown)


@dataclass
class Pace:
    """One window's pace of a cohort: ms per step (or per token) and each stage's median."""
    value: float
    per_token: bool
    stages: dict  # stage code -> median ms over ranks of the ranks' per-interval medians
    seconds: float = 0.0  # the time the window's steps took: the median step period x the steps it holds


def window_pace(rows, steps: int, slot_count: int, tokens_by_slot: np.ndarray, present: np.ndarray,
                stage_codes: np.ndarray, stage_host: np.ndarray) -> Optional[Pace]:
    """The pace of a closed window (None: no rank has a period in it). rows: the window's rows as
    judged (window_entries.Rows: slot, step offset, host ms, end), of windows of `steps` steps;
    tokens_by_slot: each slot's tokens per step (nan: not reported); stage_codes, stage_host: the
    window's (stage code, rank) entries and their per-interval medians."""
    return window_paces(rows, steps, slot_count, tokens_by_slot, present, stage_codes, stage_host)[0]


def window_paces(rows, steps: int, slot_count: int, tokens_by_slot: np.ndarray, present: np.ndarray,
                 stage_codes: np.ndarray, stage_host: np.ndarray, slots_per_cohort: Optional[int] = None,
                 codes_per_cohort: Optional[int] = None) -> list[Optional[Pace]]:
    """window_pace of each cohort of windows judged together (window_batch.py): slots are cohort *
    slots_per_cohort + the cohort's slot (slot_count of them), codes cohort * codes_per_cohort +
    the cohort's code. Without them, one cohort's window."""
    per_cohort = slot_count if slots_per_cohort is None else slots_per_cohort
    cohorts = slot_count // per_cohort if per_cohort else 1
    if rows.slot.size == 0:
        return [None] * cohorts
    slot, step_offset, end, host = rows.slot, rows.step, rows.end_unix_nano, rows.host
    bins = slot * steps + step_offset
    latest_end = np.zeros(slot_count * steps, dtype=np.int64)
    np.maximum.at(latest_end, bins, end)
    step_end = latest_end.reshape(slot_count, steps)
    if steps > 1:
        # each step a rank has after another of its steps: the time between their ends, per step
        # between them (in slot then step order, one pass, instead of a loop over the steps)
        has_slot, has_step = np.nonzero(step_end > 0)
        ends = step_end[has_slot, has_step]
        follows = has_slot[1:] == has_slot[:-1]
        period_ms = (ends[1:][follows] - ends[:-1][follows]) / (has_step[1:][follows] - has_step[:-1][follows]) / 1e6
        groups, medians = grouped_medians_signed(has_slot[1:][follows], period_ms)
        per_slot = np.full(slot_count, np.nan)
        per_slot[groups] = medians
    else:  # one step per window: the time its intervals cover
        start = np.full(slot_count, np.iinfo(np.int64).max)
        np.minimum.at(start, slot, end - (host * 1e6).astype(np.int64))
        per_slot = np.where(step_end[:, 0] > 0, (step_end[:, 0] - start) / 1e6, np.nan)
    ranks = present & np.isfinite(per_slot) & (per_slot > 0)
    if not ranks.any():
        return [None] * cohorts
    # per cohort: time per token where every rank with a period reports tokens, else step time
    reported = np.isfinite(tokens_by_slot) & (tokens_by_slot > 0)
    per_token = np.all((reported | ~ranks).reshape(cohorts, per_cohort), axis=1)
    rank_slots = ranks.nonzero()[0]
    rank_cohort = rank_slots // per_cohort
    periods = per_slot[rank_slots]
    with np.errstate(all="ignore"):  # the quotients of ranks without tokens are not used
        values = np.where(per_token[rank_cohort], periods / tokens_by_slot[rank_slots], periods)
    paced, medians = grouped_medians_signed(rank_cohort, values, cohorts)
    _, period_medians = grouped_medians_signed(rank_cohort, periods, cohorts)
    step_ms = np.where(per_token[paced], period_medians, medians)
    # the steps the window holds, not its size: one closed early (the job ended, a gap) took less
    steps_seen = np.count_nonzero((step_end > 0).reshape(cohorts, per_cohort, steps).any(axis=1), axis=1)
    seconds = step_ms * steps_seen[paced] / 1e3
    stages: list[dict] = [{} for _ in range(cohorts)]
    if stage_codes.size:
        codes, stage_medians = grouped_medians(stage_codes, stage_host)
        codes_of = codes_per_cohort or (int(codes[-1]) + 1)
        for code, median in zip(codes.tolist(), stage_medians.tolist(), strict=True):
            if np.isfinite(median):
                stages[code // codes_of][code % codes_of] = median
    paces: list[Optional[Pace]] = [None] * cohorts
    for index, cohort in enumerate(paced.tolist()):
        paces[cohort] = Pace(float(medians[index]), bool(per_token[cohort]), stages[cohort],
                             seconds=float(seconds[index]))
    return paces


def judge_pace(baseline: JobBaseline, pace: Optional[Pace], blamed: bool, cohort, window: int,
               config: DetectorConfig, now: int) -> list[Verdict]:
    """Updates `baseline` with one window's pace; the verdicts it gives (at most one)."""
    if pace is None:
        return []
    baseline.windows += 1
    if baseline.windows <= config.warmup_windows:  # startup: compilation, allocator, first loads
        return []
    if baseline.per_token is not None and pace.per_token != baseline.per_token:
        _restart(baseline)  # its unit changed: the old baseline says nothing about the new pace
    baseline.per_token = pace.per_token
    if baseline.first is not None:
        baseline.first.append(pace)
        if len(baseline.first) < BASELINE_WINDOWS:
            return []
        baseline.baseline = float(np.median([first.value for first in baseline.first]))
        first_stages = [first.stages for first in baseline.first]
        for code in set().union(*first_stages):
            values = [stages[code] for stages in first_stages if code in stages]
            baseline.stage_baseline[code] = float(np.median(values))
        baseline.first = None
        baseline.ratio = pace.value / baseline.baseline
        return []
    ratio = pace.value / baseline.baseline
    baseline.ratio = ratio
    over = ratio > 1.0 + config.job_slowdown_threshold
    verdicts = []
    if over:
        baseline.streak = 0 if blamed else baseline.streak + 1
        baseline.streak_s = 0.0 if blamed else baseline.streak_s + pace.seconds
        if (not baseline.active and baseline.streak >= config.persist_windows
                and baseline.streak_s >= config.job_slowdown_min_s):
            baseline.active = True
            verdicts.append(_verdict(baseline, pace, cohort, window, now, contract.VERDICT_JOB_SLOWDOWN,
                                     contract.REASON_SLOWER_THAN_BASELINE, _grown_stage(baseline, pace, cohort)))
        return verdicts
    baseline.streak, baseline.streak_s = 0, 0.0
    if baseline.active:
        baseline.active = False
        verdicts.append(_verdict(baseline, pace, cohort, window, now, contract.VERDICT_RECOVERED,
                                 contract.REASON_BACK_TO_BASELINE, contract.WHOLE_STEP_STAGE))
    if not blamed:  # follow a slow drift, never a straggler's effect
        baseline.baseline += BASELINE_WEIGHT * (pace.value - baseline.baseline)
        for code, value in pace.stages.items():
            known = baseline.stage_baseline.get(code)
            baseline.stage_baseline[code] = value if known is None else known + BASELINE_WEIGHT * (value - known)
    return verdicts


def _restart(baseline: JobBaseline) -> None:
    baseline.first = []
    baseline.baseline = float("nan")
    baseline.stage_baseline = {}
    baseline.streak, baseline.streak_s = 0, 0.0
    baseline.active = False
    baseline.ratio = None


def _grown_stage(baseline: JobBaseline, pace: Pace, cohort) -> str:
    growth = {code: value - baseline.stage_baseline[code] for code, value in pace.stages.items()
              if code in baseline.stage_baseline and value > baseline.stage_baseline[code]}
    if not growth:
        return contract.WHOLE_STEP_STAGE
    code = max(growth, key=growth.__getitem__)
    name = cohort.stage_names[code // 2] if code // 2 < len(cohort.stage_names) else None
    if name is None or growth[code] < STAGE_SHARE * sum(growth.values()):
        return contract.WHOLE_STEP_STAGE
    return name


def _verdict(baseline: JobBaseline, pace: Pace, cohort, window: int, now: int, kind: str, reason: str,
             stage: str) -> Verdict:
    return Verdict(
        time_unix_nano=now, job_id=cohort.job_id, cohort=cohort.name, stage=stage, rank=None, window=window,
        verdict=kind, reason=reason, slowdown=round(pace.value / baseline.baseline, 4),
        gap_ms=round(pace.value - baseline.baseline, 4), rank_ms=round(pace.value, 4),
        reference_ms=round(baseline.baseline, 4), reference_ranks=(),
        timing=contract.TIMING_HOST,  # paces are host time
        attribution=contract.ATTRIBUTION_UNKNOWN, workload_comparable=None)
