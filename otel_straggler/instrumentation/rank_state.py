"""This process's rank state, held here and nowhere else: the running instrumentation handle, the
recorder that stage(), step(), the Megatron timers and the framework hooks record on, and the
status() sections of the modules built on them.

configure() and shutdown() (api.py) change the state with use(), and only they do; everything
else reads it at call time through current() and current_recorder(), so a handle shut down or a
forked child is seen at the next call. This module imports only the hot path, so any module may
import it without importing api.py.

The hot path (hot_path.py: the C extension, else its Python reference) keeps a copy of the
recorder, set by use() and nowhere else: its Stage and Step read it on the training thread as one
pointer load (a C static, or the reference's module global), where a call into this module would
cost a Python call per stage. use() sets both at once, so they never disagree.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from otel_straggler.instrumentation import hot_path

# The running handle (api.Instrumentation) and its recorder; both None while the instrumentation is off.
_handle: Any = None
_recorder: Optional[hot_path.IntervalRecorder] = None
# Counters of the modules built on the recorder (ddp: "ddp", megatron_timers: "timer_misuse",
# automatic: "automatic"), by the name status() gives them. Each registers itself when imported.
_status_sections: dict[str, Callable[[], dict]] = {}


def current() -> Any:
    """The running handle (an otel_straggler.Instrumentation), or None when the instrumentation is off."""
    return _handle


def current_recorder() -> Optional[hot_path.IntervalRecorder]:
    """The recorder to append to, or None when the instrumentation is off (then record nothing)."""
    return _recorder


def use(handle: Any, recorder: Optional[hot_path.IntervalRecorder]) -> None:
    """Makes `handle` and `recorder` the running ones (None, None: off), the hot path's copy too."""
    global _handle, _recorder
    _handle, _recorder = handle, recorder
    hot_path.install(recorder)


def add_status_section(name: str, counts: Callable[[], dict]) -> None:
    """Adds `name: counts()` to every status() from now on."""
    _status_sections[name] = counts


def status_sections() -> dict[str, dict]:
    return {name: counts() for name, counts in _status_sections.items()}


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) has no builder thread: record nothing there."""
    use(None, None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
