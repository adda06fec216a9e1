"""Builds the report folder from an evidence directory: `report.html` (self-contained, images
embedded), the same pictures as PNG files, and a copy of the evidence under `evidence/`."""
from __future__ import annotations

import base64
import html
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from otel_straggler.demo import evidence as evidence_files
from otel_straggler.demo import figures, report_data
from otel_straggler.demo.summary import summarize
from otel_straggler.detector.config import DetectorConfig

REPORT_FILE = "report.html"
HEATMAP_FILE = "heatmap.png"
TIMELINE_FILE = "rank_timeline.png"
VERDICTS_PICTURE_FILE = "verdict_timeline.png"


@dataclass(frozen=True)
class Picture:
    file_name: str
    title: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class Report:
    html_path: Path
    picture_paths: list[Path]
    summary: str


def build(evidence_dir: Path, out_dir: Path) -> Report:
    """Raises evidence_files.EvidenceError when `evidence_dir` holds no verdicts.jsonl."""
    evidence = evidence_files.load(Path(evidence_dir))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _copy_evidence(evidence.directory, out_dir / "evidence")

    rel_threshold, min_gap_ms = _thresholds(evidence)
    pictures, notes = _pictures(evidence, rel_threshold, min_gap_ms)
    picture_paths = []
    for picture in pictures:
        path = out_dir / picture.file_name
        path.write_bytes(picture.png)
        picture_paths.append(path)

    summary = summarize(evidence.run, evidence.verdicts)
    html_path = out_dir / REPORT_FILE
    html_path.write_text(_html(evidence, summary, pictures, notes, rel_threshold, min_gap_ms), encoding="utf-8")
    return Report(html_path, picture_paths, summary)


def _thresholds(evidence: evidence_files.Evidence) -> tuple[float, float]:
    """The run's own thresholds when the demo recorded them, else the detector's defaults."""
    if evidence.run is not None:
        return evidence.run.rel_threshold, evidence.run.min_gap_ms
    defaults = DetectorConfig()
    return defaults.rel_threshold, defaults.min_gap_ms


def _copy_evidence(source: Path, target: Path) -> None:
    if source.resolve() == target.resolve():
        return
    target.mkdir(parents=True, exist_ok=True)
    for name in evidence_files.EVIDENCE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


def _pictures(evidence: evidence_files.Evidence, rel_threshold: float, min_gap_ms: float) -> tuple[list[Picture], list[str]]:
    pictures, notes = [], []
    windows = report_data.largest_job(evidence.windows)
    grids = report_data.stage_grids(windows)
    if grids:
        pictures.append(Picture(
            HEATMAP_FILE, "Stage durations, rank by window",
            "Each rank's median duration of each stage per window. A slow rank stands out in its own "
            "compute stage; in the collective stage the other ranks look slow instead, because they wait for it.",
            figures.heatmap(grids)))
    else:
        notes.append(f"No {evidence_files.WINDOWS_FILE} here, so no heat map: it needs every rank's per-window "
                     "medians, which `otel-straggler demo` records.")

    timeline = report_data.timeline(evidence, rel_threshold, min_gap_ms)
    if timeline is not None:
        pictures.append(Picture(
            TIMELINE_FILE, f"Rank {timeline.rank} against its peers",
            f"Rank {timeline.rank}'s median {timeline.stage} time per window, its peers' median (the reference) and "
            f"the threshold: slower than the reference by more than {rel_threshold:.0%} and {min_gap_ms:g} ms. "
            "An alert needs several slow windows in a row.",
            figures.rank_timeline(timeline)))
    else:
        notes.append("No rank was flagged or slowed on purpose, so there is no single rank to follow.")

    ranks = sorted({median.rank for median in windows})
    window_indexes = sorted({median.window for median in windows})
    pictures.append(Picture(
        VERDICTS_PICTURE_FILE, "Verdicts",
        "Every verdict the detector made, at its window and rank. Uncertain verdicts mean the detector "
        "could not judge (for example below the absolute floor); only straggler verdicts are alerts.",
        figures.verdict_timeline(evidence.verdicts, ranks, window_indexes)))
    return pictures, notes


def _html(evidence: evidence_files.Evidence, summary: str, pictures: list[Picture], notes: list[str],
          rel_threshold: float, min_gap_ms: float) -> str:
    escape = html.escape
    run = evidence.run
    settings = _settings_rows(run, rel_threshold, min_gap_ms)
    counts = report_data.verdict_counts(evidence.verdicts)
    parts = [
        "<!doctype html>", "<html><head><meta charset='utf-8'><title>otel-straggler report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
        "img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:0.9em;margin-bottom:2em}"
        ".summary{font-size:1.1em;background:#f5f7fa;padding:0.8em;border-left:4px solid #d62728}</style>",
        "</head><body>", "<h1>Straggler report</h1>", f"<p class='summary'>{escape(summary)}</p>",
    ]
    if settings:
        parts.append("<h2>Run</h2><table>" + "".join(
            f"<tr><th>{escape(name)}</th><td>{escape(value)}</td></tr>" for name, value in settings) + "</table>")
    for picture in pictures:
        encoded = base64.b64encode(picture.png).decode("ascii")
        parts.append(f"<h2>{escape(picture.title)}</h2><figure><img alt='{escape(picture.title)}' "
                     f"src='data:image/png;base64,{encoded}'><figcaption>{escape(picture.caption)} "
                     f"(<a href='{escape(picture.file_name)}'>{escape(picture.file_name)}</a>)</figcaption></figure>")
    for note in notes:
        parts.append(f"<p><em>{escape(note)}</em></p>")
    parts.append("<h2>Alerts, recoveries and silences</h2>")
    parts.append(_verdict_table(report_data.notable_verdicts(evidence.verdicts)))
    parts.append("<p>Verdicts by kind: " + escape(", ".join(f"{kind} {count}" for kind, count in sorted(counts.items()))
                                                  or "none") + ".</p>")
    if evidence.unreadable_lines:
        parts.append(f"<p><em>{evidence.unreadable_lines} evidence lines could not be read and were skipped.</em></p>")
    parts.append("<h2>Evidence</h2><ul>" + "".join(
        f"<li><a href='evidence/{name}'>{name}</a></li>" for name in evidence_files.EVIDENCE_FILES
        if (evidence.directory / name).is_file()) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _settings_rows(run: Optional[evidence_files.RunRecord], rel_threshold: float, min_gap_ms: float) -> list[tuple[str, str]]:
    if run is None:
        return []
    injection = run.injection
    return [
        ("job", run.job_id),
        ("ranks", str(run.ranks)),
        ("steps", f"{len(run.step_end_unix_nano)} of {run.steps}"),
        ("window", f"{run.window_steps} steps"),
        ("injected slowdown", "none (healthy run)" if injection is None else
         f"+{injection.slowdown:.0%} in {injection.stage} on rank {injection.rank} from step {injection.from_step}"),
        ("threshold", f"slower than the peers' median by more than {rel_threshold:.0%} and {min_gap_ms:g} ms"),
        ("outcome", run.outcome),
    ]


def _verdict_table(verdicts: list[dict[str, Any]]) -> str:
    if not verdicts:
        return "<p>None.</p>"
    columns = ("window", "rank", "host", "local_rank", "stage", "verdict", "reason", "slowdown", "gap_ms",
               "stalled_s", "timing", "attribution")
    rows = []
    for verdict in verdicts:
        cells = []
        for column in columns:
            value = verdict.get(column)
            text = f"{value:.3f}" if isinstance(value, float) else ("" if value is None else str(value))
            cells.append(f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{column}</th>" for column in columns) + "</tr>" + "".join(rows) + "</table>")
