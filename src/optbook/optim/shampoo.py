"""Shampoo: left and right Kronecker-factored preconditioners. Explained in chapter 4.

Source: Gupta, Koren & Singer (2018), "Shampoo: Preconditioned Stochastic Tensor Optimization",
arXiv:1802.09568, Algorithm 1 (order 2); without accumulation Shampoo's update is ``U V^T`` (Bernstein & Newhouse
2024, "Old Optimizer, New Norm", arXiv:2409.20325): the bridge to Muon.

For a matrix parameter ``W`` ``(m, n)`` with gradient ``G``::

    L <- beta2 * L + G G^T        (m, m), starts at eps * I
    R <- beta2 * R + G^T G        (n, n), starts at eps * I
    W <- W - lr * L^(-1/4) G R^(-1/4)

``beta2 = 1`` is the paper's running sum; ``beta2 = 0`` keeps no history, and then, with
``G = U S V^T`` and ``eps -> 0``, ``L^(-1/4) G R^(-1/4) = U S^(-1/2) U^T U S V^T V S^(-1/2) V^T = U V^T``.
Inverse fourth roots come from a float64 eigendecomposition, refreshed every
``precondition_frequency`` steps.

Safeguards (off the paper's Algorithm 1, as reference implementations have them). Before its statistics
have seen several gradients, ``L`` is ``eps * I`` plus a few rank-one terms, and a gradient with a
component outside their span is multiplied by up to ``eps^(-1/2)`` (1e6 at ``eps = 1e-12``); with a stale
root (``precondition_frequency > 1``) every later step can do that. Three safeguards:

- ``start_preconditioning_step``: before it the step is the gradient itself (or the grafted direction), and
  the first roots are computed at it; default ``precondition_frequency``. facebookresearch/optimizers,
  Distributed Shampoo, commit f60660661194de26d3ee78bae6d15820ff8e583d,
  ``distributed_shampoo/distributed_shampoo.py`` (``start_preconditioning_step``: ``-1`` means
  ``precondition_frequency``; before it the grafting method's direction; roots at it and every
  ``precondition_frequency`` steps after).
- ``grafting``: Shampoo's direction takes the Frobenius norm of a simpler method's (per matrix):
  ``"sgd"`` (``G``) or ``"adagrad"`` (``G / (sqrt(A) + 1e-10)``, ``A <- beta2 A + G * G``), so that only
  the direction comes from the Kronecker factors (the same file: ``P <- ||P_graft|| / ||P_shampoo|| *
  P_shampoo``; its AdaGrad grafting's default epsilon is 1e-10, ``shampoo_types.py``).
- ``relative_eps``: the roots are those of ``L + relative_eps * lambda_max(L) * I`` (and the same for
  ``R``), a ridge relative to the statistics, which bounds the amplification of any direction to
  ``relative_eps^(-1/4)`` times that of the largest eigenvector: google-research/google-research, commit
  e19012986e44d086bd033cd9ac5c8f95596226f2, ``scalable_shampoo/optax/distributed_shampoo.py``
  (``matrix_inverse_pth_root``: ``ridge_epsilon * max(lambda_max, 1e-6)``, ``ridge_epsilon=1e-6``).

The defaults keep the plain algorithm at ``precondition_frequency=1`` (the bridge to Muon above holds
bitwise); with a larger frequency the start step changes the first ``precondition_frequency - 1`` steps.

For a float16/bfloat16 parameter the statistics, roots and momentum
are kept in float32 and the update is computed in float32 and rounded into the parameter once (in
bfloat16, ``L`` drifts by percents from its float64 value within a few hundred steps).
"""

from __future__ import annotations

import torch

from .._checks import (MATRIX_HINT, check_int, check_lr, check_number, check_precondition_frequency,
                       check_weight_decay)
from ._functional import LOW_PRECISION
from .optimizer import BookOptimizer, check_statistics_range

__all__ = ["GRAFTINGS", "Shampoo", "inverse_root", "shampoo"]

#: Shampoo's grafting options: ``None`` (none), ``"sgd"`` (the gradient's norm), ``"adagrad"`` (AdaGrad's).
GRAFTINGS = (None, "sgd", "adagrad")
#: The epsilon of AdaGrad grafting (Distributed Shampoo's ``AdaGradPreconditionerConfig`` default).
GRAFTING_EPS = 1e-10


def inverse_root(A: torch.Tensor, p: int = 4, relative_eps: float = 0.0) -> torch.Tensor:
    """``(A + relative_eps * lambda_max(A) * I)^(-1/p)`` of a symmetric positive-definite matrix via ``eigh``
    in float64; A's dtype back.

    Eigenvalues are clamped at the largest times ``1e-12`` (rounding can make them slightly negative).
    """
    lam, Q = torch.linalg.eigh(A.double())
    if relative_eps:
        lam = lam + relative_eps * float(lam.max().clamp(min=0))
    lam = lam.clamp(min=float(lam.max()) * 1e-12 if float(lam.max()) > 0 else 1e-300)
    return ((Q * lam.pow(-1.0 / p)) @ Q.mT).to(A.dtype)


@torch.no_grad()
def shampoo(params: list[torch.Tensor], grads: list[torch.Tensor], Ls: list[torch.Tensor], Rs: list[torch.Tensor],
            L_inv_roots: list[torch.Tensor | None], R_inv_roots: list[torch.Tensor | None],
            momentum_buffers: list[torch.Tensor | None], steps: list[int], *, lr: float, beta2: float, eps: float,
            momentum: float, precondition_frequency: int, weight_decay: float,
            start_preconditioning_step: int | None = None, grafting: str | None = None,
            relative_eps: float = 0.0, grafting_sums: list[torch.Tensor | None] | None = None) -> None:
    """Apply one Shampoo step in place (the pure function behind :class:`Shampoo`).

    Args:
        params, grads: lists of ``(m, n)`` tensors, one entry per parameter.
        Ls, Rs: the statistics ``(m, m)`` and ``(n, n)``, updated in place.
        L_inv_roots, R_inv_roots: the inverse fourth roots in use; at steps ``1, 1 + f, 1 + 2f, ...``
            (``f = precondition_frequency``) the entry is *replaced in the list* by a fresh root.
        momentum_buffers: one ``(m, n)`` EMA per parameter when ``momentum > 0`` (else ignored).
        steps: the step number ``t >= 1`` of each parameter, *after* counting this step.
        lr, beta2, eps, momentum, precondition_frequency, weight_decay, start_preconditioning_step, grafting,
            relative_eps: as in :class:`Shampoo` (``start_preconditioning_step=None``: ``precondition_frequency``).
        grafting_sums: with ``grafting="adagrad"``, one ``(m, n)`` accumulator per parameter, updated in place.

    Before ``start_preconditioning_step`` the roots are not computed and the update is ``G`` (or the grafted
    direction); at it and every ``precondition_frequency`` steps after, fresh roots.
    """
    start = precondition_frequency if start_preconditioning_step is None else start_preconditioning_step
    for i, (p, G, L, R, t) in enumerate(zip(params, grads, Ls, Rs, steps)):
        W = p.float() if p.dtype in LOW_PRECISION else p  # float32 work for float16/bfloat16
        G = G.to(L.dtype)
        if beta2 == 0.0:  # no history: eps * I + G G^T
            L.copy_(torch.eye(L.shape[0], dtype=L.dtype, device=L.device).mul_(eps)).add_(G @ G.mT)
            R.copy_(torch.eye(R.shape[0], dtype=R.dtype, device=R.device).mul_(eps)).add_(G.mT @ G)
        else:
            L.mul_(beta2).add_(G @ G.mT)
            R.mul_(beta2).add_(G.mT @ G)
        if t >= start and (t - start) % precondition_frequency == 0:
            L_inv_roots[i], R_inv_roots[i] = inverse_root(L, relative_eps=relative_eps), \
                inverse_root(R, relative_eps=relative_eps)
        if grafting == "adagrad":
            A = grafting_sums[i]
            A.mul_(beta2).addcmul_(G, G)
            graft = G / (A.sqrt() + GRAFTING_EPS)
        else:
            graft = G
        if t < start or L_inv_roots[i] is None:
            update = graft
        else:
            update = L_inv_roots[i] @ G @ R_inv_roots[i]
            if grafting is not None:
                update = update * (torch.linalg.vector_norm(graft) / (torch.linalg.vector_norm(update) + 1e-16))
        if momentum:
            update = momentum_buffers[i].lerp_(update, 1 - momentum)
        W.mul_(1 - lr * weight_decay).sub_(update, alpha=lr)
        if W is not p:
            p.copy_(W)


class Shampoo(BookOptimizer):
    """Shampoo for 2-D parameters (pair it with AdamW for the rest, as with Muon).

    Args:
        params: 2-D real floating-point tensors or param-group dicts.
        lr: learning rate ``>= 0``.
        beta2: preconditioner accumulation in ``[0, 1]``: 1 sums (paper), 0 keeps no history.
        eps: initial diagonal ``eps * I`` of ``L`` and ``R`` (and the ridge without history), ``> 0``.
        momentum: EMA momentum on the preconditioned update, in ``[0, 1)``; a group may switch it
            on mid-run (the buffer then starts at zero).
        precondition_frequency: recompute the inverse roots every this many steps (``>= 1``).
        weight_decay: decoupled decay ``>= 0`` multiplied by ``lr``.
        start_preconditioning_step: an int ``>= 1`` or ``None`` (default: ``precondition_frequency``): the
            first step that is preconditioned; before it the step is the gradient (or the grafted direction).
        grafting: ``None`` (default), ``"sgd"`` or ``"adagrad"``: give Shampoo's direction the norm of this
            simpler method's update, per matrix (module docstring).
        relative_eps: ``>= 0`` (default 0): the roots are those of ``L + relative_eps * lambda_max(L) * I``
            (and of ``R``'s like); 1e-6 is the google-research reference's default.

    State per parameter: ``step``, ``L`` ``(m, m)``, ``R`` ``(n, n)``, their inverse roots (from the start
    step on), a ``grafting_sum`` ``(m, n)`` with ``grafting="adagrad"``, and a ``momentum_buffer`` when
    ``momentum > 0``; all in float32 for a float16/bfloat16 parameter, else in
    its dtype.

    Raises:
        ValueError: a parameter that is not 2-D (names its shape), bad hyperparameters, a
            non-finite gradient, or a finite one so large that ``L`` or ``R`` would overflow their dtype
            (before anything changes).
        TypeError: as for every optimizer of :mod:`optbook.optim`.
    """

    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "beta2", "eps", "momentum", "weight_decay")
    state_scalars = {"step": "count"}

    matrix_hint = MATRIX_HINT

    def __init__(self, params, lr: float = 1e-3, beta2: float = 1.0, eps: float = 1e-12, momentum: float = 0.0,
                 precondition_frequency: int = 1, weight_decay: float = 0.0, *,
                 start_preconditioning_step: int | None = None, grafting: str | None = None,
                 relative_eps: float = 0.0):
        super().__init__(params, dict(lr=lr, beta2=beta2, eps=eps, momentum=momentum,
                                      precondition_frequency=precondition_frequency, weight_decay=weight_decay,
                                      start_preconditioning_step=start_preconditioning_step, grafting=grafting,
                                      relative_eps=relative_eps))

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        check_number("beta2", group["beta2"], low=0.0, high=1.0)
        check_number("eps", group["eps"], low=0.0, low_open=True)
        check_number("momentum", group["momentum"], low=0.0, high=1.0, high_open=True)
        check_precondition_frequency(group["precondition_frequency"])
        check_weight_decay(group["weight_decay"])
        for key, default in (("start_preconditioning_step", 1), ("grafting", None), ("relative_eps", 0.0)):
            group.setdefault(key, default)   # a group saved before these options existed: the plain algorithm
        if group["start_preconditioning_step"] is not None:
            check_int("start_preconditioning_step", group["start_preconditioning_step"], 1)
        if group["grafting"] not in GRAFTINGS:
            raise ValueError(f"Invalid grafting: expected one of {GRAFTINGS}, got {group['grafting']!r}")
        check_number("relative_eps", group["relative_eps"], low=0.0)

    def _check_gradients(self, group: dict, named: list) -> None:
        # L <- beta2 L + G G^T (or eps I + G G^T): at most max(|L|, |R|, eps) + ||G||_F^2 with beta2 <= 1
        eps = torch.tensor(float(group["eps"]), dtype=torch.float64)
        carried = []
        for _, p in named:
            state = self.state.get(p, {})
            held = [state[k].abs().max().double().cpu() for k in ("L", "R") if k in state]
            carried.append(torch.stack([eps, *held]).max())
        check_statistics_range("Shampoo", named, carried)

    def _expected_state(self, p, group):
        (m, n), work = p.shape, torch.promote_types(p.dtype, torch.float32)
        return {"L": ((m, m), work, True), "R": ((n, n), work, True), "L_inv_root": ((m, m), work, False),
                "R_inv_root": ((n, n), work, False), "momentum_buffer": ((m, n), work, False),
                "grafting_sum": ((m, n), work, False)}

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            work = torch.promote_types(p.dtype, torch.float32)  # statistics never in float16/bfloat16
            if not state:   # one dict.update: an interrupt (Ctrl-C) cannot leave half a state behind
                m, n = p.shape
                state.update(step=0, L=group["eps"] * torch.eye(m, dtype=work, device=p.device),
                             R=group["eps"] * torch.eye(n, dtype=work, device=p.device))
            if group["momentum"] and "momentum_buffer" not in state:  # also when switched on mid-run
                state["momentum_buffer"] = torch.zeros_like(p, dtype=work)
            if group.get("grafting") == "adagrad" and "grafting_sum" not in state:
                state["grafting_sum"] = torch.zeros_like(p, dtype=work)
            state["step"] += 1
        states = [self.state[p] for p in params]
        L_inv_roots, R_inv_roots = [s.get("L_inv_root") for s in states], [s.get("R_inv_root") for s in states]
        shampoo(params, [p.grad for p in params], [s["L"] for s in states], [s["R"] for s in states],
                L_inv_roots, R_inv_roots, [s.get("momentum_buffer") for s in states], [s["step"] for s in states],
                lr=group["lr"], beta2=group["beta2"], eps=group["eps"], momentum=group["momentum"],
                precondition_frequency=group["precondition_frequency"], weight_decay=group["weight_decay"],
                start_preconditioning_step=group.get("start_preconditioning_step", 1),
                grafting=group.get("grafting"), relative_eps=group.get("relative_eps", 0.0),
                grafting_sums=[s.get("grafting_sum") for s in states])
        for s, L_inv_root, R_inv_root in zip(states, L_inv_roots, R_inv_roots):
            s["L_inv_root"], s["R_inv_root"] = L_inv_root, R_inv_root
