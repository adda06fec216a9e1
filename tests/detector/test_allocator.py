"""The detector process's allocator setting (detector/allocator.py), each case in a fresh process:
the setting is process-wide and cannot be undone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from otel_straggler.detector import allocator

pytestmark = pytest.mark.skipif(not allocator._glibc(), reason="the setting is glibc's")

# allocates and frees 1 MiB arrays, as judging a large window does, and prints the page faults
# (under numpy's 4 MiB hint for huge pages, so each array is 256 small pages wherever the kernel
# would give huge ones)
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
    np.ones(1 << 17).sum()
before = faults()
for _ in range(100):
    column = np.ones(1 << 17)
    derived = column * 2.0
    del column, derived
print(faults() - before)
"""
LOOPS, PAGES = 100, 256  # 100 loops of two arrays of 1 MiB, 256 pages each


def run(mode: str, **env: str) -> tuple[str, int]:
    """(what the child said it did, its page faults over the loops), in an environment without
    the caller's own malloc settings."""
    own = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    done = subprocess.run([sys.executable, "-c", _WINDOWS, mode], capture_output=True, text=True, check=True,
                          env={**own, **env})
    said, faults = done.stdout.splitlines()
    return said, int(faults)


def test_freed_window_arrays_are_not_faulted_in_again():
    said, kept = run("keep")
    assert said.startswith("glibc malloc keeps freed memory")
    # the same loop at glibc's defaults: an array's pages faulted in again in every loop (so the
    # test can fail), and with the setting a small fraction of that
    said, default = run("default")
    assert default > LOOPS * PAGES // 2, default
    assert kept * 10 < default, (kept, default)


@pytest.mark.parametrize("env, said_expected", [
    ({"MALLOC_TRIM_THRESHOLD_": "1"}, "left as it is (tuned through the environment)"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "left as it is (tuned through the environment)"),
    ({"LD_PRELOAD": "libc.so.6"}, "left as it is (LD_PRELOAD may replace malloc)"),  # a harmless preload
])
def test_an_operators_own_malloc_tuning_is_left_as_it_is(env, said_expected):
    said, faults = run("keep", **env)
    assert said == said_expected
    assert faults > LOOPS * PAGES // 2, faults
