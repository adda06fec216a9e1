"""One demo rank: `python -m otel_straggler.demo.rank_process PARENT_PID MODULE ARGS...` runs the
trainer module as `python -m MODULE ARGS...` would, tied to the demo's life: when the demo dies,
even by SIGKILL, the rank gets SIGTERM instead of training on as an orphan.

Set here, in the rank, rather than in a preexec_fn of the launcher: a preexec_fn forces a plain
fork() of the demo, which holds gRPC threads (the embedded detector), and gRPC then warns about it.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main() -> None:
    parent_pid, module, *arguments = sys.argv[1:]
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent_pid):
        sys.exit("otel-straggler demo rank: the demo ended before this rank started")
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
