"""Cheap checks of the book's wiring (no kernel, no build): the chapters run under the real tools
via `jupyter-book build . -W` and `pytest --nbval-lax --nbval-current-env book/chapters`."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
yaml = pytest.importorskip("yaml")


def _toc_files(node) -> list[str]:
    found = []
    if isinstance(node, dict):
        if "file" in node:
            found.append(node["file"])
        for value in node.values():
            found += _toc_files(value)
    elif isinstance(node, list):
        for item in node:
            found += _toc_files(item)
    return found


def test_every_chapter_is_in_the_toc_and_every_toc_entry_exists():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    listed = [toc["root"], *_toc_files(toc)]
    for entry in listed:
        assert (ROOT / f"{entry}.md").is_file(), f"_toc.yml lists {entry} but {entry}.md does not exist"
    chapters = {f"book/chapters/{p.stem}" for p in (ROOT / "book" / "chapters").glob("*.md")}
    assert chapters <= set(listed), f"chapters missing from _toc.yml: {sorted(chapters - set(listed))}"


def test_chapters_are_jupytext_myst_notebooks_with_a_python3_kernel():
    jupytext = pytest.importorskip("jupytext")
    for path in sorted((ROOT / "book" / "chapters").glob("*.md")):
        header = path.read_text(encoding="utf-8").split("---", 2)[1]
        meta = yaml.safe_load(header)
        assert meta["jupytext"]["text_representation"]["format_name"] == "myst", path.name
        nb = jupytext.read(path)
        assert nb.metadata["kernelspec"]["name"] == "python3", path.name
        assert any(c.cell_type == "code" for c in nb.cells), path.name
    assert not list((ROOT / "book").rglob("*.ipynb")), "no .ipynb is committed: chapters are .md"


def test_widget_and_math_javascript_is_vendored():
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["sphinx"]["config"]
    static = [ROOT / p for p in cfg["html_static_path"]]
    scripts = [*cfg["nb_ipywidgets_js"], cfg["mathjax_path"]]
    for script in scripts:
        assert "://" not in script, f"{script} would be fetched from the network"
        assert any((d / script).is_file() for d in static), f"{script} is not under html_static_path"


def test_token_pieces_html_marks_split_characters():
    from fucina_course import Tokenizer
    from fucina_course.tokenizer import map_bytes
    from fucina_course.widgets import piece_label, token_pieces_html

    tok = Tokenizer.from_parts([map_bytes(bytes([b])) for b in range(256)], [])
    html = token_pieces_html(tok, "a é")
    assert html.count('title="id ') == 4  # 'a', ' ', and the two bytes of 'é'
    assert piece_label(b"\xc3") == "\u27e8c3\u27e9" and piece_label(b" a\n") == "\u00b7a\u21b5\n"
