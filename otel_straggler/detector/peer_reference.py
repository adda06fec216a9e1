"""The reference a rank's window median is compared with: a quantile of its comparable peers' medians.

Choice: the `reference_quantile` (default 0.5, the median) of the window medians of the rank's
comparable peers, the rank itself left out.
- Robust: one lucky fast peer (or a few) cannot pull the median down, and the rank under test cannot
  pull its own reference up, so a slow rank stands out against its peers even in a cohort of three.
- Mass victims stay quiet: when many ranks look long for the same reason (everyone waits for one
  slow rank inside a stage), the median is long too, so none of them looks slow.
- At 64+ ranks with 2-3% per-step jitter the median of 63 window medians has a noise of ~0.2%, so
  the threshold applies to the rank's own noise only; docs/detection.md has the measured numbers.
A lower quantile would catch a rank sitting exactly at the threshold more often, but a healthy rank
that is persistently 2-3% slower than average (thermals, a slower link) would then cross it.

Peers are comparable when their workload (tokens per step) is within `tolerance` of the rank's,
pairwise: max/min <= 1 + tolerance. A rank or peer that reports no workload is compared without that
check. Entries come grouped by segment (one segment per stage); comparisons never cross segments.
"""
from __future__ import annotations

import bisect

import numpy as np

from otel_straggler.detector.grouped import cached_structure, order_within_groups, run_bounds

WORKLOAD_NOT_REPORTED = -1  # the rank, or every peer it was compared with, reported no workload
WORKLOAD_INCOMPARABLE = 0  # the rank reported a workload and no peer's was within tolerance
WORKLOAD_COMPARABLE = 1  # compared with at least one peer whose workload was checked


class PeerReferences:
    """Per entry: `reference` (nan without peers), `peer_count`, `workload` (one of WORKLOAD_*),
    `segment_size` (entries in its segment, itself included), and `peers(i)` on demand."""

    def __init__(self, segment_start: np.ndarray, segment_end: np.ndarray) -> None:
        size = segment_start.size
        self.reference = np.full(size, np.nan)
        self.peer_count = np.zeros(size, dtype=np.int64)
        self.workload = np.full(size, WORKLOAD_NOT_REPORTED, dtype=np.int8)
        self.segment_size = segment_end - segment_start
        self._segment_start = segment_start
        self._segment_end = segment_end
        # entries whose peers are a workload-filtered subset: their segment's (peers without
        # workload, reporting entries by workload) and their range in the latter
        self._filtered_segments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._filtered_low = np.full(size, -1, dtype=np.int64)
        self._filtered_high = np.full(size, -1, dtype=np.int64)

    def peers(self, entry: int) -> np.ndarray:
        """Indices of the entries that `entry` was compared with."""
        if self._filtered_low[entry] < 0:
            everyone = np.arange(self._segment_start[entry], self._segment_end[entry])
        else:
            unreported, by_workload = self._filtered_segments[int(self._segment_start[entry])]
            everyone = np.concatenate((unreported, by_workload[self._filtered_low[entry]:self._filtered_high[entry]]))
        return np.sort(everyone[everyone != entry])


def peer_references(segment: np.ndarray, values: np.ndarray, tokens: np.ndarray,
                    quantile: float, tolerance: float) -> PeerReferences:
    """`segment` (non-decreasing ints), `values` (finite medians), `tokens` (per entry, nan when not
    reported) all have one element per entry."""
    count = values.size
    starts, ends, segment_number, entry_start, entry_end, peers, low, high, fraction = cached_structure(
        "peer segments", segment, lambda: _segments(segment, quantile), quantile)
    result = PeerReferences(entry_start, entry_end)
    if count == 0:
        return result

    # everyone in the segment as peers: exact for ranks without workload, and for segments whose
    # reported workloads are all within tolerance of each other (the usual case)
    order = order_within_groups(segment_number, values)
    sorted_values = values[order]
    position = np.empty(count, dtype=np.int64)
    position[order] = np.arange(count)
    own = position - entry_start
    low_value = sorted_values[np.minimum(entry_start + _skipping(low, own), count - 1)]
    high_value = sorted_values[np.minimum(entry_start + _skipping(high, own), count - 1)]
    result.reference = np.where(peers >= 1, low_value + (high_value - low_value) * fraction, np.nan)
    result.peer_count = peers.copy()  # workload filtering (below) writes into it; `peers` is shared

    reports = np.isfinite(tokens) & (tokens > 0)
    reporting_in_segment = np.add.reduceat(reports.astype(np.int64), starts)
    lowest = np.minimum.reduceat(np.where(reports, tokens, np.inf), starts)
    highest = np.maximum.reduceat(np.where(reports, tokens, -np.inf), starts)
    checked = reports & (reporting_in_segment[segment_number] >= 2)
    result.workload[checked] = WORKLOAD_COMPARABLE
    for number in ((reporting_in_segment >= 2) & (highest > lowest * (1.0 + tolerance))).nonzero()[0]:
        _filter_by_workload(result, int(starts[number]), int(ends[number]), values, tokens, reports,
                            quantile, tolerance)
    return result


def _segments(segment: np.ndarray, quantile: float) -> tuple:
    """What depends on the entries' segments alone: each segment's (start, end), each entry's
    segment number, start, end and peer count, and its quantile's two positions and fraction."""
    starts, ends, segment_number = run_bounds(segment)
    entry_start = starts[segment_number]
    entry_end = ends[segment_number]
    peers = entry_end - entry_start - 1
    return (starts, ends, segment_number, entry_start, entry_end, peers) + _quantile_positions(peers, quantile)


def _quantile_positions(peers: np.ndarray, quantile: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For `peers` sorted values: the two indices and the fraction of a linear-interpolated quantile."""
    last = np.maximum(peers - 1, 0)
    target = quantile * last
    low = np.floor(target).astype(np.int64)
    return low, np.minimum(low + 1, last), target - low


def _skipping(index, own):
    """The index among all values of the `index`-th value when the rank's own value (at `own`) is
    left out: at or past it, one further along."""
    return index + (index >= own)


def _filter_by_workload(result: PeerReferences, start: int, end: int, values: np.ndarray,
                        tokens: np.ndarray, reports: np.ndarray, quantile: float, tolerance: float) -> None:
    """Reporting ranks of one segment whose workloads differ: each is compared with the peers within
    tolerance plus the peers without workload. Sorted by workload, each rank's comparable range only
    moves forward, so one sorted pool slides along: O(n log n) instead of a sort per rank."""
    members = np.arange(start, end)
    unreported = members[~reports[start:end]]
    reporting = members[reports[start:end]]
    by_workload = reporting[np.argsort(tokens[reporting], kind="stable")]
    workload = tokens[by_workload]
    low_bound = np.searchsorted(workload, workload / (1.0 + tolerance), side="left")
    high_bound = np.searchsorted(workload, workload * (1.0 + tolerance), side="right")
    peers = unreported.size + high_bound - low_bound - 1
    low, high, fraction = _quantile_positions(peers, quantile)
    low_value = np.full(by_workload.size, np.nan)
    high_value = np.full(by_workload.size, np.nan)
    pool = sorted(values[unreported].tolist())
    pool_values = values[by_workload].tolist()
    lows, highs, has_peers = low.tolist(), high.tolist(), (peers >= 1).tolist()
    in_low = in_high = 0
    for k, (first, stop) in enumerate(zip(low_bound.tolist(), high_bound.tolist(), strict=True)):
        while in_high < stop:
            bisect.insort(pool, pool_values[in_high])
            in_high += 1
        while in_low < first:
            del pool[bisect.bisect_left(pool, pool_values[in_low])]
            in_low += 1
        if has_peers[k]:
            own = bisect.bisect_left(pool, pool_values[k])
            low_value[k] = pool[_skipping(lows[k], own)]
            high_value[k] = pool[_skipping(highs[k], own)]
    result.reference[by_workload] = low_value + (high_value - low_value) * fraction
    result.peer_count[by_workload] = peers
    other_reporting = high_bound - low_bound - 1
    result.workload[by_workload] = np.where(
        other_reporting > 0, WORKLOAD_COMPARABLE,
        WORKLOAD_NOT_REPORTED if unreported.size else WORKLOAD_INCOMPARABLE)
    result._filtered_segments[start] = (unreported, by_workload)
    result._filtered_low[by_workload] = low_bound
    result._filtered_high[by_workload] = high_bound
