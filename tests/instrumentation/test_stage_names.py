"""Megatron timer names map to `training.stage.group` and the collective flag; anything else
is `other` and not a collective (never guessed from a substring)."""
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
