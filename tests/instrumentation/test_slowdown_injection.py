"""The test-only slow-rank injection: inert unless its env knobs target this rank and a stage;
then that stage is stretched by about the given fraction from the given step on."""
from __future__ import annotations

import statistics
import time

import pytest

import otel_straggler

STAGE_S = 0.02
INJECTION = {"OTEL_STRAGGLER_INJECT_RANK": "0", "OTEL_STRAGGLER_INJECT_STAGE": "forward-compute",
             "OTEL_STRAGGLER_INJECT_FROM_STEP": "3", "OTEL_STRAGGLER_INJECT_SLOWDOWN": "1.0"}


def test_inert_by_default(in_memory):
    assert in_memory.configure(rank=0).recorder.injection is None


@pytest.mark.parametrize("untargeted", [
    {"OTEL_STRAGGLER_INJECT_RANK": "1"},  # another rank
    {"OTEL_STRAGGLER_INJECT_STAGE": ""},  # no stage chosen
    {"OTEL_STRAGGLER_INJECT_SLOWDOWN": "0"},
])
def test_inert_unless_it_targets_this_rank_and_a_stage(in_memory, monkeypatch, untargeted):
    for name, value in {**INJECTION, **untargeted}.items():
        monkeypatch.setenv(name, value)
    assert in_memory.configure(rank=0).recorder.injection is None


def test_the_targeted_stage_is_stretched_from_the_chosen_step(in_memory, monkeypatch):
    for name, value in INJECTION.items():
        monkeypatch.setenv(name, value)
    in_memory.configure(rank=0)
    for number in range(6):
        otel_straggler.step(number)
        for name in ("forward-compute", "backward-compute"):
            with otel_straggler.stage(name):
                time.sleep(STAGE_S)

    durations: dict = {}
    for span in in_memory.stage_spans():
        phase = "before" if span.attributes["training.step"] < 3 else "after"
        durations.setdefault((span.name, phase), []).append((span.end_time - span.start_time) / 1e9)
    median = {key: statistics.median(values) for key, values in durations.items()}

    assert median["forward-compute", "before"] < 1.5 * STAGE_S + 0.01
    slowdown = median["forward-compute", "after"] / median["forward-compute", "before"]
    assert 1.6 < slowdown < 2.6  # +100% asked for; generous margins for a loaded machine
    untouched = median["backward-compute", "after"] / median["backward-compute", "before"]
    assert 0.6 < untouched < 1.5
