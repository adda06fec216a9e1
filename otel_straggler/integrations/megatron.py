"""Megatron-LM in one line: `otel_straggler.integrations.megatron.install()` before `pretrain()`.

Megatron-LM builds its global timers in `megatron.training.global_vars` with the `Timers` it
imported from `megatron.core`, then hands them to its model and optimizer configs
(`config.timers = timers`), so a `config.timers` set by the caller does not take there. install()
makes `Timers` ours wherever Megatron looks it up (and replaces global timers already built), so
every timer of the training loop and of megatron-core records spans instead of synchronising.
It also binds each iteration's number to what is recorded in it (`ots.step(iteration)`, by
wrapping Megatron-LM's `train_step`), since the detector compares ranks step by step.
Code that drives megatron-core directly can keep `config.timers = ots.Timers(...)` and call
`ots.step()` itself.
"""
from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

from otel_straggler.instrumentation import api
from otel_straggler.integrations.megatron_timers import Timers

# Where Megatron keeps a reference to its Timers class: each is replaced where it is imported.
TIMERS_CLASS_HOMES = ("megatron.core.timers", "megatron.core", "megatron.training.global_vars")


def install(**configure_options: Any) -> api.Instrumentation:
    """Turns the instrumentation on (`configure(**configure_options)`, so OTEL_* env vars and
    the job's identity apply as usual) and makes Megatron's timers ours. Idempotent. Raises
    ImportError, with one line, when megatron-core is not installed."""
    handle = api.configure(**configure_options)
    try:
        importlib.import_module("megatron.core.timers")
    except ImportError as error:
        raise ImportError(f"otel_straggler.integrations.megatron.install(): megatron-core is not importable "
                          f"({error})") from None
    try:
        importlib.import_module("megatron.training.global_vars")
        training: Any = importlib.import_module("megatron.training.training")
    except ImportError:
        training = None  # megatron-core alone: whatever builds megatron.core.Timers from now on gets ours
    for home in TIMERS_CLASS_HOMES:
        module: Any = sys.modules.get(home)
        if module is not None and hasattr(module, "Timers"):
            module.Timers = Timers
    _replace_built_global_timers(sys.modules.get("megatron.training.global_vars"))
    train_step = getattr(training, "train_step", None)
    if train_step is not None and not getattr(train_step, "binds_otel_straggler_step", False):
        training.train_step = binding_the_step(train_step)  # train() looks it up in its module
    return handle


def binding_the_step(train_step: Callable) -> Callable:
    """Megatron-LM's train_step, calling `ots.step(iteration)` first. The iteration is its
    `iteration=` argument (Megatron-LM passes it), else `args.curr_iteration`."""

    @functools.wraps(train_step)
    def train_step_bound_to_its_iteration(*args: Any, **kwargs: Any) -> Any:
        try:
            iteration = kwargs.get("iteration")
            if iteration is None:
                from megatron.training.global_vars import get_args

                iteration = getattr(get_args(), "curr_iteration", None)
            if iteration is not None:
                api.step(iteration)
        except Exception:
            pass  # fail open: the step goes on unbound
        return train_step(*args, **kwargs)

    # a function's own attribute: the mark install() looks for, so a second install() wraps nothing
    train_step_bound_to_its_iteration.binds_otel_straggler_step = True  # type: ignore[attr-defined]
    return train_step_bound_to_its_iteration


def _replace_built_global_timers(global_vars: Any) -> None:
    """Called after Megatron-LM built its timers (install() after `initialize_megatron()`): the
    same log level and option, ours. Configs that already hold the old ones keep them."""
    built = getattr(global_vars, "_GLOBAL_TIMERS", None)
    if built is None or isinstance(built, Timers):
        return
    global_vars._GLOBAL_TIMERS = Timers(getattr(built, "_log_level", 2), getattr(built, "_log_option", "minmax"))
