"""What a stage (timer) name means: its `training.stage.group` and whether it is a blocking
collective. Megatron-LM's timer names and the stages instrument_ddp records are mapped
explicitly; any other name is `other` and not a collective unless the caller says so (never
guessed from a substring)."""
from __future__ import annotations

import functools
from typing import NamedTuple


class StageKind(NamedTuple):
    group: str
    collective: bool
    # recorded from hooks on the host clock alone, never with CUDA events: host-only by design
    host_clock_only: bool = False


# Every timer name megatron-core 0.16-0.19 and Megatron-LM's training loop use (the one list:
# tests/instrumentation/test_stage_names.py fails on a literal name in the installed megatron-core
# that is missing here).
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
    # start-up and checkpoints (the startup-* names are set with set_elapsed, never timed as spans)
    "save-checkpoint": StageKind("setup", False),
    "save-checkpoint-non-persistent": StageKind("setup", False),
    "load-checkpoint": StageKind("setup", False),
    "model-and-optimizer-setup": StageKind("setup", False),
    "train/valid/test-data-iterators-setup": StageKind("setup", False),
    "gpu-sniff-test": StageKind("setup", False),
    "startup-program-entry-spread": StageKind("setup", False),
    "startup-library-setup": StageKind("setup", False),
    "startup-program-setup": StageKind("setup", False),
    "startup-in-process-setup": StageKind("setup", False),
    "startup-in-job-setup": StageKind("setup", False),
    "startup-initialize-megatron": StageKind("setup", False),
    "startup-set-jit-fusion-options": StageKind("setup", False),
    "startup-megatron-init-local": StageKind("setup", False),
    "startup-megatron-init-global": StageKind("setup", False),
    "all-reduce-start-timestamps-tensor": StageKind("setup", True),
    # data-parallel gradient and parameter collectives (ranks wait for peers inside them)
    "all-grads-sync": StageKind("communication", True),
    "params-all-gather": StageKind("communication", True),
    "embedding-grads-all-reduce": StageKind("communication", True),
    "position-embedding-grads-all-reduce": StageKind("communication", True),
    "layernorm-grads-all-reduce": StageKind("communication", True),
    "non-tensor-parallel-grads-all-reduce": StageKind("communication", True),
    "conditional-embedder-grads-all-reduce": StageKind("communication", True),
    "backward-embedding-all-reduce": StageKind("communication", True),
    "backward-params-all-reduce": StageKind("communication", True),
    "backward-layernorm-all-reduce": StageKind("communication", True),
    # PyTorch DDP's backward as instrument_ddp splits it: the rank's own gradient compute, then the
    # wait for the slowest rank's gradients and the all-reduce
    "ddp-grads-ready": StageKind("backward", False, host_clock_only=True),
    "ddp-grads-sync": StageKind("communication", True, host_clock_only=True),
    # torch.distributed's collectives as the automatic instrumentation names them (automatic.py)
    **{name: StageKind("communication", True) for name in (
        "all-reduce", "broadcast", "barrier", "reduce", "all-gather", "reduce-scatter", "all-to-all", "gather",
        "scatter")},
    # pipeline point-to-point: a receive blocks until the peer stage sends
    "forward-recv": StageKind("communication", True),
    "backward-recv": StageKind("communication", True),
    "forward-send": StageKind("communication", True),
    "backward-send": StageKind("communication", True),
    "forward-send-forward-recv": StageKind("communication", True),
    "forward-send-backward-recv": StageKind("communication", True),
    "backward-send-forward-recv": StageKind("communication", True),
    "backward-send-backward-recv": StageKind("communication", True),
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
    # Megatron-LM's RL loop (megatron/rl): rollouts are inference, the rest data and memory moves
    **{name: StageKind("eval", False) for name in (
        "rl/rollout-collection", "rl/inference-setup", "rl/collect-rollouts", "rl/suspend-engine",
        "rl/build-cuda-graphs", "rl/wait-for-decode-only")},
    "rl/sync-rollouts": StageKind("communication", True),  # a broadcast
    **{name: StageKind("forward", False) for name in (
        "rl/compute-logprobs", "rl/compute-old-logprobs", "rl/compute-ref-logprobs", "rl/get-logprobs",
        "rl/forward-pass", "rl/log-softmax", "rl/pack-logprobs", "rl/train/forward")},
    "rl/train/grpo-loss": StageKind("forward", False),
    **{name: StageKind("data", False) for name in (
        "rl/prepare-data-for-update", "rl/compute-group-stats", "rl/prepare-advantages", "rl/prepare-trajectories",
        "rl/get-ltor-masks", "rl/create-dataloader", "rl/sequence-packing", "rl/align-inference-logprobs",
        "rl/pack-sequences", "rl/regather-trajectories")},
    **{name: StageKind("other", False) for name in (
        "rl/offload-optimizer-before-inference", "rl/restore-optimizer-after-inference",
        "rl/offload-kv-cache-after-inference", "rl/restore-kv-cache-before-inference", "rl/restore/grad-buffers",
        "rl/restore/optimizer-state", "rl/restore/wait-for-transfers", "rl/offload/grad-buffers",
        "rl/offload/optimizer-state", "rl/prefetch-weights-to-gpu", "rl/prefetch-weights-to-cpu", "rl/log-wandb-tb")},
}

_OTHER = StageKind("other", False)


@functools.lru_cache(maxsize=4096)
def classify(name: str) -> StageKind:
    """Group and collective flag of a stage name; bounded cache, off the training thread."""
    return _EXACT.get(name, _OTHER)
