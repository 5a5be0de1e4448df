"""SGD with EMA (lerp) momentum and Nesterov. Explained in chapter 1 (SGD and momentum).

Source: Polyak (1964) for heavy ball, Nesterov (1983) and Sutskever et al. (2013,
eq. 3-4) for the look-ahead form.

The update for one parameter ``p`` with gradient ``g`` (all tensors of ``p``'s shape and dtype)::

    g       <- g + weight_decay * p                       (coupled L2, as torch.optim.SGD)
    m       <- lerp(m, g, 1 - momentum)                    (m starts at zero)
    d       <- lerp(g, m, momentum)  if nesterov  else  m
    p       <- p - lr * d

For a float16/bfloat16 parameter the step is computed in float32 and ``p`` and ``m`` are rounded back
once, so the loop and foreach paths agree bitwise.

Relation to ``torch.optim.SGD`` (heavy ball ``b <- momentum * b + g``, first ``b = g``): since
``m_t = (1 - momentum) * b_t`` in exact arithmetic, ``SGD(lr=a, momentum=mu)`` here equals
``torch.optim.SGD(lr=a * (1 - mu), momentum=mu, dampening=0)``, with or without Nesterov, up to
rounding (float64 over 5 steps: within 1.1e-16, not bit for bit).
"""

from __future__ import annotations

import torch

from ._functional import LOW_PRECISION, in_float32, momentum_directions, use_foreach, write_back
from ._sharded import local
from .._checks import check_foreach, check_lr, check_momentum, check_nesterov, check_weight_decay
from .optimizer import BookOptimizer

__all__ = ["SGD", "sgd"]


@torch.no_grad()
def sgd(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor | None],
        *, lr: float, momentum: float, nesterov: bool, weight_decay: float, foreach: bool = False) -> None:
    """Apply one SGD step in place (the pure function behind :class:`SGD`).

    Args:
        params, grads: lists of tensors of equal shapes and dtype, one per parameter.
        momentum_buffers: one EMA buffer per parameter (same shape), updated in place; ignored when
            ``momentum == 0``.
        lr, momentum, nesterov, weight_decay: as in :class:`SGD`; not re-validated here.
        foreach: use the ``torch._foreach_*`` kernels (one launch per operation for the whole list;
            pays on GPUs, not on CPUs).
    """
    if not params:
        return
    if any(p.dtype in LOW_PRECISION for p in params):  # the same step in float32, rounded back once
        work = [in_float32(x) for x in (params, grads, momentum_buffers)]
        sgd(*work, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, foreach=foreach)
        write_back(params, work[0])
        write_back(momentum_buffers, work[2])
        return
    if weight_decay:
        if foreach:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        else:
            grads = [g.add(p, alpha=weight_decay) for p, g in zip(params, grads)]
    directions = momentum_directions(momentum_buffers, grads, momentum, nesterov, foreach=foreach) if momentum else grads
    if foreach:
        torch._foreach_add_(params, directions, alpha=-lr)
    else:
        for p, d in zip(params, directions):
            p.add_(d, alpha=-lr)


class SGD(BookOptimizer):
    """Stochastic gradient descent with EMA momentum (lerp form) and optional Nesterov look-ahead.

    Args:
        params: iterable of real floating-point tensors or of param-group dicts.
        lr: learning rate (units of the parameter per unit of the EMA'd gradient), ``>= 0``.
        momentum: EMA coefficient ``mu`` in ``[0, 1)``; 0 gives plain SGD and allocates no state.
        nesterov: use ``lerp(g, m, mu)`` as the direction instead of ``m``; needs ``momentum > 0``
            (as ``torch.optim.SGD``).
        weight_decay: coupled L2 coefficient ``>= 0`` added to the gradient.
        foreach: force (``True``) or forbid (``False``) the ``torch._foreach_*`` path; ``None``
            picks it when every parameter of the group is on a CUDA device.

    State per parameter: ``momentum_buffer`` (same shape and dtype as the parameter), only when
    ``momentum > 0``.

    Raises:
        ValueError: ``lr < 0``, ``momentum`` outside ``[0, 1)``, ``weight_decay < 0``, non-finite
            values, ``nesterov=True`` with ``momentum=0``; a gradient of another shape or device; a
            gradient holding ``inf``/``NaN`` (:class:`~optbook.contract.NonFiniteGradientError`, nothing
            written).
        TypeError: integer, bool or complex parameters; sparse gradients or gradients of another dtype;
            ``nesterov`` not a bool, ``foreach`` not ``None``/``True``/``False``.
    """

    elementwise = True
    state_tensors = 1  #: parameter-sized state tensors (the momentum buffer), for optbook.memory

    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "momentum", "weight_decay")

    def __init__(self, params, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, *, foreach: bool | None = None):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        foreach=foreach)
        super().__init__(params, defaults)

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        momentum = check_momentum(group["momentum"])
        check_weight_decay(group["weight_decay"])
        check_nesterov(group["nesterov"], momentum)
        check_foreach(group["foreach"])

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        momentum = group["momentum"]
        buffers = []
        for p in params:
            state = self.state[p]
            if momentum and "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffers.append(state.get("momentum_buffer"))
        sgd(local(params), local([p.grad for p in params]), local(buffers), lr=group["lr"], momentum=momentum,
            nesterov=group["nesterov"], weight_decay=group["weight_decay"],
            foreach=use_foreach(group["foreach"], params))
