"""Specs for the book's offline interactive figures, computed with the package (``_static/interactive.js``).

A notebook cell is one call, ``interactive.show(interactive.memory_spec(7e9))``: it writes
``<div class="optbook-interactive"><script type="application/json">{spec}</script></div>``, which the
book's script draws as an SVG with a range input (keyboard: arrow keys, Home, End; touch: drag), with no
kernel and no network. Every number in a spec comes from the function of the package named in the
builder's docstring, so the figure and the package cannot disagree (``tests/test_interactive.py``).

Two kinds (``spec["kind"]``; see the header of ``_static/interactive.js`` for every field):

* ``"lines"`` (the default): curves over a shared ``x`` (or a series' own ``"x"``), one frame of curves
  per slider value, ``"fixed"`` curves in every frame; a series with ``"markers": true`` is drawn as
  points without a line (a category on the x axis, such as attention heads; hollow with ``"dash"``).
* ``"bars"``: horizontal stacked bars, one per row name, their segments named by ``"parts"``.

Builders: :func:`memory_spec` (ZeRO-1 / layer-wise sharding, chapter 16), :func:`qk_clip_spec` (QK-clip at a
threshold tau, chapter 8), :func:`newton_schulz_spec` (Newton–Schulz on a chosen spectrum, chapter 15),
:func:`dion_spec` (Dion's rank fraction, chapter 18), :func:`capstone_spec` (chapter 19's loss curves,
from ``records/capstone.json``). :func:`check_spec` validates any spec; :func:`html` and :func:`show`
embed it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PALETTE", "capstone_spec", "check_spec", "dion_spec", "html", "memory_spec", "newton_schulz_spec",
           "qk_clip_spec", "show"]

#: Colours of the curves and bar segments (matplotlib's tab10, as :mod:`optbook.plotting`).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_ROUND = 4   # significant digits kept in a spec (the drawing cannot show more; stable across CPU kernels)


def _r(value: float) -> float | None:
    value = float(value)
    if not math.isfinite(value):
        return None
    return float(f"{value:.{_ROUND}g}")


def _slider(label: str, values: Sequence, initial: int = 0) -> dict:
    return {"label": label, "values": list(values), "initial": int(initial)}


# --- validation and embedding ------------------------------------------------------------------------------

def check_spec(spec: dict) -> dict:
    """Return ``spec`` after checking what the script needs; raises ``ValueError`` naming the field.

    Checked: a title, a slider with at least two values and an initial index among them, one frame per
    slider value, limits ``[lo, hi]`` with ``lo < hi`` (and ``lo > 0`` on a log axis), and for
    ``"lines"`` every series' ``y`` as long as its ``x``; for ``"bars"`` every bar with one value per part.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"Invalid spec: expected a dict, got {type(spec).__name__}")
    kind = spec.get("kind", "lines")
    if kind not in ("lines", "bars"):
        raise ValueError(f"Invalid spec['kind']: expected 'lines' or 'bars', got {kind!r}")
    if not spec.get("title"):
        raise ValueError("Invalid spec['title']: missing or empty")
    slider = spec.get("slider") or {}
    values = slider.get("values", [])
    if len(values) < 2:
        raise ValueError(f"Invalid spec['slider']['values']: need at least 2, got {len(values)}")
    if not 0 <= slider.get("initial", 0) < len(values):
        raise ValueError(f"Invalid spec['slider']['initial']: {slider.get('initial')} outside 0..{len(values) - 1}")
    frames = spec.get("frames", [])
    if len(frames) != len(values):
        raise ValueError(f"Invalid spec['frames']: {len(frames)} frames for {len(values)} slider values")
    axes = ("xlim",) if kind == "bars" else ("xlim", "ylim")
    for name in axes:
        lim = spec.get(name)
        log = spec.get(name[0] + "log", False)
        if not (isinstance(lim, (list, tuple)) and len(lim) == 2 and lim[0] < lim[1] and (not log or lim[0] > 0)):
            raise ValueError(f"Invalid spec[{name!r}]: expected [lo, hi] with lo < hi (lo > 0 on a log axis), got {lim!r}")
    if kind == "bars":
        parts = spec.get("parts", [])
        if not parts:
            raise ValueError("Invalid spec['parts']: a bar chart needs at least one part")
        for i, frame in enumerate(frames):
            for bar in frame.get("bars", []):
                if len(bar.get("values", [])) != len(parts):
                    raise ValueError(f"Invalid spec['frames'][{i}]: bar {bar.get('name')!r} has "
                                     f"{len(bar.get('values', []))} values for {len(parts)} parts")
            if not frame.get("bars"):
                raise ValueError(f"Invalid spec['frames'][{i}]: no bars")
        return spec
    for i, frame in enumerate(frames):
        for s in list(frame.get("series", [])) + list(spec.get("fixed", [])):
            xs = s.get("x", spec.get("x"))
            if xs is None or len(xs) != len(s.get("y", [])):
                raise ValueError(f"Invalid spec['frames'][{i}]: series {s.get('name')!r} has "
                                 f"{len(s.get('y', []))} y values for {None if xs is None else len(xs)} x values")
    return spec


def html(spec: dict) -> str:
    """The HTML a notebook cell displays for ``spec`` (checked by :func:`check_spec`)."""
    text = json.dumps(check_spec(spec), allow_nan=False).replace("</", "<\\/")  # JSON inside a <script> element
    return f'<div class="optbook-interactive"><script type="application/json">{text}</script></div>'


def show(spec: dict) -> None:
    """Display ``spec`` as an interactive figure in a notebook (IPython's ``display``)."""
    from IPython.display import HTML, display
    display(HTML(html(spec)))


# --- ZeRO / layer-wise memory calculator (chapter 16) ------------------------------------------------------

#: The bars of :func:`memory_spec`: name and :func:`optbook.memory.ledger` options.
MEMORY_SETUPS = (
    ("AdamW, replicated", {"optimizer": "adamw", "sharding": "none"}),
    ("AdamW, ZeRO-1", {"optimizer": "adamw", "sharding": "zero1"}),
    ("AdamW, ZeRO-1, offload", {"optimizer": "adamw", "sharding": "zero1", "offload_fraction": 1.0}),
    ("Muon, replicated", {"optimizer": "muon", "sharding": "none"}),
    ("Muon, layer-wise", {"optimizer": "muon", "sharding": "layerwise"}),
)
_MEMORY_PARTS = (("params", "parameters"), ("grads", "gradients"), ("master", "float32 masters"),
                 ("main_grads", "float32 main gradients"), ("state", "optimizer state"))


def memory_spec(params: float = 7e9, dps: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                setups=MEMORY_SETUPS, initial: int = 3, **options) -> dict:
    """Device memory per rank by component, for each setup, with the data-parallel ranks on the slider.

    Every number is ``optbook.memory.ledger(params, dp=d, **setup, **options)[part].device_bytes / 1e9``
    (GB; host-offloaded bytes are not on the device); a part that is zero everywhere is left out. ``options``: other ledger fields for every setup
    (``param_dtype``, ``grad_dtype``, ``tp``, ...).

    Raises:
        ValueError: ``params <= 0``, fewer than two ``dps``, or what :func:`optbook.memory.ledger` raises.
    """
    from .memory import ledger

    if not params > 0:
        raise ValueError(f"Invalid params: expected > 0, got {params!r}")
    dps = [int(d) for d in dps]
    frames, top = [], 0.0
    for d in dps:
        bars, totals = [], []
        for name, setup in setups:
            book = ledger(params, dp=d, **setup, **options)
            values = [_r(book[part].device_bytes / 1e9) for part, _ in _MEMORY_PARTS]
            bars.append({"name": name, "values": values})
            totals.append(f"{name.split(',')[0]} {book.device_bytes / 1e9:.0f}")
            top = max(top, book.device_bytes / 1e9)
        best = min(bars, key=lambda b: sum(b["values"]))
        frames.append({"bars": bars, "note": f"least: {best['name']} ({sum(best['values']):.1f} GB)"})
    # a component that no set-up holds at any d (float32 main gradients with float32 gradients) is left out
    used = [j for j in range(len(_MEMORY_PARTS)) if any(b["values"][j] for f in frames for b in f["bars"])]
    for f in frames:
        for b in f["bars"]:
            b["values"] = [b["values"][j] for j in used]
    return check_spec({
        "kind": "bars", "title": f"Device memory per rank, {params / 1e9:g}B parameters",
        "xlabel": "GB per rank (device)", "xlim": [0, _r(top * 1.05)],
        "parts": [{"name": _MEMORY_PARTS[j][1], "color": PALETTE[j]} for j in used],
        "slider": _slider("data-parallel ranks d", dps, min(initial, len(dps) - 1)), "frames": frames})


# --- QK-clip on a slider of tau (chapter 8) ----------------------------------------------------------------

def qk_clip_spec(max_logits, taus: Sequence[float] | None = None, n_kv_heads: int | None = None,
                 initial: int | None = None) -> dict:
    """Each head's largest logit before and after one QK-clip at threshold ``tau`` (the slider), under the
    group and the per-head GQA rules.

    After the clip head ``h``'s maximum is ``S_h * q_h * k_g`` with ``(q, k) =
    optbook.qk_clip.qk_clip_factors(max_logits, tau, n_kv_heads, rule)``; the readout gives the largest
    query factor (above 1: the per-head rule enlarges a query to make up for a shared key).

    Args:
        max_logits: ``(n_heads,)`` per-head maxima ``S_max`` of one layer (any real dtype).
        taus: thresholds; default 8 values from below the smallest maximum to above the largest.
        n_kv_heads: key heads (GQA); ``None``: one per query head (then both rules agree).

    Raises:
        ValueError: ``max_logits`` not 1-D or not positive, a ``tau <= 0``; what ``qk_clip_factors`` raises.
    """
    from .qk_clip import qk_clip_factors

    s = torch.as_tensor(max_logits, dtype=torch.float64)
    if s.dim() != 1 or s.numel() < 1 or not bool((s > 0).all()):
        raise ValueError(f"Invalid max_logits: expected a 1-D tensor of positive maxima, got {max_logits!r}")
    if taus is None:
        lo, hi = float(s.min()) * 0.8, float(s.max()) * 1.1
        taus = [_r(lo * (hi / lo) ** (i / 7)) for i in range(8)]
    heads = list(range(1, s.numel() + 1))
    frames = []
    for tau in taus:
        series = []
        for rule, color, dash in (("group", PALETTE[0], False), ("per_head", PALETTE[2], True)):
            q, k = qk_clip_factors(s, float(tau), n_kv_heads, gqa_rule=rule)
            k_per_head = k.repeat_interleave(s.numel() // k.numel())
            after = s * q * k_per_head
            series.append({"name": f"after the clip, {rule.replace('_', '-')} rule", "y": [_r(v) for v in after],
                           "color": color, "dash": dash, "markers": True})
            if rule == "per_head":
                grow = float(q.max())
        series.append({"name": "tau", "x": [0.5, s.numel() + 0.5], "y": [_r(tau), _r(tau)], "color": "#444",
                       "dash": True})
        frames.append({"series": series, "note": f"largest query factor (per-head rule) {grow:.3f}"})
    top = max(float(s.max()), max(float(t) for t in taus))
    return check_spec({
        "title": "Largest logit of each head, before and after QK-clip", "xlabel": "query head",
        "ylabel": "largest logit S_max", "xlog": False, "ylog": False, "xlim": [0.5, s.numel() + 0.5],
        "ylim": [0, _r(top * 1.1)], "x": heads,
        "fixed": [{"name": "before the clip", "y": [_r(v) for v in s], "color": "#7f7f7f", "markers": True}],
        "slider": _slider("tau", [_r(t) for t in taus], len(taus) // 2 if initial is None else initial),
        "frames": frames})


# --- Newton–Schulz on a chosen spectrum (chapter 15) -------------------------------------------------------

def newton_schulz_spec(spectrum, steps: int = 8, schedules: Sequence[str] = ("simple", "quintic", "polar_express"),
                       shape: tuple[int, int] | None = None, seed: int = 0) -> dict:
    """The singular values of ``optbook.newton_schulz(G, k, schedule, dtype=float64)`` for ``k = 0..steps``
    (the slider; ``k = 0``: the normalised input ``G / ||G||_F``), for a matrix ``G = U diag(spectrum) V^T``
    with random orthonormal ``U``, ``V`` (``seed``), sorted from largest to smallest.

    Args:
        spectrum: the singular values of ``G`` (positive, any order); its length is ``min(shape)``.
        shape: ``(m, n)``; default ``(len(spectrum), 2 * len(spectrum))``.

    Raises:
        ValueError: an empty or non-positive spectrum, ``steps < 1``, a ``shape`` whose smaller side is not
            ``len(spectrum)``; what :func:`optbook.newton_schulz` raises (an unknown schedule).
    """
    from .polar import newton_schulz

    sv = torch.as_tensor(spectrum, dtype=torch.float64).flatten().sort(descending=True).values
    if sv.numel() < 1 or not bool((sv > 0).all()):
        raise ValueError(f"Invalid spectrum: expected positive singular values, got {spectrum!r}")
    if int(steps) < 1:
        raise ValueError(f"Invalid steps: expected >= 1, got {steps!r}")
    r = sv.numel()
    m, n = shape if shape is not None else (r, 2 * r)
    if min(m, n) != r:
        raise ValueError(f"Invalid shape: min{(m, n)} must equal len(spectrum) = {r}")
    gen = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(m, r, dtype=torch.float64, generator=gen)).Q
    V = torch.linalg.qr(torch.randn(n, r, dtype=torch.float64, generator=gen)).Q
    G = U @ torch.diag(sv) @ V.T
    x = list(range(1, r + 1))
    frames = []
    for k in range(0, int(steps) + 1):
        series = []
        for i, name in enumerate(schedules):
            X = G / G.norm() if k == 0 else newton_schulz(G, steps=k, coefficients=name, dtype=torch.float64)
            out = torch.linalg.svdvals(X)
            series.append({"name": name, "y": [_r(v) for v in out], "color": PALETTE[i], "dash": i % 2 == 1})
        spread = ", ".join(f"{s['name']} [{min(s['y']):.3g}, {max(s['y']):.3g}]" for s in series)
        frames.append({"series": series, "note": spread})
    return check_spec({
        "title": "Singular values after k Newton\u2013Schulz steps", "xlabel": "singular value index (largest first)",
        "ylabel": "singular value", "xlog": False, "ylog": False, "xlim": [1, max(r, 2)], "ylim": [0, 1.3],
        "x": x, "fixed": [{"name": "1 (the polar factor)", "x": [1, max(r, 2)], "y": [1, 1], "color": "#444",
                           "dash": True}],
        "slider": _slider("steps k", list(range(0, int(steps) + 1)), min(5, int(steps))), "frames": frames})


# --- Dion's rank fraction (chapter 18) ---------------------------------------------------------------------

def dion_spec(shape: tuple[int, int] = (48, 64), rank_fractions: Sequence[float] = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0),
              steps: int = 30, decay: float = 0.9, seed: int = 0, momentum: float = 0.95) -> dict:
    """Cosine between Dion's update and Muon's, step by step, from the same stream of gradients, with
    Dion's rank fraction on the slider.

    Both run one step from the same point on gradients ``U diag(decay**i) V^T + noise`` (fixed ``U``,
    ``V``, fresh noise of size 0.1 per step, ``seed``): ``optbook.optim.Dion(rank_fraction=f)`` and
    ``optbook.optim.Muon`` with ``scale_mode="none"``, float64, ``lr = 1``, the same ``momentum``. The
    readout gives the bytes Dion exchanges per step relative to the matrix, ``r (m + n) / (m n)``
    (``r = optbook.optim.dion.dion_rank(shape, f)``). Dion at full rank is drawn in every frame.

    Raises:
        ValueError: ``steps < 1``, ``decay`` outside ``(0, 1]``; what ``Dion``/``Muon`` raise.
    """
    from .optim import Dion, Muon
    from .optim.dion import dion_rank

    if int(steps) < 1:
        raise ValueError(f"Invalid steps: expected >= 1, got {steps!r}")
    if not 0 < decay <= 1:
        raise ValueError(f"Invalid decay: expected in (0, 1], got {decay!r}")
    m, n = shape
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64, generator=gen)).Q
    V = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=gen)).Q
    signal = U @ torch.diag(decay ** torch.arange(k, dtype=torch.float64)) @ V.T
    grads = [signal + 0.1 * torch.randn(m, n, dtype=torch.float64, generator=gen) for _ in range(int(steps))]

    def updates(make):
        w = torch.zeros(m, n, dtype=torch.float64, requires_grad=True)
        opt = make([w])
        out = []
        for g in grads:
            before = w.detach().clone()
            w.grad = g.clone()
            opt.step()
            out.append(before - w.detach())
        return out

    muon = updates(lambda p: Muon(p, lr=1.0, momentum=momentum, nesterov=False, scale_mode="none",
                                  ns_dtype=torch.float64))
    t = list(range(1, int(steps) + 1))
    frames, curves = [], {}
    for f in sorted(set(rank_fractions) | {1.0}):
        dion = updates(lambda p: Dion(p, lr=1.0, momentum=momentum, rank_fraction=f, seed=seed))
        curves[f] = [_r(float((a * b).sum() / (a.norm() * b.norm()))) for a, b in zip(dion, muon)]
    for f in rank_fractions:
        r = dion_rank(shape, f)
        frames.append({"series": [{"name": f"Dion, r = {r}", "y": curves[f], "color": PALETTE[1]}],
                       "note": f"r = {r}: exchanges {r * (m + n) / (m * n):.2f} of the matrix per step"})
    return check_spec({
        "title": f"Dion's update against Muon's ({m} x {n} matrix)", "xlabel": "step",
        "ylabel": "cosine with Muon's update", "xlog": False, "ylog": False, "xlim": [1, int(steps)],
        "ylim": [0, 1.05], "x": t,
        "fixed": [{"name": f"Dion, full rank r = {k}", "y": curves[1.0], "color": "#7f7f7f", "dash": True}],
        "slider": _slider("rank fraction r / min(m, n)", [_r(f) for f in rank_fractions], len(rank_fractions) // 2),
        "frames": frames})


# --- the capstone's loss curves (chapter 19) ---------------------------------------------------------------

def capstone_spec(record: dict | str | Path | None = None, colors: dict | None = None) -> dict:
    """Validation loss against step for each optimizer of chapter 19's table, one seed per slider value,
    with the target loss; from ``records/capstone.json`` (``make capstone``) or the ``record`` given.

    The readout gives each optimizer's steps to the target on that seed (the first evaluation at or
    below it), as the table counts them. ``colors``: a colour per optimizer name (default :data:`PALETTE`).

    Raises:
        FileNotFoundError: no record file. ValueError: a record without ``curves``, ``table_seeds`` or
            ``setup.target``, or curves of another length than the seeds.
    """
    if record is None or isinstance(record, (str, Path)):
        path = Path(record) if record is not None else Path(__file__).resolve().parents[2] / "records" / "capstone.json"
        record = json.loads(path.read_text(encoding="utf-8"))
    try:
        curves, seeds, target = record["curves"], record["table_seeds"], float(record["setup"]["target"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"Invalid record: no {e} (expected records/capstone.json's fields)") from None
    names = list(curves)
    for name in names:
        if len(curves[name]) != len(seeds):
            raise ValueError(f"Invalid record: {len(curves[name])} curves for {name!r}, {len(seeds)} seeds")
    frames, top, last = [], target, 1
    for j, seed in enumerate(seeds):
        series, reached = [], []
        for i, name in enumerate(names):
            pts = curves[name][j]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            color = (colors or {}).get(name, PALETTE[i % len(PALETTE)])
            series.append({"name": name, "x": xs, "y": [_r(y) for y in ys], "color": color,
                           "dash": i % 2 == 1})
            hit = next((x for x, y in zip(xs, ys) if y <= target), None)
            reached.append(f"{name} {hit if hit is not None else '-'}")
            top, last = max(top, max(ys)), max(last, max(xs))
        frames.append({"series": series, "note": "steps to target: " + ", ".join(reached)})
    return check_spec({
        "title": "Validation loss on real text, by optimizer", "xlabel": "step", "ylabel": "validation loss (nats)",
        "xlog": False, "ylog": False, "xlim": [0, last], "ylim": [_r(target - 0.15), _r(min(top, target + 1.2))],
        "x": [], "fixed": [{"name": f"target {target:g}", "x": [0, last], "y": [target, target], "color": "#444",
                            "dash": True}],
        "slider": _slider("seed", list(seeds)), "frames": frames})
