"""Dion: orthonormal updates from a low-rank power iteration with error feedback. Explained in chapter 18.

Source: Ahn, Xu, Abreu, Langford et al. (2025), "Dion: Distributed Orthonormalized Updates",
arXiv:2504.05295, Algorithm 1 (the single-device, unsharded form); the reference code microsoft/dion
commit 6e2c58d477722c47472fd9de54b9889d1d5ffb6d ``dion/dion_simple.py`` (``dion_update``: ``M += G``, ``P = QR(M Q)``,
``R = M^T P``, ``M -= (1 - mu) P R^T``, ``Q = R / (||R_col|| + eps)``, step ``lr * sqrt(fan_out / fan_in) P Q^T``).

Derivation. Muon orthogonalises the whole ``m x n`` momentum every step. Dion keeps a right factor ``Q``
(``n x r``) and runs one step of subspace power iteration per optimizer step, warm-started from the last
``Q``: the update ``P Q^T`` has rank ``r`` and orthonormal left factor. What the rank-``r`` update leaves
out is not lost: error feedback keeps it in the momentum for later steps::

    B <- M + G                                   (m, n): the buffer with this step's gradient
    P <- orth(B Q)                               (m, r): reduced QR (Algorithm 1, line 4)
    R <- B^T P                                   (n, r)
    M <- B - (1 - mu) P R^T                      error feedback: only the part that was applied decays
    Q <- ColumnNormalize(R)                      (n, r): r_j / (||r_j|| + eps)   (q_update="column_norm")
    W <- W (1 - lr * weight_decay) - lr * sqrt(m / n) * P Q^T

``r = ceil(rank_fraction * min(m, n))``. ``Q`` starts as a Gaussian ``n x r`` matrix drawn from a generator
seeded with ``seed``; ``M`` starts at zero.

Dion at full rank and Muon. With ``rank_fraction=1`` and ``B Q`` of full column rank, ``P P^T B = B`` (``P``
spans the column space of ``B``), so the error feedback leaves ``M = mu B``: ``B_t = mu B_{t-1} + G_t``, which
is ``1 / (1 - mu)`` times Muon's EMA buffer (no Nesterov). The paper's column normalisation does *not* make
``P Q^T`` the polar factor of ``B`` at a given step (``Q`` converges to the right singular vectors only as the
power iteration does). With ``q_update="polar"`` -- ``Q <- polar(R)``, the exact polar factor from the SVD,
an option of this implementation -- it does: with ``B = U S V^T`` and ``P = U W`` (``W`` orthogonal),
``R = V S W`` and ``polar(R) = V W``, so ``P Q^T = U W W^T V^T = U V^T = polar(B)`` exactly, whatever ``Q``
was. Hence: Dion(``rank_fraction=1, q_update="polar", momentum=mu, weight_decay=wd``) equals Muon(``momentum=mu,
nesterov=False, weight_decay=wd, scale_mode="unit_rms_norm"``) with its Newton–Schulz iteration replaced by
the exact polar factor (in float64 the converged cubic iteration: ``coefficients="cubic", ns_steps=60,
ns_dtype=torch.float64``), to rounding (checked to 1e-12 over several steps in the tests).
"""

from __future__ import annotations

import math

import torch

from ..polar import polar_factor
from ._functional import steps_in_float32
from .._checks import check_eps, check_int, check_lr, check_momentum, check_number, check_weight_decay
from .matrix_views import MatrixWork, batch_shape, check_group_shapes, matrix_shape
from .normuon import MATRIX_ROUTE
from .optimizer import BookOptimizer

__all__ = ["Q_UPDATES", "Dion", "dion", "dion_rank"]

#: How Dion forms its new right factor from ``R = B^T P``: the paper's column normalisation, or the exact
#: polar factor (with ``rank_fraction=1`` Dion is then Muon with the exact polar factor).
Q_UPDATES = ("column_norm", "polar")


def dion_rank(shape, rank_fraction: float) -> int:
    """The rank ``r = ceil(rank_fraction * min(m, n))`` (at least 1) of Dion's update of an ``(m, n)`` matrix."""
    return max(1, min(min(shape), math.ceil(rank_fraction * min(shape) - 1e-9)))


@torch.no_grad()
@steps_in_float32(4)
def dion(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
         right_factors: list[torch.Tensor], *, lr: float, momentum: float, weight_decay: float, eps: float = 1e-8,
         q_update: str = "column_norm", matrix_view: str = "matrix") -> None:
    """Apply one Dion step in place (the pure function behind :class:`Dion`).

    Args:
        params, grads, momentum_buffers: lists of ``(m, n)`` tensors, one entry per parameter, or of tensors
            that ``matrix_view`` sees as matrices (:mod:`optbook.optim.matrix_views`); the buffers (``M``) are
            updated in place.
        right_factors: one ``(n, r)`` tensor ``Q`` per matrix (``(*E, n, r)`` for a stack ``(*E, m, n)``),
            updated in place.
        lr, momentum, weight_decay, eps, q_update, matrix_view: as in :class:`Dion`; not re-validated here.

    A float16/bfloat16 parameter is stepped in float32 and rounded back once (with ``M`` and ``Q``).

    Two guards the paper's Algorithm 1 does not spell out:

    - **An all-zero buffer** ``B`` (a zero gradient on a zero buffer: an MoE expert that got no tokens, a
      zero-initialised layer) leaves ``Q`` as it was and applies no update (only the weight decay). Without
      the guard ``R = B^T P = 0`` and the column normalisation sets ``Q = 0``; from then on ``B Q = 0`` for
      every ``B``, the QR returns an arbitrary ``P`` and the next updates are neither orthonormal nor
      aligned with the gradient. The guard is microsoft/dion's ``fix_all_zero_or_nan`` (commit
      0a059a4542e5aa74b40dcd1dce363836c7afcd48, ``dion/dion_reference.py``: ``P = 0`` and ``Q = Q_init``
      where ``B`` is all zero, NaNs in ``P`` and ``R`` set to zero), written, as there, without a
      data-dependent branch.
    - **Memory layout.** The products are formed on a row-major ``B`` (a copy when the buffer is strided,
      e.g. the transpose of a contiguous tensor) and ``P Q^T`` is added entrywise, so a parameter and its
      strided twin get bitwise the same update (``tests/test_numerical_edges.py``).
    """
    work = MatrixWork(matrix_view)   # a channels_last kernel: stepped on a contiguous copy, copied back
    for p, g, M, Q in zip(params, grads, momentum_buffers, right_factors):
        p.mul_(1 - lr * weight_decay)
        for pm, gm, Mm, Qm in zip(work.work(p), work.read(g), work.work(M), work.work(Q)):
            _dion_matrix(pm, gm, Mm, Qm, lr=lr, momentum=momentum, eps=eps, q_update=q_update)
    work.write_back()


def _dion_matrix(p: torch.Tensor, g: torch.Tensor, M: torch.Tensor, Q: torch.Tensor, *, lr, momentum, eps,
                 q_update) -> None:
    """Dion's step of one ``(m, n)`` matrix ``p`` (already decayed), its buffer ``M`` and factor ``Q``."""
    M.add_(g)
    # the matrix products on a row-major copy: the bits do not depend on how p (and so M) is laid out
    B = M if M.is_contiguous() else M.contiguous()
    P, _ = torch.linalg.qr(B @ Q)                     # (m, r), orthonormal columns
    R = B.T @ P                                       # (n, r)
    # an all-zero buffer (an expert that got no tokens, a zero-initialised layer): no update, and Q is
    # kept instead of becoming R / eps = 0, after which B Q = 0 for every B (microsoft/dion's guard)
    nonzero = B.ne(0).any()
    P = P.nan_to_num_().mul_(nonzero)
    R = R.nan_to_num_()
    B.addmm_(P, R.T, alpha=-(1 - momentum))           # error feedback: M <- B - (1 - mu) P R^T
    if B is not M:
        M.copy_(B)
    if q_update == "polar":
        new_Q = polar_factor(R)
    else:
        new_Q = R / (torch.linalg.vector_norm(R, dim=0, keepdim=True) + eps)
    Q.copy_(torch.where(nonzero, new_Q, Q))
    m, n = p.shape
    # P Q^T formed on its own, then added entrywise (as the reference's X.add_(P @ Q.T)): no strided GEMM
    p.add_(P @ Q.T, alpha=-lr * math.sqrt(m / n))


class Dion(BookOptimizer):
    """Dion (Ahn et al. 2025, arXiv:2504.05295, Algorithm 1), single device: a rank-``r`` orthonormal update.

    The derivation, the update and the exact relation to Muon at full rank are in the module docstring
    (:mod:`optbook.optim.dion`).

    Args:
        params: 2-D real floating-point tensors ``(fan_out, fan_in)`` (or what ``matrix_view`` steps), or
            param-group dicts.
        lr: learning rate ``>= 0``; the step is ``lr * sqrt(fan_out / fan_in)`` times ``P Q^T``.
        momentum: ``mu`` in ``[0, 1)``: the error-feedback coefficient (``M <- B - (1 - mu) P R^T``).
        weight_decay: decoupled decay ``>= 0``, multiplied by ``lr``.
        rank_fraction: ``r / min(m, n)`` in ``(0, 1]`` (:func:`dion_rank`); 1 is full rank.
        q_update: ``"column_norm"`` (the paper) or ``"polar"`` (exact polar factor of ``R``; see the module).
        eps: added to each column norm of ``R``, ``> 0``.
        seed: an int ``>= 0`` seeding the Gaussian start of ``Q`` (one generator per parameter, so the start
            does not depend on the order of the parameters; each matrix of a stack starts from the ``Q`` a
            separate parameter of its shape would, so a stack steps bitwise as its matrices given separately).
        matrix_view: ``"matrix"`` (default: 2-D tensors only), ``"flatten"`` (conv kernels as
            ``(out, in*kh*kw)``) or ``"stacked"`` (``(*E, M, N)`` as ``prod(E)`` matrices), as
            :class:`~optbook.optim.Muon`'s (:mod:`optbook.optim.matrix_views`); ``(m, n)``, ``r`` and the
            scale ``sqrt(m / n)`` are those of each matrix stepped.

    State per parameter: ``momentum_buffer`` (the parameter's shape) and ``right_factor`` ``(n, r)``
    (``(*E, n, r)`` for a stack), the parameter's dtype. A float16/bfloat16 parameter is stepped in float32.

    Raises:
        ValueError: a parameter whose shape ``matrix_view`` cannot step (the default: one that is not 2-D),
            a hyperparameter out of range (the message names it), a non-finite gradient
            (:class:`~optbook.contract.NonFiniteGradientError`); nothing is written.
        TypeError: as for every optimizer of :mod:`optbook.optim`; ``seed`` not an int.
    """

    elementwise = False
    float_options = ("lr", "momentum", "weight_decay", "eps")

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.95, weight_decay: float = 0.0,
                 rank_fraction: float = 1.0, q_update: str = "column_norm", eps: float = 1e-8, seed: int = 0,
                 matrix_view: str = "matrix"):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      rank_fraction=rank_fraction, q_update=q_update, eps=eps, seed=seed,
                                      matrix_view=matrix_view))

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        check_momentum(group["momentum"])
        check_weight_decay(group["weight_decay"])
        check_number("rank_fraction", group["rank_fraction"], low=0.0, high=1.0, low_open=True)
        if isinstance(group["rank_fraction"], torch.Tensor):
            raise TypeError("Invalid rank_fraction: expected a Python number (it fixes the shape of the state), "
                            "got a tensor")
        if group["q_update"] not in Q_UPDATES:
            raise ValueError(f"Invalid q_update: expected one of {Q_UPDATES}, got {group['q_update']!r}")
        check_eps(group["eps"])
        check_int("seed", group["seed"], 0)
        check_group_shapes(group, "Dion", MATRIX_ROUTE)

    @staticmethod
    def _right_factor_shape(p: torch.Tensor, group: dict) -> tuple[int, ...]:
        view = group.get("matrix_view", "matrix")
        m, n = matrix_shape(p.shape, view)
        return (*batch_shape(p.shape, view), n, dion_rank((m, n), group["rank_fraction"]))

    def _expected_state(self, p, group):
        return {"momentum_buffer": (tuple(p.shape), p.dtype, True),
                "right_factor": (self._right_factor_shape(p, group), p.dtype, True)}

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                *batch, n, r = self._right_factor_shape(p, group)
                gen = torch.Generator().manual_seed(group["seed"])
                # one draw per parameter; each matrix of a stack starts from it, as a separate parameter would
                Q = torch.randn((n, r), generator=gen, dtype=torch.float64).expand(*batch, n, r)
                # one dict.update: an interrupt (Ctrl-C) cannot leave half a state behind
                state.update(momentum_buffer=torch.zeros_like(p, memory_format=torch.contiguous_format),
                             right_factor=Q.to(device=p.device, dtype=p.dtype,
                                               memory_format=torch.contiguous_format, copy=True))
        dion(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
             [self.state[p]["right_factor"] for p in params], lr=group["lr"], momentum=group["momentum"],
             weight_decay=group["weight_decay"], eps=group["eps"], q_update=group["q_update"],
             matrix_view=group.get("matrix_view", "matrix"))
