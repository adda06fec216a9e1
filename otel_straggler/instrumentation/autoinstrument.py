"""`opentelemetry-instrument python train.py` (or `opentelemetry-instrument torchrun ... train.py`)
switches the instrumentation on from env vars alone: with OTEL_STRAGGLER_ENABLED=true this
instrumentor calls configure() at interpreter start (so stage()/step() and Megatron timers in the
script record) and times the training loop with no change to the script (automatic.py).

torchrun's agent and multiprocessing's children (a spawned DataLoader worker, a rank started by
`mp.spawn`) get the same environment, so the instrumentor runs there too. There it configures
nothing until the process runs a training stage of its own: the agent and the workers never do
and stay silent; a spawned rank is configured at its first training forward, with its rank from
torch.distributed. Registered under the `opentelemetry_instrumentor` entry point group, so it sits
beside whatever distro and other instrumentors the user has."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Collection

# the module opts out of type checking as a whole (a file-level `type: ignore`), so it shows no names
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_straggler.instrumentation import api, rank_state
from otel_straggler.instrumentation.rank_settings import SETTINGS
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

            helper = _launcher_or_child(getattr(sys, "orig_argv", sys.argv))
            if not helper:
                api.configure()
            automatic.instrument(steps="optimizer", configure_lazily=helper)
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
        handle = rank_state.current()
        if handle is not None:
            handle.shutdown()


def _launcher_or_child(argv: list) -> bool:
    """Whether this interpreter is torchrun's agent (`torchrun ...`, `python -m torch.distributed.run`
    or `.launch`) or a child multiprocessing started (spawn or forkserver), from its command line."""
    words = [str(word) for word in argv]
    script = words[1] if len(words) > 1 else ""  # after the interpreter: the script it runs
    if script.endswith(("torchrun", "torch/distributed/run.py", "torch/distributed/launch.py")):
        return True
    if "-m" in words[:-1] and words[words.index("-m") + 1] in ("torch.distributed.run", "torch.distributed.launch"):
        return True
    return "--multiprocessing-fork" in words or any("from multiprocessing." in word for word in words)
