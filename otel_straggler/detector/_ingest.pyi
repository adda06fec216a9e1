"""Types of the C extension _ingest.c, the engine's fast path (its method table documents it)."""
from typing import Any, Sequence

def append_rows(observations: Any, start: int, ranks: Any, seq_mask: int, window_steps: int,
                collective_offset: int, restart_span: int, /) -> tuple[int, int, int, int]: ...
def append_records(records: bytes, strings: Sequence[str], identities: Sequence[tuple], start: int, ranks: Any,
                   seq_mask: int, window_steps: int, collective_offset: int, restart_span: int, /
                   ) -> tuple[int, int, int, int]: ...
