"""docs/contract-values.md, generated from contract.py's value tables so that the docs cannot drift
from what the detector emits: `python -m otel_straggler.contract_doc > docs/contract-values.md`. A
test compares the two. docs/contract.md itself is the contract as agreed, unchanged."""
from __future__ import annotations

from otel_straggler import contract

TITLE = "# Every value a verdict field takes"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def verdict_values_page() -> str:
    """The page, title included, ending with a newline."""
    lines = [TITLE, "",
             "The values the `verdict`, `reason`, `timing` and `attribution` fields of a verdict take "
             "([contract.md](contract.md) §3 and §5), with when. Generated from `otel_straggler/contract.py` "
             "(`python -m otel_straggler.contract_doc > docs/contract-values.md`); the detector emits no other "
             "value in these fields, and a new value is an addition to the contract.", ""]
    for field, values in contract.VERDICT_FIELD_VALUES.items():
        lines.append(f"## `{field}`")
        if field == "reason":
            lines += ["| value | verdicts | when |", "|---|---|---|"]
            lines += [f"| `{value}` | {', '.join(f'`{kind}`' for kind in kinds)} | {_cell(when)} |"
                      for value, (kinds, when) in values.items()]
        else:
            lines += ["| value | when |", "|---|---|"]
            lines += [f"| `{value}` | {_cell(when)} |" for value, when in values.items()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(verdict_values_page(), end="")
