"""What Megatron's code needs to run on a machine without a GPU, for the tests that drive it:
a one-process gloo group (its gathers run for real there), `torch.cuda.synchronize` as a no-op,
`torch.cuda.current_device()` as "cpu", and, for the modules that make tensors on "cuda"
unconditionally (megatron-core's schedules: a token counter; Megatron-LM's training_log: its loss
accumulator), a `torch` whose `zeros()` and `tensor()` make them on the CPU."""
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
    """`torch` for one Megatron module, with the tensors it asks for on "cuda" made on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, **kwargs)

    @staticmethod
    def tensor(*data, device=None, **kwargs):
        return torch.tensor(*data, **kwargs)
