"""Hugging Face `Trainer`: one line, `Trainer(..., callbacks=[StragglerCallback()])`, gives every
rank stage spans bound to the Trainer's global step; the exporter comes from the usual OTel
variables (OTEL_EXPORTER_OTLP_ENDPOINT, ...). Keyword arguments are configure()'s.

The stages (`batch-generator`, `forward-compute`, `backward-compute`, `optimizer`, the
torch.distributed collectives, `ddp-grads-ready`, `ddp-grads-sync`, `evaluate`) are timed by
otel_straggler.instrumentation.automatic, which documents what each covers. The callback switches
it on when it is made, before the Trainer wraps the model in DDP, so that model gets the DDP
hooks; and it binds the steps.

One optimizer update of transformers 5.x's `Trainer._run_epoch`, and where it lands:

| the Trainer does | hook | the callback | lands in |
|---|---|---|---|
| | on_train_begin | configure(), begin step `global_step` | |
| fetch the update's K micro-batches (and, by default, all-gather their label count) | | | step n |
| | on_step_begin (first micro-batch) | | |
| K x (forward, backward), DDP's all-reduce in the last | on_substep_end between | | step n |
| clip gradients, optimizer step | on_pre_optimizer_step, on_optimizer_step | | step n |
| scheduler step, zero_grad, `global_step` = n + 1 | on_step_end | end step n, begin step n + 1 | |
| log when due (an all-gather of the loss) | on_log | | step n + 1, unless evaluate / save follow |
| evaluate / save when due | on_evaluate, on_save | begin step n + 1 there | after step n's end |

Step n is the update that makes `state.global_step` n + 1 (the global step when it begins), one
per optimizer update however many micro-batches it accumulates. It begins before its data is
fetched, so the wait for data is its own. When the Trainer evaluates or saves after an update
(or at an epoch's end, or at train start with eval_on_start), the next step begins only after
that (at on_evaluate, on_save or on_epoch_begin), so evaluation is outside every step's span:
its spans carry the number of the step before it. At the latest a step begins at on_step_begin,
after its fetch; that is where a deferral no later hook resolved lands. accelerate's loader reads
one batch ahead, so the fetch timed in step n reads the batch after; the wait is still step n's.

The callback opens no stage of its own: on_pre_optimizer_step/on_optimizer_step bracket exactly
the optimizer step the automatic timing already times, and a stage opened by the script around
automatic ones switches the automatic stages off.

Workload: not reported. The Trainer counts tokens (include_num_input_tokens_seen) only after each
micro-batch, summed over all ranks, and no hook sees the batch, so no rank's tokens or samples of
a step are known when it begins.

The instrumentation is configured at on_init_end (the Trainer made the process group by then, so
identity is found from torch.distributed as well as the environment) and again, a no-op then, at
on_train_begin for a callback added after the Trainer was made. Every callback runs on every
rank. At on_train_end the step is ended, the spans flushed and the instrumentation shut down
(bounded), unless the script had configured it itself; a later train() configures it again.

Nothing raises into training: each hook catches its own failure, counts it (`counts()["errors"]`)
and logs the first.
"""
from __future__ import annotations

from typing import Any, Optional

from transformers import TrainerCallback

import otel_straggler
from otel_straggler.instrumentation import automatic
from otel_straggler.integrations.fail_open import fails_open, note_failure

FLUSH_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0


class StragglerCallback(TrainerCallback):
    """Stage spans and straggler verdicts for a Hugging Face `Trainer`, on every rank.
    `StragglerCallback(**kwargs)`: kwargs go to otel_straggler.configure()."""

    def __init__(self, **configure_kwargs: Any) -> None:
        self._configure_kwargs = configure_kwargs
        self._handle: Optional[otel_straggler.Instrumentation] = None
        self._owns_handle = False
        self._bound_step: Optional[int] = None  # the step last begun
        self._step_open = False
        self._deferred = False  # the next step begins after the evaluation or save under way
        self._errors = 0
        self._steps_begun = 0
        self._shut_down = False
        self._instrumented = False
        try:
            # now, before the Trainer wraps the model: every DDP model made from here on gets the hooks
            self._instrumented = automatic.instrument(steps="framework")
        except Exception as error:
            note_failure(self, "__init__", error)

    def counts(self) -> dict:
        """errors: hooks that failed; steps: steps begun; instrumented: the automatic timing is
        installed; configured: the instrumentation is on; shut_down: on_train_end shut it down."""
        return {"errors": self._errors, "steps": self._steps_begun, "instrumented": self._instrumented,
                "configured": self._handle is not None and self._handle.enabled, "shut_down": self._shut_down}

    # -- the Trainer's hooks --

    @fails_open
    def on_init_end(self, args, state, control, **kwargs):
        # every rank runs every callback; by now the Trainer's arguments have made the process
        # group, so the rank is known from torch.distributed even where no launcher set RANK
        self._configure()

    @fails_open
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._configure()
        if model is not None:
            automatic.instrument_model(model)  # a DDP model passed in, made before the callback
        self._bound_step, self._step_open = None, False
        if args.eval_on_start:
            self._deferred = True  # the evaluation comes first
        else:
            self._begin(state.global_step)

    @fails_open
    def on_epoch_begin(self, args, state, control, **kwargs):
        self._begin_unless_bound(state.global_step)

    @fails_open
    def on_step_begin(self, args, state, control, **kwargs):
        self._begin_unless_bound(state.global_step)

    @fails_open
    def on_step_end(self, args, state, control, **kwargs):
        self._end()
        if control.should_training_stop:
            return
        # DefaultFlowCallback, first in the list, has set what the Trainer does before the next
        # fetch; at an epoch's end, on_epoch_end may still ask for an evaluation or a save
        epoch_ends = state.epoch is not None and float(state.epoch).is_integer()
        if epoch_ends or control.should_evaluate or control.should_save:
            self._deferred = True
        else:
            self._begin(state.global_step)

    @fails_open
    def on_evaluate(self, args, state, control, **kwargs):
        if self._deferred and not control.should_save:
            self._begin(state.global_step)

    @fails_open
    def on_save(self, args, state, control, **kwargs):
        if self._deferred:
            self._begin(state.global_step)

    @fails_open
    def on_train_end(self, args, state, control, **kwargs):
        self._deferred = False
        self._end()
        handle, self._handle = self._handle, None
        if handle is None:
            return
        handle.flush(timeout_s=FLUSH_TIMEOUT_S)
        if self._owns_handle:
            handle.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
            self._shut_down = True

    # -- steps and configuration --

    def _configure(self) -> None:
        if self._handle is not None and otel_straggler.current() is self._handle:
            return
        self._owns_handle = otel_straggler.current() is None
        self._handle = otel_straggler.configure(**self._configure_kwargs)
        self._shut_down = False

    def _begin(self, step: int) -> None:
        self._deferred = False
        if self._step_open:
            automatic.end_step()
        automatic.begin_step(step)
        self._bound_step, self._step_open = step, True
        self._steps_begun += 1

    def _begin_unless_bound(self, step: int) -> None:
        if self._bound_step != step:
            self._begin(step)

    def _end(self) -> None:
        if self._step_open:
            automatic.end_step()
            self._step_open = False
