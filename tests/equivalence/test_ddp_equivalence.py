"""instrument_ddp changes nothing that DDP computes: on two gloo ranks with fixed seeds, the
parameters after training are bit-identical (torch.equal) with and without it, with DDP's own
all-reduce, with a hook of the user's passed through it (fp16_compress_hook) against that hook
alone, under gradient accumulation with no_sync(), and when every one of its hooks fails inside.
The ranks are tests/ddp_ranks.py, with the instrumentation configured in them."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from ddp_ranks import run_ranks  # noqa: E402

PAIRS = [("plain", "instrumented"), ("fp16", "fp16-instrumented"), ("accumulate", "accumulate-instrumented"),
         ("plain", "failing-instrumented")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    arms = sorted({arm for pair in PAIRS for arm in pair})
    return run_ranks(arms, tmp_path_factory.mktemp("ddp-equivalence"), world_size=2)


def identical(first: list, second: list) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("without, with_it", PAIRS, ids=[pair[1] for pair in PAIRS])
def test_parameters_are_bit_identical_with_and_without_instrument_ddp(ranks, without, with_it):
    for rank, result in enumerate(ranks):
        assert identical(result[without]["parameters"], result[with_it]["parameters"]), f"rank {rank}"
    # the ranks trained different shards and still agree: the all-reduce really ran
    assert identical(ranks[0][with_it]["parameters"], ranks[1][with_it]["parameters"])


def test_the_instrumented_arms_recorded_and_the_failing_one_counted(ranks):
    for result in ranks:
        for arm in ("instrumented", "fp16-instrumented", "accumulate-instrumented"):
            names = [span["name"] for span in result[arm]["spans"]]
            backwards_per_sync = 2 if arm.startswith("accumulate") else 1  # every micro-step's backward
            assert names.count("ddp-grads-ready") == backwards_per_sync * names.count("ddp-grads-sync") > 0, arm
            assert result[arm]["hook_errors"] == 0
        failing = result["failing-instrumented"]
        assert failing["hook_errors"] > 0
        assert not [span for span in failing["spans"] if span["name"].startswith("ddp-")]


def test_the_users_hook_really_ran(ranks):
    # fp16 compression rounds the gradients: with it, training ends elsewhere than without
    assert not identical(ranks[0]["plain"]["parameters"], ranks[0]["fp16"]["parameters"])
