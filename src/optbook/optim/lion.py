"""Lion: the sign of an interpolated momentum. Explained in chapter 4.

Source: Chen et al. (2023), "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675,
Algorithm 2; Megatron-LM's command-line defaults ``--lion-beta1/2 = 0.95/0.98`` (``megatron/training/arguments.py`` at core_v0.19.0).

For a parameter ``p`` with gradient ``g`` (elementwise, shapes of ``p``)::

    c <- lerp(m, g, 1 - beta1)                     (interpolate: beta1 m + (1 - beta1) g)
    p <- p * (1 - lr * weight_decay) - lr * sign(c)   (decoupled decay, outside the sign)
    m <- lerp(m, g, 1 - beta2)                     (the only state: one buffer)

``sign(0) = 0``: a coordinate whose interpolation is exactly zero does not move.
"""

from __future__ import annotations

import torch

from .._sharded import local
from .._checks import check_betas, check_lr, check_weight_decay
from .optimizer import BookOptimizer

__all__ = ["Lion", "lion"]


@torch.no_grad()
def lion(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *, lr: float,
         beta1: float, beta2: float, weight_decay: float) -> None:
    """Apply one Lion step in place (the pure function behind :class:`Lion`).

    Args:
        params, grads, exp_avgs: lists of equal-shape tensors, one entry per parameter; ``exp_avgs``
            (the momentum ``m``) is updated in place.
        lr, beta1, beta2, weight_decay: as in :class:`Lion`; not re-validated here.
    """
    for p, g, m in zip(params, grads, exp_avgs):
        direction = m.lerp(g, 1 - beta1).sign_()
        p.mul_(1 - lr * weight_decay).sub_(direction, alpha=lr)
        m.lerp_(g, 1 - beta2)


class Lion(BookOptimizer):
    """Lion (Chen et al. 2023, Algorithm 2) with decoupled weight decay.

    Args:
        params: real floating-point tensors or param-group dicts.
        lr: learning rate ``>= 0``; every coordinate moves by exactly ``lr`` (plus decay) per step,
            so Lion's lr is typically 3-10x smaller than AdamW's.
        betas: ``(beta1, beta2)`` in ``[0, 1)``: interpolation for the update, EMA for the state.
        weight_decay: decoupled decay ``>= 0`` multiplied by ``lr``.

    State per parameter: ``exp_avg`` (shape and dtype of the parameter).

    Raises:
        ValueError, TypeError: as for every optimizer of :mod:`optbook.optim`.
    """

    elementwise = True
    state_tensors = 1  #: parameter-sized state tensors (exp_avg), for optbook.memory

    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "betas", "weight_decay")

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.95, 0.98),
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_weight_decay(group["weight_decay"])

    def _expected_state(self, p, group):
        return {"exp_avg": (tuple(p.shape), p.dtype, True)}

    #: ``None`` (the eager step), or the :class:`optbook.optim.compiled.CompiledStep` whose compiled kernel
    #: runs this optimizer's arithmetic inside its own ``step()`` (set by :func:`optbook.optim.compiled_step`).
    compiled = None

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if self.compiled is not None:
            self.compiled.run_lion(params, [self.state[p]["exp_avg"] for p in params], group)
            return
        beta1, beta2 = group["betas"]
        lion(local(params), local([p.grad for p in params]),
             local([self.state[p]["exp_avg"] for p in params]), lr=group["lr"],
             beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])
