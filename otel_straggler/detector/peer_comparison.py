"""One duration kind (host or device) of a window's entries compared with their peers' references:
usable, over the relative threshold, over the floor, beyond the stage's noise."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.peer_reference import PeerReferences, peer_references
from otel_straggler.detector import stage_noise  # through the module: tests set its bound for every rule


@dataclass
class Comparison:
    """One duration kind (host or device) compared for every entry."""
    median: np.ndarray
    references: PeerReferences
    entries: np.ndarray  # which entries these rows are (device: only those with device durations)
    usable: np.ndarray
    slowdown: np.ndarray
    over: np.ndarray  # slowdown over the relative threshold
    over_floor: np.ndarray  # ... and gap over the floor
    slow: np.ndarray  # ... and beyond the cohort's noise


def compare_to_peers(entries: np.ndarray, segment: np.ndarray, median: np.ndarray, tokens: np.ndarray,
                     floor_ms: np.ndarray, config: DetectorConfig, noise_var: np.ndarray, pair: np.ndarray,
                     last_offset: np.ndarray, cohort: Optional[np.ndarray] = None, cohorts: int = 1) -> Comparison:
    """`cohort`: each entry's, where several cohorts are judged at once (window_batch.py)."""
    references = peer_references(segment, median, tokens, config.reference_quantile, config.work_tolerance)
    reference = references.reference
    slowdown = np.where(reference > 0, median / reference, np.where(median > 0, np.inf, 1.0))
    gap = median - reference
    usable = (references.peer_count + 1 >= config.min_cohort_size) & np.isfinite(reference) & ~np.isnan(slowdown)
    over = usable & (slowdown > 1.0 + config.rel_threshold)
    beyond_noise = stage_noise.beyond_stage_noise(segment, median, slowdown, usable, config, noise_var, pair,
                                                  last_offset, cohort, cohorts)
    return Comparison(median, references, entries, usable, slowdown, over, over & (gap > floor_ms),
                       over & (gap > floor_ms) & beyond_noise)
