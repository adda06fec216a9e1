"""The overhead benchmark's protocol and estimator (benchmarks/paired_protocol.py), and the launch-bound
proxy's target (benchmarks/launch_bound.py): pure logic."""
from __future__ import annotations

import numpy as np
import pytest

from paired_protocol import OFF, ON, Protocol, pair_estimates, summarize, verdict


def arm_means_for(protocol: Protocol, pair_ratios: np.ndarray, off_ms: float = 40.0) -> list[float]:
    """Arm means in schedule order whose pairs have the given ON/OFF ratios."""
    schedule = protocol.schedule()
    return [off_ms * ratio if schedule[2 * pair + position] == ON else off_ms
            for pair, ratio in enumerate(pair_ratios) for position in (0, 1)]


def test_schedule_alternates_and_each_pair_shares_its_warmup():
    protocol = Protocol(pairs=4, warmup_steps=5, warmup_extra_steps=3, steps_per_arm=10)
    assert protocol.schedule() == [OFF, ON, ON, OFF, OFF, ON, ON, OFF]
    warmups = protocol.warmups()
    assert warmups[0::2] == warmups[1::2] and all(5 <= w <= 8 for w in warmups)


def test_pair_estimate_is_on_over_off_whatever_the_order():
    assert pair_estimates([ON, OFF], [41.0, 40.0]) == pytest.approx([2.5])
    assert pair_estimates([OFF, ON], [40.0, 41.0]) == pytest.approx([2.5])


def test_a_known_overhead_is_recovered_and_decided():
    protocol = Protocol(pairs=400, warmup_steps=0, steps_per_arm=1)
    ratios = np.exp(np.random.default_rng(1).normal(np.log(1.02), 0.01, protocol.pairs))
    result = summarize(protocol, arm_means_for(protocol, ratios))
    assert result["ci95_pct"][0] < 2.0 < result["ci95_pct"][1] and result["verdict"] == "missed"
    none = summarize(protocol, arm_means_for(protocol, np.full(protocol.pairs, 1.0)))
    assert none["mean_pct"] == 0.0 and none["verdict"] == "met"


def test_a_wide_interval_is_unresolved_unless_all_of_it_is_at_or_above_the_point_target():
    assert verdict(0.3, -0.5, 1.1) == "unresolved"
    assert verdict(1.5, 0.85, 2.17) == "missed"  # 1.33 points wide, yet every value in it misses
    assert verdict(0.9, 0.1, 1.7) == "missed"  # its mean cannot be under the 0.1% point target
    assert verdict(0.05, -0.3, 0.4) == "met"


def test_noise_alone_biases_the_mean_of_ratios_up_and_the_secondary_figures_show_it():
    """An A/A run (no effect) with a 5% log-normal spread per pair: the primary estimator reads about
    +sd^2/2 = +0.125%, the geometric mean about 0, and the bias estimate says how much."""
    protocol = Protocol(pairs=200_000, warmup_steps=0, steps_per_arm=1, bootstrap_resamples=200)
    ratios = np.exp(np.random.default_rng(7).normal(0.0, 0.05, protocol.pairs))
    result = summarize(protocol, arm_means_for(protocol, ratios))
    assert result["mean_pct"] == pytest.approx(0.125, abs=0.03)
    assert result["secondary"]["geometric_mean_pct"] == pytest.approx(0.0, abs=0.03)
    assert result["secondary"]["noise_bias_pct"] == pytest.approx(0.125, rel=0.02)
    low, high = result["secondary"]["geometric_ci95_pct"]
    assert low < 0.0 < high


def test_the_launch_bound_target_is_decided_only_by_a_whole_interval():
    from launch_bound import target_verdict

    assert target_verdict(-0.3, 0.45) == "met"
    assert target_verdict(0.55, 3.0) == "missed"
    # a point estimate under 0.5% on a noisy run decides nothing, and neither does one over it
    assert target_verdict(-1.471, 10.138) == "unresolved"
    assert target_verdict(-0.188, 14.324) == "unresolved"
    assert target_verdict(0.2, 0.5) == "unresolved"  # the interval reaches the target
