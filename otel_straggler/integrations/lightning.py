"""Lightning: `Trainer(callbacks=[StragglerCallback()])` gives every rank stage spans, and the
detector its verdicts, with no other change to the script than the OTLP endpoint
(OTEL_EXPORTER_OTLP_ENDPOINT). `StragglerCallback(**kwargs)` passes its keywords to
`otel_straggler.configure()`; the rank, world size and local rank come from the Trainer.

The stages are the automatic timing's (otel_straggler/instrumentation/automatic.py): the batch
fetch (`batch-generator`), the training forward (`forward-compute`: under DDP the whole
`training_step`, as Lightning runs it inside the DDP wrapper's forward), `backward-compute`,
`optimizer` (from after the closure: the forward and backward that Lightning runs inside
`optimizer.step(closure)` are not in it), the `torch.distributed` collectives Lightning calls
(its barriers, the per-batch `broadcast` of the SIGTERM flag, `self.log(..., sync_dist=True)`'s
barrier and all-reduce) and DDP's `ddp-grads-ready` / `ddp-grads-sync`. A `self.log(...,
sync_dist=True)` in `training_step` syncs right there: its collectives split that micro-batch's
`forward-compute` in two, so the wait for the peers is theirs, not the forward's. The callback adds
what only the Trainer knows: who this rank is, and which optimizer step is under way.

| hook | what the callback does |
|---|---|
| `setup` (fit) | process group up, DDP not wrapped yet: configure(), automatic timing, `trainer.global_step` bound |
| `on_fit_start` | the model the strategy wrapped gets the DDP hooks if it has none |
| `on_train_start` | step `trainer.global_step` bound again when a checkpoint restored it |
| `on_train_batch_end` | after an optimizer step (`trainer.global_step` moved): next step bound unless training ends |
| `on_train_end`, `on_exception`, `teardown` | step ended, what the callback turned on off, spans exported (bounded) |

Steps are `trainer.global_step`, the optimizer steps: with `accumulate_grad_batches=K` the K
micro-batches of one optimizer step are one step. A step is bound right after the previous
optimizer step, so it holds everything up to its own optimizer step: the batch fetches, any
validation run at the end of the previous step, the forwards and backwards of its micro-batches.
The first step also holds the set-up from `setup` on (DDP's construction, the sanity check).
Under manual optimization `trainer.global_step` counts every `optimizer.step()`: a step of several
optimizers is numbered by the last one.

Which step a fetch lands in: with a DataLoader of known length Lightning fetches each batch just
before it runs it, so a fetch lands in the step that trains on it. Without a length (an iterable
dataset) Lightning reads one batch ahead: the fetch timed with a batch reads the next one, so a
step's last fetch reads the next step's first batch, and the first fetch, made before
`on_train_start`, is in the first step.

Validation is not counted as training: its forwards run with grad disabled and are timed as
`evaluate`, its fetches (grad disabled too) are not timed; its metric collectives are timed as
collectives of the step under way.

Workload: neither tokens nor samples are reported. Lightning has no notion of tokens, and a step
is bound before its batches are fetched, so its sample count is not known when it has to be given.

Nothing here raises into training: each hook catches its own errors and counts them
(`counts()`), logging the first. The callback shuts down at train end only what
it turned on: a handle of the script's own configure() is flushed, not shut down. Importing
otel_straggler never imports Lightning: only this module does, and it takes `lightning.pytorch`
where installed, else `pytorch_lightning` (the same hooks; either package's Trainer accepts it).
"""
from __future__ import annotations

from typing import Any, Optional

try:
    from lightning.pytorch import Callback
except ImportError:  # only the older package name is installed
    # the older package's class of the same name and hooks
    from pytorch_lightning import Callback  # type: ignore[assignment]

from otel_straggler.instrumentation import api, automatic, rank_state
from otel_straggler.integrations.fail_open import fails_open

FLUSH_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0


class StragglerCallback(Callback):
    """Stage spans and the optimizer step of every rank of a Lightning fit (see the module doc).
    Keywords go to `otel_straggler.configure()`; `rank`, `world_size` and `local_rank` default to
    the Trainer's."""

    def __init__(self, **configure_kwargs: Any) -> None:
        super().__init__()
        self._configure_kwargs = configure_kwargs
        self._handle: Optional[api.Instrumentation] = None
        self._owns_handle = False  # configure() made it here, so it is shut down here
        self._owns_timing = False  # the automatic timing was off before, so it is turned off here
        self._step: Optional[int] = None  # the step bound last
        self._steps_begun = 0
        self._errors = 0
        self._shut_down = False

    def counts(self) -> dict:
        """errors: hooks that failed; steps: steps begun; configured: the instrumentation is on;
        instrumented: the automatic timing is installed; shut_down: train end shut it down."""
        return {"errors": self._errors, "steps": self._steps_begun,
                "configured": self._handle is not None and self._handle.enabled,
                "instrumented": bool(automatic.counts()["instrumented"]), "shut_down": self._shut_down}

    # -- Lightning's hooks --

    @fails_open
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._handle is not None:
            return
        self._owns_handle = rank_state.current() is None
        self._shut_down = False
        identity = {"rank": trainer.global_rank, "world_size": trainer.world_size, "local_rank": trainer.local_rank}
        handle = api.configure(**{**identity, **self._configure_kwargs})
        self._handle = handle
        if not handle.enabled:
            return  # OTEL_SDK_DISABLED: nothing to time
        self._owns_timing = not automatic.counts()["instrumented"]
        automatic.instrument(steps="framework")
        self._bind(trainer.global_step)

    @fails_open
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._timing():
            automatic.instrument_model(trainer.strategy.model)

    @fails_open
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._timing() and trainer.global_step != self._step:
            self._bind(trainer.global_step)  # restored from a checkpoint after setup

    @fails_open
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._timing() or trainer.global_step == self._step:
            return  # a micro-batch that accumulated: the step goes on
        if not _training_ends(trainer):
            self._bind(trainer.global_step)

    @fails_open
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish()

    @fails_open
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish()

    @fails_open
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish()

    # -- ours --

    def _timing(self) -> bool:
        return self._handle is not None and self._handle.enabled

    def _bind(self, step: int) -> None:
        automatic.begin_step(step)
        self._step = step
        self._steps_begun += 1

    def _finish(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            automatic.end_step()
            if self._owns_timing:
                automatic.uninstrument()
        finally:
            self._step = None
            handle.flush(FLUSH_TIMEOUT_S)
            if self._owns_handle:
                handle.shutdown(SHUTDOWN_TIMEOUT_S)
                self._shut_down = True


def _training_ends(trainer: Any) -> bool:
    """Whether the optimizer step just made is the fit's last: then no step is bound after it."""
    if trainer.should_stop:
        return True
    max_steps = trainer.max_steps
    if max_steps is not None and 0 <= max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return bool(trainer.is_last_batch and max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1)
