"""The two records that cross the detector's internal boundaries.

decode (OTLP -> Observation) -> engine (Observation -> Verdict) -> emit (Verdict -> metrics,
events, evidence). Both are plain immutable values so the engine stays pure and replayable.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Union, overload


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


# One Observation as the C extensions read and write it (their Record, observation_record.h): identity and stage as
# indexes into lists of (job, epoch, cohort, rank, restart) and of stage names, step, seq, host_ms,
# device_ms (NaN: None), tokens and samples (0: None), end_unix_nano, collective (0 or 1).
RECORD_FORMAT = "@iiqqddqqQq"
_RECORD = struct.Struct(RECORD_FORMAT)


class ObservationRecords(Sequence[Observation]):
    """The Observations of one request as the C scanner hands them out: fixed-width records in one
    buffer, so no Python object exists per span until one is asked for. The engine's C intake reads
    the buffer itself; indexing and iteration make Observations equal to the reference decoder's."""

    __slots__ = ("records", "strings", "identities")

    def __init__(self, records: bytes, strings: Sequence[str], identities: Sequence[tuple]) -> None:
        self.records = records
        self.strings = strings
        self.identities = identities  # (job_id, epoch, cohort, rank, restart)

    def __len__(self) -> int:
        return len(self.records) // _RECORD.size

    def _observation(self, fields: tuple) -> Observation:
        identity, stage, step, seq, host_ms, device_ms, tokens, samples, end, collective = fields
        job_id, epoch, cohort, rank, restart = self.identities[identity]
        return Observation(job_id, epoch, cohort, rank, self.strings[stage], step, seq, host_ms,
                           None if math.isnan(device_ms) else device_ms, collective == 1, tokens or None,
                           samples or None, end, restart)

    @overload
    def __getitem__(self, index: int) -> Observation: ...
    @overload
    def __getitem__(self, index: slice) -> list[Observation]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[Observation, list[Observation]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("observation index out of range")
        return self._observation(_RECORD.unpack_from(self.records, index * _RECORD.size))

    def __iter__(self) -> Iterator[Observation]:
        return map(self._observation, _RECORD.iter_unpack(self.records))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ObservationRecords):
            other = list(other)
        return isinstance(other, (list, tuple)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-sequence semantics of equality, as a list

    def __repr__(self) -> str:
        return f"ObservationRecords({list(self)!r})"


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
