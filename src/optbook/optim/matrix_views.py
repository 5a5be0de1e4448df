"""Which 2-D matrices a Muon-family optimizer steps in a weight: the param group's ``matrix_view``.

Muon, NorMuon, AdaMuon, Dion and Dion2 update matrices. A param group's ``matrix_view`` says how each of
its tensors is seen as matrices; nothing is guessed from the shape alone (a ``(E, M, N)`` tensor may be
a stack of ``E`` experts or a ``Conv1d`` kernel ``(out, in, k)``, and the two need different steps):

=======================  ============================  ===============================================
``matrix_view``          tensor shape                  the matrices stepped
=======================  ============================  ===============================================
``"matrix"`` (default)   ``(A, B)``                    the tensor itself; any other shape is refused,
                                                       naming ``matrix_view``
``"flatten"``            ``(out, *rest)``, 2-D or more  one ``(out, prod(rest))`` matrix: a conv kernel
                                                       ``(out, in, kh, kw)`` as ``(out, in*kh*kw)``
``"stacked"``            ``(*E, M, N)``, 3-D or more    ``prod(E)`` matrices ``(M, N)`` (MoE experts,
                                                       per-head weights), each stepped exactly as a
                                                       separate ``(M, N)`` parameter would be
=======================  ============================  ===============================================

**The learning-rate scale of a flattened or stacked tensor** is that of the matrix stepped: every
shape-dependent factor (:func:`optbook.optim.muon_scale`'s ``(A, B)``, Dion's ``sqrt(m / n)``, AdaMuon's
``sqrt(min(m, n))``, Dion2's selection) reads ``(out, in*kh*kw)`` for a flattened kernel and ``(M, N)``
for each matrix of a stack (:func:`matrix_shape`). For a ``(64, 2, 3, 3)`` kernel, the ``(64, 18)``
matrix: ``"shape_scaling"`` gives ``sqrt(64 / 18) = 1.886``. Other readings of the same kernel, all
found in public code: the kernel's last two dimensions, ``sqrt(max(1, 3 / 3)) = 1`` (KellerJordan/Muon
``muon.py`` at commit 857d1adc159e098212f828d927460782d3da59e9, ``muon_update``: the update is flattened
with ``update.view(len(update), -1)`` but scaled by ``grad.size(-2) / grad.size(-1)``, the unflattened
gradient's); the first two, ``(64, 2)`` (MoonshotAI/Moonlight#40: ``A, B = param_shape[:2]``); timm's
AdaMuon (huggingface/pytorch-image-models at commit aa4b5850c1543fa488abf260f18390eda46cf85d,
``timm/optim/muon.py``: ``get_adamuon_lr_scale`` applied to the shape after the update is reshaped back
to ``(out, in, kh, kw)``) took conv steps 5.7x (``8x4x3x3``) to 512x (``512x512x3x3``) too small
(huggingface/pytorch-image-models#2791). microsoft/dion at commit
0a059a4542e5aa74b40dcd1dce363836c7afcd48 (``dion/megabatch_base.py``, ``muon_update_newton_schulz`` and
``adjust_lr_spectral_norm``) flattens as here with ``flatten=True``: ``X.flatten(start_dim=1)``, fan-in
``prod(shape[1:])``; its default ``flatten=False`` treats any tensor of 3 or more dimensions as a batch
over its last two, which for a conv kernel means ``out * in`` matrices of shape ``(kh, kw)``.

**Memory format.** A tensor that cannot be viewed as its matrices (a ``channels_last`` kernel) is stepped
on a contiguous copy that is copied back, so the result does not depend on the memory format: a
``channels_last`` kernel gets bitwise the step of the same kernel stored contiguously (Keller's
``view`` raises on it).

**Errors.** Each of these optimizers raises, before anything is written: ``ValueError`` for a parameter
whose shape its ``matrix_view`` cannot step (under ``"matrix"``, one that is not 2-D), a hyperparameter
out of range (the message names it) or a non-finite gradient
(:class:`~optbook.contract.NonFiniteGradientError`); ``TypeError`` as every optimizer of
:mod:`optbook.optim` (a hyperparameter of the wrong type). Each class's docstring adds its own.

Stacks: ``pytorch/pytorch#197202`` (batch dimensions in ``torch.optim.Muon``: per-head and per-expert
Muon), torchtitan's grouped-expert Muon and microsoft/dion's ``flatten=False``/``num_heads`` treat
leading dimensions the same way.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MATRIX_VIEWS", "TREATMENTS", "MatrixWork", "batch_shape", "check_group_shapes",
           "check_matrix_view", "matrices", "matrix_shape", "matrix_view_of"]

#: The values of a param group's ``matrix_view`` (module docstring); the first is the default.
MATRIX_VIEWS = ("matrix", "flatten", "stacked")

#: The words :func:`describe` and :class:`optbook.optim.routing.MuonRouting` use for each view.
TREATMENTS = {"matrix": "matrix", "flatten": "flattened conv", "stacked": "stacked"}


def matrix_view_of(group: dict) -> str:
    """``group["matrix_view"]`` (absent: ``"matrix"``, a group saved before the option existed), checked.

    Raises:
        ValueError: not one of :data:`MATRIX_VIEWS`.
    """
    view = group.get("matrix_view", "matrix")
    if not isinstance(view, str) or view not in MATRIX_VIEWS:
        raise ValueError(f"Invalid matrix_view: expected one of {MATRIX_VIEWS}, got {view!r}")
    return view


def matrix_shape(shape, view: str) -> tuple[int, int]:
    """The shape ``(rows, cols)`` of each matrix stepped in a tensor of ``shape`` under ``view``.

    ``"matrix"``: ``shape`` itself; ``"flatten"``: ``(shape[0], prod(shape[1:]))``; ``"stacked"``:
    ``shape[-2:]``. Not validated (:func:`check_matrix_view` does that).
    """
    shape = tuple(shape)
    if view == "flatten":
        return shape[0], math.prod(shape[1:])
    return shape[-2], shape[-1]


def batch_shape(shape, view: str) -> tuple[int, ...]:
    """The leading dimensions ``E`` of a stack ``(*E, M, N)`` under ``"stacked"``, ``()`` otherwise: a
    per-matrix state tensor of shape ``S`` is kept as ``(*batch_shape, *S)`` (NorMuon's ``variance``
    ``(*E, M, 1)``, Dion's right factor ``(*E, N, r)``)."""
    return tuple(shape)[:-2] if view == "stacked" else ()


def check_matrix_view(params, view: str, optimizer: str, hint: str) -> None:
    """Every tensor in ``params`` (one param group's) has a shape ``view`` can step.

    Args:
        params: the group's tensors (non-tensors are left to ``torch.optim``'s own checks).
        view: the group's ``matrix_view`` (checked here too).
        optimizer: the class name, for the message.
        hint: where tensors that are not matrices should go, appended to the message for ``"matrix"``.

    Raises:
        ValueError: an unknown ``view``; under ``"matrix"`` a tensor that is not 2-D (the message names
            ``matrix_view`` for one of 3 or more dimensions); under ``"flatten"`` one of fewer than 2;
            under ``"stacked"`` one of fewer than 3. Each names the parameter's index and shape.
    """
    view = matrix_view_of({"matrix_view": view})
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            continue
        shape = tuple(p.shape)
        if view == "matrix" and p.ndim != 2:
            message = (f"{optimizer} updates 2-D matrices only, but parameter {i} of this group has shape "
                       f"{shape}; {hint}")
            if p.ndim > 2:
                message += ("; or say how to see it as matrices with the group's matrix_view: 'flatten' "
                            "(a conv kernel (out, in, kh, kw) as (out, in*kh*kw)) or 'stacked' (E matrices "
                            "(M, N) in an (E, M, N) tensor)")
            raise ValueError(message)
        if view == "flatten" and p.ndim < 2:
            raise ValueError(f"Invalid matrix_view: 'flatten' steps a tensor (out, *rest) as the matrix "
                             f"(out, prod(rest)) and needs 2 or more dimensions, but parameter {i} of this "
                             f"group has shape {shape}; {hint}")
        if view == "stacked" and p.ndim < 3:
            raise ValueError(f"Invalid matrix_view: 'stacked' steps a tensor (*E, M, N) as prod(E) matrices "
                             f"(M, N) and needs 3 or more dimensions, but parameter {i} of this group has "
                             f"shape {shape}; a 2-D tensor is one matrix (matrix_view='matrix')")


def check_group_shapes(group: dict, optimizer: str, hint: str) -> str:
    """:func:`check_matrix_view` of a param group's tensors (``group["params"]``, if any) under its
    ``matrix_view``; returns the view. Raises as :func:`check_matrix_view`."""
    view = matrix_view_of(group)
    check_matrix_view(group.get("params", ()), view, optimizer, hint)
    return view


def matrices(t: torch.Tensor, view: str) -> list[torch.Tensor]:
    """The 2-D matrices of ``t`` under ``view``, as views of ``t``.

    ``"matrix"``: ``[t]`` (any strides); ``"flatten"``: ``[t.view(out, -1)]``; ``"stacked"``: the
    ``prod(E)`` matrices of ``t.view(-1, M, N)``, in order.

    Raises:
        RuntimeError: ``t`` cannot be viewed so (use :class:`MatrixWork`, which steps a contiguous copy).
    """
    if view == "matrix":
        return [t]
    if view == "flatten":
        return [t.view(t.shape[0], -1)]
    return list(t.view(-1, t.shape[-2], t.shape[-1]).unbind(0))


class MatrixWork:
    """The matrices of tensors that a step writes, with a write-back for those that had to be copied.

    ``work(t)`` returns :func:`matrices` of ``t`` itself when ``t`` can be viewed as them (``"matrix"``,
    or a contiguous tensor), else of a contiguous copy of ``t``, which :meth:`write_back` copies into
    ``t`` (one exact copy: the step's arithmetic is the same for every memory format). ``read(t)``
    does the same for a tensor the step only reads (no write-back).
    """

    def __init__(self, view: str):
        self.view = view
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _working(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.view == "matrix" or t.is_contiguous() else t.contiguous()

    def read(self, t: torch.Tensor) -> list[torch.Tensor]:
        return matrices(self._working(t), self.view)

    def work(self, t: torch.Tensor) -> list[torch.Tensor]:
        w = self._working(t)
        if w is not t:
            self._copies.append((t, w))
        return matrices(w, self.view)

    def write_back(self) -> None:
        for t, w in self._copies:
            t.copy_(w)
        self._copies.clear()
