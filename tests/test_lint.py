"""No undefined names and no unused imports: ruff's pyflakes rules (F) over the engine,
the reader's `course` package, the benchmarks, the scripts and the tests.

Why a test: an undefined name on a path the suite rarely runs is a NameError that a
reader meets first.  `course_accept`'s rejection branch (chapter 14) used `np` without
importing it, and the import-only test of the course package could not see it.
pyflakes finds that without running anything.  (Its one false alarm here, a closure
naming a variable `del`eted after the closure's last call, is written around: the
variable is set to None instead.)  ruff rather than pyflakes itself: the same rules, and it
honours `# noqa: F401` on the imports made for their side effect (readline, the kernel
cache set-up).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["fucina_course", "book/chapters/course", "bench", "scripts", "tests",
         "conftest.py"]
RUFF = Path(sys.executable).parent / "ruff"        # requirements-dev.txt pins it


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    assert RUFF.is_file(), f"{RUFF} is missing: pip install -r requirements-dev.txt"
    return subprocess.run([str(RUFF), "check", "--select", "F", "--no-cache",
                           "--output-format", "concise", *args],
                          cwd=cwd, capture_output=True, text=True)


def test_no_undefined_names_or_unused_imports():
    result = ruff(*PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_finds_what_it_is_for(tmp_path):
    """The same command on a file with each mistake fails and names both."""
    (tmp_path / "bad.py").write_text("import os\n\n\ndef f(p, q):\n"
                                     "    return np.maximum(p - q, 0.0)\n")
    result = ruff("bad.py", cwd=tmp_path)
    assert result.returncode == 1
    assert "F401" in result.stdout and "F821" in result.stdout
