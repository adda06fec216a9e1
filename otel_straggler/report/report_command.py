"""`otel-straggler report`: its flags, the checks that fail in one line before anything is built,
and what is printed at the end (html_report.py builds the report itself)."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from otel_straggler.cli import UsageError
from otel_straggler.report import evidence_files


def matplotlib_installed() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("evidence_dir", type=Path, metavar="EVIDENCE_DIR",
                        help="a detector's evidence directory (holding verdicts.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the report (default: EVIDENCE_DIR/report)")


def run_report(args: argparse.Namespace) -> int:
    if not matplotlib_installed():
        raise UsageError("matplotlib is not installed; install it with: pip install matplotlib")
    from otel_straggler.report import html_report

    out_dir = args.out if args.out is not None else args.evidence_dir / "report"
    try:
        built = html_report.build(args.evidence_dir, out_dir)
    except evidence_files.EvidenceError as error:
        raise UsageError(str(error)) from None
    print(built.summary)
    print(f"report: {built.html_path}")
    return 0
