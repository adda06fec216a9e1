"""Stage timing for a PyTorch training loop nobody edited: what `opentelemetry-instrument` turns on
with OTEL_STRAGGLER_ENABLED=true, and what the Hugging Face and Lightning callbacks build on.

| stage | where it is timed | how |
|---|---|---|
| `batch-generator` | a DataLoader iterator's `__next__` (with grad enabled) | patched, restorable |
| `forward-compute` | the outermost module call, grad enabled and the module in train mode | module forward hooks |
| `evaluate` | the same call with grad disabled or the module in eval mode | module forward hooks |
| `backward-compute` | `Tensor.backward` / `torch.autograd.backward` | patched, restorable |
| `optimizer` | `Optimizer.step`, from after its closure when one is passed | global optimizer step hooks |
| `all-reduce`, `broadcast`, `barrier`, ... | the `torch.distributed` collectives a script calls | patched, restorable |
| `ddp-grads-ready`, `ddp-grads-sync` | each `DistributedDataParallel` made once this is on | `instrument_ddp`'s hooks |

Steps: with `steps="optimizer"` (zero code) a step begins at the first training stage after an
optimizer step (a fetch, a training forward, a backward) and ends when the optimizer step does, so
one optimizer step is one step however many micro-batches it accumulates; numbered from 0. With
`steps="framework"` a callback binds the framework's own step with begin_step()/end_step(), and
nothing is timed between its steps (the framework's evaluation, checkpointing and logging).

Which call is outermost is learned: until the first optimizer step, global module hooks see every
module call and note the modules called at depth 0 (at most MAX_ROOTS); then those modules keep
their own hooks and the global ones go, so a model's submodules cost nothing per call and
`torch.compile` sees no global hook. A module first called after that is not timed, unless it is a
DistributedDataParallel made after that (a second `fit()`). A forward run inside a backward
(activation checkpointing recomputes) is part of the backward.

Explicit calls win: the first time one of these stages would open inside a stage the script opened
itself (`stage()`, Megatron timers), or a step is bound that this module did not bind (`step()`),
the automatic stages stop for the rest of the process (`deferred_to_explicit`); the DDP hooks stay,
as `instrument_ddp` would have put them. Only the training thread is timed: the thread of the first
training forward (the main thread until then).

Nothing here raises into training: a failure of our own bookkeeping is counted (`errors`) and, at
MAX_ERRORS, switches the automatic stages off. `uninstrument()` restores every patched function it
still finds in place (an identity check: a function someone patched over ours is left alone and
counted) and removes every hook; DDP models keep their communication hook, which then costs one
global read per bucket.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from typing import Any, Callable, Optional

from otel_straggler.instrumentation import api, rank_state
from otel_straggler.instrumentation.hot_path_reference import INTERVAL

FETCH, FORWARD, EVALUATE, BACKWARD, OPTIMIZER = (
    "batch-generator", "forward-compute", "evaluate", "backward-compute", "optimizer")
# torch.distributed's blocking collectives and the stage each is timed as (stage_names.py maps
# these names to `communication`, collective)
COLLECTIVES = {
    "all_reduce": "all-reduce", "broadcast": "broadcast", "barrier": "barrier", "monitored_barrier": "barrier",
    "reduce": "reduce", "all_gather": "all-gather", "all_gather_into_tensor": "all-gather",
    "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter", "all_to_all": "all-to-all",
    "all_to_all_single": "all-to-all", "gather": "gather", "scatter": "scatter",
    "all_gather_object": "all-gather", "broadcast_object_list": "broadcast", "gather_object": "gather",
    "scatter_object_list": "scatter",
}
STEP_MODES = ("optimizer", "framework")
MAX_ROOTS = 8  # modules learned as outermost: a model, a loss module, a GAN's two halves
MAX_ERRORS = 100
_log = logging.getLogger("otel_straggler")


class _State:
    """What the hooks of this process share. Read and written on the training thread only (the
    thread check comes first in every hook), so no lock."""

    def __init__(self, steps: str, configure_lazily: bool) -> None:
        self.steps = steps
        self.configure_lazily = configure_lazily  # zero code: configure() at the first training stage
        self.active = True
        self.thread = threading.main_thread().ident
        self.thread_learned = False  # set by the first training forward
        self.ours: list = []  # our open intervals, innermost last
        self.binding: Any = None  # the recorder's binding our last begin_step() made
        self.in_step = False
        self.step_number = 0  # the step under way, or the next one
        self.forward: Any = None  # the open forward/evaluate interval
        self.forward_depth = 0
        self.backward: Any = None
        self.optimizer: Any = None
        self.optimizer_depth = 0
        self.roots: list = []  # weak references to the modules called outermost while learning
        self.learning = True
        self.handles: list = []  # hook handles to remove
        self.global_forward_handles: list = []
        self.patches: list = []  # (owner, name, original, replacement)


_state: Optional[_State] = None
_lock = threading.Lock()


def _grad_enabled_without_torch() -> bool:
    return True


# torch's, set by _install (this module imports without torch)
_grad_enabled: Callable[[], bool] = _grad_enabled_without_torch
_Module: type[Any] = type(None)
_COUNTER_NAMES = ("errors", "deferred_to_explicit", "not_restored", "models_instrumented", "configure_failed", "roots")
_counts = dict.fromkeys(_COUNTER_NAMES, 0)


def counts() -> dict:
    """Counters of the automatic timing since instrument() put it on, plus whether it is on."""
    state = _state
    return {**_counts, "instrumented": state is not None, "active": bool(state and state.active),
            "steps": state.steps if state else None}


rank_state.add_status_section("automatic", counts)


def instrument(*, steps: str = "optimizer", configure_lazily: bool = False) -> bool:
    """Installs the automatic timing (idempotent; a second call may switch `steps`). Returns False
    when torch is not installed. `configure_lazily`: call configure() at the first training stage
    on the training thread, so a process that never trains (torchrun's agent, a DataLoader worker)
    sends nothing."""
    global _state
    if steps not in STEP_MODES:
        raise ValueError(f"steps must be one of {STEP_MODES}, got {steps!r}")
    with _lock:
        if _state is not None:
            if steps == "framework" and _state.steps != "framework":
                _switch_to_framework_steps(_state)
            return True
        try:
            import torch  # noqa: F401
        except ImportError:
            return False
        state = _State(steps, configure_lazily)
        _counts.update(dict.fromkeys(_COUNTER_NAMES, 0))
        try:
            _install(state)
        except Exception:
            _remove(state)
            raise
        _state = state
        return True


def uninstrument() -> None:
    """Restores what instrument() patched and removes its hooks; open intervals are ended."""
    global _state
    with _lock:
        state, _state = _state, None
        if state is None:
            return
        state.active = False
        _close_all(state)
        _remove(state)


def begin_step(n: int, tokens: Any = None, samples: Any = None) -> None:
    """A framework callback binds its step `n` (ends the automatic step under way first)."""
    state, recorder = _state, rank_state.current_recorder()
    if state is None or recorder is None or not state.active:
        return
    try:
        if state.in_step:
            recorder.end_step(state.step_number)
        recorder.begin_step(n, tokens, samples)
        state.binding = recorder.binding
        state.step_number, state.in_step = n, True
    except Exception:
        _error(state)


def end_step() -> None:
    """A framework callback ends its step."""
    state, recorder = _state, rank_state.current_recorder()
    if state is None or recorder is None or not state.in_step:
        return
    try:
        recorder.end_step(state.step_number)
        state.in_step = False
    except Exception:
        _error(state)


def instrument_model(model: Any) -> Any:
    """Gives a DistributedDataParallel model made before instrument() the DDP hooks (nothing for
    another model, or one that has them); returns the model."""
    _instrument_ddp_model(model)
    return model


# -- the stages' bookkeeping --

def _open(name: str, collective: Optional[bool], begins_step: bool) -> Any:
    """Starts an automatic interval on the training thread; None when it is not to be timed."""
    state = _state
    if state is None or not state.active or threading.get_ident() != state.thread:
        return None
    recorder = rank_state.current_recorder()
    try:
        if recorder is None:
            if not (begins_step and state.configure_lazily):
                return None
            recorder = _configure(state)
            if recorder is None:
                return None
        opened = recorder.open_intervals
        ours = state.ours
        binding = recorder.binding
        if ((opened and (not ours or opened[-1] is not ours[-1]))
                or (binding[0] is not None and binding is not state.binding)):
            _defer_to_explicit(state, recorder)
            return None
        if not state.in_step:
            if state.steps == "framework":
                return None  # between the framework's steps: its evaluation, checkpoints, logging
            if begins_step:
                recorder.begin_step(state.step_number)
                state.binding = recorder.binding
                state.in_step = True
        interval = recorder.start(name, collective)
        if interval is not None:
            ours.append(interval)
        return interval
    except Exception:
        _error(state)
        return None


def _close(interval: Any) -> None:
    state, recorder = _state, rank_state.current_recorder()
    if interval is None or state is None or recorder is None:
        return
    try:
        ours = state.ours
        if ours and ours[-1] is interval:
            ours.pop()
        elif interval in ours:
            ours.remove(interval)
        else:
            return  # ended already (deferred, or uninstrumented)
        recorder.stop(interval)
    except Exception:
        _error(state)


def _configure(state: _State) -> Any:
    state.configure_lazily = False
    try:
        api.configure()
    except Exception as error:
        # a bad env var or an exporter that cannot be made: say it once, stay off, train on
        _counts["configure_failed"] += 1
        state.active = False
        print(f"otel-straggler: disabled: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return rank_state.current_recorder()


def _defer_to_explicit(state: _State, recorder: Any) -> None:
    _counts["deferred_to_explicit"] += 1
    state.active = False
    _close_all(state)
    _log.info("otel-straggler: the script times its own stages; the automatic stages are off")


def _close_all(state: _State) -> None:
    """Ends our open intervals (left open they would parent every later stage) and our step."""
    recorder = rank_state.current_recorder()
    if recorder is None:
        state.ours.clear()
        return
    try:
        while state.ours:
            recorder.stop(state.ours.pop())
        if state.in_step and recorder.binding is state.binding:
            recorder.end_step(state.step_number)
        state.in_step = False
    except Exception:
        _counts["errors"] += 1


def _error(state: _State) -> None:
    _counts["errors"] += 1
    if _counts["errors"] >= MAX_ERRORS and state.active:
        state.active = False
        _log.warning("otel-straggler: %d errors in the automatic stages; they are off", MAX_ERRORS)


def _switch_to_framework_steps(state: _State) -> None:
    recorder = rank_state.current_recorder()
    if state.in_step and recorder is not None and recorder.binding is state.binding:
        try:
            recorder.end_step(state.step_number)
        except Exception:
            _counts["errors"] += 1
    state.in_step = False
    state.steps = "framework"


# -- forward: module hooks --

def _forward_starts(module: Any, args: Any) -> None:
    state = _state
    if state is None or not state.active or state.backward is not None:
        return  # a forward inside a backward (a checkpoint's recompute) is the backward's
    if state.forward_depth:
        state.forward_depth += 1
        return
    try:
        # a wrapper's own mode can be stale (Lightning's validation puts DDP's wrapper in eval mode
        # and restores only the module inside): the wrapped module's mode is the one training sets
        wrapped = getattr(module, "module", None)
        training = _grad_enabled() and (wrapped if isinstance(wrapped, _Module) else module).training
        if training and not state.thread_learned:
            state.thread = threading.get_ident()  # the training thread: the first training forward's
            state.thread_learned = True
        if threading.get_ident() != state.thread:
            return
        if state.learning:
            _learn_root(state, module)
        state.forward = _open(FORWARD if training else EVALUATE, None, begins_step=training)
        state.forward_depth = 1
    except Exception:
        _error(state)


def _forward_ended(module: Any, args: Any, output: Any) -> None:
    state = _state
    if state is None or not state.forward_depth:
        return
    state.forward_depth -= 1
    if state.forward_depth == 0:
        interval, state.forward = state.forward, None
        _close(interval)


def _hook_root(state: _State, module: Any) -> None:
    state.handles.append(module.register_forward_pre_hook(_forward_starts))
    state.handles.append(module.register_forward_hook(_forward_ended, always_call=True))
    _counts["roots"] += 1


def _learn_root(state: _State, module: Any) -> None:
    for root in state.roots:
        if root() is module:
            return
    if len(state.roots) < MAX_ROOTS:
        state.roots.append(weakref.ref(module))


def _stop_learning(state: _State) -> None:
    """After the first optimizer step: the modules seen outermost keep their own hooks, the global
    ones go."""
    state.learning = False
    roots = [root() for root in state.roots]
    roots = [module for module in roots if module is not None]
    if not roots:
        return
    for module in roots:
        _hook_root(state, module)
    for handle in state.global_forward_handles:
        handle.remove()
    state.global_forward_handles = []


# -- backward, data, collectives: patched functions --

def _timed_backward(original: Callable) -> Callable:
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        state = _state
        if state is None or state.backward is not None or not state.active:
            return original(*args, **kwargs)
        state.backward = _open(BACKWARD, None, begins_step=True)
        try:
            return original(*args, **kwargs)
        finally:
            interval, state.backward = state.backward, None  # a collective in it may have split it
            _close(interval)

    return backward


def _timed_fetch(original: Callable) -> Callable:
    @functools.wraps(original)
    def __next__(self: Any) -> Any:
        if _state is None or not _state.active:
            return original(self)
        interval = _open(FETCH, None, begins_step=True) if _grad_enabled() else None
        try:
            return original(self)
        finally:
            _close(interval)

    return __next__


def _timed_collective(original: Callable, stage: str) -> Callable:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        state = _state
        if state is None or not state.active:
            return original(*args, **kwargs)
        if kwargs.get("async_op"):
            return _timed_async(state, original, stage, args, kwargs)
        suspended = _suspend(state)
        interval = _open(stage, True, begins_step=False)
        try:
            return original(*args, **kwargs)
        finally:
            _close(interval)
            _resume(state, suspended)

    return collective


_SLOTS = ("optimizer", "forward", "backward")  # the _State attributes holding our open compute stages


def _suspend(state: _State) -> list:
    """Ends the automatic stages open around a collective (a metric's all-reduce in a training
    step, Lightning's `self.log(sync_dist=True)`): resumed after it as new intervals of the same
    names, a stage's time per step is the rank's own work, and the wait for its peers is the
    collective's, as if the script had timed them side by side. Returns what to resume, outermost
    first; nothing when one of ours is open that no slot holds (a fetch: it stays whole)."""
    if not state.ours or not state.active or threading.get_ident() != state.thread:
        return []
    held = {id(getattr(state, slot)): slot for slot in _SLOTS if getattr(state, slot) is not None}
    if any(id(interval) not in held for interval in state.ours):
        return []
    suspended = [(held[id(interval)], interval[0]) for interval in state.ours]
    for slot, _ in reversed(suspended):
        interval = getattr(state, slot)
        setattr(state, slot, None)
        _close(interval)
    return suspended


def _resume(state: _State, suspended: list) -> None:
    for slot, name in suspended:
        if state is not _state or not state.active:
            return
        setattr(state, slot, _open(name, None, begins_step=False))


def _timed_async(state: _State, original: Callable, stage: str, args: tuple, kwargs: dict) -> Any:
    """An `async_op=True` collective, from its call to the completion of its work (the future's
    callback runs where the process group completes it). Not timed inside a forward or backward:
    there it is a library's own prefetch (FSDP's all-gathers), many per step."""
    recorder = rank_state.current_recorder()
    timed = (recorder is not None and state.forward is None and state.backward is None
             and threading.get_ident() == state.thread)
    import time

    start_ns = time.time_ns()
    work = original(*args, **kwargs)
    if recorder is None or not timed or work is None:
        return work
    try:
        binding = recorder.binding
        opened = (stage, True, None, binding[0], start_ns, None)

        def completed(future: Any) -> None:
            try:
                _append(recorder, (INTERVAL, opened, time.time_ns(), None, binding))
            except Exception:
                _counts["errors"] += 1

        work.get_future().then(completed)
    except Exception:
        _counts["errors"] += 1  # a backend without futures: not timed
    return work


def _append(recorder: Any, record: tuple) -> None:
    completed = recorder.completed
    if len(completed) < recorder.capacity:
        completed.append(record)
    else:
        recorder.dropped_queue_full += 1


# -- optimizer: global step hooks --

def _optimizer_starts(optimizer: Any, args: tuple, kwargs: dict) -> Any:
    state = _state
    if state is None or not state.active or threading.get_ident() != state.thread:
        return None
    try:
        if state.optimizer_depth:  # a wrapper's step calling the wrapped optimizer's
            state.optimizer_depth += 1
            return None
        state.optimizer_depth = 1
        # args holds the optimizer first, then step()'s own arguments: step(closure) or step(closure=...)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 and callable(args[1])
                                                                     else None)
        if closure is None:
            state.optimizer = _open(OPTIMIZER, None, begins_step=True)
            return None
        # forward and backward run inside step(closure): the optimizer's own time starts after it
        timed = functools.partial(_closure_then_optimizer, state, closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": timed}
        return (args[0], timed, *args[2:]), kwargs
    except Exception:
        _error(state)
        return None


def _closure_then_optimizer(state: _State, closure: Callable) -> Any:
    result = closure()
    if state.optimizer is None and state is _state and state.optimizer_depth:
        state.optimizer = _open(OPTIMIZER, None, begins_step=True)
    return result


def _optimizer_ended(optimizer: Any, args: tuple, kwargs: dict) -> None:
    state = _state
    if state is None or not state.optimizer_depth or threading.get_ident() != state.thread:
        return
    state.optimizer_depth -= 1
    if state.optimizer_depth:
        return
    interval, state.optimizer = state.optimizer, None
    _close(interval)
    try:
        if state.learning:
            _stop_learning(state)
        recorder = rank_state.current_recorder()
        if state.steps == "optimizer" and state.in_step and recorder is not None:
            if recorder.binding is state.binding:
                recorder.end_step(state.step_number)
            state.in_step = False
            state.step_number += 1
    except Exception:
        _error(state)


# -- DDP --

def _instrument_ddp_model(model: Any) -> None:
    try:
        from torch.nn.parallel import DistributedDataParallel

        from otel_straggler.integrations import ddp

        if isinstance(model, DistributedDataParallel) and ddp.instrument_automatically(model):
            _counts["models_instrumented"] += 1
    except Exception:
        _counts["errors"] += 1


def _timed_ddp_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        state = _state
        if state is not None and state.active:
            _instrument_ddp_model(self)
            if not state.learning and len(state.roots) < MAX_ROOTS:
                # a model made after the outermost modules were learned (a second fit()): one too
                try:
                    state.roots.append(weakref.ref(self))
                    _hook_root(state, self)
                except Exception:
                    _error(state)

    return __init__


# -- installing and removing --

def _patch(state: _State, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return  # not in this torch: that stage is not timed
    replacement = make(original)
    setattr(owner, name, replacement)
    state.patches.append((owner, name, original, replacement))


def _install(state: _State) -> None:
    global _grad_enabled, _Module
    import torch
    import torch.distributed as dist
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim
    from torch.utils.data import dataloader

    _grad_enabled, _Module = torch.is_grad_enabled, torch.nn.Module
    state.global_forward_handles = [
        nn_module.register_module_forward_pre_hook(_forward_starts),
        nn_module.register_module_forward_hook(_forward_ended, always_call=True),
    ]
    state.handles += [optim.register_optimizer_step_pre_hook(_optimizer_starts),
                      optim.register_optimizer_step_post_hook(_optimizer_ended)]
    _patch(state, torch.Tensor, "backward", _timed_backward)
    _patch(state, torch.autograd, "backward", _timed_backward)
    # the base class of both iterators (single- and multi-process loading); a DataLoader's own
    # __iter__ may be overridden (accelerate's, Lightning's) and still yields from one of them
    _patch(state, dataloader._BaseDataLoaderIter, "__next__", _timed_fetch)
    if dist.is_available():
        for function, stage in COLLECTIVES.items():
            _patch(state, dist, function, functools.partial(_timed_collective, stage=stage))
        from torch.nn.parallel import DistributedDataParallel

        _patch(state, DistributedDataParallel, "__init__", _timed_ddp_init)
        from otel_straggler.integrations import ddp

        _patch(state, DistributedDataParallel, "register_comm_hook", ddp.comm_hook_registration)


def _remove(state: _State) -> None:
    for handle in state.handles + state.global_forward_handles:
        try:
            handle.remove()
        except Exception:
            _counts["errors"] += 1
    state.handles, state.global_forward_handles = [], []
    for owner, name, original, replacement in reversed(state.patches):
        if getattr(owner, name, None) is replacement:
            setattr(owner, name, original)
        else:
            _counts["not_restored"] += 1  # patched over by someone else since: theirs stays
    state.patches = []
