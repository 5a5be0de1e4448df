"""The book's one figure style: PNG, white background (readable in light and dark mode), one
colour per optimizer. Every figure cell calls :func:`subplots` and ends with ``plt.show()``.

In a notebook the figures are stored at twice their display resolution (IPython's inline backend,
format ``"retina"``: a PNG at ``2 * figure.dpi`` whose output metadata keeps the 1x width and height,
which myst-nb writes as the image's size), so that tick labels stay sharp on a phone's 2x-3x screen and
under zoom, where a 1x PNG fitted to the column blurs.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt

__all__ = ["COLORS", "flowchart", "muon_ownership", "qk_clip_layout", "shard_layout", "subplots", "use_book_style",
           "zero1_step_timeline"]

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
    """Apply the book's matplotlib settings (idempotent); in IPython also store figures at 2x
    (``matplotlib_inline``'s ``set_matplotlib_formats("retina")``). Outside IPython only the rcParams."""
    mpl.rcParams.update(_STYLE)
    _retina()


def _retina() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or "IPKernelApp" not in getattr(shell, "config", {}):
        return  # not a notebook kernel: no inline backend to configure
    try:
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    set_matplotlib_formats("retina")


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


def shard_layout(ax, layout, names: list[str] | None = None) -> list[tuple[str, list[int]]]:
    """Draw a ZeRO-1 layout (:func:`optbook.distributed.shard_layout`): one row per bucket, one cell per
    element, coloured by parameter (padding hatched grey), shard boundaries as thick lines labelled with
    their rank. Explained in chapter 13.

    Args:
        ax: a matplotlib ``Axes`` (its axis is switched off).
        layout: a :class:`optbook.distributed.zero1.Layout`.
        names: one label per parameter (default ``p0, p1, ...``); a zero-element parameter is listed in the
            legend only.

    Returns:
        ``[(name, [ranks holding a piece of it])]`` per parameter, in order, so a cell can assert what the
        figure shows (e.g. which parameter is split across two ranks).
    """
    from matplotlib.patches import Patch, Rectangle

    names = names or [f"p{r.index}" for r in layout.params]
    colors = mpl.colormaps["tab10"]
    ax.set_axis_off()
    width = max(b.numel for b in layout.buckets)
    for row, bucket in enumerate(layout.buckets):
        y = -2.2 * row
        owner = {}
        for r in layout.params:
            if r.bucket == row:
                owner.update({e: r.index for e in range(r.start, r.end)})
        for e in range(bucket.start, bucket.end):
            x = e - bucket.start
            if e in owner:
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor=colors(owner[e] % 10), edgecolor="white",
                                       lw=0.5))
            else:
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor="0.92", edgecolor="0.7", hatch="///", lw=0.5))
        for rank in range(layout.world_size + 1):
            x = rank * bucket.shard_numel
            ax.plot([x, x], [y - 0.15, y + 1.15], color="k", lw=2)
            if rank < layout.world_size:
                ax.text(x + bucket.shard_numel / 2, y - 0.2, f"rank {rank}", ha="center", va="top",
                        fontsize=8)
        ax.text(-0.5, y + 0.5, f"bucket {row}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-4, width + 0.5)
    ax.set_ylim(-2.2 * (len(layout.buckets) - 1) - 1.0, 1.3)
    handles = [Patch(facecolor=colors(r.index % 10), label=f"{names[r.index]} {tuple(r.shape)}")
               for r in layout.params]
    handles.append(Patch(facecolor="0.92", edgecolor="0.7", hatch="///", label="padding"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=min(4, len(handles)),
              fontsize=8)
    holders = {r.index: set() for r in layout.params}
    for rank in range(layout.world_size):
        for piece in layout.pieces(rank):
            holders[piece.index].add(rank)
    return [(names[r.index], sorted(holders[r.index])) for r in layout.params]


def qk_clip_layout(ax, q_factor, k_factor, max_logits, *, title: str = "") -> list[float]:
    """Draw where QK-clip's factors go in one attention layer: a row of query-head blocks of ``W_q``
    (one per head, labelled with the head's ``S_max``), below it the key-head blocks of ``W_k`` (a key
    head spans the query heads that share it), each block coloured and labelled with its factor
    (blue: shrunk, grey: 1, red: enlarged), and below that the factor each head's logits get.
    Explained in chapter 8.

    Args:
        ax: a matplotlib ``Axes`` (its axis is switched off).
        q_factor: the query-row factor of each head, shape ``(n_heads,)``.
        k_factor: the key-row factor of each key head, shape ``(n_kv_heads,)``; ``n_kv_heads`` divides
            ``n_heads``, and query head ``h`` reads key head ``h // (n_heads // n_kv_heads)``.
        max_logits: each head's ``S_max`` before the clip, shape ``(n_heads,)``.
        title: the panel title.

    Returns:
        The factor drawn under each head for its logits, ``q_factor[h] * k_factor[g(h)]`` with ``g(h)``
        the key block drawn under head ``h`` (Python floats), so a cell can assert what the figure shows.

    Raises:
        ValueError: the shapes do not fit together.
    """
    from matplotlib.patches import Rectangle

    q, k, s = ([float(v) for v in x.flatten().tolist()] for x in (q_factor, k_factor, max_logits))
    H, n_kv = len(q), len(k)
    if len(s) != H or n_kv < 1 or H % n_kv:
        raise ValueError(f"Invalid shapes: q_factor has {H} heads, k_factor {n_kv}, max_logits {len(s)}; "
                         "n_kv_heads must divide n_heads and max_logits needs one value per head")
    group = H // n_kv
    cmap, norm = mpl.colormaps["coolwarm"], mpl.colors.TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=2.0)
    ax.set_axis_off()
    w, gap = 1.5, 0.2

    def block(x0, width, y, factor):
        ax.add_patch(Rectangle((x0, y), width, 0.8, facecolor=cmap(norm(min(factor, 2.0))), edgecolor="0.3",
                               lw=0.8))
        ax.text(x0 + width / 2, y + 0.4, f"\u00d7 {factor:.3g}", ha="center", va="center", fontsize=9)

    drawn = []
    for h in range(H):
        x0 = h * (w + gap)
        ax.text(x0 + w / 2, 2.25, f"head {h}\nS_max = {s[h]:g}", ha="center", va="bottom", fontsize=8)
        block(x0, w, 1.3, q[h])
        g = int((x0 + w / 2) // (group * (w + gap)))     # the key block drawn under this head
        drawn.append(q[h] * k[g])
        ax.text(x0 + w / 2, -0.35, f"\u00d7 {drawn[-1]:.3g} \u2192 {drawn[-1] * s[h]:.3g}", ha="center",
                va="center", fontsize=8.5,
                fontweight="bold" if drawn[-1] != 1 else "normal")
    for g in range(n_kv):
        block(g * group * (w + gap), group * w + (group - 1) * gap, 0.2, k[g])
    for y, text in ((1.7, "W_q rows"), (0.6, "W_k rows"), (-0.35, "logits, S_max")):
        ax.text(-0.2, y, text, ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.9, H * (w + gap))
    ax.set_ylim(-0.8, 3.0)
    ax.set_title(title, fontsize=10)
    return drawn


def zero1_step_timeline(ax, layout) -> list[tuple[str, list[int]]]:
    """Draw one ZeRO-1 step in time (chapter 13), top to bottom (narrow enough to read on a phone): four
    moments, each a block with one row per rank showing the rank's flat buffer (all buckets, padding
    included) with what the rank holds filled in: the full local gradient; after the reduce-scatter, its
    shard of the summed gradient; after the optimizer step on that shard (its shard of the masters, ``m``
    and ``v``); after the all-gather, the full updated parameters. An arrow between two moments names the
    collective or the local step; every rank takes part in each.

    Args:
        ax: a matplotlib ``Axes`` (its axis is switched off).
        layout: a :class:`optbook.distributed.zero1.Layout` (:func:`optbook.distributed.shard_layout`).

    Returns:
        ``[(moment, [elements rank r holds at that moment for r in ranks])]`` for the four moments, read
        from ``layout`` (the bucket sizes and each rank's shard), so a cell can assert what the figure shows.
    """
    from matplotlib.patches import Rectangle

    d = layout.world_size
    total = sum(b.numel for b in layout.buckets)
    shard = sum(b.shard_numel for b in layout.buckets)
    moments = [("local gradient (full)", "#ffbf80", [total] * d),
               ("its shard, summed", "#d62728", [shard] * d),
               ("shard stepped (master, m, v)", "#1f77b4", [shard] * d),
               ("parameters (full)", "#2ca02c", [total] * d)]
    arrows = ["reduce-scatter", "AdamW on the shard", "all-gather"]
    ax.set_axis_off()
    width, height, block = 6.0, 0.7, d * 1.0 + 2.2   # a block: the title, d rows, the arrow below it
    for k, (title, color, _) in enumerate(moments):
        top = -k * block
        ax.text(0, top + 0.15, f"{k + 1}. {title}", ha="left", va="bottom", fontsize=10, weight="bold")
        for r in range(d):
            y = top - (r + 1) * 1.0
            ax.add_patch(Rectangle((0, y), width, height, facecolor="0.95", edgecolor="0.6", lw=0.6))
            if k in (0, 3):
                ax.add_patch(Rectangle((0, y), width, height, facecolor=color, edgecolor="0.3", lw=0.6))
            else:
                for b in layout.buckets:   # this rank's shard of each bucket, where it lies in the buffer
                    lo = (b.start + r * b.shard_numel) / total * width
                    ax.add_patch(Rectangle((lo, y), b.shard_numel / total * width, height, facecolor=color,
                                           edgecolor="0.3", lw=0.6))
            ax.text(-0.15, y + height / 2, f"rank {r}", ha="right", va="center", fontsize=9.5)
        if k < len(arrows):
            y0, y1 = top - d * 1.0 - 0.15, top - block + 0.85
            ax.annotate("", xy=(width / 2, y1), xytext=(width / 2, y0),
                        arrowprops=dict(arrowstyle="->", color="0.35", lw=1.2))
            ax.text(width / 2 + 0.2, (y0 + y1) / 2, arrows[k], ha="left", va="center", fontsize=9.5)
    bottom = -3 * block - d * 1.0
    ax.annotate("", xy=(width + 0.6, bottom), xytext=(width + 0.6, 0.6),
                arrowprops=dict(arrowstyle="->", color="0.5", lw=0.8))
    ax.text(width + 0.75, (bottom + 0.6) / 2, "time (one step)", ha="left", va="center", fontsize=9,
            color="0.35", rotation=-90)
    ax.set_xlim(-1.5, width + 1.3)
    ax.set_ylim(bottom - 0.2, 1.0)
    return [(title, held) for title, _, held in moments]


def muon_ownership(axes, shapes, world_size: int, names: list[str] | None = None) -> dict[str, list[int]]:
    """Draw who runs Newton–Schulz on which matrix under two distributed Muon designs (chapter 14): one row
    per rank, one column per matrix (width proportional to its Newton–Schulz cost, :func:`optbook.distributed.ns_cost`),
    a filled cell where that rank orthogonalises that matrix, and each rank's work (sum of the costs) at the
    row's end.

    * top (``axes[0]``): whole-matrix owners chosen by LPT (:func:`optbook.distributed.lpt_assign`), as in
      ``LayerWiseMuon`` and ``FSDP2Muon``: each matrix once;
    * bottom (``axes[1]``): Moonlight's distributed Muon on the ZeRO-1 layout
      (:func:`optbook.distributed.shard_layout`): every rank whose shard holds part of a matrix gathers it and
      orthogonalises it, so a matrix cut by a shard boundary is orthogonalised more than once.

    Args:
        axes: two matplotlib ``Axes`` (their axes are switched off).
        shapes: the ``(m, n)`` shapes of the matrices, in parameter order.
        world_size: ranks ``d >= 1``.
        names: one label per matrix (default ``W0, W1, ...``).

    Returns:
        ``{"owners": work per rank, "moonlight": work per rank}`` (ints, in :func:`ns_cost` units), what the
        rows' labels show, so a cell can assert it.
    """
    import torch
    from matplotlib.patches import Rectangle

    from .distributed import lpt_assign, ns_cost, shard_layout

    shapes = [tuple(int(v) for v in s) for s in shapes]
    names = names or [f"W{i}" for i in range(len(shapes))]
    costs = [ns_cost(s) for s in shapes]
    owners = lpt_assign(costs, world_size)
    layout = shard_layout([torch.empty(s) for s in shapes], world_size)
    touched = [{p.index for p in layout.pieces(r)} for r in range(world_size)]
    runs = {"owners": [{i for i, o in enumerate(owners) if o == r} for r in range(world_size)],
            "moonlight": touched}
    titles = {"owners": "whole-matrix owners (LPT): LayerWiseMuon, FSDP2Muon",
              "moonlight": "Moonlight: every rank whose shard touches the matrix"}
    colors = mpl.colormaps["tab10"]
    scale = 10.0 / sum(costs)
    work = {}
    for ax, key in zip(axes, ("owners", "moonlight")):
        ax.set_axis_off()
        work[key] = [sum(costs[i] for i in runs[key][r]) for r in range(world_size)]
        for r in range(world_size):
            y = world_size - 1 - r
            x = 0.0
            for i, c in enumerate(costs):
                w = c * scale
                mine = i in runs[key][r]
                ax.add_patch(Rectangle((x, y), w, 0.75, facecolor=colors(i % 10) if mine else "white",
                                       edgecolor="0.5", lw=0.6, alpha=0.9 if mine else 1.0))
                if r == 0:
                    ax.text(x + w / 2, world_size - 0.1, names[i], ha="center", va="bottom", fontsize=7.5,
                            rotation=90 if w < 0.6 else 0)
                x += w
            ax.text(-0.15, y + 0.37, f"rank {r}", ha="right", va="center", fontsize=8.5)
            ax.text(10.15, y + 0.37, f"{work[key][r] / sum(costs):.2f}", ha="left", va="center", fontsize=8.5)
        ax.text(10.15, world_size - 0.1, "work", ha="left", va="bottom", fontsize=8, color="0.35")
        ax.set_title(titles[key], fontsize=9.5)
        ax.set_xlim(-1.3, 11.2)
        ax.set_ylim(-0.2, world_size + 0.9)
    return work
