"""The hang rules (liveness.py), incarnations (a restart count that goes up) and placements, one test
per rule, named after it, on a job scripted second by second (scripted_job.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.liveness import _waiting_test
from otel_straggler.detector.observation import DEFAULT_COHORT

from otel_straggler.testing.scripted_job import CONFIG, SECOND, START, ScriptedJob, hangs, in_stage, stuck_rank_one


# ---------------------------------------------------------------- hang: who is the culprit

def test_hang_names_the_rank_that_never_entered_the_collective():
    job = ScriptedJob(Engine(CONFIG))
    verdicts = job.run(30)
    stopped = job.now
    verdicts += job.run(75, progress=False, open_stages=stuck_rank_one(stopped))
    found = hangs(verdicts)
    assert [(v.rank, v.reason, v.stage) for v in found] == [(1, contract.HANG_NEVER_ENTERED_COLLECTIVE, "forward-compute")]
    hang = found[0]
    assert (hang.host, hang.local_rank, hang.job_id, hang.cohort) == ("node-0", 1, "job", "c")
    assert 60 <= hang.stalled_s <= 62  # said within the timeout plus the detector's recheck
    assert hang.reference_ranks == (0, 2, 3)  # the ranks waiting in the collective: the evidence
    # open since the stop (rank 1) and 50 ms after it (the others), as long as the job has stalled
    assert hang.rank_ms == pytest.approx(hang.stalled_s * 1000, abs=500)
    assert hang.reference_ms == pytest.approx(hang.rank_ms - 50, abs=1)
    assert [v.verdict for v in verdicts if v.rank == 1] == [contract.VERDICT_HANG]  # nothing else said of it


DAY = 86_400 * SECOND


@pytest.mark.parametrize("offsets", [{0: DAY}, {rank: -300 * SECOND for rank in range(4)}, {1: DAY, 2: -DAY}],
                         ids=["rank-0-a-day-fast", "every-clock-300-s-slow", "culprit-a-day-fast-one-a-day-slow"])
def test_hang_is_judged_on_the_detectors_clock_whatever_the_ranks_clocks_say(offsets):
    job = ScriptedJob(Engine(CONFIG))
    job.clock_offset = offsets
    verdicts = job.run(30)
    verdicts += job.run(75, progress=False, open_stages=stuck_rank_one(job.now))
    found = hangs(verdicts)
    assert [(v.rank, v.reason, v.stage) for v in found] == [(1, contract.HANG_NEVER_ENTERED_COLLECTIVE, "forward-compute")]
    assert 60 <= found[0].stalled_s <= 62 and found[0].rank_ms == pytest.approx(found[0].stalled_s * 1000, abs=500)
    assert hangs(job.run(3), contract.VERDICT_RECOVERED)  # and progress ends it


def test_hang_a_rank_with_a_fast_clock_whose_heartbeats_stopped_is_lost():
    job = ScriptedJob(Engine(CONFIG))
    job.clock_offset = {2: DAY}
    verdicts = job.run(30)
    job.frozen = {2}
    verdicts += job.run(75, progress=False, open_stages=lambda rank, now: (("all-grads-sync", now),))
    assert [(v.rank, v.reason) for v in hangs(verdicts)] == [(2, contract.HANG_RANK_LOST)]


def test_hang_names_a_rank_whose_heartbeats_stopped_rank_lost():
    job = ScriptedJob(Engine(CONFIG))
    verdicts = job.run(30)
    stopped = job.now
    job.frozen = {2}
    verdicts += job.run(75, progress=False, open_stages=in_stage("all-grads-sync", stopped))
    found = hangs(verdicts)
    assert [(v.rank, v.reason) for v in found] == [(2, contract.HANG_RANK_LOST)]
    # its stage: the innermost one its last heartbeat had open
    assert found[0].stage == "forward-compute" and found[0].host == "node-1" and found[0].local_rank == 0


def test_hang_a_rank_frozen_before_its_first_heartbeat_is_lost_too():
    job = ScriptedJob(Engine(CONFIG))
    job.heartbeats_from = START + 30 * SECOND  # the first heartbeats come as rank 3 freezes
    job.run(30)
    job.frozen = {3}
    found = hangs(job.run(75, progress=False, open_stages=in_stage("all-grads-sync", job.now)))
    assert [(v.rank, v.reason, v.stage) for v in found] == [(3, contract.HANG_RANK_LOST, "*")]


def test_hang_where_every_rank_waits_in_one_collective_is_one_job_level_verdict():
    job = ScriptedJob(Engine(CONFIG))
    job.run(30)
    stopped = job.now
    found = hangs(job.run(75, progress=False, open_stages=in_stage("all-grads-sync", stopped)))
    assert [(v.rank, v.reason, v.stage, v.host) for v in found] == \
        [(None, contract.HANG_ALL_RANKS_WAITING, "all-grads-sync", None)]
    assert found[0].reference_ranks == (0, 1, 2, 3) and found[0].attribution == contract.ATTRIBUTION_WAITING


class ForwardEndsTogether(ScriptedJob):
    """Every rank's forward-compute ends at the same instant, as if a collective hid inside it: the
    judge finds a synchronization point there and judges the stage as a collective."""

    def _step(self, restart_of: dict) -> list:
        observations = super()._step(restart_of)
        forward = [index for index, o in enumerate(observations) if o.stage == "forward-compute"]
        together = max(observations[index].end_unix_nano for index in forward)
        for index in forward:
            o = observations[index]
            observations[index] = o._replace(host_ms=o.host_ms + (together - o.end_unix_nano) / 1e6,
                                              end_unix_nano=together)
        return observations


def test_hang_a_rank_blocked_in_a_stage_known_as_collective_only_from_synchronization_points_is_named():
    engine = Engine(CONFIG)
    job = ForwardEndsTogether(engine)
    job.run(30)
    assert engine._collective_stages("job", 0) == ({"all-grads-sync", "forward-compute"}, {"forward-compute"})
    stopped = job.now
    # rank 1 stays in forward-compute; its peers wait in the all-reduce the spans mark
    found = hangs(job.run(75, progress=False, open_stages=stuck_rank_one(stopped)))
    assert [(v.rank, v.reason, v.stage) for v in found] == [(1, contract.HANG_NEVER_ENTERED_COLLECTIVE, "forward-compute")]


class ForwardMarked(ScriptedJob):
    """The spans mark forward-compute as a collective (a tensor-parallel all-reduce inside it)."""

    def _step(self, restart_of: dict) -> list:
        return [o._replace(collective=True) if o.stage == "forward-compute" else o for o in super()._step(restart_of)]


def test_hang_a_stage_one_cohort_marks_as_a_collective_is_marked_for_the_job():
    engine = Engine(CONFIG)
    inferred, marked = ForwardEndsTogether(engine, cohort="a"), ForwardMarked(engine, cohort="b")
    for _ in range(30):
        inferred.run(1)
        marked.run(1)
    assert engine._collective_stages("job", 0) == ({"all-grads-sync", "forward-compute"}, set())
    # control: the cohort that only infers it, alone
    engine = Engine(CONFIG)
    ForwardEndsTogether(engine, cohort="a").run(30)
    assert engine._collective_stages("job", 0) == ({"all-grads-sync", "forward-compute"}, {"forward-compute"})


def test_hang_where_every_rank_waits_at_a_synchronization_point_is_one_job_level_verdict():
    job = ForwardEndsTogether(Engine(CONFIG))
    job.run(30)
    stopped = job.now
    found = hangs(job.run(75, progress=False, open_stages=in_stage("forward-compute", stopped)))
    assert [(v.rank, v.reason, v.stage) for v in found] == [(None, contract.HANG_ALL_RANKS_WAITING, "forward-compute")]


def test_hang_a_stage_known_only_from_synchronization_points_loses_a_tie_with_a_marked_collective():
    """Half the ranks in forward-compute (found synchronized), half in the all-reduce the spans mark:
    the mark is the stronger evidence, so the ranks in forward-compute are the ones named."""
    job = ForwardEndsTogether(Engine(CONFIG))
    job.run(30)
    stopped = job.now
    split = lambda rank, now: (("forward-compute", stopped),) if rank < 2 else (("all-grads-sync", stopped),)  # noqa: E731
    found = hangs(job.run(75, progress=False, open_stages=split))
    assert [(v.rank, v.reason, v.stage) for v in found] == \
        [(0, contract.HANG_NEVER_ENTERED_COLLECTIVE, "forward-compute"),
         (1, contract.HANG_NEVER_ENTERED_COLLECTIVE, "forward-compute")]


def test_hang_two_stages_known_only_from_synchronization_points_tied_both_count_as_waits():
    """Nothing tells two inferred collectives with as many ranks apart: neither side is named,
    whichever rank happens to be listed first (the rule reads no order)."""
    def record(stage: str) -> SimpleNamespace:
        return SimpleNamespace(open_stages=[stage])
    collectives, sync_points = {"forward-compute", "backward-compute"}, {"forward-compute", "backward-compute"}
    for stages in (["forward-compute", "backward-compute"] * 2, ["backward-compute", "forward-compute"] * 2):
        live = [(rank, record(stage)) for rank, stage in enumerate(stages)]
        waits = _waiting_test(live, collectives, sync_points)
        assert [waits(r) for _, r in live] == [True] * 4
    # control: one more rank in forward-compute, and backward-compute is no wait
    live = [(rank, record(stage)) for rank, stage in enumerate(["forward-compute"] * 3 + ["backward-compute"] * 2)]
    waits = _waiting_test(live, collectives, sync_points)
    assert [waits(r) for _, r in live] == [True] * 3 + [False] * 2


def test_hang_names_a_rank_of_the_world_size_never_heard_from_rank_lost():
    """Ranks 0-2 report a world size of 4 and wait in the all-reduce; rank 3 never sent anything
    (stuck before its first export, or its telemetry off): it is the one they wait for."""
    job = ScriptedJob(Engine(CONFIG), ranks=3, cohort=DEFAULT_COHORT, world_size=4)
    job.run(30)
    found = hangs(job.run(75, progress=False, open_stages=in_stage("all-grads-sync", job.now)))
    assert [(v.rank, v.reason, v.stage, v.host, v.local_rank) for v in found] == \
        [(3, contract.HANG_RANK_LOST, "*", None, None)]
    assert found[0].reference_ranks == (0, 1, 2) and found[0].cohort == DEFAULT_COHORT


@pytest.mark.parametrize("cohort, world_size", [("c", 4), (DEFAULT_COHORT, None), (DEFAULT_COHORT, 3)],
                         ids=["named cohort: ranks may be on another detector", "size not reported", "every rank heard"])
def test_hang_where_every_rank_heard_waits_and_none_is_known_missing_is_job_level(cohort, world_size):
    job = ScriptedJob(Engine(CONFIG), ranks=3, cohort=cohort, world_size=world_size)
    job.run(30)
    found = hangs(job.run(75, progress=False, open_stages=in_stage("all-grads-sync", job.now)))
    assert [(v.rank, v.reason) for v in found] == [(None, contract.HANG_ALL_RANKS_WAITING)]


def test_hang_a_shared_pause_shorter_than_the_timeout_is_no_hang():
    job = ScriptedJob(Engine(CONFIG))
    verdicts = job.run(30)
    verdicts += job.run(20, progress=False, open_stages=in_stage("checkpoint-save", job.now))
    verdicts += job.run(60)
    assert hangs(verdicts) == [] and hangs(verdicts, contract.VERDICT_RECOVERED) == []
    # control: the same pause, longer than the timeout, is a hang of every rank
    job = ScriptedJob(Engine(CONFIG))
    job.run(30)
    found = hangs(job.run(75, progress=False, open_stages=in_stage("checkpoint-save", job.now)))
    assert [(v.rank, v.reason, v.stage) for v in found] == [(None, contract.HANG_ALL_RANKS_STALLED, "checkpoint-save")]


def test_hang_needs_a_live_rank_inside_a_stage():
    # every rank between stages (an evaluation loop it does not time): heartbeats cannot tell
    job = ScriptedJob(Engine(CONFIG))
    job.run(30)
    assert hangs(job.run(120, progress=False, open_stages=lambda rank, now: ())) == []
    # no heartbeats at all (turned off on the ranks): nothing, however long
    job = ScriptedJob(Engine(CONFIG))
    job.heartbeat_s = 10 ** 6
    job.run(30)
    assert hangs(job.run(200, progress=False)) == []
    # every rank's heartbeats stopped (the job ended): nothing
    job = ScriptedJob(Engine(CONFIG))
    job.run(30)
    job.frozen = set(range(job.ranks))
    assert hangs(job.run(120, progress=False)) == []


def test_hang_a_culprit_seen_later_gets_its_own_verdict():
    job = ScriptedJob(Engine(CONFIG))
    job.run(30)
    stopped = job.now
    verdicts = job.run(70, progress=False, open_stages=stuck_rank_one(stopped))
    job.frozen = {3}  # then a waiting rank dies too
    verdicts += job.run(40, progress=False, open_stages=stuck_rank_one(stopped))
    assert [(v.rank, v.reason) for v in hangs(verdicts)] == [
        (1, contract.HANG_NEVER_ENTERED_COLLECTIVE), (3, contract.HANG_RANK_LOST)]


def test_hang_before_the_first_window_closes_still_knows_the_collective():
    job = ScriptedJob(Engine(CONFIG))
    job.run(1)  # ten steps: the first window is still open when the job stops
    found = hangs(job.run(75, progress=False, open_stages=stuck_rank_one(job.now)))
    assert [(v.rank, v.reason) for v in found] == [(1, contract.HANG_NEVER_ENTERED_COLLECTIVE)]


def test_hang_progress_resumed_ends_each_hang_verdict_and_its_gauge():
    engine = Engine(CONFIG)
    job = ScriptedJob(engine)
    job.run(30)
    stopped = job.now
    job.frozen = {2}
    verdicts = job.run(75, progress=False, open_stages=stuck_rank_one(stopped))
    assert {(v.rank, v.reason) for v in hangs(verdicts)} == {
        (1, contract.HANG_NEVER_ENTERED_COLLECTIVE), (2, contract.HANG_RANK_LOST)}
    assert {(s.rank, s.active) for s in engine.hang_state()} == {(1, True), (2, True)}
    job.frozen = set()
    verdicts = job.run(10)
    resumed = hangs(verdicts, contract.VERDICT_RECOVERED)
    assert {(v.rank, v.reason) for v in resumed} == {(1, contract.HANG_PROGRESS_RESUMED),
                                                     (2, contract.HANG_PROGRESS_RESUMED)}
    assert {(s.rank, s.active) for s in engine.hang_state()} == {(1, False), (2, False)}  # gauge at 0
    # a second hang later is declared again
    stopped = job.now
    assert [v.rank for v in hangs(job.run(75, progress=False, open_stages=stuck_rank_one(stopped)))] == [1]


def test_hang_state_is_bounded_and_evictions_counted():
    engine = Engine(DetectorConfig(max_tracked_ranks=16))
    for job_index in range(5):
        ScriptedJob(engine, ranks=8, job_id=f"job-{job_index}").run(6)
    stats = engine.stats()
    assert stats["tracked_ranks"] <= 16
    assert stats["evictions_liveness_ranks"] >= 40 - 16


# ---------------------------------------------------------------- incarnations

def test_incarnation_a_restart_from_a_checkpoint_is_judged_again_not_late_nor_duplicate():
    engine = Engine(CONFIG)
    job = ScriptedJob(engine)
    verdicts = job.run(30)  # steps 0-299
    job.restart_from(200, restart=1)  # torchrun restarted every rank from the step-200 checkpoint
    job.slow = {2: 1.5}
    verdicts += job.run(30) + engine.drain(job.now + 60 * SECOND)
    stats = engine.stats()
    assert stats["late"] == 0 and stats["duplicates"] == 0 and stats["incarnations"] == 1
    assert [v for v in verdicts if v.verdict == contract.VERDICT_SILENT] == []
    onsets = [v for v in verdicts if v.verdict == contract.VERDICT_STRAGGLER]
    assert {v.rank for v in onsets} == {2} and all(v.window >= 20 for v in onsets)
    # control: without the restart count the same resumed stream is read as late and duplicate
    engine = Engine(CONFIG)
    job = ScriptedJob(engine)
    job.run(30)
    job.restart_from(200, restart=0)
    job.run(30)
    assert engine.stats()["late"] + engine.stats()["duplicates"] > 1000


def test_incarnation_ranks_that_do_not_come_back_are_not_silent():
    engine = Engine(CONFIG)
    job = ScriptedJob(engine, ranks=6)
    verdicts = job.run(30)
    job.restart_from(300, restart=1)
    job.frozen = {4, 5}  # the job came back smaller
    verdicts += job.run(40)
    assert [v for v in verdicts if v.verdict == contract.VERDICT_SILENT] == []
    assert engine.stats()["late"] == 0


def test_incarnation_a_rank_with_a_lower_restart_count_joins_the_current_one():
    # torchrun restarts the workers of a node that did not fail without counting it
    engine = Engine(CONFIG)
    job = ScriptedJob(engine)
    job.run(30)
    job.restart_from(200, restart=1)
    job.slow = {3: 1.5}
    verdicts = job.run(30, restart_of={2: 0, 3: 0})
    stats = engine.stats()
    assert stats["late"] == 0 and stats["duplicates"] == 0 and stats["incarnations"] == 1
    assert {v.rank for v in verdicts if v.verdict == contract.VERDICT_STRAGGLER} == {3}


def test_incarnation_an_active_alert_ends_with_restarted():
    engine = Engine(CONFIG)
    job = ScriptedJob(engine)
    job.slow = {1: 1.5}
    verdicts = job.run(30)
    assert any(v.verdict == contract.VERDICT_STRAGGLER and v.rank == 1 for v in verdicts)
    job.restart_from(200, restart=1)
    job.slow = {}
    verdicts = job.run(5)
    ended = [v for v in verdicts if v.verdict == contract.VERDICT_RECOVERED and v.rank == 1]
    assert ended and {v.reason for v in ended} == {"restarted"}
    assert not any(state.alert_active for state in engine.rank_state())


def test_incarnation_ends_a_declared_hang():
    engine = Engine(CONFIG)
    job = ScriptedJob(engine)
    job.run(30)
    assert hangs(job.run(75, progress=False, open_stages=stuck_rank_one(job.now)))
    job.restart_from(200, restart=1)
    verdicts = job.run(5)
    assert [(v.rank, v.reason) for v in hangs(verdicts, contract.VERDICT_RECOVERED)] == [
        (1, contract.HANG_PROGRESS_RESUMED)]


# ---------------------------------------------------------------- placement

def test_placement_every_per_rank_verdict_and_rank_state_says_where_the_rank_runs():
    engine = Engine(CONFIG)
    job = ScriptedJob(engine)
    job.slow = {3: 1.5}
    onsets = [v for v in job.run(30) if v.verdict == contract.VERDICT_STRAGGLER]
    assert onsets and all((v.rank, v.host, v.local_rank) == (3, "node-1", 1) for v in onsets)
    states = [s for s in engine.rank_state() if s.rank == 3]
    assert states and all((s.host, s.local_rank) == ("node-1", 1) for s in states)
