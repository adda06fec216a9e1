"""Public entry point for Megatron-LM: `from otel_straggler.megatron import install`, then `install()`
before `pretrain(...)`. The code lives in otel_straggler.integrations.megatron (docs/megatron.md);
this module re-exports its install() so that both import paths are public and stay so, the one
launch scripts written against the first releases use included."""
from otel_straggler.integrations.megatron import install  # noqa: F401
