"""pyproject's dependencies are what the package imports (issue 44, packaging).

Every third-party module any file of `fucina_course` imports (at module level or inside a
function) must be declared: in `dependencies` if the engine, the CLI or the workbook needs it,
in the `serve` extra if only `fucina serve` needs it, in the `book` extra if only the book's
plots and widgets do; and every declared distribution must be imported somewhere (the course
code's `regex` is the book's, not the engine's). Then the engine must import and run without
the extras: a subprocess where the extras' modules cannot be imported loads a synthetic model,
chats, and reaches `fucina course`.

requirements.txt stays the pinned set the book is built and tested with; pyproject states what
a user of the package needs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fucina_course"

# import name -> distribution name, where they differ
DISTRIBUTION = {"jinja2": "Jinja2", "IPython": "ipython", "matplotlib_inline": "matplotlib-inline",
                "sse_starlette": "sse-starlette"}


def _name(requirement: str) -> str:
    for stop in "=<>![; ":
        requirement = requirement.split(stop)[0]
    return requirement.strip()


def declared() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project.get("optional-dependencies", {})}
    return {group: {_name(r) for r in reqs} for group, reqs in groups.items()}


def imported() -> dict[str, set[str]]:
    """Third-party distribution -> the package's files that import it."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("fucina_course", "__future__"):
                    continue
                dist = DISTRIBUTION.get(top, top)
                found.setdefault(dist, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_import_is_declared_and_every_declaration_imported():
    groups = declared()
    every = set().union(*groups.values())
    uses = imported()
    undeclared = {d: sorted(files) for d, files in uses.items() if d not in every}
    assert not undeclared, f"imported but not in pyproject: {undeclared}"
    unused = (groups["core"] | groups["serve"]) - set(uses)
    assert not unused, f"declared but never imported by fucina_course: {sorted(unused)}"


def test_the_book_extra_holds_the_course_codes_imports():
    course = set()
    for path in (ROOT / "book" / "chapters" / "course").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                course |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                course.add(node.module.split(".")[0])
    third_party = {DISTRIBUTION.get(m, m) for m in course
                   if m not in sys.stdlib_module_names and m not in ("fucina_course", "course")}
    groups = declared()
    assert third_party <= groups["core"] | groups["book"], third_party


def test_gguf_is_pinned_to_the_version_whose_reader_we_extend():
    """gguf_file.py overrides private methods of gguf-py's GGUFReader: another version may
    rename them, so the package asks for exactly the one it was written against."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (gguf,) = [r for r in project["dependencies"] if _name(r) == "gguf"]
    import gguf as installed
    from importlib.metadata import version

    assert gguf == f"gguf=={version('gguf')}", (gguf, installed.__file__)


BLOCK_EXTRAS = """
import importlib.abc, sys
EXTRAS = {extras!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in EXTRAS:
            raise ModuleNotFoundError(f"{{name}} blocked: an extra", name=name)
sys.meta_path.insert(0, Block())
"""


def test_the_engine_runs_without_the_extras(tmp_path):
    groups = declared()
    module_of = {dist: module for module, dist in DISTRIBUTION.items()}
    extras = {module_of.get(d, d) for d in groups["serve"] | groups["book"]}
    script = BLOCK_EXTRAS.format(extras=sorted(extras)) + """
from fucina_course import Conversation, load_model
from fucina_course.synth import TINY_QWEN3, write_synthetic
from fucina_course.cli import build_parser
from fucina_course import workbook, workbook_checks   # noqa: F401
model = load_model(write_synthetic(TINY_QWEN3, sys.argv[1]))
chat = Conversation(model, max_response_tokens=4)
print("reply:", repr(chat.send("Hi").text))
build_parser().parse_args(["course", "check"])
from fucina_course.cli import main
print("serve:", main(["serve", sys.argv[1], "--port", "0"]))
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "tiny.gguf")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reply:" in done.stdout
    assert "serve: 1" in done.stdout                     # one line, not a traceback
    assert "fucina serve needs the serve extra (fastapi is missing)" in done.stderr
