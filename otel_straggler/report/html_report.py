"""Builds the report folder from an evidence directory: `report.html` (self-contained, images
embedded), the same pictures as PNG files, and a copy of the evidence under `evidence/`."""
from __future__ import annotations

import base64
import html
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.gpu_evidence import describe
from otel_straggler.detector.next_step import next_step, suspect
from otel_straggler.detector.nodes import roll_up
from otel_straggler.report import evidence_files, figures, report_data
from otel_straggler.report.summary import also_slow, summarize

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
    pictures, notes = _pictures(evidence, rel_threshold, min_gap_ms, DetectorConfig().persist_windows)
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
    """The run's own thresholds when the demo recorded them, else the detector's defaults (the
    evidence does not say which settings its detector ran with; nor persist_windows, taken as the default)."""
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


def _pictures(evidence: evidence_files.Evidence, rel_threshold: float, min_gap_ms: float,
              persist_windows: int) -> tuple[list[Picture], list[str]]:
    pictures, notes = [], []
    windows = report_data.largest_job(evidence.windows)
    grids = report_data.stage_grids(windows)
    if grids:
        shown = f" (job {windows[0].job_id}, cohort {windows[0].cohort})" if _cohort_count(evidence) > 1 else ""
        pictures.append(Picture(
            HEATMAP_FILE, "Stage durations, rank by window",
            f"Each rank's median duration of each stage per window{shown}; `*` is the whole step (its "
            "non-collective stages summed per step). A slow rank stands out in its own compute stage; in the "
            "collective stage the other ranks look slow instead, because they wait for it.",
            figures.heatmap(grids)))
    else:
        notes.append(f"No {evidence_files.WINDOWS_FILE} here, so no heat map: it needs every rank's per-window "
                     "medians, which the detector records unless its record_windows setting is off.")

    timelines = report_data.timelines(evidence, rel_threshold, min_gap_ms, persist_windows)
    if timelines:
        ranks = sorted({timeline.rank for timeline in timelines})
        pictures.append(Picture(
            TIMELINE_FILE, f"Rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} against the peers",
            "For each alerted rank and stage: its median time per window (device time where the alert compared "
            "device time), its peers' median (the reference) and range, and the threshold: slower than the "
            f"reference by more than {rel_threshold:.0%} and {min_gap_ms:g} ms (and beyond the cohort's own noise). "
            f"A slow_vs_peers alert needs {persist_windows} slow windows in a row (the detector's default): the "
            "dotted line marks where they began; an intermittent one, slow steps in a share of its steps well "
            "beyond its peers', has no such run. The shaded window is the alert.",
            figures.rank_timelines(timelines)))
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


def _cohort_count(evidence: evidence_files.Evidence) -> int:
    return len({(median.job_id, median.cohort) for median in evidence.windows})


def _html(evidence: evidence_files.Evidence, summary: str, pictures: list[Picture], notes: list[str],
          rel_threshold: float, min_gap_ms: float) -> str:
    escape = html.escape
    run = evidence.run
    settings = _settings_rows(run, rel_threshold, min_gap_ms)
    counts = report_data.verdict_counts(evidence.verdicts)
    jobs = report_data.job_ids(evidence)
    parts = [
        "<!doctype html>", "<html><head><meta charset='utf-8'><title>otel-straggler report"
        + escape(f": {', '.join(jobs)}" if jobs else "") + "</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
        "img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:0.9em;margin-bottom:2em}"
        ".summary{font-size:1.1em;background:#f5f7fa;padding:0.8em;border-left:4px solid #d62728}"
        ".jobs{color:#555}</style>",
        "</head><body>", "<h1>Straggler report</h1>",
        f"<p class='jobs'>{_about(evidence, jobs)}</p>",
        f"<p class='summary'>{escape(summary)}</p>",
        _first_look_section(evidence),
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
    parts.append(_uncertain_section(report_data.uncertain_counts(evidence.verdicts)))
    if evidence.unreadable_lines:
        parts.append(f"<p><em>{evidence.unreadable_lines} evidence lines could not be read and were skipped.</em></p>")
    parts.append("<h2>Evidence</h2><ul>" + "".join(
        f"<li><a href='evidence/{name}'>{name}</a></li>" for name in evidence_files.EVIDENCE_FILES
        if (evidence.directory / name).is_file()) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _settings_rows(run: Optional[evidence_files.RunRecord], rel_threshold: float,
                   min_gap_ms: float) -> list[tuple[str, str]]:
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


def _about(evidence: evidence_files.Evidence, jobs: list[str]) -> str:
    """The line under the title: which jobs, how many ranks and windows, from where."""
    escape = html.escape
    parts = [("Job " if len(jobs) == 1 else "Jobs ") + ", ".join(f"<code>{escape(job)}</code>" for job in jobs)] \
        if jobs else ["No job named in this evidence"]
    ranks = {median.rank for median in evidence.windows} | {
        verdict["rank"] for verdict in evidence.verdicts if verdict.get("rank") is not None}
    windows = [median.window for median in evidence.windows] + [verdict["window"] for verdict in evidence.verdicts]
    if ranks:
        parts.append(f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}")
    if windows:
        parts.append(f"windows {min(windows)} to {max(windows)}")
    parts.append(f"evidence from <code>{escape(str(evidence.directory))}</code>")
    return " &middot; ".join(parts)


def _first_look_section(evidence: evidence_files.Evidence) -> str:
    """Each alert's and hang culprit's first verdict with what its GPU showed and what to look at
    first, and the hosts where several ranks were slow, said once (nodes.py)."""
    firsts: dict[tuple, dict[str, Any]] = {}
    for verdict in evidence.verdicts:
        if verdict.get("verdict") in ("straggler", "hang") and verdict.get("rank") is not None:
            key = (verdict.get("job_id"), verdict["verdict"], verdict["rank"], verdict.get("stage"))
            firsts.setdefault(key, verdict)
    if not firsts:
        return ""
    escape = html.escape
    # a host's ranks of the job as the detector last counted them (status.json), else unknown
    counted = {(node.get("job_id"), node.get("host")): node.get("ranks")
               for node in (evidence.status or {}).get("nodes") or () if isinstance(node, dict)}
    slow = [(v.get("job_id"), v.get("host"), v["rank"]) for v in firsts.values() if v["verdict"] == "straggler"]
    # a verdict line without job_id (evidence_files keeps it) is rolled up under None, as its own job
    nodes = [node for node in roll_up(slow, lambda job_id, host: counted.get((job_id, host)))
             if len(node.slow_ranks) > 1]
    rows = []
    for verdict in firsts.values():
        where = ", ".join(part for part in (verdict.get("host"), None if verdict.get("local_rank") is None else
                                            f"local rank {verdict['local_rank']}",
                                            (verdict.get("gpu") or {}).get("uuid")) if part)
        kind = suspect(verdict) if verdict["verdict"] == "straggler" else f"hang: {verdict.get('reason')}"
        cells = (verdict.get("window"), verdict["rank"], where, verdict.get("stage"), kind,
                 describe(verdict.get("gpu")) or "no GPU samples", next_step(verdict))
        rows.append("<tr>" + "".join(f"<td>{escape('' if cell is None else str(cell))}</td>" for cell in cells)
                    + "</tr>")
    parts = ["<h2>What to look at first</h2>"]
    if nodes:
        parts.append("<ul class='nodes'>" + "".join(f"<li>{escape(node.line())}</li>" for node in nodes) + "</ul>")
    parts.append("<table><tr><th>window</th><th>rank</th><th>where</th><th>stage</th><th>suspect</th>"
                 "<th>GPU</th><th>next step</th></tr>" + "".join(rows) + "</table>")
    return "".join(parts)


def _uncertain_section(counts: list[tuple[str, str, int]]) -> str:
    """Uncertain verdicts counted by reason and stage: what the detector could not judge, and where."""
    if not counts:
        return ""
    total = sum(count for _, _, count in counts)
    rows = "".join(f"<tr><td>{html.escape(reason)}</td><td>{html.escape(stage)}</td><td>{count}</td></tr>"
                   for reason, stage, count in counts)
    return (f"<h2>Uncertain verdicts</h2><p>{total} verdict{'s' if total != 1 else ''} where the detector could not "
            "judge, or a rank was over the relative threshold without being a straggler (below the absolute floor, "
            "a collective's wait, too few comparable peers). None of them is an alert.</p>"
            "<table><tr><th>reason</th><th>stage</th><th>verdicts</th></tr>" + rows + "</table>")


def _verdict_table(verdicts: list[dict[str, Any]]) -> str:
    if not verdicts:
        return "<p>None.</p>"
    columns = ("window", "rank", "host", "local_rank", "stage", "also_slow", "verdict", "reason", "slowdown", "gap_ms",
               "stalled_s", "timing", "attribution", "gpu")
    rows = []
    for verdict in verdicts:
        cells = []
        for column in columns:
            value = also_slow(verdict) if column == "also_slow" else describe(verdict.get("gpu")) or None \
                if column == "gpu" else verdict.get(column)
            if isinstance(value, list):
                value = ", ".join(map(str, value)) or None
            text = f"{value:.3f}" if isinstance(value, float) else ("" if value is None else str(value))
            cells.append(f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{column}</th>" for column in columns) + "</tr>" + "".join(rows) + "</table>")
