"""`opentelemetry-instrument python train.py` (or `opentelemetry-instrument torchrun ... train.py`)
switches the instrumentation on from env vars alone: with OTEL_STRAGGLER_ENABLED=true this
instrumentor times the training loop with no change to the script (automatic.py) and calls
configure() at its first training stage, so a process of the job that never trains (torchrun's
agent, a DataLoader worker) stays silent and sends nothing. Registered under the
`opentelemetry_instrumentor` entry point group, so it sits beside whatever distro and other
instrumentors the user has."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_straggler.instrumentation import api
from otel_straggler.instrumentation.settings import SETTINGS
from otel_straggler.settings import ConfigError, resolve


class StragglerInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # torch is optional: without it, configure() alone (the explicit API's stages)

    def _instrument(self, **kwargs) -> None:
        try:
            enabled = resolve([s for s in SETTINGS if s.name == "enabled"], None, os.environ).get("enabled", False)
            if not enabled:
                return
            resolve(SETTINGS, None, os.environ)  # a bad OTEL_STRAGGLER_* says so now, not at the first step
            if importlib.util.find_spec("torch") is None:
                api.configure()  # a script timing its stages with stage()/step() and no torch
                return
            from otel_straggler.instrumentation import automatic

            automatic.instrument(steps="optimizer", configure_lazily=True)
        except ConfigError as error:
            # A bad env var must not stop training: say what is wrong, once, and stay off.
            print(f"otel-straggler: disabled: {error}", file=sys.stderr)
        except Exception as error:
            # Nor anything else configure() meets (no CUDA where device timing requires it, an
            # exporter that cannot be made): raised, it would also stop the instrumentors after us.
            print(f"otel-straggler: disabled: {type(error).__name__}: {error}", file=sys.stderr)

    def _uninstrument(self, **kwargs) -> None:
        if "otel_straggler.instrumentation.automatic" in sys.modules:
            from otel_straggler.instrumentation import automatic

            automatic.uninstrument()
        handle = api.current()
        if handle is not None:
            handle.shutdown()
