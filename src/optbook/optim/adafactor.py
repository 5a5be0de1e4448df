"""Adafactor: a factored second moment. Explained in chapter 4.

Source: Shazeer & Stern (2018), "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
arXiv:1804.04235, Algorithms 4-5 (factored and unfactored), with update clipping (sec. 6) and the
relative step size (sec. 8); written in the same form as ``torch.optim.Adafactor`` so the two agree.

At step ``t`` for a matrix gradient ``G`` of shape ``(..., m, n)`` (factored over the last two dims)::

    beta2_t = 1 - t ** beta2_decay                                   (beta2_decay = -0.8)
    r <- lerp(r, mean_cols(G*G), 1 - beta2_t)       shape (..., m, 1)   (row EMA)
    c <- lerp(c, mean_rows(G*G), 1 - beta2_t)       shape (..., 1, n)   (column EMA)
    V  = r c / mean(r)                              the rank-1 estimate of E[G*G], (..., m, n)
    U  = G / sqrt(max(V, eps1**2))
    U  = U / max(1, RMS(U) / d)                     update clipping
    p <- p * (1 - lr * weight_decay) - max(eps2, RMS(p)) * min(lr, 1/sqrt(t)) * U   (relative step)

A 0-D or 1-D gradient keeps an unfactored EMA ``v`` of ``G*G`` (Algorithm 5). Memory for an
``m x n`` matrix: ``m + n`` numbers instead of Adam's ``2 m n``. If ``V`` is exactly rank one
(``G*G = a b^T``), the factored estimate equals the full second moment (chapter 4 shows it).
The paper adds ``eps1`` to ``G*G`` instead of clamping ``V``; the difference matters only for
gradients below ``eps1``.

For a float16/bfloat16 parameter the statistics ``r``, ``c`` (``v``) are float32 (``m + n`` numbers: no
memory to save) and the step is computed in float32 and rounded back once; ``eps1`` stays the parameter
dtype's epsilon. ``torch.optim.Adafactor`` (torch 2.13, ``torch/optim/_adafactor.py``) keeps them in the
parameter's dtype: in float16 a gradient entry of 256 already squares past 65504, and ``G*G``'s mean, then
the weights, become NaN (``tests/test_low_precision.py`` shows both).
"""

from __future__ import annotations

import torch

from ._functional import in_float32, write_back
from .._checks import check_bool, check_lr, check_number, check_weight_decay
from .optimizer import BookOptimizer

__all__ = ["Adafactor", "adafactor"]


@torch.no_grad()
def adafactor(params: list[torch.Tensor], grads: list[torch.Tensor], row_vars: list[torch.Tensor | None],
              col_vars: list[torch.Tensor | None], variances: list[torch.Tensor | None], steps: list[int], *,
              lr: float, beta2_decay: float, eps1: float | None, eps2: float, d: float, weight_decay: float,
              maximize: bool = False) -> None:
    """Apply one Adafactor step in place (the pure function behind :class:`Adafactor`).

    Args:
        params, grads: lists of equal-shape tensors, one entry per parameter.
        row_vars, col_vars: for a factored parameter ``(..., m, n)`` its row ``(..., m, 1)`` and column
            ``(..., 1, n)`` EMAs, else ``None``; updated in place (float32 for a float16/bfloat16 parameter).
        variances: for a 0-D/1-D parameter its unfactored EMA (its shape), else ``None``; updated in place.
        steps: the step number ``t >= 1`` of each parameter, *after* counting this step.
        lr, beta2_decay, eps1, eps2, d, weight_decay, maximize: as in :class:`Adafactor` (``eps1=None``:
            the parameter dtype's machine epsilon); not re-validated here.
    """
    for p0, g, r, c, v, t in zip(params, grads, row_vars, col_vars, variances, steps):
        e1 = torch.finfo(p0.dtype).eps if eps1 is None else eps1
        (p,) = in_float32([p0])   # float32 work for float16/bfloat16, rounded back once
        g = g.to(p.dtype)
        if maximize:   # ascend: the statistics see G*G either way, the update follows -G
            g = -g
        one_minus_beta2 = t ** beta2_decay
        alpha = max(eps2, float(p.norm()) / p.numel() ** 0.5) * min(lr, t ** -0.5)
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        if v is None:  # factored
            r.lerp_(g.square().mean(dim=-1, keepdim=True), one_minus_beta2)
            c.lerp_(g.square().mean(dim=-2, keepdim=True), one_minus_beta2)
            V = r @ c
            V.div_(r.mean(dim=-2, keepdim=True).clamp(min=e1))
        else:
            v.lerp_(g.square(), one_minus_beta2)
            V = v.clone()
        U = V.clamp_(min=e1 * e1).rsqrt_().mul_(g)
        clip = max(1.0, float(U.norm()) / (U.numel() ** 0.5 * d))
        p.sub_(U, alpha=alpha / clip)
        write_back([p0], [p])


class Adafactor(BookOptimizer):
    """Adafactor with relative step size and update clipping (Shazeer & Stern 2018).

    Args:
        params: real floating-point tensors or param-group dicts. Tensors with two or more
            dimensions are factored over their last two dimensions (leading dimensions are a batch
            of matrices); 0-D and 1-D tensors are not factored.
        lr: cap ``rho`` of the relative step ``min(lr, 1/sqrt(t))``, ``>= 0``.
        beta2_decay: exponent ``<= 0`` of ``1 - beta2_t = t ** beta2_decay``.
        eps: ``(eps1, eps2)``: floor of the second-moment estimate (``None``: the dtype's machine
            epsilon) and floor of the parameter RMS in the relative step.
        d: update-clipping threshold on ``RMS(U)``, ``>= 1`` (as ``torch.optim.Adafactor``). Shazeer & Stern
            (2018), sec. 6 and Algorithms 4-5, clip ``U / max(1, RMS(U) / d)`` against the "larger-than-desired
            updates" (their abstract) of a second-moment estimate that lags behind, with ``d = 1`` in their
            experiments. Where the estimate is right, ``RMS(U)`` is about 1, so a ``d < 1`` would scale
            (nearly) every update down by ``d`` -- a smaller ``lr``, not a safeguard -- and is refused.
        weight_decay: decoupled decay ``>= 0`` multiplied by ``lr``.
        maximize: ascend the objective (the update follows ``+G``), as ``torch.optim.Adafactor(maximize=True)``.
        foreach: not taken (``None``/``False`` accepted, ``True`` refused: this class steps one tensor at a
            time, :mod:`optbook.optim._torch_arguments`).

    State per parameter: ``step`` (int); ``row_var`` ``(..., m, 1)`` and ``col_var`` ``(..., 1, n)`` for
    factored tensors, ``variance`` (parameter's shape) otherwise; in the parameter's dtype, float32 for a
    float16/bfloat16 parameter (whose step is computed in float32 and rounded back once).

    Raises:
        ValueError, TypeError: as for every optimizer of :mod:`optbook.optim`; ``ValueError`` for ``d < 1``.
    """

    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "beta2_decay", "eps", "d", "weight_decay")
    state_scalars = {"step": "count"}
    nonnegative_state = ("row_var", "col_var", "variance")   # EMAs of G*G: refused negative at load

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0, *, maximize: bool = False):
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                      maximize=maximize))

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        check_number("beta2_decay", group["beta2_decay"], high=0.0)
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise TypeError(f"Invalid eps: expected a pair (eps1, eps2), got {eps!r}")
        if eps[0] is not None:
            check_number("eps[0]", eps[0], low=0.0)
        check_number("eps[1]", eps[1], low=0.0)
        check_number("d", group["d"], low=1.0)
        check_weight_decay(group["weight_decay"])
        check_bool("maximize", group["maximize"])

    def _expected_state(self, p, group):
        work = torch.promote_types(p.dtype, torch.float32)   # statistics never in float16/bfloat16
        if p.ndim >= 2:
            return {"row_var": ((*p.shape[:-1], 1), work, True),
                    "col_var": ((*p.shape[:-2], 1, p.shape[-1]), work, True)}
        return {"variance": (tuple(p.shape), work, True)}

    #: ``None`` (the eager step), or the :class:`optbook.optim.compiled.CompiledStep` whose compiled kernel
    #: runs this optimizer's arithmetic inside its own ``step()`` (set by :func:`optbook.optim.compiled_step`).
    compiled = None

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:   # one dict.update: an interrupt (Ctrl-C) cannot leave half a state behind
                work = torch.promote_types(p.dtype, torch.float32)   # statistics never in float16/bfloat16
                if p.ndim >= 2:  # factored
                    state.update(step=0, row_var=p.new_zeros(*p.shape[:-1], 1, dtype=work),
                                 col_var=p.new_zeros(*p.shape[:-2], 1, p.shape[-1], dtype=work))
                else:
                    state.update(step=0, variance=torch.zeros_like(p, dtype=work))
            state["step"] += 1
        states = [self.state[p] for p in params]
        if self.compiled is not None:
            self.compiled.run_adafactor(params, [s.get("row_var") for s in states], [s.get("col_var") for s in states],
                                        [s.get("variance") for s in states], [s["step"] for s in states], group)
            return
        eps1, eps2 = group["eps"]
        adafactor(params, [p.grad for p in params], [s.get("row_var") for s in states],
                  [s.get("col_var") for s in states], [s.get("variance") for s in states],
                  [s["step"] for s in states], lr=group["lr"], beta2_decay=group["beta2_decay"], eps1=eps1,
                  eps2=eps2, d=group["d"], weight_decay=group["weight_decay"], maximize=group["maximize"])
