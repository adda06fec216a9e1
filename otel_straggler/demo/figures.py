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
from otel_straggler.demo.report_data import StageGrid, Timeline  # noqa: E402

VERDICT_STYLE = {  # verdict -> (marker, color, draw order)
    contract.VERDICT_UNCERTAIN: ("o", "#b0b0b0", 1),
    contract.VERDICT_RECOVERED: ("s", "#2a9d3a", 2),
    contract.VERDICT_SILENT: ("x", "#000000", 3),
    contract.VERDICT_STRAGGLER: ("^", "#d62728", 4),
    contract.VERDICT_HANG: ("X", "#7a0000", 5),
}


MAX_ANNOTATED_CELLS = 120  # beyond this the numbers would not be legible


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def heatmap(grids: list[StageGrid]) -> bytes:
    """One panel per stage: rank x window, color = median duration (each panel its own scale)."""
    columns = min(3, len(grids))
    rows = math.ceil(len(grids) / columns)
    height = 0.9 + (0.42 * len(grids[0].ranks) + 0.8) * rows
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, height), squeeze=False, layout="constrained")
    for panel, grid in zip(axes.flat, grids):
        values = np.array([[np.nan if value is None else value for value in row] for row in grid.median_ms], dtype=float)
        # From zero, so that color differences are proportional: a 1% spread stays one color.
        image = panel.imshow(np.ma.masked_invalid(values), aspect="auto", cmap="viridis", interpolation="nearest",
                             vmin=0.0, vmax=max(np.nanmax(values), 1e-9) if np.isfinite(values).any() else 1.0)
        if values.size <= MAX_ANNOTATED_CELLS:
            for (row, column), value in np.ndenumerate(values):
                if np.isfinite(value):
                    panel.text(column, row, f"{value:.0f}" if value >= 10 else f"{value:.1f}", ha="center",
                               va="center", fontsize=6, color="white" if value < 0.6 * np.nanmax(values) else "black")
        panel.set_title(grid.stage + (" (collective: waits count)" if grid.collective else ""), fontsize=9)
        panel.set_yticks(range(len(grid.ranks)), [f"rank {rank}" for rank in grid.ranks], fontsize=8)
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


def rank_timeline(timeline: Timeline) -> bytes:
    """The rank's window medians against its peers', the threshold, the injection and the alerts."""
    figure, axis = plt.subplots(figsize=(8.5, 3.8), layout="constrained")
    windows = np.array(timeline.windows)
    if timeline.source == "windows":
        axis.fill_between(windows, _series(timeline.peer_low_ms), _series(timeline.peer_high_ms),
                          color="#1f77b4", alpha=0.15, step="mid", label="peers (fastest to slowest)")
    axis.plot(windows, _series(timeline.reference_ms), color="#1f77b4", marker=".", label="peer reference")
    axis.plot(windows, _series(timeline.threshold_ms), color="#ff7f0e", linestyle="--", label="threshold")
    axis.plot(windows, _series(timeline.rank_ms), color="#d62728", marker="o", label=f"rank {timeline.rank}")
    if timeline.injection_window is not None:
        axis.axvline(timeline.injection_window - 0.5, color="#555555", linestyle=":", label="slowdown injected")
    for index, window in enumerate(timeline.alert_windows):
        axis.axvline(window, color="#d62728", alpha=0.35, linewidth=6, label="straggler alert" if index == 0 else None)
    axis.set_xlabel("window")
    axis.set_ylabel("median ms")
    source = "" if timeline.source == "windows" else " (from the verdicts' own medians)"
    axis.set_title(f"Rank {timeline.rank}, {timeline.stage}, against its peers{source}", fontsize=11)
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(alpha=0.3)
    return _png(figure)


def verdict_timeline(verdicts: list[dict[str, Any]], ranks: list[int], windows: list[int]) -> bytes:
    """Every verdict as a marker at (window, rank); alerts are labelled with their stage. The
    axes span every rank and window the evidence knows, so quiet ones show as empty. Job-level
    verdicts (no rank) have no row."""
    verdicts = [verdict for verdict in verdicts if verdict.get("rank") is not None]
    shown_ranks = sorted(set(ranks) | {verdict["rank"] for verdict in verdicts}) or [0]
    shown_windows = sorted(set(windows) | {verdict["window"] for verdict in verdicts}) or [0]
    figure, axis = plt.subplots(figsize=(8.5, 0.9 + 0.45 * len(shown_ranks)))
    for name, (marker, color, order) in VERDICT_STYLE.items():
        chosen = [verdict for verdict in verdicts if verdict["verdict"] == name]
        if chosen:
            axis.scatter([verdict["window"] for verdict in chosen], [verdict["rank"] for verdict in chosen],
                         marker=marker, color=color, s=70, zorder=order, label=f"{name} ({len(chosen)})")
    for verdict in verdicts:
        if verdict["verdict"] == contract.VERDICT_STRAGGLER:
            axis.annotate(verdict["stage"], (verdict["window"], verdict["rank"]), textcoords="offset points",
                          xytext=(2, 7), fontsize=7, rotation=30, color=VERDICT_STYLE[contract.VERDICT_STRAGGLER][1])
    axis.set_yticks(shown_ranks, [f"rank {rank}" for rank in shown_ranks])
    axis.set_ylim(min(shown_ranks) - 0.7, max(shown_ranks) + 0.7)
    axis.set_xlim(min(shown_windows) - 0.5, max(shown_windows) + 0.5)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_xlabel("window")
    axis.set_title("Verdicts" if verdicts else "Verdicts (none)", fontsize=11)
    if verdicts:
        axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axis.grid(alpha=0.3)
    return _png(figure)
