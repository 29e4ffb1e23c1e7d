"""The engine's modules import downward only (issue 44).

* No import cycle among `fucina_course`'s modules, counting the imports made inside
  functions: a function-level import that closes a cycle is a cycle that only shows when
  that function first runs (chat and speculative imported each other that way).
* Only the layer that deals with files and flags finds models: `catalog` (where a named
  model lives) is imported by the CLI, the synthetic-model writer and the workbook's
  checks, never by the inference modules (speculative.py used to load its draft model
  through it and parse `--speculate`; the CLI does both now and hands the model over).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fucina_course"
COMMANDS = {"commands", "commands_chat", "commands_course", "commands_info",
            "commands_run", "commands_serve"}    # the subcommands, by concern
FINDS_FILES = {"catalog", "cli", "__main__", "synth", "workbook_checks",
               "__init__"} | COMMANDS
UPPER = {"catalog", "cli"} | COMMANDS


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level or in a function);
    `from . import x` counts as importing the submodule x when there is one."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = (here[:len(here) - node.level + 1] if node.level else [])
                target = ".".join(base + ([node.module] if node.module else []))
                deps |= {f"{target}.{a.name}" if f"{target}.{a.name}" in paths else target
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_even_through_function_level_imports():
    assert cycles(import_graph()) == []


def test_only_the_file_layer_imports_catalog_and_the_cli():
    upward = {name: sorted(d.rsplit(".", 1)[-1] for d in deps
                           if d.rsplit(".", 1)[-1] in UPPER)
              for name, deps in import_graph().items()
              if name.rsplit(".", 1)[-1] not in FINDS_FILES}
    assert {k: v for k, v in upward.items() if v} == {}


def test_the_cycle_check_finds_a_function_level_cycle(tmp_path):
    pkg = tmp_path / "fucina_course"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph["fucina_course.c"] == {"fucina_course.a"}
    assert cycles(graph) == [["fucina_course.a", "fucina_course.b"]]
