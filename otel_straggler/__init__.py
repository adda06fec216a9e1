"""otel-straggler: find the slow rank of a synchronous training job with OpenTelemetry.

Training side:
    import otel_straggler as ots
    handle = ots.configure()              # or OTEL_STRAGGLER_ENABLED=true under opentelemetry-instrument
    for n, batch in enumerate(loader):
        ots.step(n, tokens=batch.numel())
        with ots.stage("forward-compute"):
            loss = model(batch)
    handle.shutdown()

PyTorch DDP: `ots.instrument_ddp(model)` on the DistributedDataParallel model splits backward into
the rank's own gradient compute and the wait for its peers.

Megatron-LM: `otel_straggler.integrations.megatron.install()` before `pretrain()`; on megatron-core alone,
`config.timers = ots.Timers(log_level, log_option)`, or use `ots.timers`.
"""
from otel_straggler.instrumentation.api import Instrumentation, configure, current, stage, step
# imported for its status() section as well: every key of status() is there from the start
from otel_straggler.instrumentation import automatic as _automatic  # noqa: F401 (imports no torch)
from otel_straggler.integrations.ddp import instrument_ddp
from otel_straggler.integrations.megatron_timers import Timer, Timers

__version__ = "0.1.0"

# A ready Timers at the most detailed level, for scripts that want Megatron-style timers.
timers = Timers(log_level=2)

__all__ = [
    "Instrumentation", "Timer", "Timers", "configure", "current", "instrument_ddp", "stage", "step", "timers",
    "__version__",
]
