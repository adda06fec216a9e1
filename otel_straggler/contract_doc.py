"""docs/contract.md's last section, generated from contract.py's value tables so that the docs
cannot drift from what the detector emits: `python -m otel_straggler.contract_doc`. A test compares
it with docs/contract.md."""
from __future__ import annotations

from otel_straggler import contract

HEADING = "## Every value a verdict field takes"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def verdict_values_section() -> str:
    """The section, heading included, ending with a newline."""
    lines = [HEADING, "",
             "Generated from `otel_straggler/contract.py` (`python -m otel_straggler.contract_doc`); the detector "
             "emits no other value in these fields.", ""]
    for field, values in contract.VERDICT_FIELD_VALUES.items():
        lines.append(f"### `{field}`")
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
    print(verdict_values_section(), end="")
