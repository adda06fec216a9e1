"""The demo trainer's straggler: one rank made slow on purpose, in the trainer's own code, the way a
real straggler is slow (a slower GPU, a slow data read): extra time spent inside one of its stages.
The instrumentation only times it; nothing in it can slow a stage down.

    python -m otel_straggler.demo.trainer --slow-rank 2 --slow-stage forward-compute --from-step 40 --slowdown 0.3

From --from-step on, the rank sleeps inside --slow-stage for --slowdown x the time the stage's own
work took; or, with --block-s, blocks inside it that long, once, at the first step from
--from-step on (a pause such as a checkpoint's; BLOCK_FOR_GOOD_S: a hang, until the rank is
ended). The stage is still open while it sleeps, as a stuck stage is. Where the rank's GPU health
reads the fake NVML (OTEL_STRAGGLER_GPU_HEALTH=fake, the demo's --simulate-gpu), the slow rank's
simulated GPU reads thermally throttled from --from-step on, as the GPU of such a rank would.

Torch-free: the demo's own process builds these flags (slow_rank_args).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any, Iterator, Optional

BLOCK_FOR_GOOD_S = 1e9  # --block-s: for good, i.e. until the rank is ended
_NOTHING = contextlib.nullcontext()


def add_arguments(parser: argparse.ArgumentParser, stages: tuple[str, ...]) -> None:
    group = parser.add_argument_group("straggler", "make one rank slow on purpose (the demo's slowed rank)")
    group.add_argument("--slow-rank", type=int, default=-1, help="the rank to slow down (default -1: none)")
    group.add_argument("--slow-stage", default=stages[0], choices=stages, help="the stage it is slow in")
    group.add_argument("--from-step", type=int, default=0, help="first slowed step")
    group.add_argument("--slowdown", type=float, default=0.0,
                       help="sleep inside the stage this fraction of the time its own work took (0.3: +30%%)")
    group.add_argument("--block-s", type=float, default=0.0,
                       help="instead: block inside the stage this long, once, at the first step from --from-step "
                            f"on ({BLOCK_FOR_GOOD_S:g}: for good, a hang)")


def slow_rank_args(rank: int, stage: str, from_step: int, slowdown: float = 0.0,
                   block_s: float = 0.0) -> tuple[str, ...]:
    """The trainer flags that slow `rank` down (the demo's injection, the tests')."""
    return ("--slow-rank", str(rank), "--slow-stage", stage, "--from-step", str(from_step),
            "--slowdown", repr(slowdown), "--block-s", repr(block_s))


class Straggler:
    """What makes this rank slow, if anything: `inside(stage)` within each stage's `with` block
    (a no-op but on the slowed stage), `begin_step(step)` at the top of each step."""

    __slots__ = ("stage", "from_step", "slowdown", "block_s", "gpu", "step")

    def __init__(self, stage: Optional[str] = None, from_step: int = 0, slowdown: float = 0.0,
                 block_s: float = 0.0, gpu: Any = None) -> None:
        self.stage = stage if slowdown > 0 or block_s > 0 else None  # None: this rank is not slowed
        self.from_step = from_step
        self.slowdown = slowdown
        self.block_s = block_s
        self.gpu = gpu  # the simulated GPU (a FakeNvml) to throttle, or None
        self.step: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, rank: int, telemetry: Any = None) -> "Straggler":
        if rank != args.slow_rank:
            return cls()
        return cls(args.slow_stage, args.from_step, args.slowdown, args.block_s, simulated_gpu(telemetry))

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.gpu is not None and self.stage is not None and step >= self.from_step:
            self.gpu.throttle(True)

    def inside(self, stage: str) -> contextlib.AbstractContextManager:
        if stage != self.stage or self.step is None or self.step < self.from_step:
            return _NOTHING
        return self._extra_time()

    @contextlib.contextmanager
    def _extra_time(self) -> Iterator[None]:
        started = time.monotonic()
        yield
        if self.block_s > 0:
            block_s, self.block_s = self.block_s, 0.0  # once
            deadline = time.monotonic() + block_s
            while time.monotonic() < deadline:  # short sleeps: a signal's handler runs between them
                time.sleep(min(1.0, deadline - time.monotonic()))
            return
        time.sleep(self.slowdown * (time.monotonic() - started))


def simulated_gpu(telemetry: Any) -> Any:
    """The fake NVML the rank's GPU health reads (OTEL_STRAGGLER_GPU_HEALTH=fake), or None."""
    from otel_straggler.instrumentation.fake_nvml import FakeNvml

    health = getattr(getattr(telemetry, "_pipeline", None), "gpu_health", None)
    nvml = getattr(health, "nvml", None)
    return nvml if isinstance(nvml, FakeNvml) else None
