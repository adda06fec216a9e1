"""Slowdowns made in a training job's own code, for the field jobs beside this file: extra work in
a model's forward, extra work inside autograd's backward (so under DDP it sits inside
`loss.backward()` together with the gradient all-reduce), and a slower data source. Nothing here
comes from otel_straggler: the instrumentation only times this work, as a real straggler's.

Work is sized in CPU time of the rank's thread, calibrated once at start-up (see
SlowSwitch.calibrate); each rank runs torch on one thread.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn


class SlowSwitch:
    """Where the slowdown is on (this rank, from the onset step)."""

    def __init__(self) -> None:
        self.on = False
        self.products = 0  # matrix products that add about the calibrated extra time
        self.matrix = torch.randn(192, 192)

    def work(self) -> None:
        if self.on:
            product = self.matrix
            with torch.no_grad():
                for _ in range(self.products):
                    product = torch.mm(self.matrix, product).tanh_()

    def calibrate(self, extra_ms: float) -> None:
        """Sizes the work to about `extra_ms` of this thread's CPU time. Not wall time: measured
        at start-up beside a CPU hog or a peer still starting, wall time counts the waits for a
        core and sizes the work to a fraction of extra_ms; and not the first products, which
        carry torch's warm-up."""
        self.products = 8
        self.on = True
        self.work()  # warm-up
        per_product_ms = []
        for _ in range(5):
            started = time.thread_time()
            self.work()
            per_product_ms.append((time.thread_time() - started) * 1000 / self.products)
        self.on = False
        self.products = max(1, round(extra_ms / statistics.median(per_product_ms)))


class SlowForward(nn.Module):
    """Identity in value; does the switch's work in the forward."""

    def __init__(self, switch: SlowSwitch) -> None:
        super().__init__()
        self.switch = switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.switch.work()
        return x


class _SlowBackwardFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, switch):
        ctx.switch = switch
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.switch.work()
        return grad, None


class SlowBackward(nn.Module):
    """Identity in value; does the switch's work in autograd's backward."""

    def __init__(self, switch: SlowSwitch) -> None:
        super().__init__()
        self.switch = switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackwardFunction.apply(x, self.switch)


class SlowData:
    """A delay in a data source (a collate function, a dataset's __getitem__): `sleep()` waits
    `delay_s` once switched on."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    def sleep(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)


class Slowdowns:
    """A job's three slowdowns, the one of `kind` calibrated to `extra_ms` where `here` (the slow
    rank); all off until the job switches one on at its onset step."""

    def __init__(self, kind: str, here: bool, extra_ms: float) -> None:
        self.forward, self.backward, self.data = SlowSwitch(), SlowSwitch(), SlowData()
        if here and kind == "forward":
            self.forward.calibrate(extra_ms)
        if here and kind == "backward":
            self.backward.calibrate(extra_ms)

    def collate(self, samples: list) -> tuple:
        """A DataLoader's collate_fn for (features, target) samples, with the data delay in it."""
        self.data.sleep()
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
