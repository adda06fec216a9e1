"""Types of the C extension _otlp_write.c, the span encoder's fast path (its method table documents
it). It takes any values: what it cannot write it declines with None, for the Python encoder."""
from typing import Any, Optional

def span(trace_id: Any, span_id: Any, parent_span_id: Any, parent_is_remote: Any, name: Any, kind: Any,
         start_time: Any, end_time: Any, attributes: Any, status_code: Any, /) -> Optional[bytes]: ...

def join(parts: list[bytes], /) -> bytes: ...

def record_spans(spans: list[Any], span_type: type, resource: Any, scope: Any, index: int, /) -> list[Optional[tuple[int, bytes]]]: ...
