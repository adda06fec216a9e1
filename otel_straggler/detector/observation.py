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
    end_unix_nano: int  # span end time; used for ingest lag, never as the engine's clock


@dataclass(frozen=True, slots=True)
class Verdict:
    """One line of verdicts.jsonl (CONTRACT §3a), field for field."""

    time_unix_nano: int
    job_id: str
    cohort: str
    stage: str
    rank: int
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

    def to_dict(self) -> dict:
        record = asdict(self)
        record["reference_ranks"] = list(self.reference_ranks)
        return record
