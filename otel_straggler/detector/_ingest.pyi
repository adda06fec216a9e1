"""Types of the C extension _ingest.c, the engine's fast path (its method table documents it)."""
from typing import Any

def append_rows(observations: Any, start: int, ranks: Any, seq_mask: int, window_steps: int,
                collective_offset: int, restart_span: int, /) -> tuple[int, int, int, int]: ...
