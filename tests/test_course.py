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


def test_saved_speculative_accept_runs_its_rejection_branch():
    """Importing is not running: a name used only inside a function's body is looked
    up when that line runs (`course_accept` once rejected with an `np` its module never
    imported; tests/test_lint.py now finds that kind statically).  Run the saved
    function, outside the notebook, on a guess it must reject, and check what it
    draws is distributed as the target's p (the rule's promise)."""
    import numpy as np

    sys.path.insert(0, str(CHAPTERS))
    try:
        from course.speculative import course_accept
    finally:
        sys.path.remove(str(CHAPTERS))
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.0, 0.1, 0.1, 0.8])         # proposes token 3, which p never picks
    rng = np.random.default_rng(0)
    assert {course_accept(p, q, 3, rng) for _ in range(50)} <= {0, 1, 2}
    drawn = [course_accept(p, q, int(rng.choice(4, p=q)), rng) for _ in range(20_000)]
    freq = np.bincount(drawn, minlength=4) / len(drawn)
    assert np.abs(freq - p).max() < 0.02     # > 5 standard errors at 20,000 draws


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
