"""The reader's workbook: the course code as stubs to fill, and the machinery that checks them.

The chapters write the course code (`book/chapters/course/`, one module per chapter, saved from
the cells marked `#@save` by scripts/save_course.py) and check it against the engine as they go.
A reader who only reads and runs those cells never writes a line. `fucina course init DIR` gives
them the same modules with every function and method body replaced by
`raise NotImplementedError` (signatures, docstrings, imports and constants kept), and
`fucina course check` runs the per-function checks of `workbook_checks` on what they wrote.

Checking one function in isolation is what makes the verdicts useful: a broken `rms_norm`
should fail `rms_norm`, not also every later function that calls it. So each check runs in a
*mixed* `course` package (`environment`): every module is the reference module first, then
the reader's statements on top, but of the definitions the chapters saved only the one under
test (or, for `ask`, every one the reader has implemented) is taken from the reader; a
missing or stubbed definition stays the reference's. That is also how chapter 5 can be done
before chapter 4. The reader's own helpers, imports and constants are always theirs.

Rejected: copying the reference into the reader's directory for what is missing (their files
would change under them), and running pytest on generated test files (one line per function
with the first mismatch is what a learner needs; pytest's report is for us, and
tests/test_workbook.py runs every check on the reference through pytest).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

from .errors import FucinaError

BOOK = Path(__file__).resolve().parent.parent / "book" / "chapters"
REFERENCE = BOOK / "course"
STUB = "raise NotImplementedError"


class WorkbookError(FucinaError):
    """A workbook command cannot run (no such chapter, a directory in the way, ...)."""


@dataclass(frozen=True)
class Chapter:
    number: int
    module: str          # course/<module>.py
    title: str

    @property
    def label(self) -> str:
        return f"chapter {self.number:02d} ({self.title}), course/{self.module}.py"


def chapters() -> list[Chapter]:
    """The chapters that save course code, in book order."""
    if not REFERENCE.is_dir():
        raise WorkbookError(f"the reference course code is not at {REFERENCE} (the workbook "
                            "needs the book's source tree: a git clone, installed with -e)")
    found = []
    for md in sorted(BOOK.glob("[0-9][0-9]_*.md")):
        number, module = md.stem.split("_", 1)
        if (REFERENCE / f"{module}.py").is_file():
            title = next((line[2:].strip() for line in md.read_text().splitlines()
                          if line.startswith("# ")), module)
            found.append(Chapter(int(number), module, title))
    return found


def select(names: list[str]) -> list[Chapter]:
    """Chapters named as `3`, `03` or `forward`; all of them if `names` is empty."""
    every = chapters()
    if not names:
        return every
    chosen = []
    for name in names:
        match = [c for c in every if name == c.module
                 or (name.isdigit() and int(name) == c.number)]
        if not match:
            known = ", ".join(f"{c.number:02d} {c.module}" for c in every)
            raise WorkbookError(f"no chapter {name!r} saves course code (those that do: "
                                f"{known})")
        chosen += [c for c in match if c not in chosen]
    return chosen


# --- reading and stubbing a module -----------------------------------------------------

def _defined(node: ast.stmt) -> str | None:
    """The name a top-level `def` or `class` defines (None for anything else)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    return None


def definitions(source: str) -> list[str]:
    """The functions and classes a course module defines, in order: what a reader fills."""
    return [n for n in map(_defined, ast.parse(source).body) if n]


def _docstring(node) -> ast.stmt | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        return first
    return None


def _is_stub_function(node) -> bool:
    body = node.body[1:] if _docstring(node) else node.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    exc = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _is_stub(node) -> bool:
    """A function whose body (after its docstring) is only `raise NotImplementedError`;
    a class whose every method is such a stub."""
    if isinstance(node, ast.ClassDef):
        methods = [n for n in node.body if isinstance(n, (ast.FunctionDef,
                                                          ast.AsyncFunctionDef))]
        return bool(methods) and all(map(_is_stub_function, methods))
    return _is_stub_function(node)


def implemented(source: str) -> dict[str, bool]:
    """Name -> whether the reader wrote it (False: still a stub)."""
    return {node.name: not _is_stub(node) for node in ast.parse(source).body if _defined(node)}


def _stub_lines(node, lines: list[str], where: str) -> list[str]:
    """A function's decorators, signature and docstring, and a body that raises."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    doc = _docstring(node)
    body0 = node.body[0]
    out = lines[start - 1:body0.lineno - 1]
    indent = " " * body0.col_offset
    if doc is not None:
        out += lines[doc.lineno - 1:doc.end_lineno]
    return out + [f'{indent}{STUB}("{where}")']


def stub(source: str, chapter: Chapter) -> str:
    """The module a reader starts from: imports and constants as in the reference, every
    function and method reduced to its signature and docstring."""
    lines = source.splitlines()
    tree = ast.parse(source)
    where = f"chapter {chapter.number:02d}"
    header = (f'"""Your course code for chapter {chapter.number:02d}, {chapter.title}.\n\n'
              "Replace each `raise NotImplementedError(...)` with your code, then run\n"
              f"    fucina course check {chapter.number:02d}\n"
              f"(`fucina course solution {chapter.number:02d}` shows the book's version).\n"
              '"""')
    imports, blocks = [], []
    body = tree.body[1:] if _docstring(tree) else tree.body
    for node in body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports += lines[start - 1:node.end_lineno]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            blocks.append(_stub_lines(node, lines, f"{node.name}: {where}"))
        elif isinstance(node, ast.ClassDef):              # a class: each method a stub
            members = node.body[1:] if _docstring(node) else node.body
            block = lines[start - 1:(members[0].lineno if members else node.end_lineno) - 1]
            for member in members:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    block += [""] + _stub_lines(member, lines,
                                                f"{node.name}.{member.name}: {where}")
                else:
                    first = min([member.lineno] + [d.lineno for d in
                                                   getattr(member, "decorator_list", [])])
                    block += lines[first - 1:member.end_lineno]
            blocks.append(block)
        else:                                             # constants: kept as they are
            blocks.append(lines[start - 1:node.end_lineno])
    top = "\n\n".join([header] + (["\n".join(imports)] if imports else []))
    return "\n\n\n".join([top] + ["\n".join(b).rstrip() for b in blocks]) + "\n"


README = """# Your workbook

One module per chapter that writes course code. Each function and method is a stub: its
signature and docstring are the book's, its body is `raise NotImplementedError(...)`.
Write the body (the chapter explains what it must do), then check it:

    fucina course check                 # every chapter, one line per function
    fucina course check 03 forward      # some chapters (number or module name)
    fucina course solution 03           # the book's version, when you are stuck
    fucina course ask "What is the capital of France?"   # your own generator answers

Run them from the directory that holds this one, or pass `--dir {dir}`. Chapters can be
done in any order: a function you have not written yet is taken from the book's version
while another is checked, and each function is checked alone (with the book's version of
everything else), so a mistake is reported where it is.
"""


def init(directory: Path) -> list[Path]:
    """Write the stub modules and a README into `directory`; never overwrite a file."""
    directory = Path(directory)
    every = chapters()
    targets = {directory / f"{c.module}.py": c for c in every}
    present = [p for p in [*targets, directory / "README.md"] if p.exists()]
    if present:
        raise WorkbookError(f"{directory} already has {', '.join(p.name for p in present)}: "
                            "nothing was written (your work is never overwritten; choose "
                            "another directory)")
    if directory.exists() and not directory.is_dir():
        raise WorkbookError(f"{directory} is a file, not a directory")
    files = {path: stub((REFERENCE / path.name).read_text(), chapter)
             for path, chapter in targets.items()}            # all made before any write
    files[directory / "README.md"] = README.format(dir=directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for path, text in files.items():
            path.write_text(text)
        (directory / "__init__.py").touch()
    except OSError as err:
        raise WorkbookError(f"cannot write the workbook into {directory}: "
                            f"{err.strerror or err}") from err
    return list(files)


# --- the mixed `course` package --------------------------------------------------------

Keep = Callable[[str, str], bool]     # (module, name) -> take the reader's definition?


class _CourseFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `course` and `course.<module>`: the reference module, then the reader's
    statements on top, leaving out the saved definitions `keep` does not choose."""

    def __init__(self, reader: Path, keep: Keep):
        self.reader, self.keep = reader, keep

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "course" or fullname.startswith("course."):
            return importlib.util.spec_from_loader(fullname, self,
                                                   is_package=fullname == "course")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "course":
            module.__path__ = []
            return
        name = module.__name__.split(".", 1)[1]
        ref, mine = REFERENCE / f"{name}.py", self.reader / f"{name}.py"
        if not ref.is_file() and not mine.is_file():
            raise ImportError(f"no course module {name!r}", name=module.__name__)
        saved = set()
        if ref.is_file():                     # else a module of the reader's own helpers
            ref_source = ref.read_text()
            saved = set(definitions(ref_source))
            exec(compile(ref_source, str(ref), "exec"), module.__dict__)
        if mine.is_file():
            tree = ast.parse(mine.read_text(), str(mine))
            tree.body = [node for node in tree.body
                         if _defined(node) not in saved or self.keep(name, node.name)]
            exec(compile(tree, str(mine), "exec"), module.__dict__)


@contextmanager
def environment(reader: Path, keep: Keep) -> Iterator[Callable[[str], object]]:
    """Inside: `course` imports the mixed package; yields `module(name)` -> course.<name>.
    Whatever `course` modules were imported before are put back afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "course" or k.startswith("course.")}
    for k in saved:
        del sys.modules[k]
    finder = _CourseFinder(Path(reader), keep)
    sys.meta_path.insert(0, finder)
    try:
        yield lambda name: importlib.import_module(f"course.{name}")
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "course" or k.startswith("course.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def reader_state(reader: Path, chapter: Chapter) -> tuple[dict[str, bool], str | None]:
    """(name -> implemented, for every definition the chapter saves; an error that makes
    the reader's module unusable, e.g. a syntax error, or None)."""
    names = definitions((REFERENCE / f"{chapter.module}.py").read_text())
    path = Path(reader) / f"{chapter.module}.py"
    if not path.is_file():
        return dict.fromkeys(names, False), None
    try:
        mine = implemented(path.read_text())
    except SyntaxError as err:
        return dict.fromkeys(names, True), (f"{path.name} line {err.lineno}: "
                                            f"{err.msg}")
    return {n: mine.get(n, False) for n in names}, None


def written_by_reader(reader: Path) -> dict[str, dict[str, bool]]:
    """Module -> name -> whether the reader implemented it, for every chapter: what
    running the reader's whole stack takes from them (`keep`), and from the book."""
    return {c.module: reader_state(reader, c)[0] for c in chapters()}
