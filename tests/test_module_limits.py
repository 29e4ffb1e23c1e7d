"""Size limits of the engine's code (issue 44): a module does one job, a function one step.

* No module of `fucina_course/` over `MAX_MODULE_LINES` lines: a module past it is doing
  more than one job (commands.py, 740 lines, held eleven subcommands; it is now one module
  per concern and the steps they share).
* No function or method over `MAX_FUNCTION_LINES` lines (`def` to its last line, docstring
  included): one that long is several steps, each of which deserves a name.

`quant/` is left out of both: its kernel builders generate one specialised loop per block
format and instruction set, and are long on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fucina_course"
EXCLUDED = {"quant"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in package.rglob("*.py")
                  if not EXCLUDED & set(p.relative_to(package).parts[:-1]))


def long_modules(package: Path = PACKAGE) -> list[str]:
    """'path: N lines' for every module over the limit."""
    out = []
    for path in modules(package):
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(package.parent)}: {n} lines")
    return out


def long_functions(package: Path = PACKAGE) -> list[str]:
    """'path:line Class.function: N lines' for every function over the limit."""
    out = []
    for path in modules(package):
        tree = ast.parse(path.read_text())
        for node, qualname in _functions(tree):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(package.parent)}:{node.lineno} "
                           f"{qualname}: {n} lines")
    return out


def _functions(tree: ast.AST, prefix: str = ""):
    """(node, qualified name) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, prefix + node.name
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_no_module_over_the_line_limit():
    too_long = long_modules()
    assert not too_long, (f"modules over {MAX_MODULE_LINES} lines (split them by "
                          "concern):\n  " + "\n  ".join(too_long))


def test_no_function_over_the_line_limit():
    too_long = long_functions()
    assert not too_long, (f"functions over {MAX_FUNCTION_LINES} lines (name their "
                          "steps):\n  " + "\n  ".join(too_long))


def _function(name: str, n: int, indent: str = "") -> str:
    """The source of a function `n` lines long, its `def` line included."""
    body = "".join(f"{indent}    x = {i}\n" for i in range(n - 1))
    return f"{indent}def {name}():\n{body}"


def test_the_limits_find_what_they_are_for(tmp_path):
    """A module and functions at the limits pass; one line more is named (a method and a
    function nested in it too); quant/ is not looked at."""
    pkg = tmp_path / "fucina_course"
    (pkg / "quant").mkdir(parents=True)
    (pkg / "fine.py").write_text(_function("fine", MAX_FUNCTION_LINES)
                                 + "x = 1\n" * (MAX_MODULE_LINES - MAX_FUNCTION_LINES))
    (pkg / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "methods.py").write_text("class A:\n    def run(self):\n"
                                    + _function("step", MAX_FUNCTION_LINES + 1, " " * 8)
                                    + "        return step\n")
    (pkg / "quant" / "kernels.py").write_text(_function("build", 2 * MAX_FUNCTION_LINES)
                                              + "x = 1\n" * MAX_MODULE_LINES)
    assert long_modules(pkg) == [f"fucina_course/long.py: {MAX_MODULE_LINES + 1} lines"]
    assert long_functions(pkg) == [
        f"fucina_course/methods.py:2 A.run: {MAX_FUNCTION_LINES + 3} lines",
        f"fucina_course/methods.py:3 A.run.step: {MAX_FUNCTION_LINES + 1} lines"]
