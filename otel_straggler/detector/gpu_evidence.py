"""GPU evidence on verdicts (CONTRACT v1.1 §3a `gpu`), from the GPU health samples that heartbeats
carry (§2c). Pure, like the engine that owns it: no clock reads, no I/O.

Windows are made of steps, and each heartbeat names the step its rank was in, so a verdict about
window w reads the samples its rank took during w's steps. Heartbeats come every few seconds and a
window can be shorter (fast steps): then the samples of the windows that built the verdict's
evidence (persist_windows of them, ending at w) serve, and failing those the rank's sample nearest
to w in steps (before or after it). A hang or a silent rank is told by its latest samples. The
reference is the same rule applied to each reference rank: the median of their
medians, so one odd peer does not move it. Counters (ECC, PCIe replays) count up from the driver's
load; their growth runs from the sample before the first one used to the last one used (a counter
that went down was reset, and what it shows then counts as growth).

Bounded: SAMPLES_PER_RANK samples per rank, `max_ranks` ranks (the least recently heard from is
forgotten first, counted), PEERS_READ reference ranks read per verdict.
"""
from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from itertools import pairwise
from typing import Iterable, NamedTuple, Optional

from otel_straggler import contract
from otel_straggler.detector.observation import GpuSample, Heartbeat

SAMPLES_PER_RANK = 16  # at the default 5 s heartbeat, the last 80 s
PEERS_READ = 64  # reference ranks read for the peers' clock (evenly spread over a larger reference)
# clock event reasons that slow the GPU down (gpu_idle, sync_boost, display_clocks do not)
THROTTLING_REASONS = frozenset(("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"))


class _TimedSample(NamedTuple):
    step: Optional[int]
    time_unix_nano: int
    gpu: GpuSample


class GpuEvidence:
    def __init__(self, window_steps: int, persist_windows: int, max_ranks: int) -> None:
        self._window_steps = window_steps
        self._persist_windows = persist_windows
        self._max_ranks = max_ranks
        self._samples: OrderedDict[tuple, deque] = OrderedDict()  # (job, epoch, rank) -> _TimedSample
        self.ranks_forgotten = 0

    def note(self, heartbeats: Iterable[Heartbeat]) -> None:
        samples = self._samples
        for beat in heartbeats:
            if beat.gpu is None:
                continue
            key = (beat.job_id, beat.epoch, beat.rank)
            ring = samples.get(key)
            if ring is None:
                if len(samples) >= self._max_ranks:
                    samples.popitem(last=False)
                    self.ranks_forgotten += 1
                ring = samples[key] = deque(maxlen=SAMPLES_PER_RANK)
            else:
                samples.move_to_end(key)
            ring.append(_TimedSample(beat.step, beat.time_unix_nano, beat.gpu))

    def forget_job(self, job_id: str) -> None:
        for key in [key for key in self._samples if key[0] == job_id]:
            del self._samples[key]

    def rank_count(self) -> int:
        return len(self._samples)

    def evidence(self, job_id: str, epoch: int, rank: int, window: Optional[int],
                 peers: tuple[int, ...] = ()) -> Optional[dict]:
        """The verdict's `gpu` object for `rank` in `window` (None: the rank's latest samples), its
        clock against `peers`'; None when the rank sent no GPU sample."""
        used, before = self._window_samples(job_id, epoch, rank, window)
        if not used:
            return None
        gpus = [sample.gpu for sample in used]
        clocks = [gpu.sm_clock_mhz for gpu in gpus if gpu.sm_clock_mhz is not None]
        reasons = 0
        for gpu in gpus:
            reasons |= gpu.clock_event_reasons or 0
        temperatures = [gpu.temperature_c for gpu in gpus if gpu.temperature_c is not None]
        powers = [gpu.power_w for gpu in gpus if gpu.power_w is not None]
        utilizations = [gpu.utilization for gpu in gpus if gpu.utilization is not None]
        maxima = [gpu.sm_clock_max_mhz for gpu in gpus if gpu.sm_clock_max_mhz is not None]
        latest = gpus[-1]
        return {
            "sm_clock_mhz": _median_int(clocks),
            "peer_sm_clock_mhz": self._peer_clock(job_id, epoch, rank, window, peers),
            "clock_event_reasons": list(contract.clock_event_reason_names(reasons)),
            "temperature_c": max(temperatures) if temperatures else None,
            "power_w": round(statistics.median(powers), 1) if powers else None,
            "ecc_uncorrected_delta": _growth(used, before, "ecc_uncorrected"),
            "pcie_replay_delta": _growth(used, before, "pcie_replay"),
            # beyond the contract's fields: what an operator needs to act on that one GPU
            "sm_clock_max_mhz": max(maxima) if maxima else None,
            "utilization": round(statistics.median(utilizations), 3) if utilizations else None,
            "uuid": latest.uuid,
            "index": latest.index,
            "samples": len(used),
        }

    def _window_samples(self, job_id: str, epoch: int, rank: int,
                        window: Optional[int]) -> tuple[list[_TimedSample], Optional[_TimedSample]]:
        """(the samples that speak for the window, the sample before the first of them or None)."""
        ring = self._samples.get((job_id, epoch, rank))
        if not ring:
            return [], None
        ordered = sorted(ring, key=lambda sample: sample.time_unix_nano)
        if window is None:
            return ordered[-3:], (ordered[-4] if len(ordered) > 3 else None)
        end = (window + 1) * self._window_steps
        for first in (window * self._window_steps, (window - self._persist_windows + 1) * self._window_steps):
            positions = [i for i, sample in enumerate(ordered)
                         if sample.step is not None and first <= sample.step < end]
            if positions:
                return [ordered[i] for i in positions], (ordered[positions[0] - 1] if positions[0] else None)
        stepped = [i for i, sample in enumerate(ordered) if sample.step is not None]
        if not stepped:
            return [ordered[-1]], (ordered[-2] if len(ordered) > 1 else None)
        first = window * self._window_steps
        nearest = min(stepped, key=lambda i: max(first - ordered[i].step, ordered[i].step - end + 1, 0))
        return [ordered[nearest]], (ordered[nearest - 1] if nearest else None)

    def _peer_clock(self, job_id: str, epoch: int, rank: int, window: Optional[int],
                    peers: tuple[int, ...]) -> Optional[int]:
        peers = tuple(peer for peer in peers if peer != rank)
        if len(peers) > PEERS_READ:
            stride = len(peers) / PEERS_READ
            peers = tuple(peers[int(i * stride)] for i in range(PEERS_READ))
        medians = []
        for peer in peers:
            used, _ = self._window_samples(job_id, epoch, peer, window)
            clock = _median_int([sample.gpu.sm_clock_mhz for sample in used if sample.gpu.sm_clock_mhz is not None])
            if clock is not None:
                medians.append(clock)
        return _median_int(medians)


def _median_int(values: list) -> Optional[int]:
    return int(round(statistics.median(values))) if values else None


def _growth(used: list[_TimedSample], before: Optional[_TimedSample], field: str) -> Optional[int]:
    counts = [getattr(sample.gpu, field) for sample in ([before] if before else []) + used]
    counts = [count for count in counts if count is not None]
    if not counts:
        return None
    # a counter that went down was reset (the driver reloaded): what it counted since is growth too
    return sum(later - earlier if later >= earlier else later for earlier, later in pairwise(counts))


def throttling(gpu: Optional[dict]) -> list[str]:
    """The reasons in the evidence that slow the GPU down."""
    return [name for name in (gpu or {}).get("clock_event_reasons") or () if name in THROTTLING_REASONS]


def describe(gpu: Optional[dict]) -> str:
    """The evidence in words, most telling first: 'SM clock 1410 MHz vs 1980 at its peers;
    hw_thermal throttling; 89 °C; 402 W'. Empty without evidence."""
    if not gpu:
        return ""
    parts = []
    clock, peer, most = gpu.get("sm_clock_mhz"), gpu.get("peer_sm_clock_mhz"), gpu.get("sm_clock_max_mhz")
    if clock is not None:
        parts.append(f"SM clock {clock} MHz" + (f" vs {peer} at its peers" if peer is not None
                                                 else f" of {most} max" if most else ""))
    slowing = throttling(gpu)
    if slowing:
        parts.append(f"{', '.join(slowing)} throttling")
    if "clocks_setting" in (gpu.get("clock_event_reasons") or ()):
        parts.append("clocks held down by a clock setting")
    if gpu.get("ecc_uncorrected_delta"):
        parts.append(f"{gpu['ecc_uncorrected_delta']} new uncorrected ECC errors")
    if gpu.get("pcie_replay_delta"):
        parts.append(f"{gpu['pcie_replay_delta']} PCIe replays")
    if gpu.get("temperature_c") is not None:
        parts.append(f"{gpu['temperature_c']} °C")
    if gpu.get("power_w") is not None:
        parts.append(f"{gpu['power_w']:.0f} W")
    return "; ".join(parts)
