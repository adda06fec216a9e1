"""`otel_straggler.megatron.install()`, the path the first releases documented: the same install()
as otel_straggler.integrations.megatron, where Megatron-LM support lives (docs/megatron.md), kept
so that launch scripts written against it go on working."""
from otel_straggler.integrations.megatron import install  # noqa: F401
