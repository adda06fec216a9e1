"""benchmarks/automatic_cost.py: its rounds rotate the arms, its cost is the difference of medians,
and an automatic block run after an explicit one is timed (a fresh configure() per block: a
process that called step() keeps the automatic stages off)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn

import automatic_cost
from automatic_cost import AUTOMATIC, BARE, EXPLICIT, Block


def test_each_arm_takes_each_place_in_the_rounds():
    orders = [automatic_cost.order(r) for r in range(3)]
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(automatic_cost.ARMS)


def test_the_cost_is_the_difference_of_the_medians_over_all_steps():
    rounds = [{BARE: Block(BARE, [100, 100, 900], [0]), EXPLICIT: Block(EXPLICIT, [103, 101, 102], [0]),
               AUTOMATIC: Block(AUTOMATIC, [110, 130, 120], [0])},
              {BARE: Block(BARE, [100, 200, 100], [0]), EXPLICIT: Block(EXPLICIT, [101, 103, 102], [0]),
               AUTOMATIC: Block(AUTOMATIC, [120, 110, 130], [0])}]
    cost = automatic_cost.cost(rounds, AUTOMATIC, lambda block: block.cpu_ns)
    assert cost.median_us == pytest.approx(0.12)
    assert cost.cost_us == pytest.approx(0.02)
    assert cost.cost_pct == pytest.approx(20.0)


def test_an_automatic_block_after_an_explicit_one_is_timed():
    spec = automatic_cost.Model("small", lambda: nn.Linear(8, 8), features=8, outputs=8, batch=2, steps=5, warmup=2)
    model = spec.make()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for arm in (EXPLICIT, AUTOMATIC, BARE, AUTOMATIC):
        block = automatic_cost.run_block(arm, spec, model, optimizer)  # raises if the automatic stages were off
        assert len(block.cpu_ns) == len(block.wall_ns) == spec.steps
