"""Between intake and the engine: counting, a bounded queue, and the one thread that runs the engine.

Receivers decode on their own threads and `submit` batches; one engine thread ingests them in
arrival order, advances the engine's windows by the wall clock, and hands verdicts on. When the queue
is full, `submit` refuses and the receiver answers "retry later", so an overloaded detector sheds
load at the door instead of growing without bound. Every span lands in exactly one outcome counter.
`EngineDriver` holds the part that does not need a thread, so `replay` drives the same code
synchronously with span time as its clock.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from typing import Callable, Optional

from otel_straggler.detector.config import DetectorConfig
from otel_straggler import contract
from otel_straggler.detector.decode import OTHER_KIND, DecodedBatch, RejectedSpan, Rejection
from otel_straggler.detector.engine_interface import DetectorEngine
from otel_straggler.detector.observation import Verdict
from otel_straggler.detector.rejections import RejectionLog

_log = logging.getLogger(__name__)

# CONTRACT §3b `straggler.detector.spans{outcome}`; `ignored` (not our spans) is counted apart so it
# does not dilute the loss ratio that alert rules compute from these five.
SPAN_OUTCOMES = ("accepted", "duplicate", "late", "malformed", "dropped")
# The engine thread offers the wall clock to close windows at most this often while spans come in,
# and otherwise sleeps until the next window could go idle, waking at least every IDLE_WAKE_S:
# each wake-up costs CPU (70 µs on a small VM, benchmarks/detector_idle.py), and a detector mostly waits.
ADVANCE_INTERVAL_S = 0.1
IDLE_WAKE_S = 1.0
# the engine thread looks at least every IDLE_WAKE_S; a look later than that by more than this is a
# stall of the detector itself, which the ranks' overdue clocks do not count (Engine.detector_stalled)
STALL_SLACK_S = 1.0
# jobs that send heartbeats but no stage spans: looked for at most once a second of the engine's
# clock (a scan of its jobs), and at most this many named in status.json (the count has them all)
JOBS_WITHOUT_STAGES_LOOK_NS = 1_000_000_000
MAX_JOBS_WITHOUT_STAGES_NAMED = 16
# verdicts after which status.json's node roll-up is made again (else once a second, with the look above)
_ALERT_CHANGES = frozenset((contract.VERDICT_STRAGGLER, contract.VERDICT_RECOVERED))
# spans the engine refuses after decoding: their kind, so that rejections add up to spans.malformed
_ENGINE_REFUSED = RejectedSpan(Rejection(OTHER_KIND, "refused by the engine after decoding (a host duration that "
                                         "is not finite, or a value of the wrong type)"), None, None, None, None)


class IntakeCounters:
    """Thread-safe running totals: spans by outcome (plus `ignored`), malformed spans by kind of
    rejection, requests by result, and internal errors survived by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: Counter[str] = Counter(
            {outcome: 0 for outcome in SPAN_OUTCOMES + ("ignored", "heartbeats", "gpu_fields_invalid")})
        self._rejections: Counter[str] = Counter()
        self._requests: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()

    def add(self, **span_counts: int) -> None:
        with self._lock:
            self._spans.update(span_counts)

    def add_rejections(self, counts: dict[str, int]) -> None:
        with self._lock:
            self._rejections.update(counts)

    def add_request(self, result: str) -> None:
        with self._lock:
            self._requests[result] += 1

    def add_error(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self._errors[kind] += count

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"spans": dict(self._spans), "rejections": dict(self._rejections),
                    "requests": dict(self._requests), "errors": dict(self._errors)}


VerdictSink = Callable[[list[Verdict]], None]


class EngineDriver:
    """Feeds decoded batches to an engine and passes its verdicts to `deliver`. Every engine call
    holds one lock, so other threads may call `rank_state()` at any time; `stats()` is a copy taken
    after each advance, so status and metrics never wait for the engine. An engine exception is
    counted and logged, and intake goes on: fail open. Malformed spans are counted by kind and
    logged, rate-limited (rejections.py)."""

    def __init__(self, engine: DetectorEngine, counters: IntakeCounters, deliver: VerdictSink,
                 on_ingest_lag: Optional[Callable[[float], None]] = None) -> None:
        self.engine = engine
        self.counters = counters
        self.rejection_log = RejectionLog()
        self._deliver = deliver
        self._on_ingest_lag = on_ingest_lag
        self._engine_lock = threading.RLock()
        self._logged_engine_error = False
        self._logged_late = False
        self._stats: dict[str, int] = dict(engine.stats())
        self._nodes: list = []
        self._next_close: Optional[int] = self._engine_next_close()
        self._jobs_without_stages: dict = {"count": 0, "jobs": []}
        self._next_stageless_look = 0

    def count_decoded(self, batch: DecodedBatch) -> None:
        self.counters.add(malformed=batch.malformed, ignored=batch.ignored, heartbeats=len(batch.heartbeats),
                          gpu_fields_invalid=batch.gpu_fields_invalid)
        if batch.malformed:
            self.counters.add_rejections(batch.rejections)
            self.rejection_log.note(batch.rejections, batch.first_rejected)

    def ingest(self, batch: DecodedBatch, now_unix_nano: int) -> None:
        if batch.placements or batch.heartbeats:
            self._ingest_liveness(batch, now_unix_nano)
        observations = batch.observations
        if not observations:
            return
        try:
            with self._engine_lock:
                outcomes = self.engine.ingest_many(observations)
        except Exception:  # noqa: BLE001 - an engine bug must not stop intake
            self._engine_failed("ingest_many")
            self.counters.add(dropped=len(observations))
            return
        self.counters.add(**outcomes)
        if outcomes.get("malformed"):
            refused = {OTHER_KIND: outcomes["malformed"]}
            self.counters.add_rejections(refused)
            self.rejection_log.note(refused, {OTHER_KIND: _ENGINE_REFUSED})
        if outcomes.get("late") and not self._logged_late:  # once: the counter has the rest
            self._logged_late = True
            _log.warning("%d spans arrived after their window was judged: counted as late, not judged "
                         "(spans.late). Where steps are fast, the window closed before every rank's export "
                         "burst came; raise --window-steps so that max_open_windows windows span more than a "
                         "rank holds its spans, its build interval plus its export schedule (docs/detector.md, "
                         "Fast steps)", outcomes["late"])
        if self._on_ingest_lag is not None:
            # one sample per batch: the age of its last span when the engine took it
            self._on_ingest_lag(max(0.0, (now_unix_nano - observations[-1].end_unix_nano) / 1e9))

    def _ingest_liveness(self, batch: DecodedBatch, now_unix_nano: int) -> None:
        """Where ranks run and their heartbeats."""
        try:
            with self._engine_lock:
                if batch.placements:
                    self.engine.ingest_placements(batch.placements)
                if batch.heartbeats:
                    self.engine.ingest_heartbeats(batch.heartbeats, now_unix_nano)
        except Exception:  # noqa: BLE001 - an engine bug must not stop intake
            self._engine_failed("ingest_heartbeats")

    def advance(self, now_unix_nano: int) -> None:
        self._close("advance", now_unix_nano)
        self.rejection_log.log_due()  # the count of the last minute's rejections, if no more come

    def drain(self, now_unix_nano: int) -> None:
        self._close("drain", now_unix_nano)

    def detector_stalled(self, stalled_ns: int) -> None:
        """The engine thread did not look for `stalled_ns` longer than it should have."""
        try:
            with self._engine_lock:
                self.engine.detector_stalled(stalled_ns)
        except Exception:  # noqa: BLE001
            self._engine_failed("detector_stalled")

    def _close(self, method: str, now_unix_nano: int) -> None:
        try:
            with self._engine_lock:
                verdicts = self.engine.drain(now_unix_nano) if method == "drain" else self.engine.advance(now_unix_nano)
                self._stats = dict(self.engine.stats())
                self._next_close = self._engine_next_close()
                looking = method == "drain" or now_unix_nano >= self._next_stageless_look
                if looking:
                    self._next_stageless_look = now_unix_nano + JOBS_WITHOUT_STAGES_LOOK_NS
                    self._look_for_jobs_without_stages(now_unix_nano)
                # alerts start and end with verdicts; a host's rank count changes slowly
                if looking or any(v.verdict in _ALERT_CHANGES for v in verdicts):
                    self._nodes = self.engine.node_state()
        except Exception:  # noqa: BLE001
            self._engine_failed(method)
            return
        if verdicts:
            self._deliver(verdicts)

    def rank_state(self):
        with self._engine_lock:
            return self.engine.rank_state()

    def hang_state(self):
        """The engine's hang series (straggler.job.hang)."""
        with self._engine_lock:
            return self.engine.hang_state()

    def job_slowdown_state(self):
        """The engine's straggler.job.slowdown series."""
        with self._engine_lock:
            return self.engine.job_slowdown_state()

    def node_state(self) -> list:
        """The engine's node roll-up (nodes.py) as of the latest verdict that started or ended an
        alert, or the latest second's advance (never waits for the engine)."""
        return self._nodes

    def stats(self) -> dict[str, int]:
        """The engine's stats() as of the latest advance or drain."""
        return self._stats

    def jobs_without_stages(self) -> dict:
        """As of the latest look (at most a second old on the engine's clock): the jobs whose ranks
        send heartbeats but no stage span, `{"count": n, "jobs": [{"job_id", "ranks", "seconds"}]}`,
        the longest first, at most MAX_JOBS_WITHOUT_STAGES_NAMED of them named."""
        return self._jobs_without_stages

    def _look_for_jobs_without_stages(self, now_unix_nano: int) -> None:
        """Under the engine lock."""
        try:
            count, jobs = self.engine.jobs_without_stages(now_unix_nano, MAX_JOBS_WITHOUT_STAGES_NAMED)
        except Exception:  # noqa: BLE001 - the verdicts of this advance still go out
            self._engine_failed("jobs_without_stages")
            return
        self._jobs_without_stages = {"count": count, "jobs": [
            {"job_id": job_id, "ranks": ranks, "seconds": round(seconds, 1)} for job_id, ranks, seconds in jobs]}

    def next_close_unix_nano(self) -> Optional[int]:
        """As of the latest advance: when a window could next close with no more data (None: no
        window open; 0: now)."""
        return self._next_close

    def _engine_next_close(self) -> Optional[int]:
        return self.engine.next_close_unix_nano()

    def _engine_failed(self, method: str) -> None:
        self.counters.add_error("engine")
        if not self._logged_engine_error:  # once: a failing engine would otherwise flood the log
            self._logged_engine_error = True
            _log.exception("engine.%s failed; counted as engine_errors (logged once)", method)


_STOP = object()


class SpanPipeline:
    """The bounded queue and the engine thread of the live service."""

    def __init__(self, driver: EngineDriver, config: DetectorConfig,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.driver = driver
        self._clock = clock
        self._max_pending_spans = config.max_pending_spans
        self._pending: queue.Queue = queue.Queue(maxsize=config.max_pending_requests)
        self._pending_spans = 0
        self._pending_lock = threading.Lock()
        self._accepting = False
        self._thread: Optional[threading.Thread] = None

    @property
    def pending_spans(self) -> int:
        return self._pending_spans

    def has_room(self) -> bool:
        """Cheap check before decoding: a request that would be refused is not worth decoding."""
        return self._accepting and not self._pending.full() and self._pending_spans < self._max_pending_spans

    def submit(self, batch: DecodedBatch) -> bool:
        """Queues a decoded batch for the engine; False (spans counted as dropped) when full or stopped."""
        spans = len(batch.observations) + len(batch.heartbeats)
        with self._pending_lock:
            room = self._accepting and self._pending_spans + spans <= self._max_pending_spans
            if room:
                try:
                    self._pending.put_nowait(batch)
                    self._pending_spans += spans
                except queue.Full:
                    room = False
        if not room:
            self.driver.counters.add(dropped=spans)
            return False
        self.driver.count_decoded(batch)
        return True

    def start(self) -> None:
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="straggler-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Refuses new batches, lets the engine thread ingest what is queued, then drains the engine
        so every open window is judged. True when that finished within the timeout."""
        with self._pending_lock:
            self._accepting = False
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout_s
        # after _accepting is False nothing else is put, so this put only waits for the thread to make room
        try:
            self._pending.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        next_advance = time.monotonic() + ADVANCE_INTERVAL_S
        last_look = time.monotonic()
        ingested_since_advance = False
        stopping = False
        while not stopping:
            try:
                batch = self._pending.get(timeout=self._wait_s(next_advance, ingested_since_advance))
            except queue.Empty:
                batch = None
            if batch is _STOP:
                break
            if batch is not None:
                self._ingest(batch)
                ingested_since_advance = True
            if time.monotonic() >= next_advance:
                # A rank is overdue by the clock, so what already waits in this queue is ingested
                # first (at most what is queued now: bounded), and time in which this thread did
                # not look at all (a stalled or CPU-starved detector) is not held against the ranks.
                stopping = self._ingest_queued()
                looked = time.monotonic()
                stalled_s = looked - last_look - IDLE_WAKE_S - STALL_SLACK_S
                if stalled_s > 0:
                    self.driver.detector_stalled(int(stalled_s * 1e9))
                self.driver.advance(self._clock())
                last_look = looked
                next_advance = time.monotonic() + ADVANCE_INTERVAL_S
                ingested_since_advance = False
        self.driver.drain(self._clock())

    def _ingest(self, batch: DecodedBatch) -> None:
        with self._pending_lock:
            self._pending_spans -= len(batch.observations) + len(batch.heartbeats)
        self.driver.ingest(batch, self._clock())

    def _ingest_queued(self) -> bool:
        """Ingests the batches queued now; True when the stop mark was among them."""
        for _ in range(self._pending.qsize()):
            try:
                batch = self._pending.get_nowait()
            except queue.Empty:
                break
            if batch is _STOP:
                return True
            self._ingest(batch)
        return False

    def _wait_s(self, next_advance: float, ingested_since_advance: bool) -> float:
        """How long the engine thread may wait for the next batch: until the next advance is allowed
        when new rows wait to be looked at, else until a window could go idle, at most IDLE_WAKE_S."""
        until_advance = next_advance - time.monotonic()
        if ingested_since_advance:
            return max(0.0, until_advance)
        next_close = self.driver.next_close_unix_nano()
        until_close = IDLE_WAKE_S if next_close is None else (next_close - self._clock()) / 1e9
        return max(0.0, min(IDLE_WAKE_S, max(until_advance, until_close)))
