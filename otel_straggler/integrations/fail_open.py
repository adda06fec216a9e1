"""What the framework callbacks share: their hooks never raise into training. A hook's failure is
counted on the callback (its `_errors`, read through `counts()`) and the first one logged."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

_log = logging.getLogger("otel_straggler")


def fails_open(hook: Callable) -> Callable:
    """Wraps a callback method: a failure is noted (note_failure) and the hook returns None, which
    leaves the framework's control as it was."""

    @functools.wraps(hook)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            hook(self, *args, **kwargs)
        except Exception as error:
            note_failure(self, hook.__name__, error)
        return None

    return guarded


def note_failure(callback: Any, where: str, error: Exception) -> None:
    callback._errors += 1
    if callback._errors == 1:
        _log.warning("otel-straggler: %s.%s failed (%s: %s); training goes on without it there",
                     type(callback).__name__, where, type(error).__name__, error)
