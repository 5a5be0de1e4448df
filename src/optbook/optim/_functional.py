"""Pieces of math that several optimizers of :mod:`optbook.optim` share, written once.

``momentum_directions`` is the EMA (lerp) momentum with the optional Nesterov look-ahead of chapter 1,
used by :func:`optbook.optim.functional.sgd` and :func:`optbook.optim.functional.muon`; ``use_foreach`` is the rule that picks
the ``torch._foreach_*`` path, used by :class:`~optbook.optim.SGD` and :class:`~optbook.optim.Adam`;
``in_float32``/``write_back`` compute the update of a float16/bfloat16 parameter in float32 and round
it into the parameter (and its state) once, as mixed-precision training keeps master weights in
float32 (Micikevicius et al. 2018, arXiv:1710.03740): a quantity such as Adam's
``eps * sqrt(1 - beta2**t)`` (3e-10 at t = 1) underflows to zero in float16.
"""

from __future__ import annotations

import torch

from .._checks import LOW_PRECISION

__all__ = ["LOW_PRECISION", "in_float32", "momentum_directions", "use_foreach", "write_back"]


def momentum_directions(momentum_buffers: list[torch.Tensor], grads: list[torch.Tensor], momentum: float,
                        nesterov: bool, *, foreach: bool = False) -> list[torch.Tensor]:
    """Update each EMA buffer in place and return the step directions (chapter 1)::

        m <- lerp(m, g, 1 - momentum)                       (m starts at zero)
        d  = lerp(g, m, momentum)  if nesterov  else  m

    Source: Polyak (1964) for the heavy ball, Sutskever et al. (2013, eq. 3-4) for the look-ahead;
    ``m`` is ``(1 - momentum)`` times ``torch.optim.SGD``'s buffer, so the two agree in exact arithmetic
    (to rounding in floating point) with ``lr`` rescaled by ``1 - momentum``.

    Args:
        momentum_buffers, grads: lists of equal-shape, equal-dtype tensors, one entry per parameter;
            the buffers are updated in place.
        momentum: the EMA coefficient in ``[0, 1)`` (not re-validated here).
        nesterov: return the look-ahead ``lerp(g, m, momentum)`` (a new tensor) instead of ``m``.
        foreach: use the ``torch._foreach_*`` kernels (one launch per operation for the whole list).

    Returns:
        One direction per parameter: the buffer itself without Nesterov, a new tensor with it.
    """
    if foreach:
        torch._foreach_lerp_(momentum_buffers, grads, 1 - momentum)
        return torch._foreach_lerp(grads, momentum_buffers, momentum) if nesterov else list(momentum_buffers)
    directions = []
    for g, m in zip(grads, momentum_buffers):
        m.lerp_(g, 1 - momentum)
        directions.append(g.lerp(m, momentum) if nesterov else m)
    return directions


def use_foreach(foreach: bool | None, params: list[torch.Tensor]) -> bool:
    """The ``foreach`` option resolved for one group's ``params``.

    ``True``/``False`` are kept; ``None`` picks the ``torch._foreach_*`` path when there is at least one
    parameter and every parameter is on a CUDA device (it pays on GPUs, not on CPUs), as ``torch.optim``.
    """
    if foreach is None:
        return bool(params) and all(p.is_cuda for p in params)
    return foreach



def in_float32(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``tensors`` with every float16/bfloat16 entry replaced by a float32 copy (others kept as they are)."""
    return [t.float() if t is not None and t.dtype in LOW_PRECISION else t for t in tensors]


def write_back(targets: list[torch.Tensor | None], results: list[torch.Tensor | None]) -> None:
    """Copy each float32 working copy made by :func:`in_float32` into its original (one rounding)."""
    for t, r in zip(targets, results):
        if t is not None and r is not t:
            t.copy_(r)
