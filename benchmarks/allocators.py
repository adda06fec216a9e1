"""The malloc settings a benchmark's training processes run with, both arms alike.

glibc's malloc gives freed memory back to the OS by heuristics (a dynamic mmap threshold,
trimming the heap's top), so how many of a CPU training step's tensor pages come back fresh, to be
faulted in again at 1.4-1.7 us each, depends on where they happen to lie in the address space:
on the 2-core VM, from 0 to 1,142 faults a step from one arm to the next in the same process, in
OFF's arms as in ON's, redrawn by any allocation made before the model's (docs/overhead.md,
"Allocator"). `kept-memory` keeps freed memory mapped, so a pair compares the library, not where
the heap's top fell; `glibc-default` is glibc's own behaviour.
"""
from __future__ import annotations

from typing import Mapping

from otel_straggler.detector.allocator import MMAP_THRESHOLD_BYTES

# the largest mmap threshold glibc accepts on 64 bits, as the detector sets it (32 MiB: a larger
# one is ignored), so a single allocation of 32 MiB or more is still mapped afresh each time; the
# demo's are far smaller
KEPT_MMAP_THRESHOLD, KEPT_TRIM_THRESHOLD, KEPT_TOP_PAD = MMAP_THRESHOLD_BYTES, 1 << 30, 64 << 20
ALLOCATORS: dict[str, dict[str, str]] = {
    "kept-memory": {"MALLOC_MMAP_THRESHOLD_": str(KEPT_MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(KEPT_TRIM_THRESHOLD),
                    "MALLOC_TOP_PAD_": str(KEPT_TOP_PAD)},
    "glibc-default": {},
}
# what would change glibc's malloc behaviour if inherited from the caller's environment
# PYTHONMALLOC too: =malloc sends every Python object to glibc's malloc, moving what faults
_MALLOC_VARIABLES = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "PYTHONMALLOC")


def allocator_environment(name: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a training process under the allocator `name`: the caller's own malloc
    settings (MALLOC_*, GLIBC_TUNABLES, a preloaded allocator, Python's own allocator choice)
    removed, then the allocator's set."""
    kept = {key: value for key, value in environ.items() if not key.startswith(_MALLOC_VARIABLES)}
    return {**kept, **ALLOCATORS[name]}
