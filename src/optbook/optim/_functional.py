"""Pieces of math that several optimizers of :mod:`optbook.optim` share, written once.

``momentum_directions`` is the EMA (lerp) momentum with the optional Nesterov look-ahead of chapter 1,
used by :func:`optbook.optim.sgd` and :func:`optbook.optim.muon`; ``use_foreach`` is the rule that picks
the ``torch._foreach_*`` path, used by :class:`~optbook.optim.SGD` and :class:`~optbook.optim.Adam`.
"""

from __future__ import annotations

import torch

__all__ = ["momentum_directions", "use_foreach"]


def momentum_directions(momentum_buffers: list[torch.Tensor], grads: list[torch.Tensor], momentum: float,
                        nesterov: bool, *, foreach: bool = False) -> list[torch.Tensor]:
    """Update each EMA buffer in place and return the step directions (chapter 1)::

        m <- lerp(m, g, 1 - momentum)                       (m starts at zero)
        d  = lerp(g, m, momentum)  if nesterov  else  m

    Source: Polyak (1964) for the heavy ball, Sutskever et al. (2013, eq. 3-4) for the look-ahead;
    ``m`` is ``(1 - momentum)`` times ``torch.optim.SGD``'s buffer, so the two agree exactly with
    ``lr`` rescaled by ``1 - momentum``.

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
