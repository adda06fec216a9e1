"""What megatron-core needs to run on a machine without a GPU, for the tests that drive it:
a one-process gloo group (its gathers run for real there), `torch.cuda.synchronize` as a no-op,
`torch.cuda.current_device()` as "cpu", and, for its schedules, `torch.zeros(device="cuda")`
made on the CPU (the token counter it makes on the GPU unconditionally)."""
from __future__ import annotations

import contextlib
import types
from typing import Iterator

import pytest
import torch
import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


class TorchOnCpu(types.ModuleType):
    """`torch` for a megatron-core module, with tensors it asks for on "cuda" made on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, **kwargs)
