"""How far a rank must be from its peers to be beyond the noise of its stage (docs/detection.md,
Thresholds): the robust spreads of a stage's durations and of its collectives' arrivals, smoothed
over windows, and the Bonferroni z for a window's comparisons."""
from __future__ import annotations

import functools
import math
import statistics
from typing import Optional

import numpy as np

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.grouped import dense_groups, grouped_medians_signed
from otel_straggler.detector.synchronization_points import SYNC_MIN_STEPS

NOISE_SMOOTHING = 0.2  # weight of each window's spread in the smoothed variance
NORMAL_MAD = 0.6745  # median absolute deviation of N(0, 1)
HALF_NORMAL_MAD = 0.3986  # median absolute deviation from its median of the lower half of N(0, 1)


def beyond_stage_noise(segment: np.ndarray, median: np.ndarray, slowdown: np.ndarray, usable: np.ndarray,
                       config: DetectorConfig, noise_var: np.ndarray, pair: np.ndarray,
                       last_offset: np.ndarray, cohort: Optional[np.ndarray] = None, cohorts: int = 1) -> np.ndarray:
    """Per entry: its deviation from its reference, log(slowdown), exceeds z * sigma of its stage.

    sigma (docs/detection.md, Thresholds), per stage, the larger of two robust spreads of the
    ranks' log durations, smoothed over windows in `noise_var` (one value per code, updated here):
    - across ranks: the faster half's log window medians around their own median, so that slow
      ranks, up to half of them, do not widen it;
    - over time: the ranks' changes since their previous window of their log median's offset from
      the stage's median over its ranks (`last_offset`, per pair, updated here), over sqrt(2).
      Contention is one-sided (a rank cannot run faster than its uncontended speed), so when it
      moves from rank to rank (more processes than cores, a noisy neighbour) the faster ranks
      bunch at that speed and say little of how far a healthy rank is slowed, while each rank's
      offset jumps from window to window; a rank slow for a reason stays slow and hardly changes.
      The offset, not the deviation from the rank's reference: with 3 ranks a healthy rank's
      reference is the mean of its two peers, so a straggler's own swings moved every healthy
      rank's deviation and widened the bound past a 4x straggler; the median over all ranks
      follows the healthy ones.
    Logs: the slowdown is a ratio, and a short stage's durations have a long right tail (a few ms of
    scheduling delay on a 1 ms stage) that the log scale shortens.
    z: the normal quantile 1 - false_alarm_rate / n for the n comparisons of the window
    (Bonferroni): a healthy rank of any stage crosses it in about false_alarm_rate of the windows,
    before persist_windows asks for more. `cohort`: each entry's, where several cohorts are judged
    at once (window_batch.py): n is counted per cohort."""
    result = np.zeros(slowdown.size, dtype=bool)
    judged = (usable & np.isfinite(slowdown) & (slowdown > 0) & (median > 0)).nonzero()[0]
    if judged.size == 0:
        return result
    deviation = np.log(slowdown[judged])
    segments, by_segment = dense_groups(segment[judged])
    log_median = np.log(median[judged])
    _, stage_median = grouped_medians_signed(by_segment, log_median, segments.size)
    across = healthy_half_spread(segments, by_segment, log_median, log_median < stage_median[by_segment],
                          np.ones(judged.size), None)
    offset = log_median - stage_median[by_segment]
    previous = last_offset[pair[judged]]
    moved = np.isfinite(previous)
    over_time = np.zeros(segments.size)
    moved_segments, change = grouped_medians_signed(by_segment[moved], np.abs(offset[moved] - previous[moved]),
                                                    segments.size)
    over_time[moved_segments] = change / (NORMAL_MAD * math.sqrt(2.0))
    last_offset[pair[judged]] = offset
    sigma = smoothed_sigma(segments, np.fmax(across, over_time), noise_var)
    if cohort is None:
        z = noise_z(judged.size, config.false_alarm_rate)
    else:
        counts = np.bincount(cohort[judged], minlength=cohorts).tolist()
        z = per_cohort_z(counts, config.false_alarm_rate)[cohort[judged]]
    result[judged] = deviation > z * sigma[by_segment]
    return result


def per_cohort_z(comparisons: list[int], false_alarm_rate: float) -> np.ndarray:
    """noise_z of each cohort's count of comparisons (windows judged together, window_batch.py)."""
    return np.array([noise_z(count, false_alarm_rate) for count in comparisons])


def late_beyond_noise(code: np.ndarray, wait_ms: np.ndarray, lateness: np.ndarray, step_ms: np.ndarray,
                      candidates: np.ndarray, arrival_var: np.ndarray, z) -> np.ndarray:
    """Per entry: its lateness at a collective, over its whole-step compute, exceeds z * sigma:
    as beyond_stage_noise, mirrored (the spread of the half of the ranks that waited longest, that is
    arrived earliest, so late ranks, up to half of them, do not widen it). A rank whose host
    drifts slower for a while is then consistently late, and still not a straggler. `z`: one, or
    one per entry."""
    result = np.zeros(code.size, dtype=bool)
    judged = (candidates & np.isfinite(step_ms) & (step_ms > 0) & np.isfinite(lateness)).nonzero()[0]
    if judged.size == 0:
        return result
    segments, by_segment = dense_groups(code[judged])
    relative_wait = wait_ms[judged] / step_ms[judged]
    _, centre = grouped_medians_signed(by_segment, relative_wait, segments.size)
    sigma = healthy_half_spread(segments, by_segment, relative_wait, relative_wait > centre[by_segment],
                         np.ones(judged.size), arrival_var)
    result[judged] = lateness[judged] / step_ms[judged] > (z if np.ndim(z) == 0 else z[judged]) * sigma[by_segment]
    return result


def healthy_half_spread(segments: np.ndarray, by_segment: np.ndarray, values: np.ndarray, healthy: np.ndarray,
                        scale: np.ndarray, smoothed_var: Optional[np.ndarray]) -> np.ndarray:
    """sigma per segment: the spread of the `healthy` half of its values (the faster ranks, or the
    earlier arrivals) around their own median, each distance over its `scale`, as a half-normal
    median absolute deviation; smoothed over windows in `smoothed_var` (by segment id, updated)
    unless that is None."""
    centre = np.zeros(segments.size)
    half_segments, half_centre = grouped_medians_signed(by_segment[healthy], values[healthy], segments.size)
    centre[half_segments] = half_centre
    distance = np.abs(values[healthy] - centre[by_segment[healthy]]) / scale[healthy]
    spread = np.zeros(segments.size)
    half_segments, half_spread = grouped_medians_signed(by_segment[healthy], distance, segments.size)
    spread[half_segments] = half_spread / HALF_NORMAL_MAD
    return spread if smoothed_var is None else smoothed_sigma(segments, spread, smoothed_var)


def smoothed_sigma(segments: np.ndarray, spread: np.ndarray, smoothed_var: np.ndarray) -> np.ndarray:
    """sqrt of the variance smoothed over windows (weight NOISE_SMOOTHING) in `smoothed_var`, updated."""
    previous = smoothed_var[segments]
    variance = spread ** 2
    smoothed_var[segments] = np.where(np.isnan(previous), variance, previous + NOISE_SMOOTHING * (variance - previous))
    return np.sqrt(smoothed_var[segments])


def consistently_late(early_steps: int, steps: int, comparisons: int, config: DetectorConfig) -> bool:
    """A rank whose wait at a collective was under the step's median wait (it arrived later than
    half of its peers) in `early_steps` of `steps` steps. By chance that is a coin flip per step, so
    the binomial tail P(X >= early_steps) must be under (false_alarm_rate / comparisons) ** (1 /
    persist_windows): an alert needs persist_windows such windows in a row, which by chance happen
    with at most the window's Bonferroni share (for windows that are independent)."""
    if steps < SYNC_MIN_STEPS or 2 * early_steps <= steps:
        return False
    level = (config.false_alarm_rate / max(1, comparisons)) ** (1.0 / config.persist_windows)
    if steps <= 1000:
        tail = sum(math.comb(steps, k) for k in range(early_steps, steps + 1)) / 2.0 ** steps
    else:
        tail = 0.5 * math.erfc((early_steps - steps / 2) / math.sqrt(steps / 2))
    return tail < level


@functools.lru_cache(maxsize=4096)
def noise_z(comparisons: int, false_alarm_rate: float) -> float:
    return statistics.NormalDist().inv_cdf(1.0 - false_alarm_rate / max(1, comparisons))
