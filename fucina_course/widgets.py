"""ipywidgets helpers shared by the book's chapters.

Two kinds of widgets, because the book is read two ways:

* *live* widgets (`tokenizer_explorer`) call Python on every change; they need a running kernel
  (the chapter opened in JupyterLab).  In the rendered book they show the state they were saved in.
* *gallery* widgets (`gallery`) switch between panels computed when the chapter ran, linked in the
  browser with `jslink`; they also work in the static HTML book, offline.

ipywidgets is imported lazily, so the engine itself never needs it.
"""

from __future__ import annotations

import html
from typing import Mapping

# Pastel backgrounds for consecutive tokens (neighbours always differ).
PALETTE = ("#ffe8a3", "#c8f0d0", "#cfe3ff", "#ffd6e0", "#e6d9ff", "#d2f4f4")
_VISIBLE = {" ": "\u00b7", "\n": "\u21b5\n", "\t": "\u2192", "\r": "\u240d"}


def piece_label(data: bytes) -> str:
    """How a token's bytes are shown: text with visible whitespace, or hex if not valid UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "\u27e8" + " ".join(f"{b:02x}" for b in data) + "\u27e9"
    return "".join(_VISIBLE.get(ch, ch) for ch in text)


def token_pieces_html(tok, text: str, *, special: bool = True) -> str:
    """HTML: `text` as coloured token pieces, each with its id underneath, plus a one-line summary.

    A piece that is not valid UTF-8 on its own (part of a character split over tokens) is shown as
    hex bytes between angle brackets.
    """
    ids = tok.encode_raw(text, special=special)
    cells = []
    for k, tid in enumerate(ids):
        label = html.escape(piece_label(tok.token_to_bytes(tid)))
        cells.append(
            f'<span title="id {tid}" style="display:inline-block;margin:1px;padding:1px 3px;'
            f'border-radius:3px;background:{PALETTE[k % len(PALETTE)]};text-align:center;'
            f'font-family:monospace;white-space:pre">{label}<br>'
            f'<span style="font-size:70%;color:#57606a">{tid}</span></span>')
    n_chars, n_bytes = len(text), len(text.encode("utf-8", "surrogatepass"))
    summary = (f"{n_chars} characters, {n_bytes} bytes &rarr; <b>{len(ids)} tokens</b>"
               + (f" ({n_chars / len(ids):.2f} characters per token)" if ids else ""))
    return f'<div style="line-height:1.2">{"".join(cells)}</div><div style="color:#57606a">{summary}</div>'


def tokenizer_explorer(tok, text: str = "Type here: the model never sees text!", *, special: bool = True):
    """A text box and its tokens, re-tokenized on every keystroke (needs a running kernel)."""
    import ipywidgets as W

    box = W.Textarea(value=text, placeholder="type some text", layout=W.Layout(width="100%", height="4em"))
    out = W.HTML(token_pieces_html(tok, text, special=special))

    def update(change):
        out.value = token_pieces_html(tok, change["new"], special=special)

    box.observe(update, names="value")
    return W.VBox([box, out])


def gallery(panels: Mapping[str, str], *, description: str = "show"):
    """A dropdown over pre-rendered HTML panels (label -> HTML), switched in the browser.

    The dropdown's index is `jslink`ed to a `Stack`, so no kernel is needed to flip panels.
    """
    import ipywidgets as W

    labels = list(panels)
    choose = W.Dropdown(options=labels, index=0, description=description)
    stack = W.Stack([W.HTML(panels[label]) for label in labels], selected_index=0)
    W.jslink((choose, "index"), (stack, "selected_index"))
    return W.VBox([choose, stack])
