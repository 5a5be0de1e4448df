"""The book's one figure style: PNG, white background (readable in light and dark mode), one
colour per optimizer. Every figure cell calls :func:`subplots` and ends with ``plt.show()``.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt

__all__ = ["COLORS", "use_book_style", "subplots"]

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
