"""The compiled element-wise steps of SGD, Lion, Adafactor and Schedule-Free AdamW. Explained in chapter 15.

:func:`optbook.optim.compiled_step` runs an optimizer's arithmetic through one ``torch.compile``-d kernel per
parameter group, inside the optimizer's own ``step()`` (:mod:`optbook.optim.compiled`, which holds Adam's).
This module holds the other element-wise optimizers' halves, written as Adam's are:

* ``<name>_scalars``: the numbers of one step (``lr``, the betas, decay factors, bias corrections, each
  parameter's step count and averaging weight), computed **eagerly** with Python floats exactly as the eager
  functional twin computes them, and returned as one float64 tensor. They reach the graph as *data*: a new
  learning rate, a new step count, a momentum or weight-decay schedule run through the graph compiled at the
  first step. (A Python number in a traced function is at first a constant of the graph, guarded by its
  value: its first change compiles again, and under CUDA graphs every new value does; the module docstring
  of :mod:`optbook.optim.compiled` has the details.)
* ``<name>_elementwise``: the element-wise lines of the update, in place, over a list of parameters; what
  :class:`~optbook.optim.compiled.CompiledStep` compiles (``fullgraph=True``), so that Inductor fuses each
  parameter's lines into one loop over memory. A float16/bfloat16 parameter is computed in float32 and its
  parameter and state rounded back once, as the eager twins do (Lion's eager twin computes in the
  parameter's dtype and rounds ``p * (1 - lr * weight_decay)`` once more: the two differ by at most one
  rounding of the parameter per step).

Each kernel equals its eager twin in :mod:`optbook.optim.functional` to float rounding, not bitwise: Inductor
may contract ``a + b * c`` into one FMA and reorder a reduction (``tests/test_compiled_step.py`` checks five
steps under a changing ``lr``, float32 and bfloat16). The one other difference: a weight decay of exactly 0
is applied as ``+ 0 * p`` (SGD, Schedule-Free) or ``* 1`` (Adafactor) instead of being skipped, so that a
weight-decay schedule starting at 0 needs no second graph; that changes at most the sign of a zero.

What still recompiles (guards): the Python bools passed as keywords (``maximize``, SGD's ``nesterov`` and
whether ``momentum`` is non-zero), the set of parameters that have a gradient, their shapes and dtypes
(Adafactor: whether each one is factored). Dynamo keeps at most ``recompile_limit`` (8) graphs per kernel
function, across all groups and optimizers: past that it runs the kernel eagerly, without an error.

Sources (the algorithms, as in each optimizer's module): SGD, Polyak (1964) heavy ball and Sutskever et al.
(2013, eq. 3-4) Nesterov, in the EMA form of :mod:`optbook.optim.sgd`; Lion, Chen et al. (2023),
arXiv:2302.06675, Algorithm 2; Adafactor, Shazeer & Stern (2018), arXiv:1804.04235, Algorithms 4-5 with
update clipping (sec. 6) and the relative step (sec. 8); Schedule-Free AdamW, Defazio et al. (2024),
arXiv:2405.15682, Algorithm 1, in the form of facebookresearch/schedule_free 1.4.1
(``schedulefree/adamw_schedulefree.py``).
"""

from __future__ import annotations

import math

import torch

from ._functional import LOW_PRECISION

__all__ = ["adafactor_elementwise", "adafactor_scalars", "lion_elementwise", "lion_scalars", "parameter_norms",
           "schedule_free_elementwise", "schedule_free_scalars", "sgd_elementwise", "sgd_scalars"]

_F64 = torch.float64


def _work(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as computed in: float32 for float16/bfloat16, else itself."""
    return t.float() if t is not None and t.dtype in LOW_PRECISION else t


# ---------------------------------------------------------------- SGD

def sgd_scalars(*, lr: float, momentum: float, weight_decay: float, device=None) -> torch.Tensor:
    """SGD's numbers of one step: a float64 tensor ``(4,)`` holding ``-lr``, ``1 - momentum``, ``momentum``,
    ``weight_decay`` (Python floats in, each rounded once into the parameter's dtype in the kernel, as a
    Python scalar is when the eager step passes it to a kernel)."""
    return torch.tensor([-lr, 1 - momentum, momentum, weight_decay], dtype=_F64, device=device)


def sgd_elementwise(params: list[torch.Tensor], grads: list[torch.Tensor],
                    momentum_buffers: list[torch.Tensor | None], scalars: torch.Tensor, *, momentum: bool,
                    nesterov: bool, maximize: bool) -> None:
    """The lines of :func:`optbook.optim.functional.sgd`, in place; ``scalars`` from :func:`sgd_scalars`::

        g <- -g (maximize);  g <- g + weight_decay * p;  m <- lerp(m, g, 1 - momentum)
        d = lerp(g, m, momentum) if nesterov else m;  p <- p - lr * d

    Args:
        params, grads, momentum_buffers: lists of equal-shape tensors, one per parameter (buffers ``None``
            when ``momentum`` is False); parameters and buffers are updated in place.
        scalars: float64 ``(4,)`` on the parameters' device.
        momentum, nesterov, maximize: Python bools (constants of the graph).
    """
    for i, (p, g) in enumerate(zip(params, grads)):
        w, g = _work(p), _work(g)
        neg_lr, one_minus_momentum, mu, weight_decay = (scalars[k].to(w.dtype) for k in range(4))
        if maximize:
            g = -g
        g = g + weight_decay * w
        d = g
        if momentum:
            m = momentum_buffers[i]
            m_new = torch.lerp(_work(m), g, one_minus_momentum)
            d = torch.lerp(g, m_new, mu) if nesterov else m_new
            m.copy_(m_new)
        p.copy_(w + neg_lr * d)


# ---------------------------------------------------------------- Lion

def lion_scalars(*, lr: float, beta1: float, beta2: float, weight_decay: float, device=None) -> torch.Tensor:
    """Lion's numbers of one step: a float64 tensor ``(4,)`` holding ``1 - beta1``, ``1 - lr *
    weight_decay``, ``lr``, ``1 - beta2``, formed as :func:`optbook.optim.functional.lion` forms them."""
    return torch.tensor([1 - beta1, 1 - lr * weight_decay, lr, 1 - beta2], dtype=_F64, device=device)


def lion_elementwise(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     scalars: torch.Tensor) -> None:
    """The lines of :func:`optbook.optim.functional.lion`, in place; ``scalars`` from :func:`lion_scalars`::

        c = lerp(m, g, 1 - beta1);  p <- p * (1 - lr * weight_decay) - lr * sign(c);  m <- lerp(m, g, 1 - beta2)

    Args:
        params, grads, exp_avgs: lists of equal-shape tensors, one per parameter; ``params`` and
            ``exp_avgs`` updated in place.
        scalars: float64 ``(4,)`` on the parameters' device.
    """
    for p, g, m in zip(params, grads, exp_avgs):
        w, g, m_w = _work(p), _work(g), _work(m)
        one_minus_beta1, decay, lr, one_minus_beta2 = (scalars[k].to(w.dtype) for k in range(4))
        direction = torch.sign(torch.lerp(m_w, g, one_minus_beta1))
        p.copy_(w * decay - lr * direction)
        m.copy_(torch.lerp(m_w, g, one_minus_beta2))


# ---------------------------------------------------------------- Adafactor

def adafactor_scalars(steps: list[int], dtypes: list[torch.dtype], *, lr: float, beta2_decay: float,
                      eps1: float | None, eps2: float, d: float, weight_decay: float, device=None) -> torch.Tensor:
    """Adafactor's numbers of one step, per parameter, as :func:`optbook.optim.functional.adafactor` forms them.

    Args:
        steps: each parameter's step count ``t >= 1`` after counting this step.
        dtypes: each parameter's dtype (``eps1=None`` means its machine epsilon).
        lr, beta2_decay, eps1, eps2, d, weight_decay: as in :class:`~optbook.optim.Adafactor`.

    Returns:
        float64 ``(7, n)``: rows ``1 - beta2_t = t ** beta2_decay``, the relative step's cap ``min(lr,
        1/sqrt(t))``, ``1 - lr * weight_decay``, ``eps1``, ``eps1 ** 2``, ``eps2``, ``d``.
    """
    rows = []
    for t, dtype in zip(steps, dtypes):
        e1 = torch.finfo(dtype).eps if eps1 is None else eps1
        rows.append([t ** beta2_decay, min(lr, t ** -0.5), 1 - lr * weight_decay, e1, e1 * e1, eps2, d])
    return torch.tensor(rows, dtype=_F64, device=device).reshape(-1, 7).T


def parameter_norms(params: list[torch.Tensor]) -> torch.Tensor:
    """Each parameter's 2-norm, eagerly (one ``torch._foreach_norm`` per kind), as float64 ``(n,)``: taken in
    float32 for a float16/bfloat16 parameter and in the parameter's dtype otherwise, as the eager Adafactor
    takes ``p.norm()`` of its working copy."""
    low = [i for i, p in enumerate(params) if p.dtype in LOW_PRECISION]
    rest = [i for i, p in enumerate(params) if p.dtype not in LOW_PRECISION]
    norms: list = [None] * len(params)
    for indices, dtype in ((low, torch.float32), (rest, None)):
        if indices:
            for i, n in zip(indices, torch._foreach_norm([params[i] for i in indices], 2, dtype=dtype)):
                norms[i] = n.to(_F64)
    return torch.stack(norms)


def adafactor_elementwise(params: list[torch.Tensor], grads: list[torch.Tensor],
                          row_vars: list[torch.Tensor | None], col_vars: list[torch.Tensor | None],
                          variances: list[torch.Tensor | None], scalars: torch.Tensor, param_norms: torch.Tensor, *,
                          maximize: bool) -> None:
    """The lines of :func:`optbook.optim.functional.adafactor`, in place; ``scalars`` from
    :func:`adafactor_scalars`. Not only element-wise: the row and column means of ``G*G`` and the RMS of the
    update (for the clipping) are reductions inside the graph, so nothing leaves it to become a Python float
    (the eager twin synchronises twice per parameter); the parameters' norms (before the decay) come in as
    ``param_norms`` (:func:`parameter_norms`, eager; inside the graph, a reduction reading
    the parameter that the graph then overwrites kept Inductor from fusing the update into one loop)::

        alpha = max(eps2, RMS(p)) * min(lr, 1/sqrt(t));  p <- p * (1 - lr * weight_decay)
        r <- lerp(r, mean_cols(G*G), 1 - beta2_t);  c <- lerp(c, mean_rows(G*G), 1 - beta2_t)   (factored)
        V = r c / max(mean(r), eps1)  (factored)  or  v <- lerp(v, G*G, 1 - beta2_t); V = v
        U = G / sqrt(max(V, eps1**2));  p <- p - alpha / max(1, RMS(U) / d) * U

    ``alpha`` and the clipping factor are formed in float64 from the float32 norms, as the eager twin forms
    them from Python floats; ``RMS(U)`` is summed as ``g*g / max(V, eps1**2)`` (the same number to rounding)
    so that ``U`` is never stored. Passes over memory: ``p`` (its norm), ``G`` twice (row and column
    statistics), ``G`` (``RMS(U)``), ``G`` and ``p`` (the update, ``p`` written).

    Args:
        params, grads: lists of equal-shape tensors, one per parameter.
        row_vars, col_vars, variances: as in :func:`optbook.optim.functional.adafactor` (float32 for a
            float16/bfloat16 parameter), updated in place.
        scalars: float64 ``(7, n)`` on the parameters' device.
        param_norms: float64 ``(n,)`` from :func:`parameter_norms`, taken before this step.
        maximize: a Python bool (a constant of the graph).
    """
    for i, (p, g, r, c, v) in enumerate(zip(params, grads, row_vars, col_vars, variances)):
        w = _work(p)
        g = g.to(w.dtype)
        if maximize:
            g = -g
        one_minus_beta2, cap, decay, e1, e1_squared, eps2, d = (scalars[k, i] for k in range(7))
        one_minus_beta2, decay, e1, e1_squared = (x.to(w.dtype) for x in (one_minus_beta2, decay, e1, e1_squared))
        root_numel = math.sqrt(w.numel())
        alpha = torch.clamp_min(param_norms[i] / root_numel, eps2) * cap
        w = w * decay
        if v is None:   # factored over the last two dimensions
            square = g * g
            r_new = torch.lerp(r, square.mean(dim=-1, keepdim=True), one_minus_beta2)
            c_new = torch.lerp(c, square.mean(dim=-2, keepdim=True), one_minus_beta2)
            denominator = torch.clamp_min(r_new.mean(dim=-2, keepdim=True), e1)
            V = r_new * c_new / denominator
            V_again = r_new * (c_new / denominator)
            r.copy_(r_new)
            c.copy_(c_new)
        else:
            V = V_again = torch.lerp(v, g * g, one_minus_beta2)
            v.copy_(V)
        U = torch.rsqrt(torch.clamp_min(V, e1_squared)) * g
        # ||U||^2 as sum(g*g / max(V, eps1**2)), written apart from U so that the compiler computes it from g
        # in its own pass instead of storing U (a tensor of the parameter's size) for the update to read back
        u_norm = torch.sqrt((g * g / torch.clamp_min(V_again, e1_squared)).sum())
        clip = torch.clamp_min(u_norm.to(_F64) / (root_numel * d), 1.0)
        p.copy_(w - (alpha / clip).to(w.dtype) * U)


# ---------------------------------------------------------------- Schedule-Free AdamW

def schedule_free_scalars(steps: list[int], lrs: list[float], ckps: list[float], *, beta1: float, beta2: float,
                          eps: float, weight_decay: float, device=None) -> torch.Tensor:
    """Schedule-Free AdamW's numbers of one step, per parameter, as
    :func:`optbook.optim.functional.schedule_free_adamw` forms them.

    Args:
        steps, lrs, ckps: each parameter's step count ``t``, ``lr_t`` (warmup applied) and averaging weight
            ``c`` (:func:`optbook.optim.schedule_free.schedule_free_weight`, computed eagerly by the optimizer).
        beta1, beta2, eps, weight_decay: as in :class:`~optbook.optim.ScheduleFreeAdamW`.

    Returns:
        float64 ``(8, n)``: rows ``beta2``, ``1 - beta2``, ``1 - beta2**t``, ``eps``, ``weight_decay``, ``c``,
        ``lr_t * (beta1 * (1 - c) - 1)`` (the step of ``y``) and ``lr_t``.
    """
    rows = [[beta2, 1 - beta2, 1 - beta2 ** t, eps, weight_decay, c, lr * (beta1 * (1 - c) - 1), lr]
            for t, lr, c in zip(steps, lrs, ckps)]
    return torch.tensor(rows, dtype=_F64, device=device).reshape(-1, 8).T


def schedule_free_elementwise(params: list[torch.Tensor], grads: list[torch.Tensor], zs: list[torch.Tensor],
                              exp_avg_sqs: list[torch.Tensor], scalars: torch.Tensor) -> None:
    """The lines of :func:`optbook.optim.functional.schedule_free_adamw`, in place, on parameters holding
    ``y``; ``scalars`` from :func:`schedule_free_scalars`::

        v <- beta2 v + (1 - beta2) g*g;  u = g / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * y
        y <- lerp(y, z, c) + lr_t (beta1 (1 - c) - 1) u;  z <- z - lr_t u

    Args:
        params, grads, zs, exp_avg_sqs: lists of equal-shape tensors, one per parameter; ``params``, ``zs``
            and ``exp_avg_sqs`` updated in place.
        scalars: float64 ``(8, n)`` on the parameters' device.
    """
    for i, (y, g, z, v) in enumerate(zip(params, grads, zs, exp_avg_sqs)):
        y_w, g, z_w, v_w = _work(y), _work(g), _work(z), _work(v)
        beta2, one_minus_beta2, bias2, eps, weight_decay, c, y_step, lr = (scalars[k, i].to(y_w.dtype)
                                                                          for k in range(8))
        v_new = v_w * beta2 + one_minus_beta2 * g * g
        u = g / (torch.sqrt(v_new / bias2) + eps) + weight_decay * y_w
        y.copy_(torch.lerp(y_w, z_w, c) + y_step * u)
        z.copy_(z_w - lr * u)
        v.copy_(v_new)
