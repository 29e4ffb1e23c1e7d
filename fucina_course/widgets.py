"""ipywidgets helpers shared by the book's chapters.

Two kinds of widgets, because the book is read two ways:

* *live* widgets (`tokenizer_explorer`) call Python on every change; they need a
  running kernel (the chapter opened in JupyterLab).  In the rendered book they show
  the state they were saved in, and say so in the widget itself: `saved_caption` gives
  them one caption for JupyterLab and another for the HTML page (book/_static/fucina.css
  picks which one shows), and the book greys out their inputs.
* *gallery* widgets (`gallery`) switch between panels computed when the chapter ran,
  linked in the browser with `jslink`; they also work in the static HTML book, offline.

ipywidgets is imported lazily, so the engine itself never needs it.
"""

from __future__ import annotations

import html
import unicodedata
from typing import Mapping

# Pastel backgrounds for consecutive tokens (neighbours always differ).
PALETTE = ("#ffe8a3", "#c8f0d0", "#cfe3ff", "#ffd6e0", "#e6d9ff", "#d2f4f4")
_VISIBLE = {" ": "\u00b7", "\n": "\u21b5", "\t": "\u2192", "\r": "\u240d"}
# Short names for characters that print as nothing (or as a plain space).
_INVISIBLE_NAMES = {0x00A0: "NBSP", 0x00AD: "SHY", 0x200B: "ZWSP", 0x200C: "ZWNJ",
                    0x200D: "ZWJ", 0x2060: "WJ", 0xFE0E: "VS15", 0xFE0F: "VS16",
                    0xFEFF: "BOM"}
_PIECE_STYLE = ("display:inline-block;margin:1px;padding:1px 3px;border-radius:3px;"
                "text-align:center;font-family:monospace;white-space:pre")
_MUTED = "color:#57606a"


def _is_invisible(ch: str) -> bool:
    cp, category = ord(ch), unicodedata.category(ch)
    return (cp in _INVISIBLE_NAMES or 0xFE00 <= cp <= 0xFE0F or 0xE0100 <= cp <= 0xE01EF
            or category in ("Cc", "Cf", "Zl", "Zp", "Cn", "Co")
            or (category == "Zs" and ch != " "))


def piece_label(data: bytes) -> str:
    """How a token's bytes are shown: one line of text, nothing invisible.

    Whitespace gets a visible stand-in (`·` space, `↵` newline, `→` tab).  A character
    that prints as nothing is spelled out between single guillemets (`‹ZWJ›`, `‹VS16›`,
    `‹U+0000›`); a combining mark with nothing before it sits on a dotted circle (`◌́`).
    Bytes that are not valid UTF-8 on their own are shown in hex (`⟨f0 9f⟩`).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "\u27e8" + " ".join(f"{b:02x}" for b in data) + "\u27e9"
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif _is_invisible(ch):
            name = _INVISIBLE_NAMES.get(ord(ch), f"U+{ord(ch):04X}")
            out.append(f"\u2039{name}\u203a")
        elif not out and unicodedata.combining(ch):
            out.append("\u25cc" + ch)
        else:
            out.append(ch)
    return "".join(out)


def saved_caption(live: str, saved: str) -> str:
    """HTML for a widget caption that is true in both places a chapter is read.

    `live` shows in JupyterLab (a kernel is running), `saved` in the HTML book, where
    the widget only replays the state it was saved with.  The switch is CSS: the saved
    line is hidden by an inline style that book/_static/fucina.css overrides, and the
    live line is hidden by that same stylesheet.
    """
    return (f'<div class="fucina-widget-caption fucina-live-only">{live}</div>'
            f'<div class="fucina-widget-caption fucina-saved-only" '
            f'style="display:none">{saved}</div>')


def token_pieces_html(tok, text: str, *, special: bool = True) -> str:
    """HTML: `text` as coloured token pieces with their ids, plus a one-line summary.

    A piece that is not valid UTF-8 on its own (part of a character split over tokens)
    is shown as hex bytes between angle brackets.
    """
    ids = tok.encode_raw(text, special=special)
    cells = []
    for k, tid in enumerate(ids):
        label = html.escape(piece_label(tok.token_to_bytes(tid)))
        background = PALETTE[k % len(PALETTE)]
        cells.append(
            f'<span title="id {tid}" style="{_PIECE_STYLE};background:{background}">'
            f'{label}<br><span style="font-size:70%;{_MUTED}">{tid}</span></span>')
    n_chars, n_bytes = len(text), len(text.encode("utf-8", "surrogatepass"))
    summary = f"{n_chars} characters, {n_bytes} bytes &rarr; <b>{len(ids)} tokens</b>"
    if ids:
        summary += f" ({n_chars / len(ids):.2f} characters per token)"
    return (f'<div style="line-height:1.2">{"".join(cells)}</div>'
            f'<div style="{_MUTED}">{summary}</div>')


def tokenizer_explorer(tok, text: str = "Type here: the model never sees text!", *,
                       special: bool = True):
    """A text box and its tokens, re-tokenized on every keystroke (needs a kernel).

    In the HTML book it is a saved copy, and its caption says so.
    """
    import ipywidgets as W

    caption = W.HTML(saved_caption(
        live="Live: edit the text and the tokens below follow.",
        saved="Saved copy: this page shows the text the explorer was saved with. "
              "Open the chapter as a notebook to tokenize your own."))
    box = W.Textarea(value=text, placeholder="type some text",
                     layout=W.Layout(width="auto", height="4em"))
    out = W.HTML(token_pieces_html(tok, text, special=special))

    def update(change):
        out.value = token_pieces_html(tok, change["new"], special=special)

    box.observe(update, names="value")
    widget = W.VBox([caption, box, out])
    widget.add_class("fucina-live")
    return widget


def gallery(panels: Mapping[str, str], *, description: str = "show",
            caption: str | None = None):
    """A dropdown over pre-rendered HTML panels (label -> HTML), switched in the page.

    The dropdown's index is `jslink`ed to a `Stack`, so no kernel is needed to flip
    panels: it works the same in JupyterLab and in the HTML book.  `caption` (HTML) is
    shown above the dropdown.  `description` is a label of its own beside the dropdown,
    not the Dropdown's `description`: the widget manager typesets that one with MathJax
    2's API, which this book (MathJax 3) lacks, so on a page with math it threw.
    """
    import ipywidgets as W

    labels = list(panels)
    choose = W.Dropdown(options=labels, index=0, layout=W.Layout(width="auto"))
    stack = W.Stack([W.HTML(panels[label]) for label in labels], selected_index=0)
    W.jslink((choose, "index"), (stack, "selected_index"))
    head = []
    if caption:
        head = [W.HTML(f'<div class="fucina-widget-caption">{caption}</div>')]
    if description:
        label = W.HTML(f"<span>{html.escape(description)}</span>")
        choose = W.HBox([label, choose], layout=W.Layout(align_items="center"))
    return W.VBox([*head, choose, stack])
