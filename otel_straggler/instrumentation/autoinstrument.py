"""`opentelemetry-instrument python train.py` (or under torchrun) switches the instrumentation
on from env vars alone: with OTEL_STRAGGLER_ENABLED=true this instrumentor calls configure()
at interpreter start. Registered under the `opentelemetry_instrumentor` entry point group, so
it sits beside whatever distro and other instrumentors the user has."""
from __future__ import annotations

import os
import sys
from typing import Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_straggler.instrumentation import api
from otel_straggler.instrumentation.settings import SETTINGS
from otel_straggler.settings import ConfigError, resolve


class StragglerInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs) -> None:
        try:
            enabled = resolve([s for s in SETTINGS if s.name == "enabled"], None, os.environ).get("enabled", False)
            if not enabled:
                return
            api.configure()
        except ConfigError as error:
            # A bad env var must not stop training: say what is wrong, once, and stay off.
            print(f"otel-straggler: disabled: {error}", file=sys.stderr)
        except Exception as error:
            # Nor anything else configure() meets (no CUDA where device timing requires it, an
            # exporter that cannot be made): raised, it would also stop the instrumentors after us.
            print(f"otel-straggler: disabled: {type(error).__name__}: {error}", file=sys.stderr)

    def _uninstrument(self, **kwargs) -> None:
        handle = api.current()
        if handle is not None:
            handle.shutdown()
