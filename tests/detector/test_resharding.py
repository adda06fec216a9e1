"""Detector shards behind the gateway's load_balancing ring: when a shard is added or removed the
ring moves whole cohorts between shards mid-job. The shard that lost a cohort says nothing false
about ranks alive elsewhere (no hang, silent or rank_lost), ends its alerts (`recovered` /
`cohort_departed`) and keeps bounded state; the shard that gained it judges it after a warmup, and
a straggler flagged before the move is flagged again after it. The same test of "stopped" tells a
finished job (its alerts end the same way) from a hung one (its ranks' heartbeats go on: no end)."""
from __future__ import annotations

import numpy as np

from otel_straggler import contract
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.observation import Heartbeat, Observation, Placement

from otel_straggler.testing.scripted_job import CONFIG, SECOND, STAGES, START

COHORTS = {"c0": range(0, 4), "c1": range(4, 8)}  # c1's rank 5 is 40% slow in its compute stages
SLOW = {5: 1.4}


class ShardedJob:
    """Two cohorts of a 100 ms-step job, each second's spans and its heartbeats (every 5 s) sent to
    the shard `route(cohort, second)` names; None sends nothing (the job ended or hangs)."""

    def __init__(self, shards: dict, route) -> None:
        self.shards, self.route = shards, route
        self.rng = np.random.default_rng(0)
        self.seq = dict.fromkeys(range(8), 0)
        self.placed = {name: set() for name in shards}
        self.now, self.step, self.second = START, 0, 0
        self.verdicts = {name: [] for name in shards}  # (second, verdict)
        self.progress = True

    def run(self, seconds: int) -> None:
        for _ in range(seconds):
            sent = {name: ([], []) for name in self.shards}
            for _ in range(10 if self.progress else 0):
                start = self.now + (self.step % 10) * SECOND // 10
                for cohort, ranks in COHORTS.items():
                    target = self.route(cohort, self.second)
                    for rank in ranks:
                        end = start + int(self.rng.uniform(0, 2e6))
                        for name, base_ms, collective in STAGES:
                            ms = base_ms * (1 if collective else SLOW.get(rank, 1.0)) * self.rng.uniform(0.98, 1.02)
                            end += int(ms * 1e6)
                            if target is not None:
                                sent[target][0].append(Observation("job", 0, cohort, rank, name, self.step,
                                                                   self.seq[rank], ms, None, collective, None, None,
                                                                   end, 0))
                            self.seq[rank] += 1
                self.step += 1
            if self.second % 5 == 0:
                for cohort, ranks in COHORTS.items():
                    target = self.route(cohort, self.second)
                    if target is not None:
                        sent[target][1].extend([Heartbeat("job", 0, cohort, rank, 0, self.step, self.now,
                                                      ("forward-compute",), (self.now,), None) for rank in ranks])
            self.now += SECOND
            for name, engine in self.shards.items():
                observations, heartbeats = sent[name]
                new = {o.rank for o in observations} | {h.rank for h in heartbeats}
                if new - self.placed[name]:  # as each request's resource places its ranks
                    engine.ingest_placements([Placement("job", 0, 0, rank, f"node-{rank // 2}", rank % 2,
                                                        "c0" if rank < 4 else "c1", 8) for rank in sorted(new)])
                    self.placed[name] |= new
                engine.ingest_many(observations)
                engine.ingest_heartbeats(heartbeats)
                self.verdicts[name] += [(self.second, v) for v in engine.advance(self.now + SECOND // 2)]
            self.second += 1

    def said(self, shard: str, verdict: str, reason=None) -> list:
        return [(second, v) for second, v in self.verdicts[shard]
                if v.verdict == verdict and (reason is None or v.reason == reason)]


def test_a_cohort_moved_to_another_shard_and_back_is_judged_where_it_is_and_nothing_false_is_said():
    shards = {"A": Engine(CONFIG), "B": Engine(CONFIG)}
    job = ShardedJob(shards, lambda cohort, second: "B" if cohort == "c1" and 60 <= second < 180 else "A")
    job.run(300)
    for shard in shards:  # nobody is hung, silent or lost, and the healthy cohort is never named
        assert not job.said(shard, contract.VERDICT_HANG) and not job.said(shard, contract.VERDICT_SILENT)
        assert not [v for _, v in job.verdicts[shard] if v.cohort == "c0"]
    flagged = {shard: [s for s, v in job.said(shard, contract.VERDICT_STRAGGLER) if v.rank == 5] for shard in shards}
    ended = {shard: [s for s, v in job.said(shard, contract.VERDICT_RECOVERED, contract.REASON_COHORT_DEPARTED)]
             for shard in shards}
    assert flagged["A"][0] < 10  # before the move
    assert 60 < min(flagged["B"]) <= 60 + 10  # the shard that gained it: after its warmup
    assert ended["A"] and 60 < min(ended["A"]) <= 60 + 30  # the one that lost it ends its alert
    assert 180 < min(s for s in flagged["A"] if s > 60) <= 180 + 10  # flagged again after it came back
    assert ended["B"] and 180 < min(ended["B"]) <= 180 + 30
    assert all(v.rank == 5 and v.host == "node-2" for _, v in job.said("A", contract.VERDICT_RECOVERED))
    active = {shard: {(s.cohort, s.rank) for s in engine.rank_state() if s.alert_active}
              for shard, engine in shards.items()}
    assert active == {"A": {("c1", 5)}, "B": set()}  # one shard holds the alert at the end
    assert shards["B"].stats()["alerts_departed"] >= 1


def test_a_finished_job_ends_its_alerts_and_a_hung_one_keeps_them():
    finished = ShardedJob({"A": Engine(CONFIG)}, lambda cohort, second: "A" if second < 60 else None)
    finished.run(120)
    assert [v.rank for _, v in finished.said("A", contract.VERDICT_RECOVERED, contract.REASON_COHORT_DEPARTED)]
    assert not finished.said("A", contract.VERDICT_HANG)

    hung = ShardedJob({"A": Engine(CONFIG)}, lambda cohort, second: "A")
    hung.run(60)
    hung.progress = False  # no interval ends; heartbeats go on
    hung.run(100)
    assert not hung.said("A", contract.VERDICT_RECOVERED, contract.REASON_COHORT_DEPARTED)
    assert hung.said("A", contract.VERDICT_HANG)
