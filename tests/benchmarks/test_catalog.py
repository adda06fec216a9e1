"""The benchmark catalog (benchmarks/catalog.py, what `make bench` lists) names every benchmark in
benchmarks/, and runs one by name or says which names there are."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import catalog

BENCHMARKS = Path(catalog.__file__).resolve().parent


def runs_as_a_script(path: Path) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(path.read_text()).body)


def test_every_module_of_benchmarks_is_listed_once():
    listed = [b.name for b in catalog.CATALOG] + list(catalog.HELPERS) + list(catalog.HARNESSES)
    assert sorted(listed) == sorted(path.stem for path in BENCHMARKS.glob("*.py"))


def test_every_listed_benchmark_runs_as_a_script():
    assert [b.name for b in catalog.CATALOG if not runs_as_a_script(BENCHMARKS / f"{b.name}.py")] == []


def test_the_list_has_one_line_per_benchmark(capsys):
    assert catalog.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    for benchmark in catalog.CATALOG:
        assert [line for line in lines if line.split()[:1] == [benchmark.name]], benchmark.name


def test_run_starts_the_named_benchmark_with_its_arguments(monkeypatch):
    started = []
    monkeypatch.setattr(catalog.os, "execv", lambda program, argv: started.append(argv))
    catalog.main(["run", "hot_path", "--rounds", "3"])
    assert started == [[catalog.sys.executable, str(BENCHMARKS / "hot_path.py"), "--rounds", "3"]]


def test_an_unknown_name_is_refused_with_the_names_there_are():
    with pytest.raises(SystemExit, match="no benchmark named 'hot-path'.*hot_path"):
        catalog.main(["run", "hot-path"])
