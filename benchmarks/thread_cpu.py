"""CPU time so far of each thread of this process, by name (Linux: per-thread CPU clocks), for
the benchmarks that say which thread spent what."""
from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path


def _thread_cpu_clock(tid: int) -> int:
    """Linux's CPU-time clock id of any thread of this process (MAKE_THREAD_CPUCLOCK(tid, SCHED))."""
    return ((~tid) << 3) | 6


def thread_cpu_ns() -> dict[str, int]:
    """CPU ns so far of each live thread of this process, summed by name: Python threads by
    their threading name, the others (gloo, gRPC core) by their kernel name."""
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    totals: collections.Counter = collections.Counter()
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            cpu_ns = time.clock_gettime_ns(_thread_cpu_clock(tid))
            name = python_names.get(tid) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # exited meanwhile; its time still counts in the process total
        totals[name] += cpu_ns
    return dict(totals)


def thread_cpu_since(before: dict[str, int]) -> dict[str, int]:
    """CPU ns of each thread since the `thread_cpu_ns()` snapshot `before`; threads that spent none
    are left out."""
    spent = {name: cpu - before.get(name, 0) for name, cpu in thread_cpu_ns().items()}
    return {name: cpu for name, cpu in spent.items() if cpu > 0}
