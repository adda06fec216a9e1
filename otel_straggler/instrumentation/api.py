"""The training-side public API: configure(), stage(), step().

Until configure() succeeds, stage() and step() cost one global read and do nothing, so the
calls can stay in the training script whether the instrumentation is on or off.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any, Mapping, Optional

from otel_straggler import contract
from otel_straggler.instrumentation import hot_path, identity, rank_state
from otel_straggler.instrumentation.hot_path import IntervalRecorder
from otel_straggler.instrumentation.rank_state import current  # noqa: F401 (otel_straggler.current)
from otel_straggler.instrumentation.rank_settings import DEFAULTS, SETTINGS
from otel_straggler.settings import ConfigError, parse_bool, resolve

# The running handle and its recorder are rank_state's; this lock orders configure() and shutdown().
_configure_lock = threading.Lock()


# `with stage(name):`, `@stage(name)` and `step(n, ...)` are the hot path's own types (hot_path.py:
# C where built, else Python), documented there.
stage = hot_path.Stage
step = hot_path.Step


class Instrumentation:
    """The handle configure() returns: status(), flush(), shutdown()."""

    def __init__(self, enabled: bool, options: dict, resource_attributes: dict) -> None:
        self.enabled = enabled
        self.options = options
        self.resource_attributes = resource_attributes
        self.recorder: Optional[IntervalRecorder] = None
        self._pipeline: Any = None  # a RankPipeline once running (imported when needed: the SDK, threads)
        self._shut_down = False

    def status(self) -> dict:
        """Every counter of the rank side: what was recorded, built, exported and lost (by reason)."""
        recorder, pipeline = self.recorder, self._pipeline
        if recorder is None or pipeline is None:
            return {"enabled": False, "intervals": 0, "spans_built": 0, "exported": 0, "lost": {}}
        # the sections of the modules built on the recorder (ddp, timer_misuse, automatic)
        return {**pipeline.status(recorder), "shut_down": self._shut_down, **rank_state.status_sections()}

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Builds everything recorded so far and exports it; False if it did not finish in time."""
        if self._pipeline is None or self._shut_down:
            return self._pipeline is None
        try:
            return self._pipeline.flush(timeout_s)
        except Exception:
            return False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with _configure_lock:
            if rank_state.current() is self:
                rank_state.use(None, None)
        if self._pipeline is None or self._shut_down:
            return
        self._shut_down = True  # status() keeps answering with the final counters
        try:
            self._pipeline.shutdown(timeout_s)
        except Exception:
            pass


def configure(
    *,
    job_id: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_rank: Optional[int] = None,
    cohort: Optional[str] = None,
    topology_epoch: Optional[int] = None,
    restart_count: Optional[int] = None,
    endpoint: Optional[str] = None,
    protocol: Optional[str] = None,
    device_timing: Optional[str] = None,
    tracer_provider: Any = None,
    device_processor: Any = None,
    environ: Optional[Mapping[str, str]] = None,
    **settings: Any,
) -> Instrumentation:
    """Turns the instrumentation on for this process and returns its handle (idempotent: a
    second call returns the running handle). Unset values come from OTEL_* / OTEL_STRAGGLER_*
    env vars, then discovery. `OTEL_SDK_DISABLED=true` returns a handle that records nothing.

    `tracer_provider` reuses a provider you already have: spans go through its sampler,
    resource and processors, and the identity attributes are put on each span as well. Device
    durations are then attached only if you pass the CudaEventSpanProcessor you installed on it
    as `device_processor`.
    """
    environ = os.environ if environ is None else environ
    with _configure_lock:
        running = rank_state.current()
        if running is not None:
            return running
        explicit = {"job_id": job_id, "cohort": cohort, "topology_epoch": topology_epoch,
                    "restart_count": restart_count, "device_timing": device_timing, **settings}
        given = resolve(SETTINGS, explicit, environ)
        options = {**DEFAULTS, **given}
        # Only values given count as explicit: a default must not hide OTEL_RESOURCE_ATTRIBUTES.
        attributes = identity.discover({**given, "rank": rank, "world_size": world_size, "local_rank": local_rank},
                                       environ)
        if _sdk_disabled(environ):
            return Instrumentation(False, options, attributes)

        from otel_straggler.instrumentation.rank_pipeline import RankPipeline  # the SDK, exporters, threads

        handle = Instrumentation(True, options, attributes)
        handle.recorder = IntervalRecorder(options["queue_size"])
        handle._pipeline = RankPipeline(handle.recorder, options, attributes, endpoint, protocol,
                                        tracer_provider, device_processor, environ)
        rank_state.use(handle, handle.recorder)
        atexit.register(handle.shutdown, 5.0)
        if contract.JOB_ID not in attributes:
            # the detector rejects every span without one: say it here, once, where it can be set
            logging.getLogger("otel_straggler").warning(
                "otel-straggler: no job id found (set OTEL_STRAGGLER_JOB_ID, or training.job.id in "
                "OTEL_RESOURCE_ATTRIBUTES, to one value for every rank); the detector will reject these spans")
        return handle


def _sdk_disabled(environ: Mapping[str, str]) -> bool:
    try:
        return parse_bool(environ.get("OTEL_SDK_DISABLED", "false") or "false")
    except ValueError:
        raise ConfigError(f"OTEL_SDK_DISABLED: expected true or false, got {environ['OTEL_SDK_DISABLED']!r}") from None
