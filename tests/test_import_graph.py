"""No import cycle among the package's modules (otel_straggler/ and processors/, which installs as
otel_straggler.processors).

Every module is parsed with `ast`, not imported. An import anywhere in a module counts: at module
level, inside a function (a lazy import only moves the cycle to run time) or as
`importlib.import_module("otel_straggler....")` with a literal name. Only imports of the package's
own modules make edges: a function-level import of an optional heavy dependency (torch,
matplotlib, megatron) is outside the package and never part of a cycle.

An edge goes to the module named: `from otel_straggler.instrumentation import api` is an edge to
`...instrumentation.api`, `from otel_straggler import configure` one to `otel_straggler` (its
__init__). That importing a submodule first runs its package's __init__ is how Python finds it,
not a dependency: a package's __init__ may re-export its submodules (the public face sits on
top), and a submodule that imports the package's __init__ back makes a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parent.parent
# where each package's source lives: pyproject.toml's package-dir
PACKAGE_DIRS = {"otel_straggler": REPO / "otel_straggler", "otel_straggler.processors": REPO / "processors"}


def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name ('pkg' for pkg/__init__.py)."""
    modules = {}
    for package, root in PACKAGE_DIRS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of every import in the tree, nested ones included; a `from X import y`
    gives X.y (which is a module or a name in X)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                base = ".".join(anchor[:len(anchor) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                yield (base if alias.name == "*" else f"{base}.{alias.name}"), node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, node.lineno


def resolve(name: str, modules: dict[str, Path]) -> Optional[str]:
    """The package module an imported name is (or is defined in), None if outside the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}."""
    modules = package_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line in imported_names(tree, module, path.name == "__init__.py"):
            target = resolve(name, modules)
            if target is not None and target != module:
                edges.setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def shortest_cycle(graph: dict[str, dict[str, int]], start: str, within: set[str]) -> list[str]:
    """The shortest path from `start` back to itself inside one component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in within:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return "\n    ".join(f"{importer} -> {imported} (line {graph[importer][imported]})"
                         for importer, imported in zip(cycle, cycle[1:]))


def cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One shortest cycle through each module of each component, described edge by edge."""
    described = []
    for component in strongly_connected(graph):
        seen = set()
        for module in component:
            cycle = shortest_cycle(graph, module, set(component))
            key = frozenset(zip(cycle, cycle[1:]))
            if key not in seen:
                seen.add(key)
                described.append(f"{' -> '.join(cycle)}\n    {describe(graph, cycle)}")
    return described


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles among the package's modules:\n" + "\n".join(found)


TESTING = "otel_straggler.testing"


def test_only_the_testing_package_imports_itself():
    """otel_straggler.testing is for tests and benchmarks: a training job or the detector that
    imported it would load synthetic streams and the services' process management for nothing."""
    importers = [f"{module} -> {imported} (line {line})" for module, edges in import_graph().items()
                 if not (module == TESTING or module.startswith(TESTING + "."))
                 for imported, line in edges.items() if imported == TESTING or imported.startswith(TESTING + ".")]
    assert importers == []


def test_the_graph_sees_every_kind_of_import_and_the_cycle_check_finds_cycles():
    source = ("import otel_straggler.contract\n"
              "from otel_straggler.instrumentation import api, hot_path\n"
              "from . import rank_settings\n"
              "def lazily():\n"
              "    from otel_straggler.processors.device_events import EventPool\n"
              "    import importlib\n"
              "    importlib.import_module('otel_straggler.cli')\n"
              "    import torch\n")
    modules = package_modules()
    names = {resolve(name, modules) for name, _ in
             imported_names(ast.parse(source), "otel_straggler.instrumentation.example", False)}
    assert names == {"otel_straggler.contract", "otel_straggler.instrumentation.api",
                     "otel_straggler.instrumentation.hot_path", "otel_straggler.instrumentation.rank_settings",
                     "otel_straggler.processors.device_events", "otel_straggler.cli", None}
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert cycles(graph)[0].startswith("a -> b -> c -> a\n    a -> b (line 1)")
    assert cycles({"a": {"b": 1}, "b": {}}) == []
