"""The two records that cross the detector's internal boundaries.

decode (OTLP -> Observation) -> engine (Observation -> Verdict) -> emit (Verdict -> metrics,
events, evidence). Both are plain immutable values so the engine stays pure and replayable.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional


class Observation(NamedTuple):
    """One stage interval of one rank, as decoded from a span. A NamedTuple rather than a
    frozen dataclass: decode makes one per span, and a tuple is made several times faster."""

    job_id: str
    epoch: int
    cohort: str
    rank: int
    stage: str
    step: int
    seq: int
    host_ms: float
    device_ms: Optional[float]  # None unless training.stage.timing == "device"
    collective: bool
    tokens: Optional[int]  # None when not reported or not a positive number
    samples: Optional[int]
    end_unix_nano: int  # span end time: ingest lag, synchronization points, the job's progress
    restart: int = 0  # training.restart.count: with (job, epoch), the rank's incarnation


class GpuSample(NamedTuple):
    """The GPU health a heartbeat carries (CONTRACT §2c); a field the rank did not send, or sent
    with a value out of its type or range, is None."""

    # shadows tuple.index, which no caller of a GpuSample uses: the field is the GPU's NVML index
    index: Optional[int] = None  # type: ignore[assignment]
    uuid: Optional[str] = None
    sm_clock_mhz: Optional[int] = None
    sm_clock_max_mhz: Optional[int] = None
    clock_event_reasons: Optional[int] = None  # NVML bitmask (contract.CLOCK_EVENT_REASONS)
    temperature_c: Optional[int] = None
    power_w: Optional[float] = None
    utilization: Optional[float] = None  # 0..1
    ecc_uncorrected: Optional[int] = None  # volatile uncorrected ECC errors since the driver loaded
    pcie_replay: Optional[int] = None


class Heartbeat(NamedTuple):
    """One `train.heartbeat` span (CONTRACT §2b): a rank alive at `time_unix_nano`, and the stages
    open on its training thread then, outermost first."""

    job_id: str
    epoch: int
    cohort: str
    rank: int
    restart: int
    step: Optional[int]  # the step last bound by step(); None before the first
    time_unix_nano: int  # the sample's host wall clock
    open_stages: tuple[str, ...]
    open_since_unix_nano: tuple[int, ...]
    gpu: Optional[GpuSample] = None  # the rank's GPU health at the sample (§2c), where it sends it


DEFAULT_COHORT = "default"  # a rank that names no cohort: every rank of its job plays the same role


class Placement(NamedTuple):
    """Where a rank runs, from its resource (CONTRACT §1): what on-call needs to find it, and how
    many ranks its job has, which the windows of its cohort wait for at the start."""

    job_id: str
    epoch: int
    restart: int
    rank: int
    host: Optional[str]
    local_rank: Optional[int]
    cohort: Optional[str] = None
    world_size: Optional[int] = None  # None: not reported, or not a positive int
    pod: Optional[str] = None  # k8s.pod.name (host is k8s.node.name where the rank sent it)
    namespace: Optional[str] = None  # k8s.namespace.name
    k8s_node_name: Optional[str] = None  # as sent: the k8s_node_name metric label


@dataclass(frozen=True, slots=True)
class Verdict:
    """One line of verdicts.jsonl (CONTRACT §3a), field for field."""

    time_unix_nano: int
    job_id: str
    cohort: str
    stage: str
    rank: Optional[int]  # None for job-level verdicts (a hang with no culprit)
    window: int
    verdict: str
    reason: str
    slowdown: Optional[float]
    gap_ms: Optional[float]
    rank_ms: Optional[float]
    reference_ms: Optional[float]
    reference_ranks: tuple[int, ...]
    timing: str
    attribution: str
    workload_comparable: Optional[bool]
    host: Optional[str] = None  # v1.1: k8s.node.name, else host.name of the rank; None for job-level verdicts
    local_rank: Optional[int] = None  # v1.1: its slot on the node (which GPU)
    # v1.1: GPU evidence from heartbeats' GPU samples (§2c); null while ranks send none
    gpu: Optional[dict] = None
    stalled_s: Optional[float] = None  # v1.1, hang only: since the job's last completed interval
    # intermittent stragglers only: {"slow", "steps", "share", "peer_share"} over the windows tested
    slow_steps: Optional[dict] = None
    # v1.2: other stages of the rank slow in the same window that `stage` explains (it leads)
    also_slow: tuple[str, ...] = ()
    # v1.2: where the rank runs on Kubernetes (k8s.pod.name, k8s.namespace.name), else None
    pod: Optional[str] = None
    namespace: Optional[str] = None
    # not a verdicts.jsonl field (`host` says the node there): the k8s_node_name label of its metrics
    k8s_node_name: Optional[str] = None

    def to_dict(self) -> dict:
        record = asdict(self)
        del record["k8s_node_name"]
        record["reference_ranks"] = list(self.reference_ranks)
        record["also_slow"] = list(self.also_slow)
        return record
