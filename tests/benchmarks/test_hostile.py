"""The hostile-world probe (benchmarks/hostile.py), sized down: 3 s an attack instead of 8, the
engine cases in full. Asserted: every legitimate export served through every attack, with a p99
under P99_BOUND_MS (the docs' table, from the full run, gives the figures); the attacks got what the
receivers give them; the engine cases as their targets say."""
from __future__ import annotations

import pytest

import hostile

pytestmark = pytest.mark.slow
# the target is 100 ms; on a shared 2-core machine the test leaves room for one stall
P99_BOUND_MS = 250.0
# enough exports in a phase for its p99 to be read (under 100 it is the slowest one). The sender is
# sequential and runs in this process beside the detector and the attackers, so an attack that
# takes the CPU thins its pace too: the gzip phase's 3 s gave 49 exports in one CI run (served
# 100%, p99 115 ms), where the full run gave 445 in 20 s; at the p99 bound it would give 3 / 0.27 = 11
MIN_EXPORTS = 20


def test_legitimate_exports_are_served_through_every_attack():
    rows = {row["phase"]: row for row in hostile.intake_rows(seconds=3.0)}
    for phase, row in rows.items():
        print(phase, row)
    assert set(rows) == {"baseline", *hostile.ATTACKS}
    for phase, row in rows.items():
        assert row["legit"] >= MIN_EXPORTS, (phase, row)
        assert row["served"] == 1.0, (phase, row)
        assert row["p99_ms"] < P99_BOUND_MS, (phase, row)
    assert set(rows["gzip-members"]["hostile"]) == {"400"}
    assert rows["gzip-members"]["cpu_per_hostile_s"] < 0.1
    assert {answer.split()[1] for answer in rows["bad-framing"]["hostile"]} <= {"400", "405"}
    assert set(rows["grpc-slow-streams"]["hostile"]) <= {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}


def test_the_engine_keeps_its_verdicts_right_in_a_hostile_world():
    delays = hostile.hang_delays()
    assert all(delay is not None and delay <= 60 + 15 for delay in delays.values()), delays
    flood = hostile.id_flood()
    assert flood["window with"] == flood["window without"] is not None, flood
    assert hostile.outage_backlog() == 0
    restart = hostile.restart()
    assert restart["repeated onsets"] == 0 and restart["left open"] == 0 and restart["processes"] == 2
