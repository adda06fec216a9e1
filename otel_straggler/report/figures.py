"""The report's pictures, drawn with matplotlib (headless) from report_data's shapes; each
function returns PNG bytes."""
from __future__ import annotations

import io
import math
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from otel_straggler import contract  # noqa: E402
from otel_straggler.report.report_data import StageGrid, Timeline  # noqa: E402
from otel_straggler.report.summary import leading_alerts, straggler_alerts  # noqa: E402

VERDICT_STYLE = {  # verdict -> (marker, color, draw order)
    contract.VERDICT_UNCERTAIN: ("o", "#b0b0b0", 1),
    contract.VERDICT_RECOVERED: ("s", "#2a9d3a", 2),
    contract.VERDICT_SILENT: ("x", "#000000", 3),
    contract.VERDICT_STRAGGLER: ("^", "#d62728", 4),
    contract.VERDICT_HANG: ("X", "#7a0000", 5),
}


MAX_ANNOTATED_CELLS = 120  # beyond this the numbers would not be legible
MAX_PANEL_HEIGHT = 7.0  # inches of rank rows per heat map panel
MAX_VERDICT_ROWS = 40  # ranks in the verdict picture; beyond it, only the ranks with a verdict
MAX_LABEL_LINES = 3  # stage lines per alert label: more would reach the next rank's row


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def heatmap(grids: list[StageGrid]) -> bytes:
    """One panel per stage: rank x window, color = median duration (each panel its own scale)."""
    columns = min(3, len(grids))
    rows = math.ceil(len(grids) / columns)
    rank_count = len(grids[0].ranks)
    height = 0.9 + (min(0.42 * rank_count, MAX_PANEL_HEIGHT) + 0.8) * rows  # a large job's ranks share the height
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, height), squeeze=False, layout="constrained")
    # the grid can have more panels than stages: the spare ones are left out of the loop
    for panel, grid in zip(axes.flat, grids, strict=False):
        values = np.array([[np.nan if value is None else value for value in row] for row in grid.median_ms],
                          dtype=float)
        # From zero, so that color differences are proportional: a 1% spread stays one color.
        image = panel.imshow(np.ma.masked_invalid(values), aspect="auto", cmap="viridis", interpolation="nearest",
                             vmin=0.0, vmax=max(np.nanmax(values), 1e-9) if np.isfinite(values).any() else 1.0)
        if values.size <= MAX_ANNOTATED_CELLS:
            for (row, column), value in np.ndenumerate(values):
                if np.isfinite(value):
                    panel.text(column, row, f"{value:.0f}" if value >= 10 else f"{value:.1f}", ha="center",
                               va="center", fontsize=6, color="white" if value < 0.6 * np.nanmax(values) else "black")
        panel.set_title(_stage_name(grid.stage) + (" (collective: waits count)" if grid.collective else ""), fontsize=9)
        rank_step = max(1, math.ceil(rank_count * 0.42 / MAX_PANEL_HEIGHT))
        panel.set_yticks(range(0, rank_count, rank_step), [f"rank {rank}" for rank in grid.ranks[::rank_step]],
                         fontsize=8)
        tick_step = max(1, len(grid.windows) // 10)
        panel.set_xticks(range(0, len(grid.windows), tick_step), grid.windows[::tick_step], fontsize=8)
        panel.set_xlabel("window", fontsize=8)
        colorbar = figure.colorbar(image, ax=panel)
        colorbar.set_label("median ms", fontsize=8)
        colorbar.ax.tick_params(labelsize=7)
    for panel in list(axes.flat)[len(grids):]:
        panel.axis("off")
    figure.suptitle("Median stage duration per rank and window", fontsize=11)
    return _png(figure)


def _series(values: list[Optional[float]]) -> np.ndarray:
    return np.array([np.nan if value is None else value for value in values], dtype=float)


def rank_timelines(timelines: list[Timeline]) -> bytes:
    """A panel per timeline, one above the other on the same windows: the rank's window medians
    against its peers', the threshold, the injection, where the slow streak began and the alert."""
    figure, axes = plt.subplots(len(timelines), 1, figsize=(8.5, 0.6 + 3.0 * len(timelines)), squeeze=False,
                                layout="constrained")
    first, last = min(min(t.windows) for t in timelines), max(max(t.windows) for t in timelines)
    for axis, timeline in zip(axes[:, 0], timelines, strict=True):
        _timeline_panel(axis, timeline, (first - 0.6, last + 0.6))
    axes[-1, 0].set_xlabel("window")
    return _png(figure)


def _timeline_panel(axis: Any, timeline: Timeline, x_range: tuple[float, float]) -> None:
    windows = np.array(timeline.windows)
    marker = "o" if len(windows) <= 60 else None  # beyond that the markers would hide the line
    if timeline.source == "windows":
        axis.fill_between(windows, _series(timeline.peer_low_ms), _series(timeline.peer_high_ms),
                          color="#1f77b4", alpha=0.15, step="mid", label="peers (fastest to slowest)")
    axis.plot(windows, _series(timeline.reference_ms), color="#1f77b4", marker="." if marker else None,
              label="peer reference")
    axis.plot(windows, _series(timeline.threshold_ms), color="#ff7f0e", linestyle="--", label="threshold")
    axis.plot(windows, _series(timeline.rank_ms), color="#d62728", marker=marker, markersize=4,
              label=f"rank {timeline.rank}")
    axis.set_xlim(*x_range)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    top = axis.get_ylim()[1]
    marks = [] if timeline.injection_window is None else [(timeline.injection_window, "#555555", "slowdown injected")]
    marks += [(window, "#9467bd", "slow from here") for window in timeline.onset_windows]
    for window, color, label in marks:
        axis.axvline(window - 0.5, color=color, linestyle=":", label=label)
    for index, window in enumerate(timeline.alert_windows):
        axis.axvspan(window - 0.45, window + 0.45, color="#d62728", alpha=0.18, label="alert" if index == 0 else None)
        axis.text(window, top, "alert", color="#d62728", fontsize=7, ha="center", va="bottom")
    axis.set_ylabel("median ms" + (" (device)" if timeline.timing == "device" else ""))
    source = "" if timeline.source == "windows" else " (the verdicts' own medians)"
    explained = sorted(timeline.also_slow, key=lambda stage: stage == contract.WHOLE_STEP_STAGE)
    also = f"; also slow: {', '.join(explained)}" if explained else ""
    axis.set_title(f"Rank {timeline.rank}, {_stage_name(timeline.stage)}{also}{source}", fontsize=10, loc="left")
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))  # several onsets share one entry
    axis.legend(unique.values(), unique.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axis.grid(alpha=0.3)


def _stage_name(stage: str) -> str:
    return "the whole step (*)" if stage == contract.WHOLE_STEP_STAGE else stage


def verdict_timeline(verdicts: list[dict[str, Any]], ranks: list[int], windows: list[int]) -> bytes:
    """Every verdict as a marker at (window, rank); alerts are labelled with their stages, one label
    per window and rank (the leading stage first, the stages it explains after "also"). The axes
    span every rank and window the evidence knows, so quiet ones show as empty (of a large job, only
    the ranks with a verdict). Job-level verdicts (no rank) have no row."""
    verdicts = [verdict for verdict in verdicts if verdict.get("rank") is not None]
    flagged_ranks = {verdict["rank"] for verdict in verdicts}
    all_ranks = set(ranks) | flagged_ranks
    shown_ranks = sorted(all_ranks if len(all_ranks) <= MAX_VERDICT_ROWS else flagged_ranks) or [0]
    shown_windows = sorted(set(windows) | {verdict["window"] for verdict in verdicts}) or [0]
    figure, axis = plt.subplots(figsize=(8.5, 0.9 + 0.45 * min(len(shown_ranks), MAX_VERDICT_ROWS)))
    for name, (marker, color, order) in VERDICT_STYLE.items():
        chosen = [verdict for verdict in verdicts if verdict["verdict"] == name]
        if chosen:
            axis.scatter([verdict["window"] for verdict in chosen], [verdict["rank"] for verdict in chosen],
                         marker=marker, color=color, s=70, zorder=order, label=f"{name} ({len(chosen)})")
    for (window, rank), text in alert_labels(verdicts).items():
        axis.annotate(text, (window, rank), textcoords="offset points", xytext=(6, 4), fontsize=7,
                      va="bottom", color=VERDICT_STYLE[contract.VERDICT_STRAGGLER][1], zorder=6,
                      bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    tick_step = max(1, len(shown_ranks) // MAX_VERDICT_ROWS)
    axis.set_yticks(shown_ranks[::tick_step], [f"rank {rank}" for rank in shown_ranks[::tick_step]])
    axis.set_ylim(min(shown_ranks) - 0.7, max(shown_ranks) + 0.7)
    axis.set_xlim(min(shown_windows) - 0.5, max(shown_windows) + 0.5)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_xlabel("window")
    title = "Verdicts" if verdicts else "Verdicts (none)"
    if len(all_ranks) > MAX_VERDICT_ROWS:
        title += f" (the {len(shown_ranks)} ranks with one, of {len(all_ranks)})"
    axis.set_title(title, fontsize=11)
    if verdicts:
        axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axis.grid(alpha=0.3)
    return _png(figure)


def alert_labels(verdicts: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """(window, rank) -> one label for all its alerts: the leading stages a line each, then
    "also: ..." for the stages they explain, the whole step last."""
    leading = leading_alerts(verdicts)
    labels: dict[tuple[int, int], tuple[list[str], list[str]]] = {}
    for alert in straggler_alerts(verdicts):
        lines, also = labels.setdefault((alert["window"], alert["rank"]), ([], []))
        (lines if any(alert is lead for lead in leading) else also).append(alert["stage"])
    shown = {}
    for key, (lines, also) in labels.items():
        if len(lines) > MAX_LABEL_LINES:
            lines = lines[:MAX_LABEL_LINES - 1] + [f"+{len(lines) - MAX_LABEL_LINES + 1} more"]
        also = sorted(set(also) - set(lines), key=lambda stage: stage == contract.WHOLE_STEP_STAGE)
        shown[key] = "\n".join(lines + ([f"also: {', '.join(also)}"] if also else []))
    return shown
