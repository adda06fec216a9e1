"""The detector's engine: stage observations in, straggler verdicts out. Pure: no I/O, no threads, no
clock reads, so the same observations and the same `now` values give the same verdicts, live or
replayed.

- `ingest_many` is the hot path. Per observation it de-duplicates by (job, epoch, rank, seq) in a
  per-rank ring of the last `dedup_horizon` sequence numbers, finds the open window of its step and
  appends four numbers to that window's columns. Statistics wait until the window is judged.
  Where the optional C extension `_ingest` is built (setup.py), its loop takes every observation
  that needs only that bookkeeping, with the same effect, and hands the rest to the Python loop.
- `advance(now)` closes the windows the cohort has moved past or that stayed idle for
  `window_grace_s` (windows.py) and judges them (judge.py); `drain(now)` judges every open window.
- Everything is bounded: jobs, cohorts, ranks per cohort, stage names per cohort and open windows
  per cohort. What does not fit evicts the least recently active entry that has nothing waiting to
  be judged, or, when there is none, is dropped; both are counted in `stats()`.

Verdicts (judge.py has the rules): `straggler` at an alert's onset, `recovered` at its end,
`uncertain` once per reason and (stage, rank), `silent` when a rank stops reporting. Healthy windows
emit no `within_tolerance` lines, to keep the evidence file about changes; `rank_state()`, which
feeds the slowdown and alert gauges, updates every window. The reference is chosen in
peer_reference.py (the median of the comparable peers, the rank itself left out).

Incarnations: a higher `training.restart.count` on a rank (CONTRACT §1: torchrun restarted the
worker group) starts its cohort over: the cohort's state so far is retired (its open windows are
judged at the next advance, without `silent` verdicts, and an alert still active then ends with
`recovered`/`restarted`) and a fresh cohort takes its place, so a job resumed from a checkpoint has
its steps judged again, not `late`, its ranks warm up again, and a rank that did not come back is
not `silent`. A rank with a lower count than its cohort's (torchrun restarts the workers of a node
that did not fail without counting it) joins the current incarnation.

Liveness and hangs are liveness.py's: the engine hands it heartbeats, placements and each cohort's
latest interval end, and adds where a rank runs (host, local rank) to every per-rank verdict. The
world size that placements carry (liveness keeps it) sizes a job's default cohort, whose first
windows wait for it.

Outcomes of `ingest`: `accepted`; `duplicate` (seq seen before, or older than the rank's
de-duplication horizon); `late` (its window was already judged: counted, never judged again);
`malformed` (a value of the wrong type, or a host duration that is negative or not finite);
`dropped` (no room under the bounds). They match CONTRACT §3b `straggler.detector.spans{outcome}`.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.departure import CHECK_INTERVAL_NS, departed_verdicts, has_active_alert
from otel_straggler.detector.gpu_evidence import GpuEvidence
from otel_straggler.detector.inherited_alerts import AlertKey, InheritedAlerts
from otel_straggler.detector.intermittent import ring_length
from otel_straggler.detector.judge import judge_window, judge_windows
from otel_straggler.detector.window_batch import WindowBatch, batches
from otel_straggler.detector.verdict_records import ended_alert_verdicts
from otel_straggler.detector.liveness import HangState, Liveness
from otel_straggler.detector.nodes import NodeRollup, roll_up
from otel_straggler.detector.observation import (DEFAULT_COHORT, Heartbeat, Observation, ObservationRecords, Placement,
                                                 Verdict)
from otel_straggler.detector.windows import Cohort, RankEntry, RowLayout, WindowRows

OUTCOMES = ("accepted", "duplicate", "late", "malformed", "dropped")
# the hot path unpacks each observation as a tuple (faster than 11 attribute reads), so it relies
# on this field order; a change to Observation must fail here, not misread every span
_OBSERVATION_FIELDS = ("job_id", "epoch", "cohort", "rank", "stage", "step", "seq", "host_ms",
                       "device_ms", "collective", "tokens", "samples", "end_unix_nano", "restart")
if Observation._fields != _OBSERVATION_FIELDS:
    raise ImportError(f"engine.ingest_many unpacks Observation{_OBSERVATION_FIELDS}; it now has {Observation._fields}")
# a seq this far below what the rank's ring holds means the rank's process started over
RESTART_HORIZONS = 4

_append_rows: Optional[Callable[..., tuple[int, int, int, int]]]
_append_records: Optional[Callable[..., tuple[int, int, int, int]]]
try:  # the intake loop's common case in C (setup.py builds it where a compiler is)
    from otel_straggler.detector._ingest import append_records as _append_records, append_rows as _append_rows
except ImportError:
    _append_rows = _append_records = None


class JobSlowdownState(NamedTuple):
    """The straggler.job.slowdown gauge of one cohort: its latest window's pace over its baseline."""
    job_id: str
    cohort: str
    ratio: float
    active: bool  # a job_slowdown alert is active


class RankState(NamedTuple):
    """The live view of one (job, epoch, cohort, stage, rank): the straggler.rank.slowdown and
    straggler.alert.active gauges."""
    job_id: str
    epoch: int
    cohort: str
    stage: str
    rank: int
    slowdown: Optional[float]  # latest window's slowdown vs its reference; None when not comparable
    alert_active: bool
    host: Optional[str] = None  # where the rank runs, when its resource said
    local_rank: Optional[int] = None
    k8s_node_name: Optional[str] = None  # where it sent k8s.node.name (then also its host)


class _JobView(NamedTuple):
    """A job as _evictable sees it: its cohorts together."""
    job_id: str
    cohorts: list

    def established(self) -> bool:
        return any(cohort.established() for cohort in self.cohorts)

    def rank_count(self) -> int:
        return sum(cohort.rank_count() for cohort in self.cohorts)

    @property
    def last_active_unix_nano(self) -> int:
        return max(cohort.last_active_unix_nano for cohort in self.cohorts)


MAX_FLAGGED_HOSTS = 256  # hosts that had a rank alerted, kept for status.json's node roll-up


class Engine:
    """Not thread-safe: one thread calls everything (or the caller holds a lock around each call)."""

    def __init__(self, config: DetectorConfig, patient_start: bool = False,
                 windows_judged: Optional[Callable[[Cohort, list], None]] = None) -> None:
        """patient_start: every cohort's first windows wait `max_export_lag_s` for ranks not seen yet,
        as a restarted incarnation's do (replay: its clock is recorded times, which precede a line's
        arrival by up to the export delay, and offline the wait costs nothing).
        windows_judged(cohort, windows): told of each cohort's closed windows (windows.WindowRows)
        right before they are judged (window_record.py records their medians); it must not raise."""
        self._config = config
        self._windows_judged = windows_judged
        self._patient_start = patient_start
        self._layout = RowLayout(config.window_steps, config.max_ranks)
        self._dedup_horizon = 1 << max(0, (config.dedup_horizon - 1).bit_length())
        # the C intake loop's arguments after the rank table: seq mask, window steps, collective
        # offset, restart span
        self._intake_params = (self._dedup_horizon - 1, self._layout.window_steps, self._layout.collective_offset,
                               RESTART_HORIZONS * self._dedup_horizon)
        self._grace_ns = int(config.window_grace_s * 1e9)
        self._ranks: dict[tuple, RankEntry] = {}  # (job_id, epoch, rank) -> entry
        self._cohorts: dict[tuple, Cohort] = {}  # (job_id, epoch, cohort) -> cohort
        self._cohorts_by_job: dict[str, list[tuple]] = {}
        self._counts: Counter = Counter()
        self._now = 0  # latest `now` given; new cohorts start their activity clock there
        self._retiring: list[Cohort] = []  # superseded by a new incarnation, judged at the next advance
        self._next_departure_check = 0
        self._liveness = Liveness(config, self._counts)
        # (job, epoch, host) that had a rank alerted, oldest first
        self._flagged_hosts: dict[tuple[str, int, str], None] = {}
        self._gpu = GpuEvidence(config.window_steps, config.persist_windows, config.max_gpu_ranks)
        self._liveness_verdicts: list[Verdict] = []  # made at intake, handed out at the next advance
        self._inherited: Optional[InheritedAlerts] = None  # a previous process's open alerts

    def inherit_alerts(self, alerts: dict[AlertKey, str]) -> None:
        """Alerts a previous detector process left open (inherited_alerts.py): held from the first
        window judged with their rank and stage, so they end with `recovered`, never start twice."""
        self._inherited = InheritedAlerts(alerts) if alerts else None

    # ---- intake ----
    def ingest(self, observation: Observation) -> str:
        """One observation; returns its outcome (see the module docstring)."""
        counts = self.ingest_many((observation,))
        return next(outcome for outcome in OUTCOMES if counts[outcome])

    def ingest_many(self, observations: Iterable[Observation]) -> dict[str, int]:
        """The fast path: outcome counts of a batch."""
        if _append_records is not None and type(observations) is ObservationRecords:
            outcomes = self._ingest_fast(observations, _append_records,
                                         (observations.records, observations.strings, observations.identities))
        elif _append_rows is not None and isinstance(observations, (list, tuple)):
            outcomes = self._ingest_fast(observations, _append_rows, (observations,))
        else:
            outcomes = self._ingest_rows(observations)
        totals = self._counts  # item by item: Counter.update is a Python loop, paid per request
        for name, count in zip(OUTCOMES, outcomes, strict=True):
            if count:
                totals[name] += count
        return dict(zip(OUTCOMES, outcomes, strict=True))

    def _ingest_fast(self, observations: Sequence[Observation], fast: Callable[..., tuple[int, int, int, int]],
                     source: tuple) -> tuple[int, int, int, int, int]:
        """The C loop takes every observation that needs bookkeeping only and stops at the first
        that needs more (a new rank, stage or window...), which the Python loop takes."""
        count = len(observations)
        index, accepted, duplicate, malformed = fast(*source, 0, self._ranks, *self._intake_params)
        late = dropped = 0
        while index < count:
            one = self._ingest_rows((observations[index],))
            accepted, duplicate, late, malformed, dropped = (
                accepted + one[0], duplicate + one[1], late + one[2], malformed + one[3], dropped + one[4])
            index, fast_accepted, fast_duplicate, fast_malformed = fast(*source, index + 1, self._ranks,
                                                                        *self._intake_params)
            accepted += fast_accepted
            duplicate += fast_duplicate
            malformed += fast_malformed
        return accepted, duplicate, late, malformed, dropped

    def _ingest_rows(self, observations: Iterable[Observation]) -> tuple[int, int, int, int, int]:
        """The intake loop in Python: (accepted, duplicate, late, malformed, dropped). It alone
        handles new ranks, stages, windows and every unusual value; _ingest.c repeats its common case."""
        ranks = self._ranks
        window_steps = self._layout.window_steps
        collective_offset = self._layout.collective_offset
        seq_mask = self._dedup_horizon - 1
        nan, inf = math.nan, math.inf
        accepted = duplicate = late = malformed = dropped = 0
        rows: Optional[WindowRows] = None
        for observation in observations:
            try:
                (job_id, epoch, cohort_name, rank, stage, step, seq, host_ms, device_ms, collective, tokens,
                 _, end_unix_nano, restart) = observation
                entry = ranks.get((job_id, epoch, rank))
                if entry is None or entry.cohort_name != cohort_name or restart > entry.restart:
                    entry = self._admit_rank(job_id, epoch, rank, cohort_name, restart)
                    if entry is None:
                        dropped += 1
                        continue
                recent_seqs = entry.recent_seqs
                seq_slot = seq & seq_mask
                if recent_seqs[seq_slot] >= seq and not self._restarted(entry, seq, recent_seqs[seq_slot]):
                    duplicate += 1
                    continue
                if not 0.0 <= host_ms < inf:
                    malformed += 1
                    continue
                cohort = entry.cohort
                stage_offset = cohort.stage_offsets.get(stage)
                if stage_offset is None:
                    stage_offset = self._admit_stage(cohort, stage)
                    if stage_offset is None:
                        dropped += 1
                        continue
                if end_unix_nano > cohort.latest_end_unix_nano:  # the job made progress (hangs)
                    cohort.latest_end_unix_nano = end_unix_nano
                window = step // window_steps
                rows = cohort.open_windows.get(window)
                if rows is None:
                    rows = cohort.open_window(window)
                    if rows is None:
                        late += 1
                        continue
                recent_seqs[seq_slot] = seq
                rows.host_ms.append(host_ms)
                rows.device_ms.append(nan if device_ms is None else device_ms)
                rows.tokens.append(tokens if tokens is not None and tokens > 0 else 0.0)
                rows.end_unix_nano.append(end_unix_nano)
                rows.keys.append(stage_offset + entry.key_slot + step - window * window_steps
                                 + (collective_offset if collective else 0))
                if window > entry.latest_window:
                    cohort.rank_reached(entry, window)
                accepted += 1
            except (TypeError, ValueError, OverflowError, AttributeError):
                malformed += 1
                if rows is not None:
                    rows.repair()
        return accepted, duplicate, late, malformed, dropped

    def _restarted(self, entry: RankEntry, seq: int, remembered: int) -> bool:
        """A seq far below the one remembered in its ring slot: the rank's process started over."""
        if remembered - seq <= RESTART_HORIZONS * self._dedup_horizon:
            return False
        entry.cohort.rank_restarted(entry)
        self._counts["seq_restarts"] += 1
        return True

    def ingest_heartbeats(self, heartbeats: Iterable[Heartbeat], now_unix_nano: Optional[int] = None) -> None:
        """Heartbeats that arrived at `now_unix_nano` (the caller's clock; default: the latest advance)."""
        now = self._now if now_unix_nano is None else now_unix_nano
        heartbeats = heartbeats if isinstance(heartbeats, (list, tuple)) else list(heartbeats)
        self._gpu.note(heartbeats)
        self._liveness_verdicts += self._liveness.note_heartbeats(heartbeats, now)

    def ingest_placements(self, placements: Iterable[Placement]) -> None:
        placements = list(placements)
        self._liveness_verdicts += self._liveness.note_placements(placements, self._now)
        for job_id, epoch in {(p.job_id, p.epoch) for p in placements if p.world_size is not None}:
            cohort = self._cohorts.get((job_id, epoch, DEFAULT_COHORT))
            if cohort is not None:
                cohort.expected_ranks = self._liveness.world_size(job_id, epoch)

    def _admit_rank(self, job_id: str, epoch: int, rank: int, cohort_name: str,
                    restart: int = 0) -> Optional[RankEntry]:
        """Registers a rank (or its move to another cohort, or a new incarnation of its cohort),
        within the bounds; None: no room."""
        if not (isinstance(job_id, str) and isinstance(cohort_name, str) and _is_int(epoch) and _is_int(rank)
                and _is_int(restart)):
            raise TypeError("job_id and cohort must be str, epoch, rank and restart count int")
        cohort = self._cohort(job_id, epoch, cohort_name)
        if cohort is None:
            return None
        if restart > cohort.restart:
            cohort = self._new_incarnation(cohort, restart)
        entry, evicted = cohort.add_rank(rank, self._dedup_horizon)
        if evicted is not None:
            self._forget_rank(evicted)
        if entry is None:
            return None
        # a rank that moved cohorts keeps its old entry there (it falls silent); this one replaces it here
        self._ranks[(job_id, epoch, rank)] = entry
        return entry

    def _admit_stage(self, cohort: Cohort, stage: str) -> Optional[int]:
        if not isinstance(stage, str):
            raise TypeError("stage must be str")
        return cohort.add_stage(stage)

    def _cohort(self, job_id: str, epoch: int, name: str) -> Optional[Cohort]:
        key = (job_id, epoch, name)
        cohort = self._cohorts.get(key)
        if cohort is not None:
            return cohort
        if job_id not in self._cohorts_by_job and len(self._cohorts_by_job) >= self._config.max_jobs:
            if not self._evict_job():
                self._counts["jobs_shed"] += 1
                return None
        if len(self._cohorts) >= self._config.max_cohorts:
            victim = self._evictable(self._cohorts.values())
            if victim is None:
                self._counts["cohorts_shed"] += 1
                return None
            self._evict_cohort(victim)
            self._counts["evictions_cohorts"] += 1
        cohort = self._make_cohort(job_id, epoch, name, 0)
        self._cohorts_by_job.setdefault(job_id, []).append(key)
        return cohort

    def _make_cohort(self, job_id: str, epoch: int, name: str, restart: int) -> Cohort:
        config = self._config
        cohort = Cohort(job_id, epoch, name, self._layout, config.max_ranks, config.max_stages,
                        config.max_open_windows, self._counts, self._now, config.max_export_lag_s, restart,
                        self._patient_start)
        if name == DEFAULT_COHORT:
            cohort.expected_ranks = self._liveness.world_size(job_id, epoch)
        self._cohorts[(job_id, epoch, name)] = cohort
        return cohort

    def _new_incarnation(self, old: Cohort, restart: int) -> Cohort:
        """A fresh cohort in the place of `old`, which is judged and dropped at the next advance."""
        for entry in old.slot_entries:
            if entry is not None:
                self._forget_rank(entry)
        self._retiring.append(old)
        self._counts["incarnations"] += 1
        self._liveness_verdicts += self._liveness.new_incarnation(old.job_id, old.epoch, restart, self._now)
        return self._make_cohort(old.job_id, old.epoch, old.name, restart)

    def _evict_job(self) -> bool:
        """Makes room for a new job (see _evictable); False when there is none to give."""
        jobs = [_JobView(job_id, [self._cohorts[key] for key in keys]) for job_id, keys in self._cohorts_by_job.items()]
        # (a job is established when one of its cohorts is, active when its latest cohort is)
        victim = self._evictable(jobs)
        if victim is None:
            return False
        for cohort in victim.cohorts:
            self._evict_cohort(cohort)
        self._counts["evictions_jobs"] += 1
        return True

    def _evictable(self, candidates):
        """What a full table gives up for a newcomer: of those not established (never judged, and
        reporting in one window only), the one with the fewest ranks, then the least recently active
        (a flood of ids each sent once by one client churns among its own, while a job starting up
        has its ranks); else the least recently active of those idle for idle_evict_s; None when all
        are established and active: the newcomer is shed instead (counted), never a job at work."""
        candidates = list(candidates)
        newcomers = [c for c in candidates if not c.established()]
        if newcomers:
            return min(newcomers, key=lambda c: (c.rank_count(), c.last_active_unix_nano))
        idle_before = self._now - int(self._config.idle_evict_s * 1e9)
        oldest = min(candidates, key=lambda c: c.last_active_unix_nano, default=None)
        return oldest if oldest is not None and oldest.last_active_unix_nano <= idle_before else None

    def _retire(self, now_unix_nano: int) -> list[Verdict]:
        """Judges what superseded incarnations still hold, then ends their active alerts."""
        verdicts: list[Verdict] = []
        retiring, self._retiring = self._retiring, []
        for cohort in retiring:
            for rows in cohort.all_windows():
                judgement = judge_window(cohort, rows, self._config, now_unix_nano)
                self._counts["windows_closed"] += 1
                # their ranks were restarted, not lost
                verdicts += self._placed([v for v in judgement.verdicts if v.verdict != contract.VERDICT_SILENT],
                                         cohort.epoch)
            ended = ended_alert_verdicts(cohort, now_unix_nano, contract.REASON_RESTARTED)
            verdicts += self._placed(ended, cohort.epoch)
        self._counts["verdicts"] += len(verdicts)
        return verdicts

    def _placed(self, verdicts: list[Verdict], epoch: int) -> list[Verdict]:
        """Per-rank verdicts with where the rank runs (CONTRACT v1.1 §3a host, local_rank; v1.2 §5 pod,
        namespace, and the node as host) and its
        GPU's health over the verdict's window (`gpu`)."""
        placed = []
        for verdict in verdicts:
            if verdict.rank is not None and verdict.host is None and verdict.local_rank is None:
                where = self._liveness.placement(verdict.job_id, epoch, verdict.rank)
                if any(value is not None for value in where.values()):
                    verdict = dataclasses.replace(verdict, **where)
            placed.append(self._with_gpu(verdict, epoch))
        self._flag_hosts(placed, epoch)
        return placed

    def _with_gpu(self, verdict: Verdict, epoch: Optional[int]) -> Verdict:
        if verdict.rank is None or verdict.gpu is not None:
            return verdict
        if epoch is None:  # a liveness verdict: the job's latest topology
            epoch = max((key[1] for key in self._cohorts_by_job.get(verdict.job_id, ())), default=0)
        # a hang or a silent rank: its latest samples, as they were when it stopped
        latest = verdict.verdict in (contract.VERDICT_HANG, contract.VERDICT_SILENT)
        gpu = self._gpu.evidence(verdict.job_id, epoch, verdict.rank, None if latest else verdict.window,
                                 verdict.reference_ranks)
        return verdict if gpu is None else dataclasses.replace(verdict, gpu=gpu)

    def _evict_cohort(self, cohort: Cohort) -> None:
        """Forgets a cohort, its ranks and its unjudged windows (counted as dropped)."""
        key = (cohort.job_id, cohort.epoch, cohort.name)
        del self._cohorts[key]
        job_cohorts = self._cohorts_by_job[cohort.job_id]
        job_cohorts.remove(key)
        if not job_cohorts:
            del self._cohorts_by_job[cohort.job_id]
        for entry in cohort.slot_entries:
            if entry is not None:
                self._forget_rank(entry)
        self._counts["windows_dropped"] += cohort.pending_window_count()

    def _forget_rank(self, entry: RankEntry) -> None:
        key = (entry.job_id, entry.epoch, entry.rank)
        if self._ranks.get(key) is entry:  # not when the rank has since moved to another cohort
            del self._ranks[key]

    # ---- judging ----
    def advance(self, now_unix_nano: int) -> list[Verdict]:
        """Closes and judges the windows that are due at `now` (the caller's clock, ns), then
        looks for hangs."""
        self._now = now_unix_nano
        config = self._config
        verdicts = self._retire(now_unix_nano)
        verdicts += self._judge(lambda cohort: cohort.windows_to_judge(
            now_unix_nano, self._grace_ns, config.window_close_lag, config.max_window_rows_per_rank), now_unix_nano)
        return verdicts + self._judge_liveness(now_unix_nano) + self._departed(now_unix_nano)

    def _departed(self, now_unix_nano: int) -> list[Verdict]:
        """Ends the alerts of cohorts whose every rank stopped reporting here (departure.py)."""
        if now_unix_nano < self._next_departure_check:
            return []
        self._next_departure_check = now_unix_nano + CHECK_INTERVAL_NS
        verdicts: list[Verdict] = []
        for cohort in self._cohorts.values():
            if has_active_alert(cohort) and all(
                    self._liveness.stopped(cohort.job_id, cohort.epoch, entry.rank, now_unix_nano)
                    for entry in cohort.slot_entries if entry is not None):
                ended = departed_verdicts(cohort, now_unix_nano)
                self._counts["alerts_departed"] += len(ended)
                verdicts += self._placed(ended, cohort.epoch)
        self._counts["verdicts"] += len(verdicts)
        return verdicts

    def _judge_liveness(self, now_unix_nano: int) -> list[Verdict]:
        verdicts, self._liveness_verdicts = self._liveness_verdicts, []
        for cohort in self._cohorts.values():
            if cohort.latest_end_unix_nano:
                verdicts += self._liveness.note_progress(cohort.job_id, cohort.epoch, cohort.restart,
                                                         cohort.latest_end_unix_nano, now_unix_nano)
        verdicts += self._liveness.judge(now_unix_nano, self._collective_stages)
        verdicts = [self._with_gpu(verdict, None) for verdict in verdicts]
        self._counts["verdicts"] += len(verdicts)
        return verdicts

    def _collective_stages(self, job_id: str, epoch: int) -> tuple[set[str], set[str]]:
        """The job's collective stages, and those of them judged so only from synchronization points
        (a stage the spans of one cohort mark is marked for the job)."""
        stages: set[str] = set()
        sync_points: set[str] = set()
        marked: set[str] = set()
        for key in self._cohorts_by_job.get(job_id, ()):
            if key[1] == epoch:
                collectives = self._cohorts[key].collective_stage_names()
                inferred = self._cohorts[key].sync_point_stage_names()
                stages |= collectives
                sync_points |= inferred
                marked |= collectives - inferred
        return stages, sync_points - marked

    def hang_state(self) -> list[HangState]:
        """Every hang series (straggler.job.hang): 1 while declared, 0 once progress resumed."""
        return self._liveness.hang_states()

    def next_close_unix_nano(self) -> Optional[int]:
        """The earliest time (same clock as `advance`) at which `advance` could close a window with no
        more data arriving; None when no window is open, 0 when one is due now. A caller that
        advances when data comes and otherwise sleeps until this time misses no close."""
        dues = [due for cohort in self._cohorts.values()
                if (due := cohort.next_idle_close_unix_nano(self._grace_ns)) is not None]
        return min(dues, default=None)

    def detector_stalled(self, stalled_ns: int) -> None:
        """The caller did not look for `stalled_ns` (its process stalled): no rank is overdue for it."""
        self._counts["detector_stalls"] += 1
        for cohort in self._cohorts.values():
            cohort.delivery_clocks_paused(stalled_ns)

    def drain(self, now_unix_nano: int) -> list[Verdict]:
        """Closes and judges every open window: end of a replay, or shutdown."""
        self._now = now_unix_nano
        verdicts = self._retire(now_unix_nano)
        return verdicts + self._judge(Cohort.all_windows, now_unix_nano) + self._judge_liveness(now_unix_nano)

    def _judge(self, windows_of, now_unix_nano: int) -> list[Verdict]:
        closing = []
        for cohort in list(self._cohorts.values()):
            closed = windows_of(cohort)
            if closed and self._windows_judged is not None:
                self._windows_judged(cohort, closed)
            if closed and self._inherited is not None:
                self._inherited.take_over(cohort)
            if closed:
                closing.append((cohort, closed))
        # each cohort's windows in order; the n-th windows of cohorts alike judged in one batch
        # (window_batch.py), which gives what judging each alone does
        judged: dict[int, list] = {id(cohort): [] for cohort, _ in closing}
        ring = ring_length(self._config.persist_windows)
        for turn in range(max((len(closed) for _, closed in closing), default=0)):
            due = [(cohort, closed[turn]) for cohort, closed in closing if turn < len(closed)]
            for batch in batches(due):
                cohorts = [cohort for cohort, _ in batch]
                judgements = judge_windows(WindowBatch(cohorts, [rows for _, rows in batch], ring), self._config,
                                           now_unix_nano)
                for cohort, judgement in zip(cohorts, judgements, strict=True):
                    cohort.ranks_fell_silent(judgement.fell_silent)
                    cohort.ranks_came_back(judgement.came_back)
                    judged[id(cohort)].append(judgement)
        verdicts: list[Verdict] = []
        for cohort, _ in closing:
            for judgement in judged[id(cohort)]:
                self._counts["windows_closed"] += 1
                self._counts["coverage_gaps"] += judgement.coverage_gaps
                self._counts["invalid_device_durations"] += judgement.invalid_device_rows
                self._counts["below_floor_quiet"] += judgement.quiet_below_floor
                self._counts["verdicts"] += len(judgement.verdicts)
                verdicts.extend(self._placed(judgement.verdicts, cohort.epoch))
        return verdicts

    # ---- views ----
    def stats(self) -> dict[str, int]:
        """Running counters plus the current sizes of everything bounded."""
        counters = ("accepted", "late", "malformed", "dropped", "windows_closed", "coverage_gaps",
                    "evictions_jobs", "evictions_cohorts", "evictions_ranks", "evictions_stages",
                    "evictions_windows", "windows_dropped", "windows_closed_full", "seq_restarts",
                    "invalid_device_durations",
                    "verdicts", "heartbeats", "incarnations", "evictions_liveness_jobs", "evictions_liveness_ranks",
                    "detector_stalls", "below_floor_quiet", "jobs_shed", "cohorts_shed", "alerts_departed")
        stats = {name: int(self._counts[name]) for name in counters}
        stats["duplicates"] = int(self._counts["duplicate"])
        stats["jobs"] = len(self._cohorts_by_job)
        stats["cohorts"] = len(self._cohorts)
        stats["ranks"] = sum(cohort.rank_count() for cohort in self._cohorts.values())
        stats["open_windows"] = sum(cohort.pending_window_count() for cohort in self._cohorts.values())
        stats["tracked_ranks"] = self._liveness.tracked_ranks()
        stats["gpu_ranks"] = self._gpu.rank_count()  # ranks whose GPU samples are kept
        stats["evictions_gpu_ranks"] = self._gpu.ranks_forgotten
        inherited = self._inherited.counts() if self._inherited is not None else {"taken_over": 0, "pending": 0}
        stats["alerts_taken_over"], stats["alerts_pending_takeover"] = inherited["taken_over"], inherited["pending"]
        return stats

    def job_slowdown_state(self) -> list[JobSlowdownState]:
        """Per cohort with a pace baseline: its latest ratio and whether job_slowdown is active."""
        return [JobSlowdownState(cohort.job_id, cohort.name, job.ratio, job.active)
                for cohort in self._cohorts.values()
                for job in (cohort.verdict_state.job,) if job.ratio is not None and math.isfinite(job.ratio)]

    def jobs_without_stages(self, now_unix_nano: int, limit: int) -> tuple[int, list[tuple[str, int, float]]]:
        """Jobs that send heartbeats and no stage span (liveness.py): how many, and up to `limit`."""
        return self._liveness.jobs_without_stages(now_unix_nano, limit)

    def rank_state(self) -> list[RankState]:
        """Latest slowdown and alert per (job, epoch, cohort, stage, rank) that has been compared.

        A stage has two codes, as a compute stage and as a collective (one found to end at a
        synchronization point is judged as both in different windows); a (stage, rank) is one
        series outside, so the two are merged: alerted when either holds an alert, its ratio the
        alerted code's, else the compute code's where there is one."""
        states = []
        for cohort in self._cohorts.values():
            verdict_state = cohort.verdict_state
            slot_count = len(cohort.slot_entries)
            pairs = min(len(cohort.stage_names), verdict_state.alert.shape[0] // 2)
            slowdown = verdict_state.slowdown[:2 * pairs, :slot_count].reshape(pairs, 2, slot_count)
            alert = (verdict_state.alert[:2 * pairs, :slot_count]
                     | verdict_state.intermittent.alert[:2 * pairs, :slot_count]).reshape(pairs, 2, slot_count)
            as_collective = (alert[:, 1] & ~alert[:, 0]) | (~alert[:, 0] & np.isnan(slowdown[:, 0]))
            value = np.where(as_collective, slowdown[:, 1], slowdown[:, 0])
            active = np.any(alert, axis=1)
            indices, slots = np.nonzero(~np.isnan(value) | active)
            for index, slot, ratio, alerted in zip(indices.tolist(), slots.tolist(),
                                                  value[indices, slots].tolist(), active[indices, slots].tolist(),
                                                  strict=True):
                entry = cohort.slot_entries[slot]
                stage = cohort.stage_names[index]
                if entry is not None and stage is not None:
                    where = self._liveness.placement(cohort.job_id, cohort.epoch, entry.rank)
                    states.append(RankState(cohort.job_id, cohort.epoch, cohort.name, stage, entry.rank,
                                            ratio if math.isfinite(ratio) else None, alerted, where["host"],
                                            where["local_rank"], where["k8s_node_name"]))
        return states

    def node_state(self) -> list[NodeRollup]:
        """Every host that had a rank alerted (the latest MAX_FLAGGED_HOSTS of them), with its ranks
        under an active straggler alert now (any stage) and its ranks of the job, rolled up (nodes.py)."""
        slow = []
        for cohort in self._cohorts.values():
            verdict_state = cohort.verdict_state
            slot_count = len(cohort.slot_entries)
            alert = verdict_state.alert[:, :slot_count] | verdict_state.intermittent.alert[:, :slot_count]
            for slot in np.nonzero(alert.any(axis=0))[0].tolist():
                entry = cohort.slot_entries[slot]
                if entry is not None:
                    host = self._liveness.placement(cohort.job_id, cohort.epoch, entry.rank)["host"]
                    slow.append((cohort.job_id, host, entry.rank))
        epochs: dict[tuple[str, str], int] = {}  # (job, host) -> the latest epoch it was flagged in
        for job_id, epoch, host in self._flagged_hosts:
            epochs[(job_id, host)] = max(epochs.get((job_id, host), epoch), epoch)
        nodes = roll_up(slow, lambda job_id, host: self._liveness.ranks_on_host(
            job_id, epochs.get((job_id, host), 0), host) or None)
        listed = {(node.job_id, node.host) for node in nodes}
        quiet = [NodeRollup(job_id, host, (), self._liveness.ranks_on_host(job_id, epoch, host) or None)
                 for (job_id, host), epoch in epochs.items() if (job_id, host) not in listed]
        return nodes + quiet

    def _flag_hosts(self, verdicts: list[Verdict], epoch: int) -> None:
        for verdict in verdicts:
            if verdict.verdict == contract.VERDICT_STRAGGLER and verdict.host:
                key = (verdict.job_id, epoch, verdict.host)
                self._flagged_hosts.pop(key, None)
                self._flagged_hosts[key] = None
                if len(self._flagged_hosts) > MAX_FLAGGED_HOSTS:
                    self._flagged_hosts.pop(next(iter(self._flagged_hosts)))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
