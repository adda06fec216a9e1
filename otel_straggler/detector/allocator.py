"""The detector process's memory allocator: memory freed after one window kept for the next.

Judging a window makes numpy arrays of a few hundred KiB to a few MiB (tens of them, one per
column and intermediate statistic) and frees them at its end. glibc's malloc serves a block over
its mmap threshold with a mapping of its own, unmapped at free, and gives the top of its heap back
to the OS past its trim threshold; its adaptive thresholds settle low for this pattern. Each window
then faults its arrays' pages in again, zeroed by the kernel: about 0.13 s of kernel time in each
end-to-end pass of the throughput benchmark (1-1.7 s of CPU), none with the setting
(docs/detection.md#speed).

keep_freed_memory() sets both thresholds, as `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_`
would, so those arrays come from the heap and its freed top stays mapped up to TRIM_THRESHOLD_BYTES
per arena. RSS then stays near its high-water mark instead of falling between windows; the peak
moves by little (387.5 against 382.0 MiB of growth at 10,000 ranks). The detector's own processes
call it (`detect`, `replay`): an application that embeds DetectorService keeps its allocator as it
is. Where the operator tuned malloc through the environment, preloads a library (LD_PRELOAD, such as
another allocator), or the C library is not glibc, it changes nothing.
"""
from __future__ import annotations

import os

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's own ceiling for its adaptive mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and
# twice it for the trim threshold, as its adaptive rule keeps them
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20
# an operator's own tuning, which wins
_OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> str:
    """Sets glibc's thresholds (see the module docstring); says what it did, for the start-up line.
    Never raises: the detector starts either way."""
    if not _glibc():
        return "left as it is (not glibc)"
    if any(name in os.environ for name in _OPERATOR_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "left as it is (tuned through the environment)"
    if os.environ.get("LD_PRELOAD"):  # tcmalloc, jemalloc: their mallopt, where they have one, does nothing
        return "left as it is (LD_PRELOAD may replace malloc)"
    try:
        import ctypes  # here: a Python built without _ctypes still runs the detector

        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        mmap_set = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        trim_set = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) if mmap_set else 0
    except Exception as error:  # noqa: BLE001 - whatever ctypes raises, the allocator stays as it is
        return f"left as it is (mallopt: {type(error).__name__})"
    if not mmap_set:
        return "left as it is (mallopt refused)"
    if not trim_set:  # the mmap threshold is set (and glibc's adaptive thresholds off): say so
        return (f"glibc malloc keeps freed memory in part (mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB; "
                "trim threshold refused)")
    return f"glibc malloc keeps freed memory (mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, " \
           f"trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB)"


def _glibc() -> bool:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):  # a platform without the name, or without confstr
        return False
    return version is not None and version.startswith("glibc")
