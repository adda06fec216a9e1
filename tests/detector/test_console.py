"""What `otel-straggler detect` prints (console.py): a line per verdict worth one, the periodic status
line, and a console that never holds up or stops the engine thread."""
from __future__ import annotations

import dataclasses
import io
import threading
import time

from otel_straggler import contract
from otel_straggler.detector.console import (MAX_PENDING_VERDICTS, DetectorConsole, shown, status_text,
                                             verdict_text)
from otel_straggler.detector.observation import Verdict

SECOND = 1_000_000_000
ALERT = Verdict(
    time_unix_nano=1, job_id="train-42", cohort="default", stage="forward-compute", rank=2, window=4,
    verdict=contract.VERDICT_STRAGGLER, reason="slow_vs_peers", slowdown=1.3, gap_ms=9.0, rank_ms=39.0,
    reference_ms=30.0, reference_ranks=(0, 1, 3), timing="host", attribution=contract.ATTRIBUTION_HOST,
    workload_comparable=None, host="node-3", local_rank=2)


def kind(verdict: str, **changes) -> Verdict:
    return dataclasses.replace(ALERT, verdict=verdict, **changes)


def test_an_alert_line_is_the_demos_with_where_the_rank_runs():
    assert verdict_text(ALERT) == ("ALERT: straggler rank 2 in forward-compute at window 4 (1.30x its peers, +9.0 ms); "
                                   "job train-42, host node-3, local rank 2, reason slow_vs_peers; next: The rank's "
                                   "host-side work is slow while its GPU is not: look for CPU contention on node-3 "
                                   "(other processes, CPU frequency, data loader workers); `py-spy dump --pid` of the "
                                   "rank shows where its Python spends the time.")
    also = verdict_text(dataclasses.replace(ALERT, also_slow=("ddp-grads-ready", "*")))
    assert also.startswith("ALERT: straggler rank 2 in forward-compute at window 4 (1.30x its peers, +9.0 ms")
    assert also.count("also slow: ddp-grads-ready, ") == 1  # as the demo words it, once
    assert "; job train-42, host node-3, local rank 2, reason slow_vs_peers; next: " in also
    assert "also slow" not in verdict_text(ALERT)
    recovered = verdict_text(kind(contract.VERDICT_RECOVERED, reason="within_tolerance", also_slow=("optimizer",)))
    assert "at window 4; also slow: optimizer; job train-42" in recovered
    unplaced = dataclasses.replace(ALERT, host=None, local_rank=None)
    assert "; job train-42, reason slow_vs_peers; next: " in verdict_text(unplaced)
    assert "CPU contention on its host" in verdict_text(unplaced)


def test_an_alert_line_says_what_the_gpu_showed_and_what_to_look_at_first():
    hot = dataclasses.replace(ALERT, attribution=contract.ATTRIBUTION_GPU, gpu={
        "sm_clock_mhz": 1410, "peer_sm_clock_mhz": 1980, "clock_event_reasons": ["gpu_idle", "hw_thermal"],
        "temperature_c": 89, "power_w": 402.4, "ecc_uncorrected_delta": 0, "pcie_replay_delta": 0, "uuid": "GPU-abc"})
    assert verdict_text(hot).endswith(
        "reason slow_vs_peers; GPU: SM clock 1410 MHz vs 1980 at its peers; hw_thermal throttling; 89 °C; 402 W; "
        "next: GPU GPU-abc on node-3 runs at reduced clocks: check cooling: fans, inlet temperature, airflow; "
        "`nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE,POWER`, then `dcgmi diag -r 3` on that GPU.")
    failing = dataclasses.replace(hot, gpu={**hot.gpu, "ecc_uncorrected_delta": 3})
    assert "3 new uncorrected ECC errors" in verdict_text(failing)
    assert "next: GPU GPU-abc on node-3 is logging errors (uncorrected ECC or PCIe replays): drain that GPU" in \
        verdict_text(failing)
    recovered = verdict_text(kind(contract.VERDICT_RECOVERED, reason="within_tolerance", gpu=hot.gpu))
    assert "next:" not in recovered and "GPU:" not in recovered  # what to do is said when the alert starts


def test_recoveries_hangs_silences_and_job_slowdowns_get_a_line_uncertain_none():
    assert verdict_text(kind(contract.VERDICT_RECOVERED, reason="within_tolerance", slowdown=1.01, gap_ms=0.3)) == (
        "RECOVERED: rank 2 in forward-compute at window 4; job train-42, host node-3, local rank 2, "
        "reason within_tolerance, slowdown 1.01x, gap +0.3 ms")
    assert verdict_text(kind(contract.VERDICT_SILENT, stage="*", reason="no_report", slowdown=None, gap_ms=None)) == (
        "SILENT: rank 2 stopped reporting at window 4; job train-42, host node-3, local rank 2, reason no_report")
    hang = kind(contract.VERDICT_HANG, reason=contract.HANG_NEVER_ENTERED_COLLECTIVE, slowdown=None, gap_ms=None,
                stalled_s=31.0, reference_ms=31_000.0)
    assert verdict_text(hang) == (
        "HANG: no interval ended for 31 s: rank 2 on node-3 never left forward-compute (never_entered_collective); "
        "ranks 0, 1, 3 wait in the collective (31.0 s); job train-42, local rank 2, reason never_entered_collective; "
        "next: `py-spy dump --pid <pid>` of the worker with LOCAL_RANK=2 on node-3 shows where it is stuck outside "
        "the collective (data loader, I/O, a lock, a CUDA call); the NCCL flight recorder dump "
        "(TORCH_NCCL_TRACE_BUFFER_SIZE) of the waiting ranks shows the collective they wait in.")
    resumed = kind(contract.VERDICT_RECOVERED, reason=contract.HANG_PROGRESS_RESUMED, slowdown=None, gap_ms=None)
    assert verdict_text(resumed) == ("RESUMED: rank 2 is making progress again; job train-42, host node-3, "
                                     "local rank 2, stage forward-compute, reason progress_resumed")
    slower = kind(contract.VERDICT_JOB_SLOWDOWN, rank=None, host=None, local_rank=None, stage="*",
                  reason="slower_than_baseline", slowdown=1.36, gap_ms=100.0, rank_ms=378.0, reference_ms=278.0)
    assert verdict_text(slower) == ("JOB SLOWDOWN: every rank alike, 1.36x its own baseline (378 vs 278 ms), at "
                                    "window 4; job train-42, reason slower_than_baseline, gap +100.0 ms")
    assert verdict_text(kind(contract.VERDICT_UNCERTAIN, reason="below_absolute_floor")) is None


def test_a_senders_names_are_cut_short_and_printable():
    hostile = dataclasses.replace(ALERT, job_id="x\n" * 1000, host="evil\x1b[2J", also_slow=("a\rb",) * 20)
    line = verdict_text(hostile)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert len(line) < 1000
    assert "host evil?[2J" in line and "also slow: a?b, a?b" in line and "a?b, 12 more" in line
    assert shown("y" * 200) == "y" * 80 + "..."


def status(at_s: float, accepted: int, **fields) -> dict:
    record = {"time_unix_nano": int(at_s * SECOND), "started_unix_nano": 0, "engine": {"jobs": 2, "ranks": 16},
              "spans": {"accepted": accepted, "late": 0, "malformed": 0, "dropped": 0}, "rejections": {},
              "requests": {"ok": 10}, "errors": {}, "jobs_without_stages": {"count": 0, "jobs": []}}
    record.update(fields)
    return record


def test_the_status_line_rates_the_spans_since_the_last_line_and_totals_the_losses():
    first = status(60, 60_000)
    assert status_text(first, None, 1) == ("status: 2 jobs, 16 ranks, 1000 spans/s, 1 alert active; "
                                           "since start: 0 late, 0 malformed")
    later = status(120, 90_000, spans={"accepted": 90_000, "late": 75, "malformed": 12, "dropped": 4},
                   rejections={"missing_job_id": 10, "bad_rank": 2},
                   requests={"ok": 10, "partial": 2, "other_signal": 5, "unauthenticated": 3, "too_large": 1},
                   errors={"console_write": 2})
    assert status_text(later, first, 0) == (
        "status: 2 jobs, 16 ranks, 500 spans/s, 0 alerts active; since start: 75 late, "
        "12 malformed (missing_job_id 10, bad_rank 2), 4 dropped, 4 requests refused (unauthenticated 3, too_large 1), "
        "2 errors (console_write 2)")


def test_the_status_line_names_jobs_that_send_heartbeats_but_no_stage_spans():
    jobs = [{"job_id": f"job-{index}", "ranks": 4 - index, "seconds": 90.0 - index} for index in range(4)]
    line = status_text(status(60, 0, jobs_without_stages={"count": 5, "jobs": jobs}), None, None)
    assert line.endswith("; jobs without stages: job-0 (4 ranks, 90 s), job-1 (3 ranks, 89 s), "
                         "job-2 (2 ranks, 88 s) and 2 more")
    assert "alert" not in line  # not known: not shown


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_console_writes_verdict_lines_and_a_status_line_every_interval():
    stream = io.StringIO()
    records = iter(status(second, 1000 * second) for second in range(1, 1000))
    console = DetectorConsole(stream, lambda: next(records), alerts_active=lambda: 1, status_interval_s=0.1,
                              prefix="detect: ")
    console.start()
    console.on_verdict(ALERT)
    console.on_verdict(kind(contract.VERDICT_UNCERTAIN))
    wait_for(lambda: stream.getvalue().count("status:") >= 2)
    assert console.stop(5.0)
    lines = stream.getvalue().splitlines()
    assert lines[0] == f"detect: {verdict_text(ALERT)}"
    assert lines[1] == "detect: status: 2 jobs, 16 ranks, 1000 spans/s, 1 alert active; since start: 0 late, 0 malformed"
    assert lines[2].startswith("detect: status: 2 jobs, 16 ranks, 1000 spans/s")
    assert not any("uncertain" in line for line in lines)


def test_verdicts_queued_at_stop_are_still_written_and_no_status_comes_with_interval_0():
    stream = io.StringIO()
    console = DetectorConsole(stream, lambda: status(1, 0), status_interval_s=0.0)
    for window in range(5):
        console.on_verdict(dataclasses.replace(ALERT, window=window))
    console.start()
    assert console.stop(5.0)
    assert [line.split(" at window ")[1][0] for line in stream.getvalue().splitlines()] == list("01234")
    assert "status:" not in stream.getvalue()


class BlockedStream(io.StringIO):
    """stderr as a full pipe nobody reads: write() waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.writing = threading.Event()

    def write(self, text: str) -> int:
        self.writing.set()
        self.release.wait()
        return super().write(text)


def test_a_blocked_console_never_holds_up_the_engine_thread_and_what_it_drops_is_counted():
    stream = BlockedStream()
    errors: dict[str, int] = {}
    console = DetectorConsole(stream, lambda: status(1, 0), status_interval_s=0.0,
                              count_error=lambda kind, count: errors.__setitem__(kind, errors.get(kind, 0) + count))
    console.start()
    console.on_verdict(ALERT)
    assert stream.writing.wait(5.0)  # the console thread now waits in write(), holding that one
    started = time.monotonic()
    for _ in range(MAX_PENDING_VERDICTS + 100):
        console.on_verdict(ALERT)
    assert time.monotonic() - started < 5.0
    assert errors["console_dropped"] == 100
    assert not console.stop(0.1)  # the thread is left behind, blocked
    stream.release.set()


class BrokenStream(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_console_and_a_failing_status_are_counted_not_raised():
    errors: list[str] = []

    def failing_status() -> dict:
        raise RuntimeError("no status")

    console = DetectorConsole(BrokenStream(), failing_status, status_interval_s=0.05,
                              count_error=lambda kind, count: errors.append(kind))
    console.start()
    console.on_verdict(ALERT)
    wait_for(lambda: "console_write" in errors and "console_status" in errors)
    assert console.stop(5.0)


class FakeService:
    def __init__(self) -> None:
        self.listeners: list = []

    def add_verdict_listener(self, listener) -> None:
        self.listeners.append(listener)

    def status(self) -> dict:
        return status(1, 0)

    def rank_state(self) -> list:
        return []

    def count_error(self, kind: str, count: int = 1) -> None:
        pass


def test_detect_prints_what_its_settings_ask_for():
    from otel_straggler.detector.commands import _console
    from otel_straggler.detector.config import DetectorConfig

    service = FakeService()
    assert _console(service, DetectorConfig(console_verdicts=False, console_status_interval_s=0.0)) is None
    assert _console(service, DetectorConfig(console_verdicts=False)) is not None and service.listeners == []
    console = _console(service, DetectorConfig(console_status_interval_s=0.0))
    assert service.listeners == [console.on_verdict]
