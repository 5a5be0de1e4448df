"""SOAP: Adam in Shampoo's eigenbasis. Explained in chapter 4.

Source: Vyas et al. (2024), "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321,
Algorithm 1 (one-sided variants and merged dimensions are left out).

For a matrix parameter ``W`` ``(m, n)`` with gradient ``G``::

    L <- lerp(L, G G^T, 1 - shampoo_beta);  R <- lerp(R, G^T G, 1 - shampoo_beta)
    every precondition_frequency steps: Q_L, Q_R <- eigenvectors of L, R
    G' = Q_L^T G Q_R                                   (rotate into the eigenbasis)
    m  <- lerp(m, G, 1 - beta1)                         (kept in the original basis)
    v  <- lerp(v, G'*G', 1 - beta2)                     (kept in the rotated basis)
    N' = (Q_L^T m Q_R / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
    W  <- W * (1 - lr * weight_decay) - lr * Q_L N' Q_R^T

Every basis orders its eigenvectors by decreasing eigenvalue. When the basis is refreshed, each
second-moment slot of ``v`` follows its eigenvector, as in the authors' reference implementation
(github.com/nikhilvyas/SOAP, ``get_orthogonal_matrix_QR``): the old eigenvectors are ranked by their
eigenvalue estimates under the new statistics, ``diag(Q_L^T L Q_L)`` (likewise for ``R``), the rows
(columns) of ``v`` are permuted into that order, and the new basis takes the eigenvectors of ``L``
(``R``) in decreasing order. (The reference then refines the old basis by one power-iteration step
and a QR decomposition; we take the exact ``eigh`` basis, in float64.) Keeping ``v`` in place instead
is a pitfall: ``eigh`` ranks by the new eigenvalues, so when two directions swap rank each slot's
second moment ends up attached to the other direction. The very first step computes the basis from
the first gradient before using it.

The first step. With ``G = U S V^T`` the first basis is ``Q_L = U``, ``Q_R = V`` (completed), so in exact
arithmetic ``G' = Q_L^T G Q_R`` is diagonal, ``m_hat = G'``, ``v_hat = G'^2`` and ``N = G' / (|G'| + eps)``:
the first step is ``lr * U V^T`` on the singular values well above ``eps``. In floating point the entries
of ``G'`` that should be zero hold a rounding residue of about ``u ||G||`` (``u`` the unit roundoff); where
it is below ``eps`` (float64, ordinary gradients) the first step is ``lr U V^T`` to rounding, where it is
above (float32: ``u ||G|| ~ 1e-7 ||G||`` against ``eps = 1e-8``) such an entry gets ``N = +-1``, and the
step is not ``U V^T``. It stays bounded, ``|N| <= 1`` entrywise and ``||dW||_F <= lr sqrt(mn)``, only if
``m_hat`` and ``v_hat`` come from the *same* rotated numbers: rotating the updated ``m`` and the gradient
separately (two roundings) leaves a numerator residue over a denominator that may be exactly ``eps``, and
in float32 the first step reached 2.2 ``lr sqrt(mn)`` for gradient entries near 1 and 126 for entries
near 1e4 (16 x 24, ten seeds). We rotate the gradient once and form the rotated first moment as
``lerp(Q_L^T m Q_R, G', 1 - beta1)`` (the same number by linearity, with as many products), so that the
bound holds in every dtype (measured after the change: at most 0.84 and 1.00 ``lr sqrt(mn)`` in float32,
0.20 in float64). The references avoid the problem otherwise: nikhilvyas/SOAP (commit
a1e553530fde97d0e6b307d7c82ac6d38b072340, ``soap.py``) skips the first step ("so that we never use the
current gradients in the projection"), and NVIDIA-NeMo/Emerging-Optimizers (commit
fd7729267109a8848709e9406bf19e53e970c3f4, ``emerging_optimizers/legacy_soap/soap.py``; its PR #68 stopped
skipping the first step) feeds both moments from one projected gradient ``project_in(grad)``.
"""

from __future__ import annotations

import torch

from .._checks import (MATRIX_HINT, check_betas, check_eps, check_lr, check_number, check_precondition_frequency,
                          check_weight_decay)
from ._functional import in_float32, write_back
from .optimizer import BookOptimizer, check_statistics_range

__all__ = ["SOAP", "eigenbasis", "slot_order", "soap"]


def eigenbasis(S: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The eigenvectors of the symmetric ``(k, k)`` matrix ``S`` as columns, by decreasing eigenvalue.

    Computed by ``torch.linalg.eigh`` in float64 (which returns them increasing), returned in ``dtype``.
    """
    return torch.linalg.eigh(S.double())[1].flip(-1).to(dtype)


def slot_order(Q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """The old basis ``Q`` ``(k, k)`` ranked by its eigenvalue estimates under new statistics ``S``.

    Returns the ``(k,)`` int64 index that sorts ``diag(Q^T S Q)`` decreasingly (float64); slot ``j`` of the
    refreshed basis then holds the old column ``index[j]``, as in the SOAP reference implementation.
    """
    Q64 = Q.double()
    return torch.argsort((Q64 * (S.double() @ Q64)).sum(dim=0), descending=True, stable=True)


@torch.no_grad()
def soap(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
         exp_avg_sqs: list[torch.Tensor], Ls: list[torch.Tensor], Rs: list[torch.Tensor],
         Q_Ls: list[torch.Tensor | None], Q_Rs: list[torch.Tensor | None], steps: list[int], *, lr: float,
         beta1: float, beta2: float, shampoo_beta: float, eps: float, precondition_frequency: int,
         weight_decay: float) -> None:
    """Apply one SOAP step in place (the pure function behind :class:`SOAP`).

    Args:
        params, grads, exp_avgs, exp_avg_sqs: lists of ``(m, n)`` tensors, one entry per parameter;
            ``exp_avgs`` (original basis) and ``exp_avg_sqs`` (rotated basis) are updated in place.
        Ls, Rs: the statistics ``(m, m)`` and ``(n, n)``, updated in place (set to the first
            gradient's ``G G^T``, ``G^T G`` at step 1).
        Q_Ls, Q_Rs: the eigenbases in use (``None`` before the first step); at steps ``1, 1 + f, ...``
            (``f = precondition_frequency``) the entry is *replaced in the list* by a fresh basis, and
            the rows and columns of ``exp_avg_sqs`` are permuted so each slot follows its eigenvector.
        steps: the step number ``t >= 1`` of each parameter, *after* counting this step.
        lr, beta1, beta2, shampoo_beta, eps, precondition_frequency, weight_decay: as in :class:`SOAP`.
    """
    for i, (p0, G, m0, v0, L, R, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, Ls, Rs, steps)):
        p, m, v = in_float32([p0, m0, v0])  # float32 work for float16/bfloat16, rounded back once
        G = G.to(L.dtype)
        if t == 1:
            L.copy_(G @ G.mT)
            R.copy_(G.mT @ G)
        else:
            L.lerp_(G @ G.mT, 1 - shampoo_beta)
            R.lerp_(G.mT @ G, 1 - shampoo_beta)
        if Q_Ls[i] is None:
            Q_Ls[i], Q_Rs[i] = eigenbasis(L, L.dtype), eigenbasis(R, R.dtype)
        elif (t - 1) % precondition_frequency == 0:  # each slot of v follows its eigenvector
            v.copy_(v[slot_order(Q_Ls[i], L)][:, slot_order(Q_Rs[i], R)])
            Q_Ls[i], Q_Rs[i] = eigenbasis(L, L.dtype), eigenbasis(R, R.dtype)
        QL, QR = Q_Ls[i], Q_Rs[i]
        # one rotated gradient for both moments: the rotated m is lerp(Q_L^T m Q_R, G', 1 - beta1) (linearity),
        # so at t = 1 m_hat and v_hat come from the same G' and |N| <= 1 entrywise in every dtype
        G_rot = QL.mT @ G @ QR
        m_rot = (QL.mT @ m.to(QL.dtype) @ QR).lerp_(G_rot, 1 - beta1)
        m.lerp_(G, 1 - beta1)
        v.lerp_(G_rot.square(), 1 - beta2)
        m_hat = m_rot.div_(1 - beta1 ** t)
        N = m_hat / (v.div(1 - beta2 ** t).sqrt_().add_(eps))
        p.mul_(1 - lr * weight_decay).sub_(QL @ N @ QR.mT, alpha=lr)
        write_back([p0, m0, v0], [p, m, v])


class SOAP(BookOptimizer):
    """SOAP for 2-D parameters (pair it with AdamW for the rest).

    Args:
        params: 2-D real floating-point tensors or param-group dicts.
        lr: learning rate ``>= 0``.
        betas: Adam's ``(beta1, beta2)`` in ``[0, 1)``.
        shampoo_beta: EMA coefficient of ``L`` and ``R`` in ``[0, 1)``.
        eps: Adam's ``eps`` ``> 0`` (outside the root).
        precondition_frequency: refresh the eigenbasis every this many steps (``>= 1``).
        weight_decay: decoupled decay ``>= 0`` multiplied by ``lr``.

    State per parameter: ``step``, ``exp_avg`` ``(m, n)``, ``exp_avg_sq`` ``(m, n)`` (the parameter's
    dtype), ``L``, ``Q_L`` ``(m, m)``, ``R``, ``Q_R`` ``(n, n)`` (float32 for a float16/bfloat16 parameter,
    else its dtype). For a float16/bfloat16 parameter the step is computed in float32 and ``p``, ``m``,
    ``v`` are rounded back once.

    Raises:
        ValueError: a parameter that is not 2-D (names its shape), bad hyperparameters, a
            non-finite gradient, or a finite one so large that ``L``, ``R`` or ``exp_avg_sq`` would
            overflow their dtype (before anything changes).
        TypeError: as for every optimizer of :mod:`optbook.optim`.
    """

    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "betas", "shampoo_beta", "eps", "weight_decay")
    state_scalars = {"step": "count"}

    def _check_state_entry(self, state: dict, where: str) -> None:
        if ("Q_L" in state) != ("Q_R" in state):  # the bases are computed together, at the same steps
            raise ValueError(f"Invalid state_dict: {where} has only one of 'Q_L' and 'Q_R'; SOAP keeps both or neither")

    matrix_hint = MATRIX_HINT

    def __init__(self, params, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95),
                 shampoo_beta: float = 0.95, eps: float = 1e-8, precondition_frequency: int = 10,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps,
                                      precondition_frequency=precondition_frequency, weight_decay=weight_decay))

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_number("shampoo_beta", group["shampoo_beta"], low=0.0, high=1.0, high_open=True)
        check_eps(group["eps"])
        check_precondition_frequency(group["precondition_frequency"])
        check_weight_decay(group["weight_decay"])

    def _check_gradients(self, group: dict, named: list) -> None:
        # L, R and the rotated second moment are overwritten or averaged (lerp) with terms <= ||G||_F^2
        check_statistics_range("SOAP", named, [torch.zeros((), dtype=torch.float64)] * len(named))

    def _expected_state(self, p, group):
        (m, n), work = p.shape, torch.promote_types(p.dtype, torch.float32)
        return {"exp_avg": ((m, n), p.dtype, True), "exp_avg_sq": ((m, n), p.dtype, True), "L": ((m, m), work, True),
                "R": ((n, n), work, True), "Q_L": ((m, m), work, False), "Q_R": ((n, n), work, False)}

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:   # one dict.update: an interrupt (Ctrl-C) cannot leave half a state behind
                m, n = p.shape
                work = torch.promote_types(p.dtype, torch.float32)  # statistics never in float16/bfloat16
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                             L=p.new_zeros(m, m, dtype=work),  # set to G G^T by the first step
                             R=p.new_zeros(n, n, dtype=work))
            state["step"] += 1
        states = [self.state[p] for p in params]
        Q_Ls, Q_Rs = [s.get("Q_L") for s in states], [s.get("Q_R") for s in states]
        beta1, beta2 = group["betas"]
        soap(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
             [s["L"] for s in states], [s["R"] for s in states], Q_Ls, Q_Rs, [s["step"] for s in states],
             lr=group["lr"], beta1=beta1, beta2=beta2, shampoo_beta=group["shampoo_beta"], eps=group["eps"],
             precondition_frequency=group["precondition_frequency"], weight_decay=group["weight_decay"])
        for s, Q_L, Q_R in zip(states, Q_Ls, Q_Rs):
            s["Q_L"], s["Q_R"] = Q_L, Q_R
