"""Stacked verdict states (cohort_state.py): the same cohorts stacked again reuse the stacked state
with nothing copied; a member that grows, or a batch of other cohorts, dissolves it, and every
member keeps its values in arrays of its own."""
from __future__ import annotations

import numpy as np

from otel_straggler.detector.cohort_state import CohortVerdictState, stack, unstack

RING = 4


def state(marker: int) -> CohortVerdictState:
    made = CohortVerdictState()
    made.ensure(stage_count=3, slot_count=5)
    made.ensure_ring(RING)
    made.slow_streak[:] = marker
    made.windows_seen[:] = marker
    made.intermittent.slow[:] = marker
    made.intermittent.position = marker
    return made


def judged(stacked: CohortVerdictState, add: int) -> None:
    """What judging does to a stacked state: writes in place, moves the rings on."""
    stacked.slow_streak += add
    stacked.windows_seen += add
    stacked.intermittent.slow += add
    stacked.intermittent.position = stacked.intermittent.position + 1


def test_the_same_states_stacked_again_reuse_the_stacked_state():
    states = [state(1), state(2), state(3)]
    stacked = stack(states)
    judged(stacked, 10)
    unstack(stacked, states)
    assert [int(s.slow_streak[0, 0]) for s in states] == [11, 12, 13]
    assert [s.intermittent.position for s in states] == [2, 3, 4]
    assert all(s.stacked_in is stacked and s.slow_streak.base is stacked.slow_streak for s in states)

    states[1].reset_slot(0)  # between windows, through the view: the stacked state sees it
    again = stack(states)
    assert again is stacked and int(again.slow_streak[states[0].alert.shape[0], 0]) == 0
    judged(again, 100)
    unstack(again, states)
    assert [int(s.windows_seen[1]) for s in states] == [111, 112, 113]
    assert [int(s.intermittent.slow[0, 0, 1]) for s in states] == [111, 112, 113]
    assert [s.intermittent.position for s in states] == [3, 4, 5]


def test_growth_dissolves_the_stack_and_keeps_every_value():
    states = [state(1), state(2)]
    stacked = stack(states)
    judged(stacked, 10)
    unstack(stacked, states)
    states[0].ensure(stage_count=3, slot_count=40)  # grows: both leave the stack
    assert all(s.stacked_in is None for s in states) and stacked.members is None
    assert states[1].slow_streak.base is None and int(states[1].slow_streak[0, 0]) == 12
    assert int(states[0].slow_streak[0, 0]) == 11 and int(states[0].slow_streak[0, 39]) == 0
    restacked = stack([states[1]] + [state(7)])
    assert restacked is not stacked and int(restacked.windows_seen[0]) == 12


def test_other_cohorts_batched_make_a_new_stack_and_the_old_one_lets_go():
    first, second, third = state(1), state(2), state(3)
    stacked = stack([first, second])
    judged(stacked, 10)
    unstack(stacked, [first, second])
    other = stack([second, third])  # a batch of other cohorts: the first stack is dissolved
    assert other is not stacked and stacked.members is None
    assert first.stacked_in is None and first.slow_streak.base is None and int(first.slow_streak[0, 0]) == 11
    judged(other, 100)
    unstack(other, [second, third])
    assert int(second.slow_streak[0, 0]) == 112 and int(third.slow_streak[0, 0]) == 103
    assert int(first.slow_streak[0, 0]) == 11
    assert np.shares_memory(second.alert, other.alert) and not np.shares_memory(first.alert, other.alert)
