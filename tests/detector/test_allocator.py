"""The detector process's allocator setting (detector/allocator.py), each case in a fresh process:
the setting is process-wide and cannot be undone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from otel_straggler.detector import allocator

pytestmark = pytest.mark.skipif(not allocator._glibc(), reason="the setting is glibc's")

# allocates and frees 4 MiB arrays, as judging a large window does, and prints the page faults
_WINDOWS = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from otel_straggler.detector.allocator import keep_freed_memory
    print(keep_freed_memory())
else:
    print("defaults")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    np.ones(1 << 19).sum()
before = faults()
for _ in range(100):
    column = np.ones(1 << 19)
    derived = column * 2.0
    del column, derived
print(faults() - before)
"""
ALLOCATIONS = 200  # two arrays of 4 MiB, 1,024 pages each, in each of the 100 loops
PAGES = 1024


def run(mode: str, **env: str) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", _WINDOWS, mode], capture_output=True, text=True, check=True,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
    said, faults = done.stdout.splitlines()
    return said, int(faults)


def test_freed_window_arrays_are_not_faulted_in_again():
    said, faults = run("keep")
    assert said.startswith("glibc malloc keeps freed memory")
    assert faults < ALLOCATIONS * PAGES // 20, faults
    # the same loop at glibc's defaults: an array's pages faulted in again in every loop (the test can fail)
    said, faults = run("default")
    assert faults > ALLOCATIONS * PAGES // 4, faults


def test_an_operators_own_malloc_tuning_is_left_as_it_is():
    said, faults = run("keep", MALLOC_TRIM_THRESHOLD_="1")
    assert said == "left as it is (tuned through the environment)"
    assert faults > ALLOCATIONS * PAGES // 4, faults
