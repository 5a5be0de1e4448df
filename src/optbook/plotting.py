"""The book's one figure style: PNG, white background (readable in light and dark mode), one
colour per optimizer. Every figure cell calls :func:`subplots` and ends with ``plt.show()``.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt

__all__ = ["COLORS", "flowchart", "use_book_style", "subplots"]

#: One colour per optimizer (and per line style family) across all chapters.
COLORS = {
    "SGD": "#7f7f7f", "momentum": "#1f77b4", "Nesterov": "#2ca02c", "Adam": "#d62728",
    "AdamW": "#d62728", "AdaGrad": "#9467bd", "RMSProp": "#ff7f0e", "Muon": "#17becf",
    "L2": "#8c564b", "decoupled": "#e377c2",
}

_STYLE = {
    "figure.facecolor": "white", "savefig.facecolor": "white", "axes.facecolor": "white",
    "figure.dpi": 100, "savefig.dpi": 100, "figure.autolayout": True,
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
    "font.size": 10, "axes.titlesize": 11, "legend.fontsize": 9, "legend.frameon": False,
    "lines.linewidth": 1.8,
}


def use_book_style() -> None:
    """Apply the book's matplotlib settings (idempotent)."""
    mpl.rcParams.update(_STYLE)


def subplots(nrows: int = 1, ncols: int = 1, *, width: float = 4.2, height: float = 3.2, **kwargs):
    """``plt.subplots`` in the book style, sized ``width`` x ``height`` inches per panel."""
    use_book_style()
    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), **kwargs)


def flowchart(ax, stages: list[tuple[str, str]], *, branch: tuple[int, str] | None = None) -> list[str]:
    """Draw ``stages`` as a top-to-bottom chain of boxes joined by arrows (no network, no fonts to fetch).

    Args:
        ax: a matplotlib ``Axes`` (its axis is switched off).
        stages: ``(title, detail)`` per box, in order; ``detail`` (may be empty) is set in a smaller font.
        branch: optional ``(i, text)``: a box to the right of stage ``i``, reached by a dashed arrow
            (e.g. the path of a skipped step).

    Returns:
        The titles in the order drawn (top to bottom), so a cell can assert the figure's order.
    """
    from matplotlib.patches import FancyBboxPatch

    ax.set_axis_off()
    n = len(stages)
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.5, n - 0.2)
    drawn = []
    for k, (title, detail) in enumerate(stages):
        y = n - 1 - k
        ax.add_patch(FancyBboxPatch((0.3, y - 0.32), 5.4, 0.64, boxstyle="round,pad=0.02",
                                    facecolor="#eef3fa", edgecolor="#1f77b4"))
        ax.text(3.0, y + (0.1 if detail else 0.0), title, ha="center", va="center", fontsize=10, weight="bold")
        if detail:
            ax.text(3.0, y - 0.16, detail, ha="center", va="center", fontsize=8, color="0.25")
        if k:
            ax.annotate("", xy=(3.0, y + 0.34), xytext=(3.0, y + 0.66),
                        arrowprops=dict(arrowstyle="->", color="0.2"))
        drawn.append(title)
    if branch is not None:
        i, text = branch
        y = n - 1 - i
        ax.add_patch(FancyBboxPatch((6.6, y - 0.4), 3.2, 0.8, boxstyle="round,pad=0.02",
                                    facecolor="#fdf0ec", edgecolor="#d62728"))
        ax.text(8.2, y, text, ha="center", va="center", fontsize=8)
        ax.annotate("", xy=(6.55, y), xytext=(5.75, y),
                    arrowprops=dict(arrowstyle="->", color="#d62728", linestyle="--"))
    return drawn
