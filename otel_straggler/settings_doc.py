"""Markdown tables of every setting, generated from the settings tables so the docs cannot
drift: `python -m otel_straggler.settings_doc rank|detector`. A test compares them with
docs/instrumentation.md and docs/detector.md."""
from __future__ import annotations

import sys
from typing import Iterable

from otel_straggler.settings import Setting


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _bounds(setting: Setting) -> str:
    if setting.choices:
        return " / ".join(setting.choices)
    if setting.minimum is None and setting.maximum is None:
        return ""
    low = "" if setting.minimum is None else _number(setting.minimum)
    high = "" if setting.maximum is None else _number(setting.maximum)
    bounds = f"{low} .. {high}"
    return bounds if setting.off is None else f"{_number(setting.off)} (off), or {bounds}"


def markdown_table(settings: Iterable[Setting], with_flags: bool) -> str:
    header = ("| env var | flag | default | bounds | meaning |" if with_flags
              else "| env var | default | bounds | meaning |")
    rule = "|---|---|---|---|---|" if with_flags else "|---|---|---|---|"
    rows = [header, rule]
    for setting in settings:
        default = f"`{setting.default!r}`" if setting.default != "" else "(unset)"
        cells = [f"`{setting.env_var}`"] + ([f"`{setting.flag}`"] if with_flags else [])
        cells += [default, _bounds(setting), setting.help.replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table(which: str) -> str:
    if which == "rank":
        from otel_straggler.instrumentation.rank_settings import SETTINGS

        return markdown_table(SETTINGS, with_flags=False)
    if which == "detector":
        from otel_straggler.detector.config import SETTINGS

        return markdown_table(SETTINGS, with_flags=True)
    raise SystemExit(f"unknown table {which!r}: rank or detector")


if __name__ == "__main__":
    print(table(sys.argv[1] if len(sys.argv) > 1 else "rank"))
