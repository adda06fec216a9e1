"""When, on what and on which code a benchmark's figures were measured: the date, the cores, the
load average and the commit, for a report's JSON and its header line (the README's figures carry
the same date, machine and code columns)."""
from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIT_TIMEOUT_S = 10.0


def _git(*arguments: str) -> str:
    completed = subprocess.run(["git", "-C", str(REPO), *arguments], capture_output=True, text=True,
                               timeout=GIT_TIMEOUT_S, check=True)
    return completed.stdout.strip()


def commit() -> str:
    """The checkout's short commit, with "+changes" when tracked files differ from it; "unknown"
    outside a git checkout or without git (a figure is still worth printing without it)."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def measured_on() -> dict:
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cores": os.cpu_count(),
            "load_average": os.getloadavg(), "commit": commit()}


def describe(context: dict) -> str:
    """One line for a report's header, from measured_on()'s keys."""
    return (f"{context['date']}, {context['cores']} cores, load average {context['load_average'][0]:.1f},"
            f" commit {context['commit']}")
