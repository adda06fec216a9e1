"""`instrument_ddp(model)`: splits a DistributedDataParallel backward into the rank's own compute
and the wait for its peers.

Under DDP the gradient all-reduce runs inside `loss.backward()`, so a stage around backward is as
long on the ranks that wait as on the rank they wait for. Hooks tell them apart, on the host clock:

- `ddp-grads-ready` (not a collective), once per backward, micro-steps under `no_sync()` included:
  from the moment the backward reaches the model's output (a hook on the output tensors, set at
  the end of each training forward) to the moment the backward's last parameter gradient is
  accumulated (a post-accumulate-grad hook): this rank's own backward compute, with no waiting in
  it and without code the loop runs between forward and backward (a batch fetch, say);
- `ddp-grads-sync` (a collective), once per synchronizing backward: from the communication hook's
  call for the iteration's last bucket (`is_last()`) to the completion of that bucket's all-reduce
  future: the wait for the slowest rank plus the transfer. The rank whose gradients are ready last
  waits least.

Which parameter's gradient comes last is learned over the first LEARN_BACKWARDS backwards (hooks on
every parameter that requires a gradient, each noting when it fired); after that only the
parameters that came last keep a hook, so a backward costs one or two hook calls, not one per
parameter. A backward whose end no kept hook saw (unused parameters, a graph that changed) is closed
at the last bucket's readiness when it synchronizes, else at the latest kept gradient seen when the
next forward comes, else not recorded. Limits: a `torch.autograd.grad` call on the outputs before
the backward (a gradient penalty) opens the interval early; with the instrumentation off the
parameters' hooks still run (one global read each).

The communication hook wraps DDP's own all-reduce (`allreduce_hook`, which DDP documents as
computing what it computes without a hook) or the hook given, and hands its future on with a
`then()` that returns the value unchanged. Both intervals are appended to the running recorder's
queue as the hot path's own records, bound to the step `step()` bound when the backward started
(one optimizer step may hold several backwards: gradient accumulation); they carry no CUDA events
(timing `host_only`, reason `host_clock_only`). With the instrumentation off the hooks cost one
global read each. Nothing here ever changes a gradient or raises into training: our own failures
are counted in `status()["ddp"]["hook_errors"]`, a full queue in `lost.queue_full`. The hooks may
run on autograd's or the process group's threads; deque appends are atomic.

On CUDA (NCCL) these host times are when the work was launched (NCCL's future may complete once
the all-reduce is enqueued), not when the device did it.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

from otel_straggler.instrumentation import rank_state
from otel_straggler.instrumentation.hot_path_reference import INTERVAL

GRADS_READY = "ddp-grads-ready"
GRADS_SYNC = "ddp-grads-sync"

_time_ns = time.time_ns
_TIMED_MARK = "_timed_by_otel_straggler"  # on our hook: wraps() gives it the wrapped hook's name
_TIMING_ATTR = "_otel_straggler_timing"  # on a model: its _GradTiming
_counts = {"hook_errors": 0, "models": 0}


def hook_counts() -> dict[str, int]:
    """Models instrumented and failures of our own bookkeeping in their hooks, since the process
    started (counted per process, as the recorder they record on is one per process)."""
    return dict(_counts)


rank_state.add_status_section("ddp", hook_counts)


def instrument_ddp(model: Any, hook: Optional[Callable] = None, state: Any = None) -> Any:
    """Registers the hooks on a `DistributedDataParallel` model and returns the model.

    `hook`/`state` are a communication hook of yours and its state, as you would have passed them
    to `model.register_comm_hook(state, hook)`: it runs unchanged, timed. Without them the hook is
    DDP's default all-reduce on the model's process group. DDP takes one communication hook per
    model, so a model that already has one is refused. A model the automatic instrumentation
    hooked already is returned as it is (with `hook`, that hook replaces DDP's default).
    """
    timing = getattr(model, _TIMING_ATTR, None)
    if timing is not None and timing.automatic:
        if hook is not None:
            timing.use_hook(hook, model.process_group if state is None else state)
        return model
    registered = getattr(model, "_comm_hooks", None)  # DDP keeps (hook, state) of register_comm_hook here
    if registered:
        if getattr(registered[0][0], _TIMED_MARK, False):
            raise RuntimeError("otel-straggler: this DDP model is already instrumented (instrument_ddp once per model)")
        raise RuntimeError(_already_hooked(registered[0][0]))
    _register(model, hook, state, automatic=False)
    return model


def instrument_automatically(model: Any) -> bool:
    """The automatic instrumentation's instrument_ddp: True when it hooked the model, False when the
    model has a communication hook already (ours or another)."""
    if getattr(model, _TIMING_ATTR, None) is not None or getattr(model, "_comm_hooks", None):
        return False
    try:
        _register(model, None, None, automatic=True)
    except RuntimeError:
        return False  # a built-in hook registered in C++ only
    return True


def comm_hook_registration(original: Callable) -> Callable:
    """DistributedDataParallel.register_comm_hook while the automatic instrumentation is on: on a
    model it hooked, the script's hook replaces DDP's default inside the timing (the reducer takes
    one hook per model, ours); anywhere else DDP's own method runs."""

    @functools.wraps(original)
    def register_comm_hook(self: Any, state: Any, hook: Callable) -> None:
        timing = getattr(self, _TIMING_ATTR, None)
        if timing is None or not timing.automatic:
            return original(self, state, hook)
        if timing.user_hook:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if not callable(hook):
            raise TypeError(f"communication hook must be callable, got {type(hook).__name__}")
        timing.use_hook(hook, state)
        return None

    return register_comm_hook


def _register(model: Any, hook: Optional[Callable], state: Any, automatic: bool) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    timing = _GradTiming(automatic)
    if hook is None:
        timing.use_hook(default_hooks.allreduce_hook, model.process_group if state is None else state)
        timing.user_hook = False
    else:
        timing.use_hook(hook, state)
    try:
        model.register_comm_hook(timing.comm[1], timing.timed())
    except RuntimeError as error:
        # a built-in hook is registered in C++ only, out of _comm_hooks' sight: the reducer refuses ours
        if "only be called once" not in str(error):
            raise
        raise RuntimeError(_already_hooked(None)) from None
    setattr(model, _TIMING_ATTR, timing)
    model.register_forward_pre_hook(timing.forward_starts)
    model.register_forward_hook(timing.forward_ended)
    timing.watch_gradients([p for p in model.parameters() if p.requires_grad])
    _counts["models"] += 1


def _already_hooked(hook: Optional[Callable]) -> str:
    which = f" ({getattr(hook, '__qualname__', hook)})" if hook is not None else ""
    return (f"otel-straggler: this DDP model already has a communication hook{which}; register it "
            f"through ots.instrument_ddp(model, hook=..., state=...) instead of model.register_comm_hook")


LEARN_BACKWARDS = 3  # backwards watched on every parameter before only the last ones keep a hook
MAX_OUTPUT_HOOKS = 4  # output tensors hooked per forward (the loss and the logits, say)


class _GradTiming:
    """The hooks of one model and what they noted of the backward under way.

    The backward under way is `[start ns, binding, latest gradient ns or None]`, replaced whole;
    None when none is open."""

    __slots__ = ("forward_end", "backward", "_handles", "_fired", "_last_fired", "_kept", "_learned",
                 "_kept_pending", "automatic", "comm", "user_hook")

    def __init__(self, automatic: bool = False) -> None:
        self.automatic = automatic  # hooked by the automatic instrumentation, not instrument_ddp
        self.comm: tuple = (None, None)  # (communication hook, its state), replaced whole
        self.user_hook = False  # the script gave its own hook
        # (host ns, binding then) of the latest training forward's end: a backward's start when no
        # output hook fired (a loss computed from something else)
        self.forward_end: Optional[tuple] = None
        self.backward: Optional[list] = None
        self._handles: dict[int, Any] = {}  # parameter index -> its post-accumulate-grad hook
        self._fired: list[int] = []  # learning: indices of this backward's gradients, in order
        self._last_fired: set[int] = set()  # learning: the last index of each backward watched
        self._kept: frozenset = frozenset()  # after learning: the indices that keep a hook
        self._learned = 0  # backwards watched so far
        self._kept_pending: set[int] = set()  # kept indices not fired yet in this backward

    # -- forward --
    def forward_starts(self, module: Any, inputs: Any) -> None:
        recorder = rank_state.current_recorder()
        if recorder is None or self.backward is None:
            return
        try:
            self._close_backward(recorder, None)  # the last one's end went unseen
        except Exception:
            _counts["hook_errors"] += 1

    def forward_ended(self, module: Any, inputs: Any, output: Any) -> None:
        recorder = rank_state.current_recorder()
        if recorder is None:
            return
        try:
            import torch

            if not torch.is_grad_enabled():  # an evaluation forward: no backward follows
                return
            self.forward_end = (_time_ns(), recorder.binding)
            for tensor in _grad_tensors(output, torch.Tensor):
                tensor.register_hook(self._backward_reached_output)
        except Exception:
            _counts["hook_errors"] += 1

    # -- backward --
    def _backward_reached_output(self, gradient: Any) -> None:
        recorder = rank_state.current_recorder()
        if recorder is None or self.backward is not None:
            return None  # the first output reached opens the backward; the others are in it
        try:
            self.backward = [_time_ns(), recorder.binding, None]
            self._kept_pending = set(self._kept)
        except Exception:
            _counts["hook_errors"] += 1
        return None

    def watch_gradients(self, parameters: list) -> None:
        for index, parameter in enumerate(parameters):
            self._handles[index] = parameter.register_post_accumulate_grad_hook(
                functools.partial(self._gradient_accumulated, index))

    def _gradient_accumulated(self, index: int, parameter: Any) -> None:
        recorder = rank_state.current_recorder()
        if recorder is None:
            return
        try:
            now = _time_ns()
            backward = self.backward
            if backward is None:  # no output hook fired: the backward started after the forward ended
                forward_end = self.forward_end
                if forward_end is None:
                    return
                backward = self.backward = [forward_end[0], forward_end[1], None]
                self._kept_pending = set(self._kept)
            backward[2] = now
            if self._learned < LEARN_BACKWARDS:
                self._fired.append(index)
                return
            self._kept_pending.discard(index)
            if not self._kept_pending:
                self._close_backward(recorder, now)
        except Exception:
            _counts["hook_errors"] += 1

    def _close_backward(self, recorder: Any, end_ns: Optional[int]) -> None:
        """Records the backward under way as `ddp-grads-ready`, ending at `end_ns` or else at its
        latest gradient (nothing when it saw none), and learns from it while learning."""
        backward, self.backward = self.backward, None
        assert backward is not None  # each caller checks first
        self.forward_end = None  # one forward, one backward
        if self._learned < LEARN_BACKWARDS and self._fired:
            self._learn(self._fired[-1])
        self._fired = []
        end_ns = backward[2] if end_ns is None else end_ns
        if end_ns is None:
            return
        start_ns, binding = backward[0], backward[1]
        opened = (GRADS_READY, False, None, binding[0], start_ns, None)
        _append(recorder, (INTERVAL, opened, end_ns, None, binding))

    def _learn(self, last_index: int) -> None:
        self._last_fired.add(last_index)
        self._learned += 1
        if self._learned < LEARN_BACKWARDS:
            return
        self._kept = frozenset(self._last_fired)
        for index in list(self._handles):
            if index not in self._kept:
                self._handles.pop(index).remove()

    # -- communication --
    def use_hook(self, hook: Callable, state: Any) -> None:
        """The communication hook the timed hook runs: DDP's default or the script's."""
        self.comm = (hook, state)
        self.user_hook = True

    def timed(self) -> Callable:
        """The hook registered with DDP: runs `comm`'s hook with its state, timing the last bucket
        of each iteration; wraps() keeps the name and signature of the hook it was made for, for
        DDP's checks and logging."""

        @functools.wraps(self.comm[0])
        def timed_hook(_registered_state: Any, bucket: Any) -> Any:
            hook, state = self.comm
            recorder = rank_state.current_recorder()
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
        """At the last bucket: closes a backward whose end no kept hook saw; returns (ready ns,
        binding), else None."""
        try:
            if type(bucket) is tuple or not bucket.is_last():  # a tuple: DDP's Python reducer, per parameter
                return None
            ready_ns = _time_ns()
            backward = self.backward
            if backward is not None:  # its end went unseen (its last gradient not among those kept)
                self._close_backward(recorder, ready_ns)
                binding = backward[1]
            else:
                binding = recorder.binding
            return ready_ns, binding
        except Exception:
            _counts["hook_errors"] += 1
            return None


def _grad_tensors(output: Any, tensor_type: type[Any]) -> list:
    """Up to MAX_OUTPUT_HOOKS tensors of a forward's output that backward can reach: the output
    itself, or the items of a tuple, list or mapping (a Hugging Face ModelOutput is one), one level
    down."""
    if isinstance(output, tensor_type):
        candidates = [output]
    elif isinstance(output, (tuple, list)):
        candidates = list(output)
    elif isinstance(output, dict):
        candidates = list(output.values())
    else:
        return []
    # not a leaf (a parameter returned as it is): a hook on it would stay for every later forward
    return [value for value in candidates
            if isinstance(value, tensor_type) and value.requires_grad and value.grad_fn is not None][:MAX_OUTPUT_HOOKS]


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
