"""Megatron-LM in one line: `otel_straggler.megatron.install()` before `pretrain()`.

Megatron-LM builds its global timers in `megatron.training.global_vars` with the `Timers` it
imported from `megatron.core`, then hands them to its model and optimizer configs
(`config.timers = timers`), so a `config.timers` set by the caller does not take there. install()
makes `Timers` ours wherever Megatron looks it up (and replaces global timers already built), so
every timer of the training loop and of megatron-core records spans instead of synchronising.
Code that drives megatron-core directly can keep `config.timers = ots.Timers(...)`.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

from otel_straggler.instrumentation import api
from otel_straggler.instrumentation.megatron_timers import Timers

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
        raise ImportError(f"otel_straggler.megatron.install(): megatron-core is not importable ({error})") from None
    try:
        importlib.import_module("megatron.training.global_vars")
    except ImportError:
        pass  # megatron-core alone: whatever builds megatron.core.Timers from now on gets ours
    for home in TIMERS_CLASS_HOMES:
        module = sys.modules.get(home)
        if module is not None and hasattr(module, "Timers"):
            module.Timers = Timers
    _replace_built_global_timers(sys.modules.get("megatron.training.global_vars"))
    return handle


def _replace_built_global_timers(global_vars: Any) -> None:
    """Called after Megatron-LM built its timers (install() after `initialize_megatron()`): the
    same log level and option, ours. Configs that already hold the old ones keep them."""
    built = getattr(global_vars, "_GLOBAL_TIMERS", None)
    if built is None or isinstance(built, Timers):
        return
    global_vars._GLOBAL_TIMERS = Timers(getattr(built, "_log_level", 2), getattr(built, "_log_option", "minmax"))
