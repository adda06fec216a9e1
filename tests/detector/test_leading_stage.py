"""Which named stage carries a rank's slow whole step when none is slow beyond its own noise
(leading_stage.carrier_stage), on one window's entries built by hand: the shape a 4-rank gloo job
with gradient accumulation gave, rank 1's backward 80 ms over its peers' and its optimizer 10 ms
over on a busy host, the whole step 68 ms over."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from otel_straggler.detector import leading_stage
from otel_straggler.detector.window_entries import Rows

# stage codes as the engine packs them: 0 the whole step, named stages even, collectives odd
WHOLE, DATA, FORWARD, GRADS_READY, GRADS_SYNC, OPTIMIZER = 0, 2, 4, 6, 9, 10
CODES = (WHOLE, DATA, FORWARD, GRADS_READY, GRADS_SYNC, OPTIMIZER)
STEPS = 10


def back_to_back_rows(slot: int) -> Rows:
    """The rank's named stages one after the other in each step: none contains another."""
    named = [code for code in CODES if code != WHOLE]
    code, step, host, end = [], [], [], []
    for s in range(STEPS):
        start_ns = s * 1_000_000_000
        for index, stage in enumerate(named):
            code.append(stage)
            step.append(s)
            host.append(10.0)
            end.append(start_ns + (index + 1) * 20_000_000)
    size = len(code)
    return Rows(code=np.array(code), slot=np.full(size, slot), step=np.array(step), host=np.array(host),
                end_unix_nano=np.array(end, dtype=np.int64))


def entries_of(slot: int = 1) -> SimpleNamespace:
    rows = back_to_back_rows(slot)
    return SimpleNamespace(code=np.array(CODES), local_code=np.array(CODES), slot=np.full(len(CODES), slot),
                           rows=rows, rows_of_cohort=lambda _: rows)


def carrier(gaps: dict[int, float], over: set[int]):
    entries = entries_of()
    gap_ms = np.array([gaps.get(code, 0.0) for code in CODES])
    clearly_over = np.array([code in over for code in CODES])
    candidates = entries.code == WHOLE  # the whole step is convicted, no named stage is
    found = leading_stage.carrier_stage(entries, 1, candidates, clearly_over, gap_ms)
    return None if found is None else CODES[found]


def test_the_stage_holding_most_of_the_excess_carries_it_beside_a_short_stage_also_over():
    # the backward holds the step's excess; the optimizer is over its threshold and floor too, by
    # far less: the backward carries the step, it does not fall back to `*`
    assert carrier({WHOLE: 68.0, GRADS_READY: 82.6, OPTIMIZER: 10.1}, {GRADS_READY, OPTIMIZER}) == GRADS_READY


def test_one_stage_over_carries_it():
    assert carrier({WHOLE: 68.0, GRADS_READY: 60.0}, {GRADS_READY}) == GRADS_READY


def test_two_stages_sharing_the_excess_leave_it_to_the_whole_step():
    assert carrier({WHOLE: 70.0, GRADS_READY: 40.0, OPTIMIZER: 35.0}, {GRADS_READY, OPTIMIZER}) is None


def test_a_stage_under_half_of_the_excess_carries_nothing():
    assert carrier({WHOLE: 70.0, GRADS_READY: 30.0}, {GRADS_READY}) is None


def test_a_stage_not_clearly_over_carries_nothing():
    assert carrier({WHOLE: 68.0, GRADS_READY: 82.6}, set()) is None
