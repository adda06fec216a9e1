"""Megatron timer names map to `training.stage.group` and the collective flag; anything else
is `other` and not a collective (never guessed from a substring)."""
import importlib.util
import re
from pathlib import Path

import pytest

from otel_straggler import contract
from otel_straggler.instrumentation.stage_names import classify


@pytest.mark.parametrize("name, group, collective", [
    ("forward-backward", "other", False),
    ("forward-compute", "forward", False),
    ("backward-compute", "backward", False),
    ("batch-generator", "data", False),
    ("interval-time", "other", False),
    ("evaluate", "eval", False),
    ("save-checkpoint", "setup", False),
    ("all-grads-sync", "communication", True),
    ("params-all-gather", "communication", True),
    ("embedding-grads-all-reduce", "communication", True),
    ("layernorm-grads-all-reduce", "communication", True),
    ("forward-recv", "communication", True),
    ("forward-send", "communication", True),
    ("backward-recv", "communication", True),
    ("backward-send", "communication", True),
    ("forward-send-backward-recv", "communication", True),
    ("backward-send-forward-recv", "communication", True),
    ("optimizer", "optimizer", False),
    ("optimizer-copy-to-main-grad", "optimizer", False),
    ("optimizer-unscale-and-check-inf", "optimizer", True),
    ("optimizer-clip-main-grad", "optimizer", True),
    ("optimizer-inner-step", "optimizer", False),
    ("optimizer-copy-main-to-model-params", "optimizer", False),
    ("non-tensor-parallel-grads-all-reduce", "communication", True),
    ("forward-send-forward-recv", "communication", True),
    ("backward-send-backward-recv", "communication", True),
    ("save-checkpoint-non-persistent", "setup", False),
    ("gpu-sniff-test", "setup", False),
    ("startup-initialize-megatron", "setup", False),
    ("rl/sync-rollouts", "communication", True),
    ("ddp-grads-ready", "backward", False),
    ("ddp-grads-sync", "communication", True),
])
def test_megatron_names_have_their_group_and_collective_flag(name, group, collective):
    kind = classify(name)
    assert (kind.group, kind.collective) == (group, collective)


@pytest.mark.parametrize("name", ["my-stage", "forward", "all_reduce_custom", "send-metrics", "", "Forward-Compute",
                                  # like a Megatron name, but not one: not guessed from its prefix or suffix
                                  "router-grads-all-reduce", "optimizer-some-new-phase", "forward-compute-extra"])
def test_unknown_names_are_other_and_not_collective(name):
    kind = classify(name)
    assert (kind.group, kind.collective) == ("other", False)


def test_every_group_is_a_contract_group():
    from otel_straggler.instrumentation import stage_names

    assert {kind.group for kind in stage_names._EXACT.values()} <= set(contract.STAGE_GROUPS)


# a timer asked for by a literal name: `timers('x', ...)`, `config.timers("x")`, and Megatron-LM's
# `nvtx_range("rl/x", time=True)`, which times through the global timers
LITERAL_TIMER_NAME = re.compile(r"""(?:\btimers\(\s*|\bnvtx_range\(\s*)(['"])([^'"]+)\1""")


def megatron_sources() -> list[Path]:
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        if importlib.util.find_spec("torch") is None:
            pytest.skip("megatron-core is in the test extras with torch; the torch-free check has neither")
        pytest.fail("megatron-core is not installed, though the test extras name it")
    roots = [Path(location) for location in spec.submodule_search_locations]
    return sorted(path for root in roots for sub in ("core", "training", "rl") for path in (root / sub).rglob("*.py"))


def test_every_literal_timer_name_in_the_installed_megatron_is_mapped():
    from otel_straggler.instrumentation import stage_names

    sources = megatron_sources()
    found = {match.group(2): path.name for path in sources for match in LITERAL_TIMER_NAME.finditer(path.read_text())}
    assert len(found) >= 20, f"the pattern no longer finds Megatron's timer names ({len(found)} in {len(sources)} files)"
    unmapped = {name: where for name, where in found.items() if name not in stage_names._EXACT}
    assert not unmapped, f"Megatron timer names missing from stage_names._EXACT: {unmapped}"
