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
    assert piece_label(b"\xc3") == "\u27e8c3\u27e9" and piece_label(b" a\n") == "\u00b7a\u21b5"


def test_piece_label_shows_invisible_characters():
    from fucina_course.widgets import piece_label

    assert piece_label("\ufe0f".encode()) == "\u2039VS16\u203a"  # variation selector
    assert piece_label("a\u200db".encode()) == "a\u2039ZWJ\u203ab"
    assert piece_label(b"\x00") == "\u2039U+0000\u203a"
    assert piece_label("\u0301".encode()) == "\u25cc\u0301"  # lone combining accent
    assert piece_label("e\u0301".encode()) == "e\u0301"  # ... combines as usual
    assert "\n" not in piece_label(b".\n\n")  # one line, so every box has one height


def test_saved_caption_hides_the_saved_line_outside_the_book():
    from fucina_course.widgets import saved_caption

    html = saved_caption(live="LIVE", saved="SAVED")
    assert 'class="fucina-widget-caption fucina-live-only">LIVE' in html
    assert 'fucina-saved-only" style="display:none">SAVED' in html
    css = (ROOT / "book" / "_static" / "fucina.css").read_text(encoding="utf-8")
    assert ".fucina-saved-only { display: block !important; }" in css
    assert ".fucina-live-only { display: none !important; }" in css


def test_print_items_wraps_between_items(capsys):
    from fucina_course.viz import print_items, text_width

    items = [f"'item{k}'" for k in range(40)]
    print_items(items, sep=" | ", indent="  ", width=40)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and all(text_width(line) <= 40 for line in lines)
    assert all(line.startswith("  '") for line in lines)
    joined = " ".join(line.strip() for line in lines).replace(" |", "").split()
    assert joined == items  # nothing lost, nothing split inside an item
    print_items(["日本語"] * 30, width=20)
    assert all(text_width(line) <= 20 for line in capsys.readouterr().out.splitlines())


def test_toc_lists_chapters_in_their_numbered_order():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    chapters = [f for f in _toc_files(toc) if f.startswith("book/chapters/")]
    assert chapters == sorted(chapters), "_toc.yml lists the chapters in NN_ order"
