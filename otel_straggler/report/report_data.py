"""What the report's pictures and tables show, shaped from the evidence: pure functions, no plotting.

- a grid per stage: rank x window of median durations (needs windows.jsonl);
- a timeline per alerted rank and stage against its peers, with the detector's threshold, where
  the alert's slow streak began and the alert itself;
- the verdicts themselves, by window and rank, and the uncertain ones counted by reason and stage.
From verdicts.jsonl alone a timeline is built from the verdicts' own medians, where they exist.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from otel_straggler import contract
from otel_straggler.contract import REASON_SLOW_VS_PEERS
from otel_straggler.report.evidence_files import Evidence, WindowMedian
from otel_straggler.report.summary import find_detection, leading_alerts, straggler_alerts

Verdict = dict[str, Any]
MAX_TIMELINES = 6  # panels in the timeline picture; a large job's further alerts are in the table


@dataclass(frozen=True)
class StageGrid:
    stage: str
    collective: bool
    ranks: list[int]
    windows: list[int]
    median_ms: list[list[Optional[float]]]  # [rank index][window index]; None where the rank sent nothing


@dataclass(frozen=True)
class Timeline:
    """One rank's stage duration per window next to its peers'. Lists are aligned with `windows`."""

    rank: int
    stage: str
    windows: list[int]
    rank_ms: list[Optional[float]]
    reference_ms: list[Optional[float]]
    threshold_ms: list[Optional[float]]  # above this (and persistently) the rank is a straggler
    peer_low_ms: list[Optional[float]]  # fastest and slowest peer; None when only verdicts are known
    peer_high_ms: list[Optional[float]]
    alert_windows: list[int]
    injection_window: Optional[int]
    source: str  # "windows" (every window's medians) or "verdicts" (only windows that got a verdict)
    onset_windows: list[int] = field(default_factory=list)  # where each alert's run of slow windows began
    timing: str = "host"  # "device": device durations, as the alert compared them
    also_slow: tuple[str, ...] = ()  # the stages the alert's stage explains


@dataclass(frozen=True)
class Focus:
    """A rank and stage to draw, and the alert that chose it (None: the injection, not flagged)."""

    rank: int
    stage: str
    alert: Optional[Verdict]


def job_ids(evidence: Evidence) -> list[str]:
    """Every job the evidence speaks of."""
    jobs = {verdict["job_id"] for verdict in evidence.verdicts if isinstance(verdict.get("job_id"), str)}
    jobs.update(median.job_id for median in evidence.windows)
    if evidence.run is not None:
        jobs.add(evidence.run.job_id)
    return sorted(jobs)


def largest_job(windows: Iterable[WindowMedian]) -> list[WindowMedian]:
    """The windows of the job and cohort with the most records: the heat map draws one cohort."""
    by_cohort: dict[tuple[str, str], list[WindowMedian]] = {}
    for median in windows:
        by_cohort.setdefault((median.job_id, median.cohort), []).append(median)
    return max(by_cohort.values(), key=len) if by_cohort else []


def cohort_windows(windows: list[WindowMedian], alert: Optional[Verdict]) -> list[WindowMedian]:
    """The windows of the alert's job and cohort; the largest cohort's without an alert."""
    if alert is None or not isinstance(alert.get("job_id"), str):
        return largest_job(windows)
    return [median for median in windows
            if median.job_id == alert["job_id"] and median.cohort == alert.get("cohort", median.cohort)]


def stage_grids(windows: list[WindowMedian], device: bool = False) -> list[StageGrid]:
    """One grid per stage, stages in the order the job first ran them (the whole step `*` first).
    `device`: device durations, where the ranks measured them."""
    stage_order: list[str] = []
    cells: dict[str, dict[tuple[int, int], float]] = {}
    collective: dict[str, bool] = {}
    for median in sorted(windows, key=lambda median: (median.window, median.rank)):
        if median.stage not in cells:
            stage_order.append(median.stage)
            cells[median.stage] = {}
        value = median.device_ms if device else median.median_ms
        if value is not None:
            cells[median.stage][(median.rank, median.window)] = value
        collective[median.stage] = collective.get(median.stage, False) or median.collective
    ranks = sorted({median.rank for median in windows})
    window_indexes = sorted({median.window for median in windows})
    return [
        StageGrid(
            stage=stage, collective=collective[stage], ranks=ranks, windows=window_indexes,
            median_ms=[[cells[stage].get((rank, window)) for window in window_indexes] for rank in ranks],
        )
        for stage in stage_order
    ]


def focuses(evidence: Evidence, limit: int = MAX_TIMELINES) -> list[Focus]:
    """What the timelines show: the demo's detection (or its injection, flagged or not) first, then
    every alerted rank and stage, each alert's leading stage before the stages it explains and the
    whole step last. A whole-step (`*`) alert is drawn from `*` where windows.jsonl has it, else
    from the rank's injected or slowest stage (the demo's windows.jsonl of before held raw stages only)."""
    run = evidence.run
    chosen: list[Focus] = []
    detection = find_detection(run, evidence.verdicts) if run is not None else None
    if detection is not None:
        chosen.append(Focus(detection.verdict["rank"], detection.verdict["stage"], detection.verdict))
    elif run is not None and run.injection is not None:
        chosen.append(Focus(run.injection.rank, run.injection.stage, None))
    leading = leading_alerts(evidence.verdicts)
    explained = [alert for alert in straggler_alerts(evidence.verdicts) if not any(alert is lead for lead in leading)]
    for alert in leading + explained:
        chosen.append(Focus(alert["rank"], alert["stage"], alert))

    shown: list[Focus] = []
    seen: set[tuple] = set()
    for focus in chosen:
        stage = _drawable_stage(evidence, focus)
        key = (_cohort_key(focus.alert), focus.rank, stage)
        if key in seen:
            continue
        seen.add(key)
        shown.append(Focus(focus.rank, stage, focus.alert))
        if len(shown) == limit:
            break
    return shown


def _cohort_key(alert: Optional[Verdict]) -> tuple:
    return (None, None) if alert is None else (alert.get("job_id"), alert.get("cohort"))


def _drawable_stage(evidence: Evidence, focus: Focus) -> str:
    if focus.stage != contract.WHOLE_STEP_STAGE:
        return focus.stage
    windows = cohort_windows(evidence.windows, focus.alert)
    if any(median.stage == contract.WHOLE_STEP_STAGE for median in windows) or not windows:
        return focus.stage
    run = evidence.run
    if run is not None and run.injection is not None and run.injection.rank == focus.rank:
        return run.injection.stage
    return _slowest_stage(windows, focus.rank) or focus.stage


def _slowest_stage(windows: list[WindowMedian], rank: int) -> Optional[str]:
    """The non-collective stage where `rank` is furthest above its peers' median, over all windows."""
    excess: dict[str, list[float]] = {}
    for grid in stage_grids(windows):
        if grid.collective or rank not in grid.ranks:
            continue
        row = grid.ranks.index(rank)
        for column in range(len(grid.windows)):
            own = grid.median_ms[row][column]
            column_values = [values[column] for index, values in enumerate(grid.median_ms) if index != row]
            peers = [value for value in column_values if value is not None]
            if own is not None and peers and statistics.median(peers) > 0:
                excess.setdefault(grid.stage, []).append(own / statistics.median(peers))
    if not excess:
        return None
    return max(excess, key=lambda stage: statistics.median(excess[stage]))


def threshold(reference_ms: float, rel_threshold: float, min_gap_ms: float) -> float:
    """The smallest median that is slow under both rules (docs/detection.md#thresholds)."""
    return max(reference_ms * (1.0 + rel_threshold), reference_ms + min_gap_ms)


def timeline_from_windows(
    windows: list[WindowMedian], verdicts: list[Verdict], rank: int, stage: str,
    rel_threshold: float, min_gap_ms: float, injection_window: Optional[int],
    alert: Optional[Verdict] = None, persist_windows: int = 1, marks_whole_step: bool = False,
) -> Optional[Timeline]:
    """The rank's medians against its peers' from windows.jsonl; device durations where the alert
    compared them and the windows hold them. `marks_whole_step`: the timeline stands in for the
    rank's whole step, so its `*` alerts are marked too."""
    windows = [median for median in windows if median.stage == stage]
    device = alert is not None and alert.get("timing") == "device" and any(
        median.device_ms is not None for median in windows if median.rank == rank)
    grid = next(iter(stage_grids(windows, device)), None)
    if grid is None or rank not in grid.ranks:
        return None
    row = grid.ranks.index(rank)
    reference, low, high, limit = [], [], [], []
    for column in range(len(grid.windows)):
        column_values = [values[column] for index, values in enumerate(grid.median_ms) if index != row]
        peers = [value for value in column_values if value is not None]
        median = statistics.median(peers) if peers else None
        reference.append(median)
        low.append(min(peers) if peers else None)
        high.append(max(peers) if peers else None)
        limit.append(threshold(median, rel_threshold, min_gap_ms) if median is not None else None)
    alerts = _alerts_of(verdicts, rank, stage, marks_whole_step, _cohort_key(alert))
    return Timeline(
        rank=rank, stage=stage, windows=grid.windows, rank_ms=grid.median_ms[row], reference_ms=reference,
        threshold_ms=limit, peer_low_ms=low, peer_high_ms=high,
        alert_windows=sorted({alert_["window"] for alert_ in alerts}), injection_window=injection_window,
        source="windows", onset_windows=_onsets(alerts, persist_windows), timing="device" if device else "host",
        also_slow=_also_slow(alert, stage),
    )


def timeline_from_verdicts(
    verdicts: list[Verdict], rank: int, stage: str, rel_threshold: float, min_gap_ms: float,
    injection_window: Optional[int], alert: Optional[Verdict] = None, persist_windows: int = 1,
    marks_whole_step: bool = False,
) -> Optional[Timeline]:
    """The rank's and reference medians as the verdicts recorded them: only windows that got a verdict."""
    by_window: dict[int, Verdict] = {}
    for verdict in _in_cohort(verdicts, _cohort_key(alert)):
        if verdict["rank"] == rank and verdict["stage"] == stage and _number(verdict.get("rank_ms")) is not None:
            by_window[verdict["window"]] = verdict  # the latest verdict of a window wins
    if not by_window:
        return None
    windows = sorted(by_window)
    reference = [_number(by_window[window].get("reference_ms")) for window in windows]
    alerts = _alerts_of(verdicts, rank, stage, marks_whole_step, _cohort_key(alert))
    return Timeline(
        rank=rank, stage=stage, windows=windows, rank_ms=[_number(by_window[window]["rank_ms"]) for window in windows],
        reference_ms=reference,
        threshold_ms=[threshold(value, rel_threshold, min_gap_ms) if value is not None else None
                      for value in reference],
        peer_low_ms=[None] * len(windows), peer_high_ms=[None] * len(windows),
        alert_windows=sorted({alert_["window"] for alert_ in alerts}), injection_window=injection_window,
        source="verdicts", onset_windows=_onsets(alerts, persist_windows),
        timing=(alert or {}).get("timing") or "host", also_slow=_also_slow(alert, stage),
    )


def timelines(evidence: Evidence, rel_threshold: float, min_gap_ms: float, persist_windows: int) -> list[Timeline]:
    """One per focus (focuses()), each from windows.jsonl where it has the stage, else from the verdicts."""
    run = evidence.run
    injection_window = (run.injection.from_step // run.window_steps
                        if run is not None and run.injection is not None else None)
    built = []
    for focus in focuses(evidence):
        windows = cohort_windows(evidence.windows, focus.alert)
        injected = injection_window if run is not None and run.injection is not None and \
            run.injection.rank == focus.rank else None
        whole_step = focus.stage != contract.WHOLE_STEP_STAGE and focus.stage == _drawable_stage(
            evidence, Focus(focus.rank, contract.WHOLE_STEP_STAGE, focus.alert))
        timeline = timeline_from_windows(windows, evidence.verdicts, focus.rank, focus.stage, rel_threshold,
                                         min_gap_ms, injected, focus.alert, persist_windows, whole_step) \
            or timeline_from_verdicts(evidence.verdicts, focus.rank, focus.stage, rel_threshold, min_gap_ms,
                                      injected, focus.alert, persist_windows, whole_step)
        if timeline is not None:
            built.append(timeline)
    return built


def timeline(evidence: Evidence, rel_threshold: float, min_gap_ms: float,
             persist_windows: int = 1) -> Optional[Timeline]:
    """The first of timelines(): the detection, the injection or the first alert."""
    built = timelines(evidence, rel_threshold, min_gap_ms, persist_windows)
    return built[0] if built else None


def _in_cohort(verdicts: list[Verdict], where: tuple) -> list[Verdict]:
    """The verdicts of one (job, cohort); all of them for (None, None)."""
    return verdicts if where == (None, None) else [verdict for verdict in verdicts if _cohort_key(verdict) == where]


def _alerts_of(verdicts: list[Verdict], rank: int, stage: str, marks_whole_step: bool, where: tuple) -> list[Verdict]:
    """The alerts a timeline of (rank, stage) marks: its own, those whose stage explains it, and the
    whole step's where it stands in for it."""
    return [
        alert for alert in straggler_alerts(_in_cohort(verdicts, where))
        if alert["rank"] == rank and (alert["stage"] == stage or stage in (alert.get("also_slow") or ())
                                      or (marks_whole_step and alert["stage"] == contract.WHOLE_STEP_STAGE))
    ]


def _onsets(alerts: list[Verdict], persist_windows: int) -> list[int]:
    """Where the slow streak of each persistence alert began (an intermittent one has no streak)."""
    return sorted({alert["window"] - (persist_windows - 1) for alert in alerts
                   if alert.get("reason") == REASON_SLOW_VS_PEERS and persist_windows > 1})


def _also_slow(alert: Optional[Verdict], stage: str) -> tuple[str, ...]:
    if alert is None or alert["stage"] != stage:
        return ()
    return tuple(name for name in alert.get("also_slow") or () if isinstance(name, str))


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def verdict_counts(verdicts: list[Verdict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for verdict in verdicts:
        counts[verdict["verdict"]] = counts.get(verdict["verdict"], 0) + 1
    return counts


def uncertain_counts(verdicts: list[Verdict]) -> list[tuple[str, str, int]]:
    """(reason, stage, count) of the uncertain verdicts, most frequent first."""
    counts = Counter((str(verdict.get("reason")), verdict["stage"]) for verdict in verdicts
                     if verdict["verdict"] == contract.VERDICT_UNCERTAIN)
    return [(reason, stage, count) for (reason, stage), count in
            sorted(counts.items(), key=lambda item: (-item[1], item[0][0], item[0][1] == contract.WHOLE_STEP_STAGE,
                                                     item[0][1]))]


def notable_verdicts(verdicts: list[Verdict]) -> list[Verdict]:
    """The verdicts a reader looks at first: alerts, recoveries, silences and hangs, in window order
    (uncertain verdicts are counted, not listed); job-level ones (no rank) first in their window,
    then by rank, each rank's leading stage first and the whole step last."""
    notable = (contract.VERDICT_STRAGGLER, contract.VERDICT_RECOVERED, contract.VERDICT_SILENT, contract.VERDICT_HANG)
    chosen = [verdict for verdict in verdicts if verdict["verdict"] in notable]
    return sorted(chosen, key=lambda verdict: (
        verdict["window"], -1 if verdict["rank"] is None else verdict["rank"], not verdict.get("also_slow"),
        verdict["stage"] == contract.WHOLE_STEP_STAGE, verdict["stage"]))
