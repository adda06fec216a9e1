"""`otel-straggler demo` for real: 4 gloo ranks on this machine, the embedded detector, the report.

Each run takes tens of seconds (torch start-up dominates on 2 cores); every wait is bounded.
"""
from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 240  # a generous bound; a run takes 30-60 s on 2 busy cores
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SLOW_RANK, SLOW_STAGE, FROM_STEP, WINDOW_STEPS = 2, "forward-compute", 20, 20
# +50%, not the demo's +30%: on a loaded 2-core CI machine forward-compute can take 17 ms, where +30%
# (5 ms) sits on the 5 ms absolute floor and one window under it breaks the streak
SLOWDOWN = "0.5"


def demo_command(out_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "otel_straggler.cli", "demo", "--out", str(out_dir), *flags]


def demo_environment() -> dict[str, str]:
    """The ranks must talk to the embedded detector, whatever this shell points OTLP at."""
    return {name: value for name, value in os.environ.items() if not name.startswith(("OTEL_EXPORTER_OTLP", "OTEL_STRAGGLER_"))}


def machine_load() -> str:
    """For failure messages: other work on the machine slows ranks unevenly (docs/demo.md)."""
    return f"load average {os.getloadavg()[0]:.1f} on {len(os.sched_getaffinity(0))} cores"


def run_demo(out_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    finished = subprocess.run(demo_command(out_dir, *flags), env=demo_environment(), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    print(f"demo {' '.join(flags) or '(defaults)'}: exit {finished.returncode} after "
          f"{time.monotonic() - started:.1f} s, {machine_load()}")
    return finished


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def stragglers(out_dir: Path) -> list[dict]:
    return [v for v in read_jsonl(out_dir / "evidence" / "verdicts.jsonl") if v["verdict"] == "straggler"]


@pytest.fixture(scope="module")
def injected_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("injected") / "demo"
    finished = run_demo(out_dir, "--ranks", "4", "--slow-rank", str(SLOW_RANK), "--stage", SLOW_STAGE,
                        "--from-step", str(FROM_STEP), "--slowdown", SLOWDOWN, "--window-steps", str(WINDOW_STEPS))
    return out_dir, finished


def test_injected_rank_is_flagged_and_no_other(injected_run):
    out_dir, finished = injected_run
    assert finished.returncode == 0, finished.stderr[-2000:]
    alerts = stragglers(out_dir)
    caught = [v for v in alerts if v["rank"] == SLOW_RANK and v["stage"] in (SLOW_STAGE, "*")]
    assert caught, f"no straggler verdict for rank {SLOW_RANK}; verdicts: {alerts}\n{finished.stdout[-3000:]}"
    assert [v for v in alerts if v["rank"] != SLOW_RANK] == [], f"{machine_load()}\n{finished.stdout[-3000:]}"
    first = min(caught, key=lambda v: v["window"])
    assert first["window"] >= FROM_STEP // WINDOW_STEPS  # not before the slowdown began

    summary = next(line for line in finished.stdout.splitlines() if line.startswith("Flagged rank"))
    latency = re.search(r"(\d+) windows? and ([\d.]+) s after", summary)
    assert latency, summary
    print(f"detection latency: {latency.group(1)} windows, {latency.group(2)} s after the injection "
          f"(verdict at window {first['window']}, slowdown {first['slowdown']:.2f}x)\nsummary: {summary}")


def test_waiting_in_all_grads_sync_does_not_convict(injected_run):
    out_dir, finished = injected_run
    assert finished.returncode == 0
    windows = read_jsonl(out_dir / "evidence" / "windows.jsonl")
    slowed_windows = range(FROM_STEP // WINDOW_STEPS + 1, max(w["window"] for w in windows) + 1)

    def sync_ms(rank):
        return statistics.median(w["median_ms"] for w in windows
                                 if w["stage"] == "all-grads-sync" and w["rank"] == rank and w["window"] in slowed_windows)

    # The other ranks wait for the slow one inside the collective, so their sync is longer...
    assert all(sync_ms(rank) > sync_ms(SLOW_RANK) for rank in range(4) if rank != SLOW_RANK)
    # ...and that wait convicts none of them; at the collective only the rank they wait for can be
    # named, as the last to arrive
    at_sync = [v for v in stragglers(out_dir) if v["stage"] == "all-grads-sync"]
    assert all(v["rank"] == SLOW_RANK and v["reason"] == "last_to_arrive" for v in at_sync), at_sync


def test_report_renders_with_valid_pictures(injected_run):
    out_dir, finished = injected_run
    assert finished.returncode == 0
    html = (out_dir / "report.html").read_text()
    embedded = [base64.b64decode(data) for data in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)]
    assert len(embedded) == 3
    for name in ("heatmap.png", "rank_timeline.png", "verdict_timeline.png"):
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and data in embedded
        assert matplotlib.image.imread(io.BytesIO(data), format="png").ndim == 3
    assert f"report: {out_dir}/report.html" in finished.stdout


def test_report_command_rebuilds_from_the_evidence(injected_run):
    out_dir, finished = injected_run
    assert finished.returncode == 0
    rebuilt = subprocess.run([sys.executable, "-m", "otel_straggler.cli", "report", str(out_dir / "evidence")],
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (out_dir / "evidence" / "report" / "report.html").is_file()
    assert (out_dir / "evidence" / "report" / "evidence" / "verdicts.jsonl").is_file()
    assert f"rank {SLOW_RANK}" in rebuilt.stdout.splitlines()[0]


def test_healthy_run_flags_nobody(tmp_path):
    finished = run_demo(tmp_path / "demo", "--healthy")
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert stragglers(tmp_path / "demo") == [], f"{machine_load()}\n{finished.stdout[-3000:]}"
    assert "No rank was flagged" in finished.stdout


def test_killed_rank_ends_the_run_with_a_clear_message(tmp_path):
    process = subprocess.Popen(demo_command(tmp_path / "demo"), env=demo_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        pids, reached, deadline = None, None, time.monotonic() + RUN_TIMEOUT_S
        for line in process.stdout:  # plain lines, one progress line per window: stdout is a pipe
            pids = pids or re.search(r"pids ([\d ]+)\)", line)
            reached = re.match(r"\[[#.]+\] step (\d+)/", line)
            if reached and int(reached.group(1)) >= 2 * WINDOW_STEPS:
                break
            assert time.monotonic() < deadline
        assert pids, "the demo did not print its ranks' pids"
        assert reached, "the demo ended before rank 1 could be killed mid-run"
        killed_at = time.monotonic()
        os.kill(int(pids.group(1).split()[1]), signal.SIGKILL)  # rank 1
        _, errors = process.communicate(timeout=90)
        print(f"demo ended {time.monotonic() - killed_at:.1f} s after rank 1 was killed: {errors.strip()}")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1
    assert "rank 1 was killed by SIGKILL" in errors
    assert len(errors.strip().splitlines()) == 1


def test_hang_run_names_the_blocked_rank_and_ends_itself(tmp_path):
    out_dir = tmp_path / "demo"
    finished = run_demo(out_dir, "--hang", "--slow-rank", "1", "--stage", "backward-compute", "--from-step", "25",
                        "--hang-timeout-s", "20")
    assert finished.returncode == 0, finished.stderr[-2000:]
    verdicts = read_jsonl(out_dir / "evidence" / "verdicts.jsonl")
    hangs = [(v["rank"], v["reason"], v["stage"]) for v in verdicts if v["verdict"] == "hang"]
    assert hangs == [(1, "never_entered_collective", "backward-compute")], finished.stdout[-3000:]
    assert "HANG: no interval ended for" in finished.stdout  # said live
    assert re.search(r"stalled: no step finished for \d+ s", finished.stdout)  # the stall shown as it grew
    assert "Named the hang's culprit: rank 1" in finished.stdout  # and in the summary
    assert json.loads((out_dir / "evidence" / "demo.json").read_text())["outcome"] == "hang declared"
