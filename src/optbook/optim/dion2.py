"""Dion2: orthonormalise only the rows (or columns) of the momentum that carry the most. Explained in chapter 18.

Source: the reference code microsoft/dion at commit 0a059a4542e5aa74b40dcd1dce363836c7afcd48, ``dion/dion2.py``
(``dion2_pre_orthogonalize``, ``dion2_post_orthogonalize``, ``dion2_update_megabatch_async``) and
``dion/megabatch_base.py`` (``adjust_lr_spectral_norm``); the paper is Ahn et al., "Dion2" (arXiv:2512.16928),
which the reference's docstring leaves "TBD". The code here is our own, written from that reading.

Derivation. Muon orthogonalises the whole ``m x n`` momentum every step; Dion (chapter 18) a rank-``r``
power iteration of it. Dion2 orthogonalises a *submatrix*: the ``k`` slices along the shorter dimension whose
momentum has the largest L1 norm. Error feedback keeps what was not applied: a selected slice decays by
``ef_decay`` after it is used, an unselected one keeps accumulating until it is large enough to be picked::

    M <- M + G                                     (m, n), the momentum as a sum (no decay here)
    select rows if m <= n, else columns            the shorter dimension; k = max(1, ceil(fraction * count))
    I <- the k slices with the largest L1 norms    (over the other dimension)
    S <- M[I]                                      (k, n) or (m, k)
    M[I] <- ef_decay * S                           error feedback: only what was applied decays
    W <- W (1 - lr * weight_decay)
    W[I] <- W[I] - lr * scale * NS(S)              scale from the whole (m, n) shape, as the reference

``NS`` is :func:`optbook.newton_schulz` (normalised by ``max(||S||_F, eps)``, then ``ns_steps`` iterations in
``ns_dtype``); the reference normalises by ``||S||_F + eps`` and runs Polar Express in bfloat16 by default,
so ``coefficients="polar_express"`` and ``ns_dtype="bfloat16"`` are the defaults here. ``scale`` is
:func:`~optbook.optim.muon.muon_scale` of the full shape; the default ``"unit_rms_norm"``,
``sqrt(fan_out / fan_in)``, is the reference's default ``adjust_lr="spectral_norm"``.

Two exact relations (tested): with ``fraction=1`` every slice is selected, so ``M_t = ef_decay * (M_{t-1} + G_t)``
and the update is ``NS(B_t)`` with ``B_t = ef_decay * B_{t-1} + G_t`` -- Muon's momentum in its sum form,
``1 / (1 - mu)`` times Muon's EMA buffer, which Newton–Schulz's normalisation removes: Dion2(``fraction=1,
ef_decay=mu``) is Muon(``momentum=mu, nesterov=False``) with the same scale and iteration, to rounding. With
``fraction=1, ef_decay=0`` it is Muon without momentum.

Ties between equal L1 norms go to the lower index (a stable sort), so the selection is the same on every
machine; the reference's ``torch.topk(sorted=False)`` leaves ties to the kernel.
"""

from __future__ import annotations

import math

import torch

from .._checks import FLOATS, check_int, check_lr, check_number, check_weight_decay
from ..polar import COEFFICIENTS, newton_schulz
from ._functional import steps_in_float32
from .muon import SCALE_MODES, muon_scale
from .matrix_views import MatrixWork, check_group_shapes
from .normuon import MATRIX_ROUTE
from .optimizer import BookOptimizer

__all__ = ["Dion2", "dion2", "dion2_selection"]


def _dtype(name) -> torch.dtype:
    """``"bfloat16"`` or ``torch.bfloat16`` -> ``torch.bfloat16`` (param groups keep the name: DCP saves strings)."""
    return name if isinstance(name, torch.dtype) else getattr(torch, name)


def dion2_selection(shape, fraction: float) -> tuple[int, int]:
    """``(select_dim, k)`` for an ``(m, n)`` matrix: the slices of the shorter dimension (rows, ``-2``, when
    ``m <= n``; else columns, ``-1``) and how many of them, ``k = max(1, ceil(fraction * count))``."""
    m, n = shape
    select_dim = -2 if m <= n else -1
    count = m if select_dim == -2 else n
    return select_dim, max(1, min(count, math.ceil(fraction * count - 1e-9)))


@torch.no_grad()
@steps_in_float32(3)
def dion2(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor], *, lr: float,
          fraction: float, ef_decay: float, weight_decay: float, eps: float = 1e-7, ns_steps: int = 5,
          coefficients="polar_express", ns_dtype="bfloat16", scale_mode: str = "unit_rms_norm",
          matrix_view: str = "matrix") -> None:
    """Apply one Dion2 step in place (the pure function behind :class:`Dion2`; the update is in the module
    docstring, :mod:`optbook.optim.dion2`).

    Args:
        params, grads, momentum_buffers: lists of ``(m, n)`` tensors, one entry per parameter, or of tensors
            that ``matrix_view`` sees as matrices (:mod:`optbook.optim.matrix_views`); the buffers are updated
            in place.
        lr, fraction, ef_decay, weight_decay, eps, ns_steps, coefficients, ns_dtype, scale_mode, matrix_view:
            as in :class:`Dion2`; not re-validated here.

    A float16/bfloat16 parameter is stepped in float32 and rounded back once (with its buffer). Each matrix
    of a flattened or stacked tensor is stepped as a parameter of that matrix's shape would be (its own
    selection of rows or columns, and its own scale).
    """
    work = MatrixWork(matrix_view)   # a channels_last kernel: stepped on a contiguous copy, copied back
    for p, g, M in zip(params, grads, momentum_buffers):
        for pm, gm, Mm in zip(work.work(p), work.read(g), work.work(M)):
            Mm.add_(gm)
            select_dim, k = dion2_selection(pm.shape, fraction)
            norms = torch.linalg.vector_norm(Mm, ord=1, dim=-1 if select_dim == -2 else -2)
            index = torch.sort(norms, descending=True, stable=True).indices[:k]
            S = Mm.index_select(select_dim, index)                       # a copy: (k, n) or (m, k)
            Mm.index_copy_(select_dim, index, S * ef_decay)              # error feedback: the selected slices
            U = newton_schulz(S, ns_steps, coefficients, eps=eps, dtype=_dtype(ns_dtype)).to(p.dtype)
            pm.mul_(1 - lr * weight_decay)
            pm.index_add_(select_dim, index, U, alpha=-lr * muon_scale(pm.shape, scale_mode))
    work.write_back()


class Dion2(BookOptimizer):
    """Dion2 (microsoft/dion ``dion/dion2.py`` at 0a059a4; arXiv:2512.16928), single device: Newton–Schulz on the
    ``fraction`` of rows (or columns) of the momentum with the largest L1 norms, with error feedback.

    The update and its relation to Muon are in the module docstring (:mod:`optbook.optim.dion2`).

    Args:
        params: 2-D real floating-point tensors ``(fan_out, fan_in)`` (or what ``matrix_view`` steps), or
            param-group dicts.
        lr: learning rate ``>= 0``; the selected slices move by ``lr * muon_scale(shape, scale_mode)`` times
            the orthogonalised submatrix.
        fraction: the share of slices orthogonalised each step, in ``(0, 1]`` (a Python number: it fixes
            the shapes of the step).
        ef_decay: the factor in ``[0, 1]`` by which a selected slice of the momentum decays after use.
        weight_decay: decoupled decay ``>= 0``, multiplied by ``lr``, applied to the whole matrix.
        eps: floor of the Newton–Schulz normaliser, ``> 0``.
        ns_steps, coefficients: the iteration (:func:`optbook.newton_schulz`); default 5 Polar Express steps.
        ns_dtype: the iteration's dtype, a ``torch.dtype`` or its name (kept as the name in ``param_groups``,
            so that ``torch.distributed.checkpoint`` can save the groups).
        scale_mode: as :class:`~optbook.optim.Muon`'s, of the full shape; ``"unit_rms_norm"``
            (``sqrt(fan_out / fan_in)``, the reference's ``adjust_lr="spectral_norm"``) by default.
        matrix_view: ``"matrix"`` (default: 2-D tensors only), ``"flatten"`` (conv kernels as
            ``(out, in*kh*kw)``) or ``"stacked"`` (``(*E, M, N)`` as ``prod(E)`` matrices), as
            :class:`~optbook.optim.Muon`'s (:mod:`optbook.optim.matrix_views`); the selection and the scale
            are those of each matrix stepped. (microsoft/dion#121 makes the reference refuse ``flatten=True``
            for tensors of 3 or more dimensions in Dion2, its selection and error feedback not being
            flatten-aware; here the flattened matrix is selected from as any matrix.)

    State per parameter: ``momentum_buffer`` (the parameter's shape and dtype).

    Raises:
        ValueError, TypeError: those of every matrix optimizer (:mod:`optbook.optim.matrix_views`: a shape
            ``matrix_view`` cannot step, a hyperparameter out of range, a non-finite gradient), before
            anything is written; TypeError also for ``fraction`` given as a tensor.
    """

    elementwise = False
    float_options = ("lr", "ef_decay", "weight_decay", "eps")

    def __init__(self, params, lr: float = 0.02, fraction: float = 0.25, ef_decay: float = 0.95,
                 weight_decay: float = 0.0, eps: float = 1e-7, ns_steps: int = 5, coefficients="polar_express",
                 ns_dtype="bfloat16", scale_mode: str = "unit_rms_norm", matrix_view: str = "matrix"):
        if isinstance(ns_dtype, torch.dtype):
            ns_dtype = str(ns_dtype).removeprefix("torch.")
        super().__init__(params, dict(lr=lr, fraction=fraction, ef_decay=ef_decay, weight_decay=weight_decay,
                                      eps=eps, ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype,
                                      scale_mode=scale_mode, matrix_view=matrix_view))

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        if isinstance(group["fraction"], torch.Tensor):
            raise TypeError("Invalid fraction: expected a Python number (it fixes the shapes of the step), "
                            "got a tensor")
        check_number("fraction", group["fraction"], low=0.0, high=1.0, low_open=True)
        check_number("ef_decay", group["ef_decay"], low=0.0, high=1.0)
        check_weight_decay(group["weight_decay"])
        check_number("eps", group["eps"], low=0.0, low_open=True)
        check_int("ns_steps", group["ns_steps"], 1)
        coefficients = group["coefficients"]
        if isinstance(coefficients, str) and coefficients not in COEFFICIENTS:
            raise ValueError(f"Invalid coefficients: expected one of {tuple(COEFFICIENTS)} or a sequence of "
                             f"(a, b, c), got {coefficients!r}")
        names = tuple(str(d).removeprefix("torch.") for d in FLOATS)
        ns_dtype = group["ns_dtype"]
        if isinstance(ns_dtype, torch.dtype):
            ns_dtype = str(ns_dtype).removeprefix("torch.")
        if ns_dtype not in names:
            raise ValueError(f"Invalid ns_dtype: expected one of {names} (or the torch.dtype), got {ns_dtype!r}")
        if group["scale_mode"] not in SCALE_MODES:
            raise ValueError(f"Invalid scale_mode: expected one of {SCALE_MODES}, got {group['scale_mode']!r}")
        check_group_shapes(group, "Dion2", MATRIX_ROUTE)

    def _expected_state(self, p, group):
        return {"momentum_buffer": (tuple(p.shape), p.dtype, True)}

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        dion2(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
              lr=group["lr"], fraction=group["fraction"], ef_decay=group["ef_decay"],
              weight_decay=group["weight_decay"], eps=group["eps"], ns_steps=group["ns_steps"],
              coefficients=group["coefficients"], ns_dtype=group["ns_dtype"], scale_mode=group["scale_mode"],
              matrix_view=group.get("matrix_view", "matrix"))
