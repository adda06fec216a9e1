"""`instrument_ddp(model)`: splits a DistributedDataParallel backward into the rank's own compute
and the wait for its peers.

Under DDP the gradient all-reduce runs inside `loss.backward()`, so a stage around backward is as
long on the ranks that wait as on the rank they wait for. Two hooks tell them apart, per
optimizer step, on the host clock:

- `ddp-grads-ready` (not a collective): from the end of the latest forward to the moment the
  iteration's last gradient bucket is ready (the communication hook's call for the bucket whose
  `is_last()` is true): this rank's loss and backward compute, with no waiting in it;
- `ddp-grads-sync` (a collective): from that moment to the completion of that bucket's
  all-reduce future: the wait for the slowest rank plus the transfer. The rank whose gradients
  are ready last waits least.

The communication hook wraps DDP's own all-reduce (`allreduce_hook`, which DDP documents as
computing what it computes without a hook) or the hook given, and hands its future on with a
`then()` that returns the value unchanged. Both intervals are appended to the running recorder's
queue as the hot path's own records, bound to the step `step()` bound when the last bucket became
ready; they carry no CUDA events (timing `host_only`, reason `host_clock_only`). With the instrumentation off the hooks cost one global read each.
Nothing here ever changes a gradient or raises into training: our own failures are counted in
`status()["ddp"]["hook_errors"]`, a full queue in `lost.queue_full`. The hooks may run on
autograd's or the process group's threads; deque appends are atomic.

On CUDA (NCCL) these host times are when the work was launched (NCCL's future may complete once
the all-reduce is enqueued), not when the device did it.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

from otel_straggler.instrumentation import api
from otel_straggler.instrumentation.recorder import INTERVAL

GRADS_READY = "ddp-grads-ready"
GRADS_SYNC = "ddp-grads-sync"

_time_ns = time.time_ns
_TIMED_MARK = "_timed_by_otel_straggler"  # on our hook: wraps() gives it the wrapped hook's name
_counts = {"hook_errors": 0, "models": 0}


def hook_counts() -> dict[str, int]:
    """Models instrumented and failures of our own bookkeeping in their hooks, since the process
    started (counted per process, as the recorder they record on is one per process)."""
    return dict(_counts)


def instrument_ddp(model: Any, hook: Optional[Callable] = None, state: Any = None) -> Any:
    """Registers the two hooks on a `DistributedDataParallel` model and returns the model.

    `hook`/`state` are a communication hook of yours and its state, as you would have passed them
    to `model.register_comm_hook(state, hook)`: it runs unchanged, timed. Without them the hook is
    DDP's default all-reduce on the model's process group. DDP takes one communication hook per
    model, so a model that already has one is refused.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    registered = getattr(model, "_comm_hooks", None)  # DDP keeps (hook, state) of register_comm_hook here
    if registered:
        if getattr(registered[0][0], _TIMED_MARK, False):
            raise RuntimeError("otel-straggler: this DDP model is already instrumented (instrument_ddp once per model)")
        raise RuntimeError(_already_hooked(registered[0][0]))
    if hook is None:
        hook = default_hooks.allreduce_hook
        state = model.process_group if state is None else state
    timing = _GradTiming()
    try:
        model.register_comm_hook(state, timing.timed(hook))
    except RuntimeError as error:
        # a built-in hook is registered in C++ only, out of _comm_hooks' sight: the reducer refuses ours
        if "only be called once" not in str(error):
            raise
        raise RuntimeError(_already_hooked(None)) from None
    model.register_forward_hook(timing.forward_ended)
    _counts["models"] += 1
    return model


def _already_hooked(hook: Optional[Callable]) -> str:
    which = f" ({getattr(hook, '__qualname__', hook)})" if hook is not None else ""
    return (f"otel-straggler: this DDP model already has a communication hook{which}; register it "
            f"through ots.instrument_ddp(model, hook=..., state=...) instead of model.register_comm_hook")


class _GradTiming:
    """The two hooks of one model and what the forward hook noted for the communication hook."""

    __slots__ = ("forward_end",)

    def __init__(self) -> None:
        # (host ns, step bound then) of the latest forward's end, replaced whole (read on another thread)
        self.forward_end: Optional[tuple] = None

    def forward_ended(self, module: Any, inputs: Any, output: Any) -> None:
        recorder = api._recorder
        if recorder is None:
            return
        try:
            self.forward_end = (_time_ns(), recorder.binding[0])
        except Exception:
            _counts["hook_errors"] += 1

    def timed(self, hook: Callable) -> Callable:
        """`hook`, timing the last bucket of each iteration; wraps() keeps its name and signature
        for DDP's checks and logging."""

        @functools.wraps(hook)
        def timed_hook(state: Any, bucket: Any) -> Any:
            recorder = api._recorder
            if recorder is None:
                return hook(state, bucket)
            ready = self._grads_ready(recorder, bucket)
            future = hook(state, bucket)
            if ready is None:
                return future
            try:
                return future.then(functools.partial(_grads_synced, recorder, ready))
            except Exception:
                _counts["hook_errors"] += 1
                return future

        setattr(timed_hook, _TIMED_MARK, True)
        return timed_hook

    def _grads_ready(self, recorder: Any, bucket: Any) -> Optional[tuple]:
        """At the last bucket: records `ddp-grads-ready`; returns (ready ns, binding), else None."""
        try:
            if type(bucket) is tuple or not bucket.is_last():  # a tuple: DDP's Python reducer, per parameter
                return None
            ready_ns = _time_ns()
            binding = recorder.binding
            forward_end, self.forward_end = self.forward_end, None  # one forward, one ready interval
            if forward_end is not None:
                opened = (GRADS_READY, False, None, forward_end[1], forward_end[0], None)
                _append(recorder, (INTERVAL, opened, ready_ns, None, binding))
            return ready_ns, binding
        except Exception:
            _counts["hook_errors"] += 1
            return None


def _grads_synced(recorder: Any, ready: tuple, future: Any) -> Any:
    """The all-reduce future's callback: records `ddp-grads-sync`, returns its value unchanged (a
    failed all-reduce raises here, as it would have without us, and records nothing)."""
    value = future.value()
    try:
        ready_ns, binding = ready
        opened = (GRADS_SYNC, True, None, binding[0], ready_ns, None)
        _append(recorder, (INTERVAL, opened, _time_ns(), None, binding))
    except Exception:
        _counts["hook_errors"] += 1
    return value


def _append(recorder: Any, record: tuple) -> None:
    """Queues a record as the recorder's stop() does: within capacity, else counted as dropped
    (the span builder numbers training.seq with those drops, so the loss shows downstream). The
    training thread waits inside backward meanwhile, so the count is not raced."""
    completed = recorder.completed
    if len(completed) < recorder.capacity:
        completed.append(record)
    else:
        recorder.dropped_queue_full += 1
