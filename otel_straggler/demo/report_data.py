"""What the report's pictures show, shaped from the evidence: pure functions, no plotting.

- a grid per stage: rank x window of median durations (needs windows.jsonl);
- one rank's timeline against its peers, with the detector's threshold;
- the verdicts themselves, by window and rank.
From verdicts.jsonl alone the timeline is built from the verdicts' own medians, where they exist.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from otel_straggler import contract
from otel_straggler.demo.evidence import Evidence, WindowMedian
from otel_straggler.demo.summary import find_detection, straggler_alerts

Verdict = dict[str, Any]


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


def largest_job(windows: Iterable[WindowMedian]) -> list[WindowMedian]:
    """The windows of the job and cohort with the most records: the report draws one cohort."""
    by_cohort: dict[tuple[str, str], list[WindowMedian]] = {}
    for median in windows:
        by_cohort.setdefault((median.job_id, median.cohort), []).append(median)
    return max(by_cohort.values(), key=len) if by_cohort else []


def stage_grids(windows: list[WindowMedian]) -> list[StageGrid]:
    """One grid per stage, stages in the order the job first ran them."""
    stage_order: list[str] = []
    cells: dict[str, dict[tuple[int, int], float]] = {}
    collective: dict[str, bool] = {}
    for median in sorted(windows, key=lambda median: (median.window, median.rank)):
        if median.stage not in cells:
            stage_order.append(median.stage)
            cells[median.stage] = {}
        cells[median.stage][(median.rank, median.window)] = median.median_ms
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


def focus(evidence: Evidence) -> Optional[tuple[int, str]]:
    """The rank and stage the timeline shows: the detection, else the injection, else the first
    alert. A whole-step (`*`) choice becomes the rank's slowest measured stage, since windows.jsonl
    holds raw stages only."""
    run = evidence.run
    detection = find_detection(run, evidence.verdicts) if run is not None else None
    if detection is not None:
        chosen = (detection.verdict["rank"], detection.verdict["stage"])
    elif run is not None and run.injection is not None:
        chosen = (run.injection.rank, run.injection.stage)
    else:
        alerts = straggler_alerts(evidence.verdicts)
        if not alerts:
            return None
        chosen = (alerts[0]["rank"], alerts[0]["stage"])
    rank, stage = chosen
    if stage == contract.WHOLE_STEP_STAGE and run is not None and run.injection is not None:
        stage = run.injection.stage
    if stage == contract.WHOLE_STEP_STAGE and evidence.windows:
        stage = _slowest_stage(evidence.windows, rank) or stage
    return rank, stage


def _slowest_stage(windows: list[WindowMedian], rank: int) -> Optional[str]:
    """The non-collective stage where `rank` is furthest above its peers' median, over all windows."""
    excess: dict[str, list[float]] = {}
    for grid in stage_grids(windows):
        if grid.collective or rank not in grid.ranks:
            continue
        row = grid.ranks.index(rank)
        for column in range(len(grid.windows)):
            own = grid.median_ms[row][column]
            peers = [values[column] for index, values in enumerate(grid.median_ms) if index != row]
            peers = [value for value in peers if value is not None]
            if own is not None and peers and statistics.median(peers) > 0:
                excess.setdefault(grid.stage, []).append(own / statistics.median(peers))
    if not excess:
        return None
    return max(excess, key=lambda stage: statistics.median(excess[stage]))


def threshold(reference_ms: float, rel_threshold: float, min_gap_ms: float) -> float:
    """The smallest median that is slow under both rules (DESIGN §3, Thresholds)."""
    return max(reference_ms * (1.0 + rel_threshold), reference_ms + min_gap_ms)


def timeline_from_windows(
    windows: list[WindowMedian], verdicts: list[Verdict], rank: int, stage: str,
    rel_threshold: float, min_gap_ms: float, injection_window: Optional[int],
) -> Optional[Timeline]:
    grid = next((grid for grid in stage_grids(windows) if grid.stage == stage), None)
    if grid is None or rank not in grid.ranks:
        return None
    row = grid.ranks.index(rank)
    reference, low, high, limit = [], [], [], []
    for column in range(len(grid.windows)):
        peers = [values[column] for index, values in enumerate(grid.median_ms) if index != row]
        peers = [value for value in peers if value is not None]
        median = statistics.median(peers) if peers else None
        reference.append(median)
        low.append(min(peers) if peers else None)
        high.append(max(peers) if peers else None)
        limit.append(threshold(median, rel_threshold, min_gap_ms) if median is not None else None)
    return Timeline(
        rank=rank, stage=stage, windows=grid.windows, rank_ms=grid.median_ms[row], reference_ms=reference,
        threshold_ms=limit, peer_low_ms=low, peer_high_ms=high,
        alert_windows=_alert_windows(verdicts, rank, stage), injection_window=injection_window, source="windows",
    )


def timeline_from_verdicts(
    verdicts: list[Verdict], rank: int, stage: str, rel_threshold: float, min_gap_ms: float,
    injection_window: Optional[int],
) -> Optional[Timeline]:
    """The rank's and reference medians as the verdicts recorded them: only windows that got a verdict."""
    by_window: dict[int, Verdict] = {}
    for verdict in verdicts:
        if verdict["rank"] == rank and verdict["stage"] == stage and _number(verdict.get("rank_ms")) is not None:
            by_window[verdict["window"]] = verdict  # the latest verdict of a window wins
    if not by_window:
        return None
    windows = sorted(by_window)
    reference = [_number(by_window[window].get("reference_ms")) for window in windows]
    return Timeline(
        rank=rank, stage=stage, windows=windows, rank_ms=[_number(by_window[window]["rank_ms"]) for window in windows],
        reference_ms=reference,
        threshold_ms=[threshold(value, rel_threshold, min_gap_ms) if value is not None else None for value in reference],
        peer_low_ms=[None] * len(windows), peer_high_ms=[None] * len(windows),
        alert_windows=_alert_windows(verdicts, rank, stage), injection_window=injection_window, source="verdicts",
    )


def timeline(evidence: Evidence, rel_threshold: float, min_gap_ms: float) -> Optional[Timeline]:
    chosen = focus(evidence)
    if chosen is None:
        return None
    rank, stage = chosen
    run = evidence.run
    injection_window = (run.injection.from_step // run.window_steps
                        if run is not None and run.injection is not None else None)
    windows = largest_job(evidence.windows)
    built = timeline_from_windows(windows, evidence.verdicts, rank, stage, rel_threshold, min_gap_ms, injection_window)
    return built or timeline_from_verdicts(evidence.verdicts, rank, stage, rel_threshold, min_gap_ms, injection_window)


def _alert_windows(verdicts: list[Verdict], rank: int, stage: str) -> list[int]:
    return sorted({
        alert["window"] for alert in straggler_alerts(verdicts)
        if alert["rank"] == rank and alert["stage"] in (stage, contract.WHOLE_STEP_STAGE)
    })


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def verdict_counts(verdicts: list[Verdict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for verdict in verdicts:
        counts[verdict["verdict"]] = counts.get(verdict["verdict"], 0) + 1
    return counts


def notable_verdicts(verdicts: list[Verdict]) -> list[Verdict]:
    """The verdicts a reader looks at first: alerts, recoveries, silences and hangs, in window order
    (uncertain verdicts are counted, not listed); job-level ones (no rank) first in their window."""
    notable = (contract.VERDICT_STRAGGLER, contract.VERDICT_RECOVERED, contract.VERDICT_SILENT, contract.VERDICT_HANG)
    chosen = [verdict for verdict in verdicts if verdict["verdict"] in notable]
    return sorted(chosen, key=lambda verdict: (verdict["window"], -1 if verdict["rank"] is None else verdict["rank"],
                                               verdict["stage"]))
