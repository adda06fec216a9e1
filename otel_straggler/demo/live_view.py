"""What the demo shows while it runs: a progress bar, the latest window's per-rank stage
medians, and alerts as they fire.

On a terminal the block is redrawn in place; otherwise (a pipe, a CI log) the same content
comes out as plain lines, each once. Events arrive from several threads; one lock orders them.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional, TextIO, cast

from otel_straggler import contract
from otel_straggler.detector.gpu_evidence import describe
from otel_straggler.detector.next_step import next_step
from otel_straggler.detector.nodes import roll_up
from otel_straggler.report.summary import describe_alert, stage_phrase

RED = "\x1b[31m"
BOLD = "\x1b[1m"
RESET = "\x1b[0m"
MAX_ALERT_LINES = 6
STALL_LINE_EVERY_S = 5.0


def progress_bar(done: int, total: int, width: int = 30) -> str:
    filled = 0 if total <= 0 else min(width, done * width // total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def verdict_line(verdict: dict[str, Any]) -> Optional[str]:
    """One line for an alert, a recovery or a silence; None for verdicts not worth a line."""
    kind = verdict.get("verdict")
    if kind == contract.VERDICT_STRAGGLER:
        return f"ALERT: straggler {describe_alert(verdict)}"
    if kind == contract.VERDICT_RECOVERED and verdict.get("reason") == contract.HANG_PROGRESS_RESUMED:
        who = "the job" if verdict.get("rank") is None else f"rank {verdict['rank']}"
        return f"RESUMED: {who} is making progress again"
    if kind == contract.VERDICT_RECOVERED and verdict.get("rank") is None:
        return f"RECOVERED: the job is back to its own baseline at window {verdict['window']}"
    if kind == contract.VERDICT_RECOVERED:
        return f"RECOVERED: rank {verdict['rank']} in {stage_phrase(verdict['stage'])} at window {verdict['window']}"
    if kind == contract.VERDICT_JOB_SLOWDOWN:
        grew = "" if verdict["stage"] == contract.WHOLE_STEP_STAGE else f", most in {verdict['stage']}"
        return (f"JOB SLOWDOWN: every rank alike, {verdict['slowdown']:.2f}x its own baseline "
                f"({verdict['rank_ms']:.4g} vs {verdict['reference_ms']:.4g} ms){grew}, at window {verdict['window']}")
    if kind == contract.VERDICT_SILENT:
        return f"SILENT: rank {verdict['rank']} stopped reporting at window {verdict['window']}"
    if kind == contract.VERDICT_HANG:
        return f"HANG: {describe_hang(verdict)}"
    return None


def describe_hang(verdict: dict[str, Any]) -> str:
    """'no step for 31 s: rank 2 never left forward-compute (never_entered_collective); ranks 0, 1, 3
    wait in the collective (31.0 s)'."""
    stalled = (f"no interval ended for {verdict['stalled_s']:.0f} s" if verdict.get("stalled_s") is not None
               else "stalled")
    waiting = verdict.get("reference_ranks") or []
    waited = f" ({verdict['reference_ms'] / 1000:.1f} s)" if verdict.get("reference_ms") is not None else ""
    others = f"; ranks {', '.join(map(str, waiting))} wait in the collective{waited}" if waiting else ""
    if verdict.get("rank") is None:
        return f"{stalled}: every rank is stuck in {verdict['stage']} ({verdict['reason']})"
    where = f" on {verdict['host']}" if verdict.get("host") else ""
    if verdict.get("reason") == contract.HANG_RANK_LOST:
        return f"{stalled}: rank {verdict['rank']}{where} is gone (no heartbeats; last in {verdict['stage']}){others}"
    return f"{stalled}: rank {verdict['rank']}{where} never left {verdict['stage']} ({verdict['reason']}){others}"


def window_table(
    window: int, window_steps: int, medians: dict[int, dict[str, float]], stages: list[str],
    flagged: set[tuple[int, str]], color: bool,
) -> list[str]:
    """The window's median ms, a row per rank and a column per stage; flagged cells are marked
    (red on a terminal, '!' otherwise). A whole-step alert marks the rank."""
    first_step = window * window_steps
    lines = [f"window {window} (steps {first_step}-{first_step + window_steps - 1}), median ms per stage"]
    widths = [max(len(stage), 7) for stage in stages]
    lines.append("rank   " + "  ".join(stage.rjust(width) + " " for stage, width in zip(stages, widths, strict=True)))
    for rank in sorted(medians):
        whole_step = (rank, contract.WHOLE_STEP_STAGE) in flagged
        cells = []
        for stage, width in zip(stages, widths, strict=True):
            value = medians[rank].get(stage)
            text = "-" if value is None else f"{value:.1f}"
            cells.append(_mark(text.rjust(width), (rank, stage) in flagged, color))
        lines.append(_mark(f"{rank:>4}", whole_step, color) + "  " + "  ".join(cells))
    return lines


def _mark(cell: str, flagged: bool, color: bool) -> str:
    """The cell and one more column: '!' when flagged without color, else a space."""
    if not flagged:
        return cell + " "
    return f"{RED}{BOLD}{cell}{RESET} " if color else cell + "!"


def evidence_line(verdict: dict[str, Any]) -> Optional[str]:
    """The line under an alert or a hang culprit's: what its GPU showed, what to look at first."""
    if verdict.get("verdict") not in (contract.VERDICT_STRAGGLER, contract.VERDICT_HANG) or verdict.get("rank") is None:
        return None
    words = describe(verdict.get("gpu"))
    return "  " + (f"GPU: {words}; " if words else "") + f"next: {next_step(verdict)}"


class LiveView:
    def __init__(self, stream: TextIO, total_steps: int, window_steps: int, header: str,
                 interactive: Optional[bool] = None, host_ranks: Optional[dict[str, int]] = None) -> None:
        """host_ranks: how many ranks each host runs, where known, for the node roll-up (nodes.py)."""
        self._stream = stream
        self._total_steps = total_steps
        self._window_steps = window_steps
        self._header = header
        self._interactive = stream.isatty() if interactive is None else interactive
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._steps_done = 0
        self._loss: Optional[float] = None
        self._latest_window: Optional[tuple[int, dict[int, dict[str, float]]]] = None
        self._stages: list[str] = []
        self._active_alerts: set[tuple[int, str]] = set()
        self._host_ranks = host_ranks or {}
        self._alert_hosts: dict[tuple[int, str], str] = {}  # active alert -> its rank's host
        self._nodes_said: set[str] = set()  # degraded hosts already said, until they are not
        self._alert_lines: list[str] = []
        self._drawn_lines = 0
        self._last_progress_line = -1
        self._stalled_s: Optional[float] = None
        self._stall_lines_written = 0
        self._write_lines([header])

    # events, from any thread

    def on_progress(self, steps_done: int, loss: Optional[float]) -> None:
        with self._lock:
            self._steps_done, self._loss = steps_done, loss
            if not self._interactive and (steps_done % self._window_steps == 0 or steps_done == self._total_steps):
                if steps_done != self._last_progress_line:
                    self._last_progress_line = steps_done
                    self._write_lines([self._progress_line()])

    def on_window(self, window: int, medians: dict[int, dict[str, float]]) -> None:
        with self._lock:
            for stages in medians.values():
                self._stages.extend(stage for stage in stages if stage not in self._stages)
            self._latest_window = (window, medians)
            if not self._interactive:
                self._write_lines(self._window_lines())

    def on_verdict(self, verdict: dict[str, Any]) -> None:
        with self._lock:
            # kept for straggler alerts and their recoveries only, which name a rank and a stage
            key = cast("tuple[int, str]", (verdict.get("rank"), verdict.get("stage")))
            if verdict.get("verdict") == contract.VERDICT_STRAGGLER:
                self._active_alerts.add(key)
                if verdict.get("host"):
                    self._alert_hosts[key] = verdict["host"]
            elif verdict.get("verdict") == contract.VERDICT_RECOVERED:
                self._active_alerts.discard(key)
                self._alert_hosts.pop(key, None)
            line = verdict_line(verdict)
            if line is None:
                return
            extra = evidence_line(verdict)
            lines = [line] + ([extra] if extra else []) + self._node_lines()
            self._alert_lines.extend(lines)
            if not self._interactive:
                self._write_lines(lines)

    def _node_lines(self) -> list[str]:
        """'NODE: node017: 4 of 8 ranks slow (...): suspect the node, ...', once as a host becomes degraded."""
        nodes = roll_up((("", host, rank) for (rank, _), host in self._alert_hosts.items()),
                        lambda _, host: self._host_ranks.get(host))
        degraded = {node.host: node for node in nodes if node.degraded}
        self._nodes_said &= set(degraded)
        fresh = [node for host, node in degraded.items() if host not in self._nodes_said]
        self._nodes_said.update(node.host for node in fresh)
        return [f"NODE: {node.line()}" for node in fresh]

    def on_stall(self, seconds: Optional[float]) -> None:
        """How long no step has finished (None: progressing), shown as it grows: in the progress
        line on a terminal, otherwise one line every STALL_LINE_EVERY_S."""
        with self._lock:
            self._stalled_s = seconds
            if seconds is None:
                self._stall_lines_written = 0
            elif not self._interactive and seconds >= STALL_LINE_EVERY_S * (self._stall_lines_written + 1):
                self._stall_lines_written = int(seconds // STALL_LINE_EVERY_S)
                self._write_lines([f"stalled: no step finished for {seconds:.0f} s (after step {self._steps_done})"])

    def message(self, text: str) -> None:
        """A line that stays (above the live block on a terminal)."""
        with self._lock:
            self._write_lines([text])

    def refresh(self) -> None:
        """Redraws the block on a terminal; call it a few times a second. No-op otherwise."""
        if not self._interactive:
            return
        with self._lock:
            self._erase_block()
            block = [self._progress_line(), *self._window_lines()]
            if self._alert_lines:
                block += ["alerts:"] + ["  " + line for line in self._alert_lines[-MAX_ALERT_LINES:]]
            self._stream.write("\n".join(block) + "\n")
            self._stream.flush()
            self._drawn_lines = len(block)

    def close(self) -> None:
        """Leaves the last block on screen (a terminal) or the final progress line (plain)."""
        self.refresh()
        with self._lock:
            self._drawn_lines = 0
            if not self._interactive and self._steps_done != self._last_progress_line:
                self._write_lines([self._progress_line()])

    # drawing, under the lock

    def _progress_line(self) -> str:
        loss = "" if self._loss is None else f"  loss {self._loss:.4f}"
        elapsed = time.monotonic() - self._started
        stall = "" if self._stalled_s is None else f"  STALLED {self._stalled_s:.0f} s"
        return (f"{progress_bar(self._steps_done, self._total_steps)} step {self._steps_done}/{self._total_steps}"
                f"{loss}  {elapsed:.1f} s{stall}")

    def _window_lines(self) -> list[str]:
        if self._latest_window is None:
            return []
        window, medians = self._latest_window
        return window_table(window, self._window_steps, medians, self._stages, self._active_alerts,
                            color=self._interactive)

    def _erase_block(self) -> None:
        if self._drawn_lines:
            self._stream.write(f"\x1b[{self._drawn_lines}F\x1b[J")  # to the block's first line, clear below
            self._drawn_lines = 0

    def _write_lines(self, lines: list[str]) -> None:
        self._erase_block()
        self._stream.write("".join(line + "\n" for line in lines))
        self._stream.flush()
