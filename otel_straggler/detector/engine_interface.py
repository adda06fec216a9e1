"""What the detector calls on an engine: the driver (driver.py) for intake, closing windows and the
state it reports, the service (service.py) for a restart's open alerts, replay (replay.py) through
the driver. `Engine` (engine.py) is the implementation; a custom engine passed to DetectorService or
replay implements every method here, delegating to an Engine for what it does not change."""
from __future__ import annotations

from typing import Iterable, Optional, Protocol, runtime_checkable

from otel_straggler.detector.engine import JobSlowdownState, RankState
from otel_straggler.detector.inherited_alerts import AlertKey
from otel_straggler.detector.liveness import HangState
from otel_straggler.detector.nodes import NodeRollup
from otel_straggler.detector.observation import Heartbeat, Observation, Placement, Verdict


@runtime_checkable
class DetectorEngine(Protocol):
    """Called by one thread at a time (the driver holds a lock around each call)."""

    def inherit_alerts(self, alerts: dict[AlertKey, str]) -> None:
        """Alerts a previous detector process left open, held until they end."""

    def ingest_many(self, observations: Iterable[Observation]) -> dict[str, int]:
        """A batch of stage observations; returns counts by outcome (driver.SPAN_OUTCOMES)."""

    def ingest_heartbeats(self, heartbeats: Iterable[Heartbeat], now_unix_nano: Optional[int] = None) -> None:
        """Heartbeats: liveness and GPU samples."""

    def ingest_placements(self, placements: Iterable[Placement]) -> None:
        """Where ranks run (host, pod)."""

    def advance(self, now_unix_nano: int) -> list[Verdict]:
        """Closes and judges the windows due by `now_unix_nano`."""

    def drain(self, now_unix_nano: int) -> list[Verdict]:
        """Judges every open window (shutdown, end of a replay)."""

    def next_close_unix_nano(self) -> Optional[int]:
        """When a window could next close with no more data (None: none open)."""

    def detector_stalled(self, stalled_ns: int) -> None:
        """The engine thread looked `stalled_ns` later than it should have: not the ranks' time."""

    def stats(self) -> dict[str, int]:
        """Counts for status.json."""

    def rank_state(self) -> list[RankState]:
        """Per rank and stage: the live slowdown gauge and alert state."""

    def hang_state(self) -> list[HangState]:
        """Per job: its straggler.job.hang series."""

    def job_slowdown_state(self) -> list[JobSlowdownState]:
        """Per cohort: its straggler.job.slowdown series."""

    def node_state(self) -> list[NodeRollup]:
        """Ranks rolled up by host."""

    def jobs_without_stages(self, now_unix_nano: int, limit: int) -> tuple[int, list[tuple[str, int, float]]]:
        """(count, up to `limit` of (job_id, ranks, seconds)): jobs with heartbeats but no stage span."""


def missing_methods(engine_class: type) -> list[str]:
    """The protocol's methods that `engine_class` lacks (a structural check that needs no type checker)."""
    wanted = [name for name, member in vars(DetectorEngine).items() if not name.startswith("_") and callable(member)]
    return [name for name in wanted if not callable(getattr(engine_class, name, None))]
