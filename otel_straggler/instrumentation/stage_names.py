"""What a stage (timer) name means: its `training.stage.group` and whether it is a blocking
collective. Megatron-LM's timer names are mapped explicitly; any other name is `other` and
not a collective unless the caller says so (never guessed from a substring)."""
from __future__ import annotations

import functools
from typing import NamedTuple


class StageKind(NamedTuple):
    group: str
    collective: bool


_EXACT: dict[str, StageKind] = {
    # whole-step and compute
    "forward-backward": StageKind("other", False),
    "forward-compute": StageKind("forward", False),
    "backward-compute": StageKind("backward", False),
    "batch-generator": StageKind("data", False),
    "interval-time": StageKind("other", False),
    "train-step": StageKind("other", False),
    "evaluate": StageKind("eval", False),
    "eval-time": StageKind("eval", False),
    "save-checkpoint": StageKind("setup", False),
    "load-checkpoint": StageKind("setup", False),
    "model-and-optimizer-setup": StageKind("setup", False),
    "train/valid/test-data-iterators-setup": StageKind("setup", False),
    # data-parallel gradient and parameter collectives (ranks wait for peers inside them)
    "all-grads-sync": StageKind("communication", True),
    "params-all-gather": StageKind("communication", True),
    "embedding-grads-all-reduce": StageKind("communication", True),
    "position-embedding-grads-all-reduce": StageKind("communication", True),
    "layernorm-grads-all-reduce": StageKind("communication", True),
    "conditional-embedder-grads-all-reduce": StageKind("communication", True),
    "backward-embedding-all-reduce": StageKind("communication", True),
    "backward-params-all-reduce": StageKind("communication", True),
    "backward-layernorm-all-reduce": StageKind("communication", True),
    # pipeline point-to-point: a receive blocks until the peer stage sends
    "forward-recv": StageKind("communication", True),
    "backward-recv": StageKind("communication", True),
    "forward-send": StageKind("communication", True),
    "backward-send": StageKind("communication", True),
    "forward-send-backward-recv": StageKind("communication", True),
    "backward-send-forward-recv": StageKind("communication", True),
    "forward-backward-send-forward-backward-recv": StageKind("communication", True),
    "cross-rank-barrier": StageKind("communication", True),
    # optimizer
    "optimizer": StageKind("optimizer", False),
    "optimizer-copy-to-main-grad": StageKind("optimizer", False),
    "optimizer-unscale-and-check-inf": StageKind("optimizer", True),  # all-reduces found_inf
    "optimizer-clip-main-grad": StageKind("optimizer", True),  # all-reduces the grad norm
    "optimizer-count-zeros": StageKind("optimizer", True),
    "optimizer-inner-step": StageKind("optimizer", False),
    "optimizer-copy-main-to-model-params": StageKind("optimizer", False),
}

_OTHER = StageKind("other", False)


@functools.lru_cache(maxsize=4096)
def classify(name: str) -> StageKind:
    """Group and collective flag of a stage name; bounded cache, off the training thread."""
    return _EXACT.get(name, _OTHER)
