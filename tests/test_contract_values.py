"""docs/contract.md is the shared contract unchanged, docs/contract-values.md is what contract_doc
generates, and the detector emits no verdict, reason, timing or attribution value that contract.py's
tables lack."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from otel_straggler import contract
from otel_straggler.contract_doc import verdict_values_page

REPO = Path(__file__).resolve().parent.parent
CONTRACT_PAGE = REPO / "docs" / "contract.md"
VALUES_PAGE = REPO / "docs" / "contract-values.md"
SHARED_CONTRACT = REPO.parent / "shared" / "CONTRACT.md"  # the contract as agreed with its other users
DETECTOR = REPO / "otel_straggler" / "detector"
# constant name prefixes of contract.py, and the table of the field their values go in
TABLE_OF_PREFIX = {"VERDICT_": contract.VERDICTS, "REASON_": contract.REASONS, "HANG_": contract.REASONS,
                   "ATTRIBUTION_": contract.ATTRIBUTIONS}
FIELD_KEYWORDS = {"verdict": contract.VERDICTS, "reason": contract.REASONS, "timing": contract.TIMINGS,
                  "attribution": contract.ATTRIBUTIONS}


def test_the_values_page_is_the_generated_one():
    assert VALUES_PAGE.read_text() == verdict_values_page(), (
        "run: python -m otel_straggler.contract_doc > docs/contract-values.md")


def test_the_contract_page_is_the_shared_contract():
    if not SHARED_CONTRACT.is_file():
        pytest.skip(f"{SHARED_CONTRACT} is not beside this checkout")
    assert CONTRACT_PAGE.read_text() == SHARED_CONTRACT.read_text()


def test_the_contract_page_is_at_the_version_the_values_page_extends():
    assert "## 5. v1.2 additions" in CONTRACT_PAGE.read_text()


def test_every_value_constant_of_the_contract_is_in_its_table():
    for name, value in vars(contract).items():
        if name == "VERDICT_EVENT_NAME" or not isinstance(value, str):
            continue
        for prefix, table in TABLE_OF_PREFIX.items():
            if name.startswith(prefix):
                assert value in table, name
    assert set(contract.TIMINGS) == {contract.TIMING_HOST, contract.TIMING_DEVICE}


def literal_field_values(source: str) -> list[tuple[int, str]]:
    """(line, value) of each string literal given as a verdict field keyword, or compared with
    something, that is a value of one of the tables: values belong in contract.py, named."""
    values = {value for table in (contract.VERDICTS, contract.REASONS, contract.ATTRIBUTIONS) for value in table}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg in FIELD_KEYWORDS and isinstance(node.value, ast.Constant):
            found.append((node.lineno, node.value.value))
        elif isinstance(node, ast.Compare):
            found += [(node.lineno, operand.value) for operand in [node.left, *node.comparators]
                      if isinstance(operand, ast.Constant) and operand.value in values]
    return sorted(found)


def contract_names_given_as_field(source: str) -> list[tuple[int, str, str]]:
    """(line, field, value) of each `field=contract.NAME` keyword in a call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.keyword) and node.arg in FIELD_KEYWORDS and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "contract"):
            found.append((node.lineno, node.arg, getattr(contract, node.value.attr)))
    return found


def test_the_checks_catch_a_literal_and_a_value_outside_the_tables():
    assert literal_field_values('Verdict(reason="slow_vs_peers")\nif x.reason == "intermittent": pass') == [
        (1, "slow_vs_peers"), (2, "intermittent")]
    assert contract_names_given_as_field("Verdict(timing=contract.TIMING_HOST_ONLY)") == [
        (1, "timing", contract.TIMING_HOST_ONLY)]


def test_the_detector_gives_verdict_fields_only_values_of_the_tables():
    modules = sorted(DETECTOR.glob("*.py"))
    assert modules
    literals = {path.name: found for path in modules if (found := literal_field_values(path.read_text()))}
    assert literals == {}
    for path in modules:
        for line, field, value in contract_names_given_as_field(path.read_text()):
            assert value in FIELD_KEYWORDS[field], f"{path.name}:{line}: {field}={value!r}"
