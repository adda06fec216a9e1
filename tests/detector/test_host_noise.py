"""The busy-host noise model (host_noise.py) has the properties its docstring claims, as the
detector sees them: window medians that drift and stay off their peers for windows in a row,
heavy-tailed per-step jitter, rare spikes, a busy host's ranks slowed together, then back, and
contention that moves from rank to rank."""
from functools import lru_cache

import numpy as np

from otel_straggler.testing.host_noise import BusyHost, HostNoise
from otel_straggler.testing.synthetic import Stage, SyntheticJob

RANKS, WINDOWS, WINDOW_STEPS = 32, 40, 10


@lru_cache(maxsize=None)
def durations(noise: HostNoise, seed: int = 7) -> np.ndarray:
    """host_ms of a one-stage job, shape (steps, ranks)."""
    job = SyntheticJob(ranks=RANKS, stages=(Stage("work", 100.0, device=False),), seed=seed, noise=noise)
    host_ms = np.array([observation.host_ms for observation in job.observations(WINDOWS * WINDOW_STEPS)])
    return host_ms.reshape(WINDOWS * WINDOW_STEPS, RANKS)


def window_medians(host_ms: np.ndarray) -> np.ndarray:
    """shape (windows, ranks)."""
    return np.median(host_ms.reshape(WINDOWS, WINDOW_STEPS, RANKS), axis=1)


def off_peers(host_ms: np.ndarray) -> np.ndarray:
    """each rank's window median over its peers' median, minus 1, shape (windows, ranks)."""
    medians = window_medians(host_ms)
    return medians / np.median(medians, axis=1, keepdims=True) - 1.0


def test_window_medians_drift_and_stay_off_their_peers():
    relative = off_peers(durations(HostNoise()))
    lag1 = [np.corrcoef(relative[:-1, rank], relative[1:, rank])[0, 1] for rank in range(RANKS)]
    assert np.median(lag1) > 0.5
    assert 0.025 < relative.std() < 0.045
    # a healthy rank 5% or more over its peers for 3 windows in a row, somewhere in the job
    over = relative > 0.05
    assert (over[:-2] & over[1:-1] & over[2:]).any()


def test_gaussian_jitter_does_neither():
    relative = off_peers(durations(None))
    lag1 = [np.corrcoef(relative[:-1, rank], relative[1:, rank])[0, 1] for rank in range(RANKS)]
    assert abs(np.median(lag1)) < 0.2
    assert relative.std() < 0.015


def test_step_jitter_has_heavier_tails_than_gaussian():
    steady = HostNoise(drift_std=0.0, spike_rate=0.0)
    log_jitter = np.log(durations(steady) / 100.0).ravel()
    robust_sigma = 1.4826 * np.median(np.abs(log_jitter - np.median(log_jitter)))
    beyond = np.mean(np.abs(log_jitter) > 4 * robust_sigma)
    assert beyond > 0.005  # a Gaussian: 6e-5; a Student-t with 3 degrees of freedom: about 2%


def test_spikes_are_rare_and_large():
    host_ms = durations(HostNoise(drift_std=0.0))
    assert 0.003 < np.mean(host_ms > 250.0) < 0.008


def test_a_busy_host_slows_its_ranks_together_then_recovers():
    episode = BusyHost(host=2, first_step=200, last_step=279, ranks_per_host=8, slowdown=(1.05, 1.15))
    # the same seed gives the same drift and jitter, with the episode on top
    slower = window_medians(durations(HostNoise(busy_host=episode))) / window_medians(durations(HostNoise()))
    host, others = slice(16, 24), np.r_[0:16, 24:RANKS]
    assert np.all((slower[20:28, host] >= 1.05) & (slower[20:28, host] <= 1.15))
    assert np.allclose(slower[20:28, others], 1.0)
    assert np.allclose(slower[:20], 1.0) and np.allclose(slower[28:], 1.0)


def test_contention_slows_a_share_of_the_ranks_one_sided_and_moves():
    contended = HostNoise(contention_share=0.25, contention_steps=2, contention=(1.2, 1.5))
    # the same seed gives the same drift and jitter, with the contention on top
    slower = durations(contended) / durations(HostNoise())
    assert np.all(slower >= 1.0 - 1e-9) and np.all(slower <= 1.5)
    assert np.all(np.sum(slower > 1.0 + 1e-9, axis=1) == RANKS // 4)  # 8 of the 32 ranks, every step
    assert np.allclose(slower[0::2], slower[1::2])  # the same for each block of 2 steps
    assert 0.15 < np.mean(~np.isclose(slower[1:], slower[:-1])) < 0.6  # and moving: the ranks change from block to block


def test_it_is_deterministic():
    assert np.array_equal(durations(HostNoise(), seed=3), durations(HostNoise(), seed=3))
    assert not np.array_equal(durations(HostNoise(), seed=3), durations(HostNoise(), seed=4))
