"""Small matplotlib (and printing) helpers shared by the book's chapters.

Every plotting function draws on a fresh (or given) Axes and returns it, so a chapter
can add a title or an annotation afterwards.  Nothing here computes a result: the
numbers come from the chapter's cells.  matplotlib is imported lazily, so the engine
itself never needs it.

Figures are sized for the narrowest reader: at most `FIG_WIDTH` inches wide with
11-point text, drawn as SVG, so that on a 400-pixel phone screen (where the page shrinks
them to ~0.75x) their labels are still ~11 px tall, and on a desktop they stay sharp.
`print_items` keeps printed output within the book's 88-column code width.
"""

from __future__ import annotations

import unicodedata
from typing import Iterable, Mapping, Sequence

import numpy as np

# One colour per role, reused across chapters so a reader learns them once.
COLORS = {"engine": "#1f6feb", "reference": "#d1242f", "course": "#2da44e",
          "muted": "#8c959f"}

WIDTH = 88        # columns: the widest code line or printed line the book shows
FIG_WIDTH = 5.0   # inches: the widest figure (5 in = 480 px at the SVG's 96 px/in)
BOOK_RC = {
    "font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11,
    "xtick.labelsize": 11, "ytick.labelsize": 11, "legend.fontsize": 11,
    "svg.fonttype": "path", "svg.hashsalt": "fucina_course",
}


def text_width(text: str) -> int:
    """Columns a line takes in a monospace font (East Asian wide characters: two)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def print_items(items: Iterable[str], *, sep: str = " ", indent: str = "",
                width: int = WIDTH) -> None:
    """Print strings joined by `sep`, wrapping between items (never inside one).

    Each line (with the separator that ends it) is at most `width` columns unless a
    single item is longer; every line, the first and the continuations, starts with
    `indent`.
    """
    line = ""
    for item in items:
        candidate = f"{line}{sep}{item}" if line else item
        if line and text_width(indent + candidate + sep.rstrip()) > width:
            print(indent + line + sep.rstrip())
            line = item
        else:
            line = candidate
    print(indent + line)


def axes(height: float = 3.0, width: float = FIG_WIDTH):
    """A fresh Axes in the book's figure style, for a chapter's own plot.

    `width` and `height` are in inches; keep `width` at most `FIG_WIDTH` so the figure
    stays legible at phone width.
    """
    return _axes(figsize=(min(width, FIG_WIDTH), height))


def _axes(ax=None, figsize=(FIG_WIDTH, 3.0)):
    import matplotlib.pyplot as plt

    plt.rcParams.update(BOOK_RC)
    _svg_output()
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _svg_output() -> None:
    """Inline figures as SVG when running under IPython (sharp at every zoom level)."""
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    if get_ipython() is not None:
        set_matplotlib_formats("svg")


def barh(values: Mapping[str, float], *, xlabel: str, title: str | None = None,
         fmt: str = "{:.2f}", color: str = COLORS["engine"], ax=None):
    """Horizontal bars, one per label (top to bottom in the mapping's order)."""
    labels, numbers = list(values), [float(v) for v in values.values()]
    ax = _axes(ax, figsize=(FIG_WIDTH, 0.3 * len(labels) + 1.1))
    y = np.arange(len(labels))
    ax.barh(y, numbers, color=color)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    for yi, v in zip(y, numbers):
        ax.text(v, yi, " " + fmt.format(v), va="center", fontsize=11)
    ax.set_xlim(0, max(numbers) * 1.15 if numbers else 1)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def hist_int(values: Sequence[int], *, xlabel: str, ylabel: str = "count",
             title: str | None = None, log: bool = False, color: str = COLORS["engine"],
             ax=None):
    """A histogram of small non-negative integers: one bar per value, no binning."""
    values = np.asarray(values, dtype=np.int64)
    counts = np.bincount(values)
    ax = _axes(ax)
    ax.bar(np.arange(len(counts)), counts, width=0.85, color=color, log=log)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def char_grid(chars: Sequence[str], highlight: Sequence[bool], *,
              title: str | None = None, legend: tuple[str, str] = ("kept", "shifted"),
              columns: int = 16, ax=None):
    """A table of characters (e.g. a byte map's 256 entries), row label = high nibble.

    Cells where `highlight` is true are coloured, with `legend` naming the two kinds of
    cells (shown under the grid, so the grid gets the figure's whole width).
    """
    import matplotlib.patches as mpatches

    rows = (len(chars) + columns - 1) // columns
    cell = (FIG_WIDTH - 0.4) / columns  # inches per cell
    ax = _axes(ax, figsize=(FIG_WIDTH, cell * rows + 1.2 + (0.35 if title else 0)))
    for k, (ch, hi) in enumerate(zip(chars, highlight)):
        r, c = divmod(k, columns)
        ax.add_patch(mpatches.Rectangle((c, r), 1, 1, edgecolor="white",
                                        facecolor="#ffd8a8" if hi else "#f6f8fa"))
        ax.text(c + 0.5, r + 0.5, ch, ha="center", va="center", fontsize=13)
    ax.set_xlim(0, columns)
    ax.set_ylim(rows, 0)
    ax.set_xticks(np.arange(columns) + 0.5, [f"{c:X}" for c in range(columns)])
    ax.set_yticks(np.arange(rows) + 0.5, [f"{r * columns:02X}" for r in range(rows)])
    ax.tick_params(length=0, labeltop=True, labelbottom=False)
    ax.set_aspect("equal")
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [
        mpatches.Patch(facecolor="#f6f8fa", edgecolor="#8c959f", label=legend[0]),
        mpatches.Patch(facecolor="#ffd8a8", label=legend[1])]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
              frameon=False)
    if title:
        ax.set_title(title)
    return ax
