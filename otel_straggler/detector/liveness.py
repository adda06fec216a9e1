"""Liveness and hangs: where each rank runs, whether it is alive, what it is inside, and whether its
job still makes progress (CONTRACT §2b heartbeats, §3a `hang`). Pure, like the engine it serves:
the caller's clock, no I/O.

Per (job, topology epoch) it keeps one RankRecord per rank (host and local rank from the resource,
the latest heartbeat: its time, the stages then open, the step), and the job's progress: the latest
end time of an interval the engine accepted.

`judge(now)` declares a hang when no interval of the job ended for `hang_timeout_s` (counted from
its last progress, or its first heartbeat if it never made any) while some rank's heartbeats are
recent. Every age is on the detector's clock (`now`), never a rank's: progress is when the latest
end of the job's intervals last moved on, as the detector saw it, and a heartbeat is as old as its
arrival; a rank's clock only measures spans between its own readings (the gap between its
heartbeats, how long a stage has been open at one). So a rank whose clock is a day fast or every
clock minutes slow leaves hangs judged as with honest clocks, at the cost of the export lag (a
hang is declared that much later). A rank's heartbeats have stopped when its latest arrived longer
ago than twice its own heartbeat gap plus `max_export_lag_s` (its exporter sends them in bursts), at
most half the hang timeout; a rank that sent spans but never a heartbeat has stopped when its
latest spans came that long ago. Among the
live ranks, those whose innermost open stage is a collective wait; a collective is a stage the job's
spans mark as one, or one the judge found to end at a synchronization point where it is the
collective most of the ranks inside one have open (found in windows past, it is weaker evidence:
a compute stage that once looked synchronized must not hide the rank blocked in it). Then:
- most live ranks wait: every other live rank is a culprit, `never_entered_collective`, its stage
  the innermost one it has open (`*` when none); every rank whose heartbeats stopped is one too,
  `rank_lost`, its stage the innermost one its last heartbeat had open. No culprit: the ranks the
  job's world size says it has that were never heard from, `rank_lost` with stage `*` (stuck before
  their first export, or sending nowhere), where the ranks report it and name no cohort (then one
  detector holds all of them); with none of those either, one job-level verdict (rank null),
  `all_ranks_waiting`, the collective most of them wait in;
- otherwise the ranks whose heartbeats stopped are culprits (`rank_lost`); with none, one job-level
  verdict `all_ranks_stalled`, the stage most live ranks have open (a checkpoint save that outlasts
  the timeout, say);
- no live rank has a stage open: nothing is said. The job is outside the stages it times (an
  evaluation loop it does not time, or its end), and a heartbeat cannot tell that from a hang.
A culprit that appears later in the same hang gets its own verdict. When an interval ends again,
each hang verdict gets `recovered`/`progress_resumed`. A new incarnation (a higher
`training.restart.count` on any rank) starts the job's records over, and ends its hang the same way.

Bounded: at most `max_tracked_ranks` records over all jobs (the least recently touched go first,
counted) and `max_jobs` jobs.
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Callable, Iterable, NamedTuple, Optional

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.observation import DEFAULT_COHORT, Heartbeat, Placement, Verdict

DEFAULT_HEARTBEAT_GAP_NS = 5_000_000_000  # OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS's default, until a rank's own is seen
GAP_DECAY = 0.8  # as windows.py's delivery gap: the largest recent gap, following a rank that sends more often
RECHECK_NS = 1_000_000_000  # a stalled job is looked at again at most this often
EVICT_FRACTION = 8  # a full table frees this fraction of its records at once, so eviction scans stay rare
MAX_NEVER_HEARD_NAMED = 64  # a job that mostly never reported is a configuration matter, not 1,000 pages
REASON_NONE = "none"  # the gauge's series of a job whose heartbeats come and that has no hang


class HangState(NamedTuple):
    """One series of the straggler.job.hang gauge: 1 while declared, 0 once resumed."""
    job_id: str
    rank: int  # -1: job-level
    host: str
    local_rank: int
    stage: str
    reason: str
    active: bool


def _where(record: Optional["RankRecord"]) -> dict:
    if record is None:
        return {"host": None, "local_rank": None, "pod": None, "namespace": None, "k8s_node_name": None}
    return {"host": record.host, "local_rank": record.local_rank, "pod": record.pod, "namespace": record.namespace,
            "k8s_node_name": record.node}


class RankRecord:
    __slots__ = ("cohort", "host", "local_rank", "pod", "namespace", "node", "heartbeat_ns", "heard_ns", "gap_ns",
                 "open_stages", "open_since", "step", "touched_ns")

    def __init__(self, cohort: str, now: int) -> None:
        self.cohort = cohort
        self.host: Optional[str] = None
        self.local_rank: Optional[int] = None
        self.pod: Optional[str] = None  # on Kubernetes (host is then the node)
        self.namespace: Optional[str] = None
        self.node: Optional[str] = None  # k8s.node.name as sent (then also the host)
        self.heartbeat_ns = 0  # its latest heartbeat's time on the rank's clock; 0: no heartbeat yet
        self.heard_ns = 0  # when that heartbeat arrived, on the detector's clock
        self.gap_ns = 0  # largest recent gap between its heartbeats (rank clock); 0: unknown
        self.open_stages: tuple[str, ...] = ()
        self.open_since: tuple[int, ...] = ()  # rank clock
        self.step: Optional[int] = None
        self.touched_ns = now


class _Hang:
    """A declared hang: the progress it stalled at, and its verdicts by (rank or None, reason)."""
    __slots__ = ("progress_ns", "verdicts")

    def __init__(self, progress_ns: int) -> None:
        self.progress_ns = progress_ns
        self.verdicts: dict[tuple, Verdict] = {}


class JobLiveness:
    __slots__ = ("job_id", "epoch", "restart", "ranks", "latest_end_ns", "progress_ns", "first_heartbeat_ns", "hang",
                 "resumed", "next_check_ns", "touched_ns", "world_size", "names_cohorts", "evicted")

    def __init__(self, job_id: str, epoch: int, restart: int, now: int) -> None:
        self.job_id = job_id
        self.epoch = epoch
        self.restart = restart
        self.ranks: dict[int, RankRecord] = {}
        self.latest_end_ns = 0  # latest end of an accepted interval (the ranks' clocks); 0: none yet
        self.progress_ns = 0  # when that last moved on (detector clock); 0: never
        self.first_heartbeat_ns = 0  # when its first heartbeat arrived (detector clock)
        self.hang: Optional[_Hang] = None
        self.resumed: list[Verdict] = []  # the last hang's verdicts, after it ended: gauge series at 0
        self.next_check_ns = 0
        self.touched_ns = now
        self.world_size: Optional[int] = None  # as its ranks report it; None: not reported
        self.names_cohorts = False  # some rank names a cohort: the job's ranks may be split over detectors
        self.evicted = False  # some rank's record was evicted: a rank without one may have been heard


class Liveness:
    def __init__(self, config: DetectorConfig, counts: Counter) -> None:
        self._timeout_ns = int(config.hang_timeout_s * 1e9)
        self._export_lag_ns = int(config.max_export_lag_s * 1e9)
        self._window_steps = config.window_steps
        self._max_records = config.max_tracked_ranks
        self._max_jobs = config.max_jobs
        self._counts = counts
        self._jobs: dict[tuple, JobLiveness] = {}  # (job_id, epoch) -> its liveness
        self._records = 0

    # ---- intake ----
    def note_placements(self, placements: Iterable[Placement], now: int) -> list[Verdict]:
        verdicts: list[Verdict] = []
        for placement in placements:
            job = self._job(placement.job_id, placement.epoch, placement.restart, now, verdicts)
            record = self._record(job, placement.rank, None, now)
            if record is not None:
                record.host, record.local_rank = placement.host, placement.local_rank
                record.pod, record.namespace, record.node = placement.pod, placement.namespace, placement.k8s_node_name
            if placement.cohort is not None and placement.cohort != DEFAULT_COHORT:
                job.names_cohorts = True
            if placement.world_size is not None:
                job.world_size = placement.world_size
        return verdicts

    def note_heartbeats(self, heartbeats: Iterable[Heartbeat], now: int) -> list[Verdict]:
        verdicts: list[Verdict] = []
        for beat in heartbeats:
            job = self._job(beat.job_id, beat.epoch, beat.restart, now, verdicts)
            record = self._record(job, beat.rank, beat.cohort, now)
            if record is None or beat.time_unix_nano <= record.heartbeat_ns:
                continue  # an older sample, delivered late: the newer one stands
            if record.heartbeat_ns:
                gap = min(beat.time_unix_nano - record.heartbeat_ns, self._timeout_ns)
                record.gap_ns = max(gap, int(record.gap_ns * GAP_DECAY))
            record.heartbeat_ns, record.heard_ns = beat.time_unix_nano, now
            record.open_stages, record.open_since, record.step = beat.open_stages, beat.open_since_unix_nano, beat.step
            if not job.first_heartbeat_ns:
                job.first_heartbeat_ns = now
            self._counts["heartbeats"] += 1
        return verdicts

    def note_progress(self, job_id: str, epoch: int, restart: int, end_unix_nano: int, now: int) -> list[Verdict]:
        """The latest end of the job's accepted intervals (a rank's clock) as of `now`: progress,
        dated `now`, when it moved on."""
        verdicts: list[Verdict] = []
        job = self._job(job_id, epoch, restart, now, verdicts)
        if end_unix_nano > job.latest_end_ns:
            job.latest_end_ns = end_unix_nano
            job.progress_ns = now
        return verdicts

    def new_incarnation(self, job_id: str, epoch: int, restart: int, now: int) -> list[Verdict]:
        """The engine saw a higher restart count for the job: its records start over."""
        verdicts: list[Verdict] = []
        self._job(job_id, epoch, restart, now, verdicts)
        return verdicts

    def world_size(self, job_id: str, epoch: int) -> Optional[int]:
        """How many ranks the job has, where every rank of it reported so and named no cohort."""
        job = self._jobs.get((job_id, epoch))
        return job.world_size if job is not None and not job.names_cohorts else None

    def placement(self, job_id: str, epoch: int, rank: int) -> dict:
        """The verdict fields that say where the rank runs: host, local_rank, pod, namespace (and
        k8s_node_name, its metrics' label)."""
        job = self._jobs.get((job_id, epoch))
        record = job.ranks.get(rank) if job is not None else None
        return _where(record)

    def ranks_on_host(self, job_id: str, epoch: int, host: str) -> int:
        """How many of the job's ranks report `host` as theirs (a scan of the job's records)."""
        job = self._jobs.get((job_id, epoch))
        return sum(1 for record in job.ranks.values() if record.host == host) if job is not None else 0

    # ---- judging ----
    def judge(self, now: int, collectives_of: Callable[[str, int], tuple[set, set]]) -> list[Verdict]:
        """Hang and resumed verdicts due at `now`; `collectives_of(job, epoch)` names the job's
        collective stages, and those of them found only from synchronization points."""
        verdicts: list[Verdict] = []
        for job in self._jobs.values():
            if job.hang is not None and job.progress_ns > job.hang.progress_ns:
                verdicts.extend(self._resume(job, job.hang, now))
                continue
            stalled_from = job.progress_ns or job.first_heartbeat_ns
            if not stalled_from or now - stalled_from < self._timeout_ns or now < job.next_check_ns:
                continue
            job.next_check_ns = now + RECHECK_NS
            verdicts.extend(self._judge_stall(job, now, stalled_from, *collectives_of(job.job_id, job.epoch)))
        return verdicts

    def stopped(self, job_id: str, epoch: int, rank: int, now: int) -> bool:
        """Whether nothing of the rank reached this detector lately: its heartbeats stopped, or,
        never having sent one, its spans did (the rank_lost test). A rank without a record (none
        placed it, or its record was evicted) cannot be told stopped: False."""
        job = self._jobs.get((job_id, epoch))
        record = job.ranks.get(rank) if job is not None else None
        return record is not None and self._stopped(record, now)

    def _stopped(self, record: RankRecord, now: int) -> bool:
        # without heartbeats: its spans (each request places its ranks), none of them lately (a
        # rank frozen before its first heartbeat, say)
        return now - (record.heard_ns if record.heartbeat_ns else record.touched_ns) > self._patience_ns(record)

    def _judge_stall(self, job: JobLiveness, now: int, stalled_from: int, collectives: set,
                     sync_points: set) -> list[Verdict]:
        live, lost = [], []
        for rank, record in job.ranks.items():
            if self._stopped(record, now):
                lost.append((rank, record))
            elif record.heartbeat_ns:
                live.append((rank, record))
        if not any(record.open_stages for _, record in live):
            return []
        waits = _waiting_test(live, collectives, sync_points)
        waiting = [(rank, record) for rank, record in live if waits(record)]
        others = [(rank, record) for rank, record in live if not waits(record)]
        waited_ms = statistics.median([_open_ms(record, now) for _, record in waiting]) if waiting else None
        waiting_ranks = tuple(sorted(rank for rank, _ in waiting))
        found: list[tuple] = []  # (rank, record or None, reason, stage)
        if waiting and len(waiting) >= len(others):
            found += [(rank, record, contract.HANG_NEVER_ENTERED_COLLECTIVE, _innermost(record))
                      for rank, record in others]
            found += [(rank, record, contract.HANG_RANK_LOST, _innermost(record)) for rank, record in lost]
            if not found:
                found += [(rank, None, contract.HANG_RANK_LOST, contract.WHOLE_STEP_STAGE)
                          for rank in self._never_heard(job)]
            if not found:
                found.append((None, None, contract.HANG_ALL_RANKS_WAITING, _most_common(waiting)))
        else:
            found += [(rank, record, contract.HANG_RANK_LOST, _innermost(record)) for rank, record in lost]
            if not found:
                found.append((None, None, contract.HANG_ALL_RANKS_STALLED, _most_common(live)))
        if job.hang is None:
            job.hang = _Hang(stalled_from)
        verdicts = []
        for rank, record, reason, stage in found:
            key = (rank, reason)
            if key in job.hang.verdicts:
                continue
            cohort = record.cohort if record is not None else _most_common_cohort(waiting or live)
            open_ms = _open_ms(record, now) if record is not None and record.open_since else None
            steps = [r.step for _, r in live + lost if r.step is not None]
            step = record.step if record is not None and record.step is not None else max(steps, default=0)
            verdict = Verdict(
                time_unix_nano=now, job_id=job.job_id, cohort=cohort, stage=stage, rank=rank,
                window=step // self._window_steps, verdict=contract.VERDICT_HANG, reason=reason, slowdown=None,
                gap_ms=None, rank_ms=_ms(open_ms), reference_ms=_ms(waited_ms), reference_ranks=waiting_ranks,
                timing=contract.TIMING_HOST,
                attribution=contract.ATTRIBUTION_WAITING if rank is None and waiting else contract.ATTRIBUTION_UNKNOWN,
                workload_comparable=None, **_where(record),
                stalled_s=round((now - stalled_from) / 1e9, 3),
            )
            job.hang.verdicts[key] = verdict
            verdicts.append(verdict)
        return verdicts

    def _resume(self, job: JobLiveness, hang: _Hang, now: int) -> list[Verdict]:
        """Ends the job's hang (`hang`, its declared one): one `recovered` per hang verdict."""
        ended, job.hang = list(hang.verdicts.values()), None
        job.resumed = ended
        return [Verdict(
            time_unix_nano=now, job_id=v.job_id, cohort=v.cohort, stage=v.stage, rank=v.rank, window=v.window,
            verdict=contract.VERDICT_RECOVERED, reason=contract.HANG_PROGRESS_RESUMED, slowdown=None, gap_ms=None,
            rank_ms=None, reference_ms=None, reference_ranks=(), timing=v.timing, attribution=v.attribution,
            workload_comparable=None, host=v.host, local_rank=v.local_rank, pod=v.pod, namespace=v.namespace,
            k8s_node_name=v.k8s_node_name, stalled_s=None,
        ) for v in ended]

    def _never_heard(self, job: JobLiveness) -> list[int]:
        """Ranks below the job's world size with no record: never heard from (nothing evicted)."""
        if job.world_size is None or job.names_cohorts or job.evicted or len(job.ranks) >= job.world_size:
            return []
        return [rank for rank in range(job.world_size) if rank not in job.ranks][:MAX_NEVER_HEARD_NAMED]

    def _patience_ns(self, record: RankRecord) -> int:
        """How long after its latest heartbeat a rank counts as lost: at most half the hang timeout,
        so a rank that stopped with the job is lost by the time the hang is declared."""
        gap = record.gap_ns or DEFAULT_HEARTBEAT_GAP_NS
        return min(2 * gap + self._export_lag_ns, self._timeout_ns // 2)

    # ---- views ----
    def hang_states(self) -> list[HangState]:
        states = []
        for job in self._jobs.values():
            active = list(job.hang.verdicts.values()) if job.hang is not None else []
            if not active and not job.resumed and job.first_heartbeat_ns:
                # watched, no hang: one series at 0, so "no hang" and "not watched" (no heartbeats) differ
                states.append(HangState(job.job_id, -1, "", -1, contract.WHOLE_STEP_STAGE, REASON_NONE, False))
            for verdict in active + job.resumed:
                states.append(HangState(job.job_id, -1 if verdict.rank is None else verdict.rank, verdict.host or "",
                                        -1 if verdict.local_rank is None else verdict.local_rank, verdict.stage,
                                        verdict.reason, verdict in active))
        return states

    def tracked_ranks(self) -> int:
        return self._records

    def jobs_without_stages(self, now: int, limit: int) -> tuple[int, list[tuple[str, int, float]]]:
        """Jobs whose ranks send heartbeats and no stage span was accepted from, for longer than a
        rank's first spans may take to come (max_export_lag_s): instrumented, yet timing nothing (no
        stage() in the loop, say). How many, and at most `limit` of them, longest first, as (job id,
        ranks heard from, seconds since the first heartbeat)."""
        found = [(job.job_id, len(job.ranks), (now - job.first_heartbeat_ns) / 1e9) for job in self._jobs.values()
                 if job.first_heartbeat_ns and not job.progress_ns
                 and now - job.first_heartbeat_ns >= self._export_lag_ns]
        found.sort(key=lambda job: (-job[2], job[0]))
        return len(found), found[:limit]

    # ---- bounded tables ----
    def _job(self, job_id: str, epoch: int, restart: int, now: int, verdicts: list) -> JobLiveness:
        key = (job_id, epoch)
        job = self._jobs.get(key)
        if job is not None and restart > job.restart:
            if job.hang is not None:
                verdicts.extend(self._resume(job, job.hang, now))
            # a new incarnation: every rank's process is new, the gone ones are not lost
            self._records -= len(job.ranks)
            job.ranks.clear()
            job.evicted = False
            job.restart = restart
            job.first_heartbeat_ns = 0
            job.next_check_ns = 0
            job.progress_ns = job.latest_end_ns = 0
        if job is None:
            if len(self._jobs) >= self._max_jobs:
                # as the engine's tables: a job at work (heartbeats and progress) goes last, and of
                # the others the one with the fewest ranks (an id sent once), then the least touched
                victim = min(self._jobs, key=lambda k: (
                    bool(self._jobs[k].first_heartbeat_ns and self._jobs[k].progress_ns),
                    len(self._jobs[k].ranks), self._jobs[k].touched_ns))
                self._records -= len(self._jobs.pop(victim).ranks)
                self._counts["evictions_liveness_jobs"] += 1
            job = self._jobs[key] = JobLiveness(job_id, epoch, restart, now)
        job.touched_ns = now
        return job

    def _record(self, job: JobLiveness, rank: int, cohort: Optional[str], now: int) -> Optional[RankRecord]:
        record = job.ranks.get(rank)
        if record is None:
            if self._records >= self._max_records:
                self._evict_records()
            record = job.ranks[rank] = RankRecord(cohort or "", now)
            self._records += 1
        elif cohort is not None:
            record.cohort = cohort
        record.touched_ns = now
        return record

    def _evict_records(self) -> None:
        """Frees the least recently touched records, a fraction of the table at once."""
        touched = sorted((record.touched_ns, id(record), job, rank)
                         for job in self._jobs.values() for rank, record in job.ranks.items())
        for _, _, job, rank in touched[:max(1, self._max_records // EVICT_FRACTION)]:
            del job.ranks[rank]
            job.evicted = True
            self._records -= 1
            self._counts["evictions_liveness_ranks"] += 1


def _waiting_test(live: list, collectives: set, sync_points: set) -> Callable[["RankRecord"], bool]:
    """Whether a live rank waits in a collective: its innermost open stage is one the spans mark as
    a collective, or one found to end at a synchronization point that at least as many ranks have
    open as any other collective (more than any marked one). A stage known as a collective only from
    synchronization points found in windows past is weaker evidence: a compute stage that looked
    synchronized once (steps that start together after a barrier, say) must not hide the rank
    blocked in it while its peers wait in the job's collective. Two such stages tied for the most
    ranks both count: the evidence cannot tell them apart, so neither side is named."""
    counts = Counter(record.open_stages[-1] for _, record in live
                     if record.open_stages and record.open_stages[-1] in collectives)
    most = max(counts.values(), default=0)
    marked_most = max((count for stage, count in counts.items() if stage not in sync_points), default=0)

    def waits(record: RankRecord) -> bool:
        if not record.open_stages:
            return False
        stage = record.open_stages[-1]
        if stage not in collectives:
            return False
        return stage not in sync_points or (counts[stage] == most and counts[stage] > marked_most)
    return waits


def _open_ms(record: RankRecord, now: int) -> float:
    """How long its innermost stage has been open at `now`: open at its latest heartbeat (both
    times on its clock), plus the time since that heartbeat arrived (on the detector's)."""
    return ((record.heartbeat_ns - record.open_since[-1]) + (now - record.heard_ns)) / 1e6


def _innermost(record: RankRecord) -> str:
    return record.open_stages[-1] if record.open_stages else contract.WHOLE_STEP_STAGE


def _most_common(ranks: list[tuple]) -> str:
    stages = Counter(record.open_stages[-1] for _, record in ranks if record.open_stages)
    return min(stages, key=lambda stage: (-stages[stage], stage)) if stages else contract.WHOLE_STEP_STAGE


def _most_common_cohort(ranks: list[tuple]) -> str:
    cohorts = Counter(record.cohort for _, record in ranks)
    return min(cohorts, key=lambda cohort: (-cohorts[cohort], cohort)) if cohorts else ""


def _ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 1)
