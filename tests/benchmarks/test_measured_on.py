"""The stamp a benchmark's report carries (benchmarks/measured_on.py): the checkout's commit as git
gives it, and "unknown" where git cannot say."""
from __future__ import annotations

import subprocess

import measured_on


def test_the_commit_is_the_checkouts_head():
    head = subprocess.run(["git", "-C", str(measured_on.REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert measured_on.commit() in (head, head + "+changes")


def test_outside_a_checkout_the_commit_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(measured_on, "REPO", tmp_path)
    assert measured_on.commit() == "unknown"


def test_the_header_line_names_date_cores_load_and_commit():
    context = measured_on.measured_on()
    line = measured_on.describe(context)
    assert line.startswith(context["date"]) and f"{context['cores']} cores" in line
    assert line.endswith(f"commit {context['commit']}") and "load average" in line
