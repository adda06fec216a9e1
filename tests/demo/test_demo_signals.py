"""Stopping the demo from outside never leaves its ranks training on as orphans."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is not training
        return stat.read().split(") ", 1)[1][0] != "Z"


def start_demo(out_dir) -> tuple[subprocess.Popen, list[int]]:
    demo = subprocess.Popen([sys.executable, "-m", "otel_straggler", "demo", "--out", str(out_dir), "--steps", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    for line in demo.stdout:
        found = re.search(r"started \d+ ranks \(pids ([\d ]+)\)", line)
        if found:
            return demo, [int(pid) for pid in found.group(1).split()]
        if time.monotonic() > deadline:
            break
    demo.kill()
    pytest.fail("the demo never said it started its ranks")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_demo_stops_its_ranks(tmp_path, stop_signal):
    demo, rank_pids = start_demo(tmp_path / "demo")
    try:
        assert all(alive(pid) for pid in rank_pids)
        demo.send_signal(stop_signal)
        demo.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in rank_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in rank_pids if alive(pid)] == []
    finally:
        demo.kill()
        for pid in rank_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
