"""Types of the C extension _otlp_scan.c, decode.py's fast path (its method table documents each)."""
from typing import Any, Optional

RECORD_SIZE: int

def configure(keys: tuple[bytes, ...], default_cohort: str, device_timing: bytes, heartbeat_name: bytes, /) -> None: ...
def scan(payload: bytes, /) -> Optional[tuple[bytes, list[str], list[tuple[str, int, str, int, int]], int,
                                              list[bytes], list[tuple[bytes, bytes]]]]: ...
