"""The benchmarks' malloc settings (benchmarks/allocators.py): glibc keeps freed memory mapped under
kept-memory, gives it back under its defaults, and a caller's own settings do not leak into either."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from allocators import ALLOCATORS, allocator_environment

# Allocates 8 MiB, writes it, frees it, allocates and writes 8 MiB again: prints the page faults of
# the second allocation, which memory kept mapped does not take.
REUSE = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 8 << 20
first = libc.malloc(size); ctypes.memset(first, 1, size); libc.free(ctypes.c_void_p(first))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = libc.malloc(size); ctypes.memset(second, 2, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_on_reuse(allocator: str) -> int:
    output = subprocess.run([sys.executable, "-c", REUSE], env=allocator_environment(allocator, os.environ),
                            check=True, capture_output=True, text=True).stdout
    return int(output)


def _transparent_huge_pages_always() -> bool:
    """Where every anonymous mapping may get 2 MiB pages, 8 MiB faults in a few times, kept or not."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="huge pages take the 8 MiB in a few faults either way")
def test_kept_memory_reuses_freed_pages_where_glibc_default_faults_them_in_again():
    pages = (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults_on_reuse("glibc-default") > pages // 2
    assert faults_on_reuse("kept-memory") < pages // 20


def test_the_callers_malloc_settings_are_replaced_not_inherited():
    caller = {"PATH": "/bin", "MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "1", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0",
              "LD_PRELOAD": "libjemalloc.so.2", "PYTHONMALLOC": "malloc"}
    assert allocator_environment("glibc-default", caller) == {"PATH": "/bin"}
    assert allocator_environment("kept-memory", caller) == {"PATH": "/bin", **ALLOCATORS["kept-memory"]}
