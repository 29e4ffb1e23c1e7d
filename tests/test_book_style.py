"""The book's conventions, checked on the sources (no kernel, no build).

CONTRIBUTING.md ("Writing a chapter") states them; this file holds them:

* every line the book shows as code fits the rendered column: chapter code cells, fenced code
  blocks in any page, and the engine code quoted with ``{literalinclude}`` are at most
  ``MAX_WIDTH`` characters wide (printed output is checked in the browser by
  scripts/check_book.py, which needs the executed book);
* every ``{literalinclude}`` still resolves: the file exists and the ``:pyobject:`` /
  ``:lines:`` / ``:start-after:`` ... selection still finds something;
* a hidden cell says what it hides (``mystnb.code_prompt_show``, e.g. "Show solution");
* every chapter has a ``(ch-...)=`` label on its title and ends with a "Next:" line.
"""

from __future__ import annotations

import re
import types
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
MAX_WIDTH = 88
HIDE_TAGS = {"hide-input", "hide-output", "hide-cell"}

jupytext = pytest.importorskip("jupytext")
markdown_it = pytest.importorskip("markdown_it")

# Options of Sphinx's literalinclude that select or reshape the quoted lines.
_INT_OPTIONS = {"dedent", "lineno-start", "tab-width"}
_READER_OPTIONS = {"pyobject", "lines", "start-after", "end-before", "start-at", "end-at",
                   "prepend", "append", *_INT_OPTIONS}


def width(line: str) -> int:
    """Columns a line takes in a monospace font (East Asian wide characters take two)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in line)


def pages() -> list[Path]:
    return sorted(p for p in BOOK.rglob("*.md") if not any(part.startswith(("_", ".")) for part in
                                                          p.relative_to(BOOK).parts))


def chapters() -> list[Path]:
    return sorted((BOOK / "chapters").glob("*.md"))


def is_notebook(path: Path) -> bool:
    return path.read_text(encoding="utf-8").startswith("---\njupytext:")


def markdown_parts(path: Path) -> list[tuple[str, int]]:
    """(markdown text, line offset) pieces of a page: the markdown cells of a notebook, or the
    whole file of a plain page.  Line offsets are approximate for notebooks (cell index)."""
    if not is_notebook(path):
        return [(path.read_text(encoding="utf-8"), 0)]
    nb = jupytext.read(path)
    return [(cell.source, 0) for cell in nb.cells if cell.cell_type == "markdown"]


def fences(path: Path):
    """Every fenced block of the page's markdown: (info string, content, line number)."""
    md = markdown_it.MarkdownIt("commonmark")
    for text, offset in markdown_parts(path):
        for token in md.parse(text):
            if token.type == "fence":
                yield token.info.strip(), token.content, offset + token.map[0] + 1


def code_cells(path: Path):
    if not is_notebook(path):
        return []
    return [cell for cell in jupytext.read(path).cells if cell.cell_type == "code"]


def literalincludes(path: Path):
    """(page, line, target file, reader options) for every {literalinclude} of a page."""
    for info, content, line in fences(path):
        if not info.startswith("{literalinclude}"):
            continue
        target = info.split(None, 1)[1].strip()
        options = {}
        for opt in content.splitlines():
            m = re.match(r"^:([\w-]+):\s*(.*)$", opt.strip())
            if m:
                options[m.group(1)] = m.group(2)
        # Sphinx: a leading "/" is relative to the source directory (the repository root here).
        file = ROOT / target[1:] if target.startswith("/") else path.parent / target
        yield line, file, options


def quoted_text(file: Path, options: dict) -> str:
    """The text Sphinx's literalinclude shows for these options (Sphinx's own reader)."""
    from sphinx.directives.code import LiteralIncludeReader

    opts = {k: (int(v) if k in _INT_OPTIONS else v) for k, v in options.items()
            if k in _READER_OPTIONS}
    config = types.SimpleNamespace(source_encoding="utf-8-sig")
    text, _ = LiteralIncludeReader(str(file), opts, config).read()
    return text


def too_wide(text: str) -> list[str]:
    return [f"{width(line)} cols: {line.strip()[:60]}"
            for line in text.splitlines() if width(line) > MAX_WIDTH]


@pytest.mark.parametrize("path", chapters(), ids=lambda p: p.name)
def test_chapter_code_cells_fit_the_column(path):
    wide = []
    for k, cell in enumerate(code_cells(path)):
        wide += [f"cell {k}: {w}" for w in too_wide(cell.source)]
    assert not wide, f"{path.name}: code lines wider than {MAX_WIDTH}:\n" + "\n".join(wide)


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(BOOK)))
def test_fenced_code_blocks_fit_the_column(path):
    wide = []
    for info, content, line in fences(path):
        if info.startswith("{") and not info.startswith("{code-block}"):
            continue  # a directive: its body is options or prose, not shown as code
        wide += [f"block at {line}: {w}" for w in too_wide(content)]
    assert not wide, f"{path.name}: code lines wider than {MAX_WIDTH}:\n" + "\n".join(wide)


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(BOOK)))
def test_quoted_engine_code_exists_and_fits_the_column(path):
    problems = []
    for line, file, options in literalincludes(path):
        what = f"{file.relative_to(ROOT) if file.is_relative_to(ROOT) else file} {options}"
        if not file.is_file():
            problems.append(f"{what}: file not found")
            continue
        try:
            text = quoted_text(file, options)
        except ValueError as err:  # e.g. "Object named 'X' not found in include file"
            problems.append(f"{what}: {err}")
            continue
        if not text.strip():
            problems.append(f"{what}: the selection is empty")
        problems += [f"{what}: {w}" for w in too_wide(text)]
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", chapters(), ids=lambda p: p.name)
def test_hidden_cells_say_what_they_hide(path):
    unlabelled = []
    for k, cell in enumerate(code_cells(path)):
        tags = set(cell.metadata.get("tags", []))
        if not tags & HIDE_TAGS:
            continue
        labels = cell.metadata.get("mystnb", {})
        show, hide = labels.get("code_prompt_show", ""), labels.get("code_prompt_hide", "")
        if not (show.startswith("Show ") and hide.startswith("Hide ")):
            unlabelled.append(f"cell {k}: {cell.source.splitlines()[0][:60]!r}")
    assert not unlabelled, (
        f"{path.name}: hidden cells need mystnb.code_prompt_show/hide labels "
        "('Show solution' / 'Hide solution'), or the tag remove-cell if the reader never needs "
        "them:\n" + "\n".join(unlabelled))


@pytest.mark.parametrize("path", chapters(), ids=lambda p: p.name)
def test_chapter_has_a_label_and_ends_with_next(path):
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.md", path.name), "chapters are named NN_name.md"
    nb = jupytext.read(path)
    first = nb.cells[0].source.lstrip()
    assert re.match(r"\(ch-[a-z0-9-]+\)=\n# ", first), (
        f"{path.name}: the first cell starts with a (ch-name)= label and the chapter title")
    last_markdown = [c for c in nb.cells if c.cell_type == "markdown"][-1].source
    assert re.search(r"^(\*\*)?Next:", last_markdown, re.M), (
        f"{path.name}: the last markdown cell has a 'Next:' line")


def test_width_counts_wide_characters_twice():
    assert width("abc") == 3 and width("日本") == 4 and width("é") == 1




def saved_names(path: Path) -> list[str]:
    """The functions and classes a chapter saves with #@save (scripts/save_course.py)."""
    import ast
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import save_course
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    names = []
    for statement in save_course.saved_statements(path):
        node = ast.parse(statement).body[0]
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
    return names


def your_turn_problems(path: Path) -> list[str]:
    """A chapter that saves course code says, in a `## Your turn` section before `## What
    you now know`, which stubs of the reader's workbook to fill (every saved name) and the
    command that checks them."""
    names = saved_names(path)
    headings = [line.strip() for text, _ in markdown_parts(path)
                for line in text.splitlines() if line.startswith("## ")]
    if not names:
        return [f"{path.name}: saves no course code but has a 'Your turn' section"] \
            if "## Your turn" in headings else []
    if "## Your turn" not in headings:
        return [f"{path.name}: saves {names} but has no '## Your turn' section"]
    if "## What you now know" in headings and \
            headings.index("## Your turn") > headings.index("## What you now know"):
        return [f"{path.name}: '## Your turn' comes after '## What you now know'"]
    section = "\n".join(text for text, _ in markdown_parts(path)).split("## Your turn", 1)[1]
    section = section.split("\n## ", 1)[0]
    out = [f"{path.name}: 'Your turn' does not name `{n}`" for n in names
           if f"`{n}" not in section]
    command = f"fucina course check {path.name[:2]}"
    if command not in section:
        out.append(f"{path.name}: 'Your turn' does not give the command {command!r}")
    return out


@pytest.mark.parametrize("path", chapters(), ids=lambda p: p.name)
def test_chapters_that_save_code_say_your_turn(path):
    problems = your_turn_problems(path)
    assert not problems, "\n".join(problems)


def test_your_turn_check_can_fail(tmp_path):
    header = ("---\njupytext:\n  text_representation:\n    extension: .md\n"
              "    format_name: myst\n---\n\n# Toy\n\n")
    cell = "```{code-cell} ipython3\n#@save\ndef f(x):\n    return x\n```\n\n"
    path = tmp_path / "99_toy.md"
    path.write_text(header + cell + "## What you now know\n\n- f\n")
    assert "no '## Your turn'" in your_turn_problems(path)[0]
    path.write_text(header + cell + "## Your turn\n\nWrite `g`.\n\n## What you now know\n")
    assert your_turn_problems(path) == [
        "99_toy.md: 'Your turn' does not name `f`",
        "99_toy.md: 'Your turn' does not give the command 'fucina course check 99'"]
    path.write_text(header + cell + "## Your turn\n\n`f(x)`: `fucina course check 99`\n")
    assert your_turn_problems(path) == []
