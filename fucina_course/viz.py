"""Small matplotlib helpers shared by the book's chapters.

Every function draws on a fresh (or given) Axes and returns it, so a chapter can add a title or an
annotation afterwards.  Nothing here computes a result: the numbers come from the chapter's cells.
matplotlib is imported lazily, so the engine itself never needs it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

# One colour per role, reused across chapters so a reader learns them once.
COLORS = {"engine": "#1f6feb", "reference": "#d1242f", "course": "#2da44e", "muted": "#8c959f"}


def _axes(ax=None, figsize=(7.0, 3.2)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def barh(values: Mapping[str, float], *, xlabel: str, title: str | None = None, fmt: str = "{:.2f}",
         color: str = COLORS["engine"], ax=None):
    """Horizontal bars, one per label (top to bottom in the mapping's order), each with its value."""
    labels, numbers = list(values), [float(v) for v in values.values()]
    ax = _axes(ax, figsize=(7.0, 0.35 * len(labels) + 1.0))
    y = np.arange(len(labels))
    ax.barh(y, numbers, color=color)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    for yi, v in zip(y, numbers):
        ax.text(v, yi, " " + fmt.format(v), va="center", fontsize=9)
    ax.set_xlim(0, max(numbers) * 1.15 if numbers else 1)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def hist_int(values: Sequence[int], *, xlabel: str, ylabel: str = "count", title: str | None = None,
             log: bool = False, color: str = COLORS["engine"], ax=None):
    """A histogram of small non-negative integers: one bar per value, no binning surprises."""
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


def char_grid(chars: Sequence[str], highlight: Sequence[bool], *, title: str | None = None,
              legend: tuple[str, str] = ("kept", "shifted"), columns: int = 16, ax=None):
    """A table of characters (e.g. the 256 entries of a byte map), row label = high nibble in hex.

    Cells where `highlight` is true are coloured, with `legend` naming the two kinds of cells.
    """
    import matplotlib.patches as mpatches

    rows = (len(chars) + columns - 1) // columns
    ax = _axes(ax, figsize=(0.45 * columns + 1.0, 0.42 * rows + 1.0))
    for k, (ch, hi) in enumerate(zip(chars, highlight)):
        r, c = divmod(k, columns)
        ax.add_patch(mpatches.Rectangle((c, r), 1, 1, facecolor="#ffd8a8" if hi else "#f6f8fa",
                                        edgecolor="white"))
        ax.text(c + 0.5, r + 0.5, ch, ha="center", va="center", fontsize=10)
    ax.set_xlim(0, columns)
    ax.set_ylim(rows, 0)
    ax.set_xticks(np.arange(columns) + 0.5, [f"{c:X}" for c in range(columns)])
    ax.set_yticks(np.arange(rows) + 0.5, [f"{r * columns:02X}" for r in range(rows)])
    ax.tick_params(length=0)
    ax.set_aspect("equal")
    for side in ax.spines.values():
        side.set_visible(False)
    ax.legend(handles=[mpatches.Patch(facecolor="#f6f8fa", edgecolor="#8c959f", label=legend[0]),
                       mpatches.Patch(facecolor="#ffd8a8", label=legend[1])],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    return ax
