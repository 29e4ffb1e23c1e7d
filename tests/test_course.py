"""The reader's `course` package: saved from the chapters, importable alone, and what chapter 11
("Build it yourself") assembles its generator from.

scripts/save_course.py copies every statement a chapter marks `#@save` into
book/chapters/course/<name>.py.  These tests keep the copies equal to the chapters, check that each
module imports without the notebook around it, that the marking rules fail loudly when misused,
and that chapter 11 builds its generator from the course package, not from the engine.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "book" / "chapters"
sys.path.insert(0, str(ROOT / "scripts"))
import save_course  # noqa: E402


def test_saved_modules_equal_the_chapters():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "save_course.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module", sorted(p.stem for p in (CHAPTERS / "course").glob("*.py")
                                          if p.name != "__init__.py"))
def test_each_module_imports_alone(module):
    """A saved statement may use only names the saved statements define or import."""
    result = subprocess.run([sys.executable, "-c", f"import course.{module}"], cwd=CHAPTERS,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _chapter(tmp_path: Path, *cells: str) -> Path:
    text = "\n\n".join(f"```{{code-cell}} ipython3\n{c}\n```" for c in cells)
    path = tmp_path / "99_toy.md"
    header = ("---\njupytext:\n  text_representation:\n    extension: .md\n"
              "    format_name: myst\n---\n\n")
    path.write_text(header + "# Toy\n\n" + text + "\n")
    return path


def test_marks_save_the_next_statement_or_a_tailed_line(tmp_path):
    path = _chapter(tmp_path,
                    "import numpy as np  #@save\nimport os\n\n#@save\ndef f(x):\n"
                    "    return np.sum(x)\n\nassert f([1, 2]) == 3",
                    "#@save\n@staticmethod\ndef g():\n    pass\nY = 2")
    assert save_course.saved_statements(path) == [
        "import numpy as np", "def f(x):\n    return np.sum(x)",
        "@staticmethod\ndef g():\n    pass"]
    text = save_course.render(path, save_course.saved_statements(path))
    compile(text, "toy.py", "exec")                 # a valid module
    assert text.index("import numpy") < text.index("def f")


def test_a_mark_before_nothing_fails(tmp_path):
    path = _chapter(tmp_path, "def f():\n    #@save\n    return 1")   # inside a body
    with pytest.raises(SystemExit, match="not followed by a top-level statement"):
        save_course.saved_statements(path)


def test_chapter_11_builds_from_the_course_package():
    """Before its section that checks against the engine, chapter 11 imports from the engine
    only the file reader (and where the file is); the dequantizer comes via course.forward."""
    allowed = {("fucina_course.catalog", "resolve"), ("fucina_course.gguf_file", "GGUFFile")}
    used, course = set(), set()
    for cell in jupytext.read(CHAPTERS / "11_build_it.md").cells:
        if cell.cell_type == "markdown" and "## Checked against the engine" in cell.source:
            break
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.ImportFrom):
                names = {(node.module, a.name) for a in node.names}
                (course if node.module.startswith("course") else used).update(names)
            elif isinstance(node, ast.Import):
                used.update((a.name, None) for a in node.names)
    engine = {(m, n) for m, n in used if m.split(".")[0] == "fucina_course"}
    assert engine <= allowed, engine - allowed
    modules = {m for m, _ in course}
    # the pieces of chapters 2, 3, 5, 6, 8 and 9
    assert modules >= {"course.tokenizer", "course.forward", "course.attention",
                       "course.kv_cache", "course.sampling", "course.chat"}, modules
