"""Newton–Schulz orthogonalisation and the exact polar factor. Explained in chapter 5.

Source: Keller Jordan's Muon (2024) for the "simple" coefficients, modded-nanogpt / Megatron-LM for
the 5-step "quintic" schedule, the DeepSeek-V4 report for the 8 + 2 hybrid schedule, Amsel, Persson,
Musco & Gower (2025), *The Polar Express* (arXiv:2505.16932), for the "polar_express" schedule as
published in modded-nanogpt's and microsoft/dion's ``polar_express``; Higham (2008), *Functions of
Matrices*, ch. 8 (the polar decomposition), for the Newton–Schulz iteration itself.

For ``X = U S V^T`` the step ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` equals
``U phi(S) V^T`` with the odd polynomial ``phi(s) = a s + b s^3 + c s^5``: every singular value is
mapped by the same scalar function and the singular vectors are kept. Five "simple" steps do *not*
reach ``U V^T``; they push every singular value of a normalised input into a band around 1
(chapter 5 measures it: about [0.68, 1.13] for inputs down to 0.01).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["COEFFICIENTS", "newton_schulz", "ns_schedule", "polar_factor"]

SIMPLE = (3.4445, -4.7750, 2.0315)
CUBIC = (1.5, -0.5, 0.0)
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
DEEPSEEK_V4 = (SIMPLE,) * 8 + ((2.0, -1.5, 0.5),) * 2

#: Polar Express (Amsel et al. 2025, arXiv:2505.16932): the five per-step minimax triples as published
#: in modded-nanogpt's and microsoft/dion's ``polar_express`` ("computed for num_iters=5,
#: safety_factor=2e-2"). The safety factor 1.02 is baked into all but the last polynomial (each is
#: ``p(x / 1.02)``: headroom for singular values that bf16 rounding pushes a little above the range a
#: polynomial was fitted on), and that code also normalises by ``1.02 ||G||_F`` instead of ``||G||_F``.
POLAR_EXPRESS_PUBLISHED = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                           (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                           (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                           (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                           (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
#: The input normalisation of the published code: ``X = G / (POLAR_EXPRESS_SAFETY * ||G||_F)``.
POLAR_EXPRESS_SAFETY = 1.02
#: The schedule ``newton_schulz`` runs after its own ``G / ||G||_F``: the first published polynomial
#: with the normalisation's 1/1.02 folded in, ``p_1(x / 1.02)`` = (a/1.02, b/1.02^3, c/1.02^5), then
#: the other four verbatim. The composition equals the published code's (normalise by 1.02 ||G||_F,
#: then the five triples) in exact arithmetic.
POLAR_EXPRESS = ((POLAR_EXPRESS_PUBLISHED[0][0] / POLAR_EXPRESS_SAFETY,
                  POLAR_EXPRESS_PUBLISHED[0][1] / POLAR_EXPRESS_SAFETY ** 3,
                  POLAR_EXPRESS_PUBLISHED[0][2] / POLAR_EXPRESS_SAFETY ** 5),) + POLAR_EXPRESS_PUBLISHED[1:]

#: The named coefficient schedules (``"deepseek_v4"`` is a fixed 10-step schedule).
COEFFICIENTS = {"simple": (SIMPLE,), "cubic": (CUBIC,), "quintic": QUINTIC, "deepseek_v4": DEEPSEEK_V4,
                "polar_express": POLAR_EXPRESS}


def ns_schedule(coefficients: str | Sequence[Sequence[float]] = "simple", steps: int = 5
                ) -> list[tuple[float, float, float]]:
    """The list of ``(a, b, c)`` applied at each of ``steps`` iterations.

    ``"simple"`` and ``"cubic"`` repeat one triple; ``"quintic"``, ``"polar_express"`` and an explicit
    sequence of triples are applied in order, and a schedule run for more steps than it has triples
    repeats its *last* triple; ``"deepseek_v4"`` is 8 simple steps and 2 of ``(2, -1.5, 0.5)`` and needs
    ``steps=10``.

    ``"polar_express"`` (Amsel et al. 2025) is a different minimax polynomial per step, a 5-step
    schedule; its first triple carries the published code's ``1/1.02`` input normalisation (see
    :data:`POLAR_EXPRESS`). Measured in float64 (``tests/test_newton_schulz.py``): inputs with
    singular values in ``[1e-3, 1]`` (after ``G / ||G||_F``) end in about [0.847, 1.141]
    (``"quintic"``: [0.475, 1.145]). Its last triple's fixed point is about 1.035, not 1, so extra
    steps tighten the band around 1.035 (12 steps: about [1.025, 1.048] for inputs down to 1e-2).

    Pitfall: cycling back to the first triple (``schedule[i % len(schedule)]``, what Megatron-LM's
    ``newton_schulz`` does for ``steps`` beyond the quintic schedule's five) restarts the aggressive
    opening polynomials on an iterate whose singular values are already near 1. The first quintic
    triple maps 1 to ``4.0848 - 6.8946 + 2.9270 = 0.117``, so ``"quintic"`` with ``steps=6`` ends with
    singular values of 0.07-0.14 instead of about 1. The closing triples are built to keep values near
    1 where they are, so repeating the last one is safe.

    Raises:
        ValueError: unknown name, ``steps < 1`` or not an int, a triple that is not 3 finite numbers,
            ``"deepseek_v4"`` with ``steps != 10``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Invalid steps: expected an int >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENTS:
            raise ValueError(f"Invalid coefficients: unknown schedule {coefficients!r}; expected one of "
                             f"{sorted(COEFFICIENTS)} or a sequence of (a, b, c)")
        base = COEFFICIENTS[coefficients]
        if coefficients == "deepseek_v4" and steps != len(base):
            raise ValueError(f"Invalid steps: coefficients='deepseek_v4' is a 10-step schedule "
                             f"(8 x simple + 2 x (2, -1.5, 0.5)); pass steps=10, got {steps}")
    else:
        base = tuple(tuple(c) for c in coefficients)
        if not base or any(len(c) != 3 or not all(math.isfinite(float(x)) for x in c) for c in base):
            raise ValueError(f"Invalid coefficients: expected a non-empty sequence of (a, b, c) triples "
                             f"of finite numbers, got {coefficients!r}")
    return [tuple(float(x) for x in base[min(i, len(base) - 1)]) for i in range(steps)]


def _same(Y: torch.Tensor) -> torch.Tensor:
    return Y


def _column_major(Y: torch.Tensor) -> torch.Tensor:
    """``Y`` with the same values, stored column-major (a transpose copy, O(mn) of the O(m^2 n) product).

    On CPUs without bf16/fp16 matrix instructions, PyTorch's low-precision ``bmm`` is 5-10x faster
    when its right operand is column-major (measured with torch 2.13 on an AVX2-only CPU: B X of
    8 x (192, 192) @ (192, 768) in bf16 takes 350 ms row-major, 46 ms column-major). The values,
    and so the mathematics, are unchanged; only the order of the rounding inside the kernel may differ.
    """
    return Y.mT.contiguous().mT


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: str | Sequence = "simple", eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16, gram: str = "plain") -> torch.Tensor:
    """Approximate the polar factor ``U V^T`` of ``G`` by ``steps`` Newton–Schulz iterations.

    Args:
        G: ``(..., m, n)`` floating tensor; leading dimensions are a batch (one matrix each).
        steps: number of iterations (``>= 1``).
        coefficients: ``"simple"``, ``"quintic"``, ``"deepseek_v4"``, ``"cubic"``, ``"polar_express"``
            or a sequence of ``(a, b, c)`` (see :func:`ns_schedule`).
        eps: floor of the normaliser: ``X = G / max(||G||_F, eps)`` (per matrix), so the result is
            scale invariant for ``||G||_F >= eps`` and a zero matrix maps to zeros, never NaN.
        dtype: dtype of the iteration (bf16 by default, as in Muon; float64 for exactness demos).
            The normalisation runs in at least float32 *before* the cast, so a gradient of size
            ~1e5 cannot overflow a low-precision dtype.
        gram: how the two symmetric products of a step are formed. ``"plain"`` (default): torch's
            ``X @ X.mT`` and ``torch.baddbmm``. ``"symmetric"``: :func:`optbook.kernels.gram_xxt` and
            :func:`optbook.kernels.gram_poly`, Triton kernels that compute only the tiles on and below
            the diagonal (chapter 15); on a CPU tensor they run only under ``TRITON_INTERPRET=1`` and
            otherwise fall back to torch's products (see :func:`optbook.kernels.gram_backend`). Needs a
            float16, bfloat16 or float32 ``dtype``, and no autograd (the kernels have no backward: call
            it under ``torch.no_grad()``, as an optimizer step does). Same mathematics; the roundings
            differ.

    Returns:
        A tensor of ``G``'s shape and dtype: ``U phi_k(S) V^T`` where ``phi_k`` composes the
        schedule's odd polynomials (singular values near 1, not exactly 1).

    Raises:
        ValueError: ``G`` has fewer than 2 dimensions, ``eps <= 0``, a bad ``steps``/``coefficients``, an
            unknown ``gram``, or ``gram="symmetric"`` with a ``dtype`` other than float16/bfloat16/float32
            or with a ``G`` that requires grad while grad mode is on.
        TypeError: ``G`` is not a real floating-point tensor.
    """
    schedule = ns_schedule(coefficients, steps)
    if gram not in ("plain", "symmetric"):
        raise ValueError(f"Invalid gram: expected 'plain' or 'symmetric', got {gram!r}")
    if gram == "symmetric" and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"Invalid gram: 'symmetric' needs dtype float16, bfloat16 or float32, got {dtype}")
    if gram == "symmetric" and isinstance(G, torch.Tensor) and G.requires_grad and torch.is_grad_enabled():
        raise ValueError("Invalid gram: 'symmetric' has no backward and G requires grad; call under "
                         "torch.no_grad() (as an optimizer step does) or pass G.detach()")
    if not isinstance(G, torch.Tensor) or not G.is_floating_point():
        raise TypeError(f"Invalid G: expected a real floating-point tensor, got "
                        f"{getattr(G, 'dtype', type(G).__name__)}")
    if G.ndim < 2:
        raise ValueError(f"Invalid G: expected shape (..., m, n), got {tuple(G.shape)}")
    if not eps > 0:
        raise ValueError(f"Invalid eps: expected > 0, got {eps!r}")
    norm_dtype = torch.promote_types(G.dtype, torch.float32)
    X = G.to(norm_dtype)
    norm = torch.linalg.matrix_norm(X, keepdim=True).clamp_min_(eps)
    X = (X.div_(norm) if X is not G else X / norm).to(dtype)  # divide in place when G.to made a copy
    tall = G.shape[-2] > G.shape[-1]
    if tall:  # work on the wide orientation: the Gram matrix is min(m, n) squared
        X = X.mT
    X = X.reshape(-1, *X.shape[-2:]).contiguous()  # one batch dimension for baddbmm, rows in memory
    right = _column_major if X.device.type == "cpu" and X.dtype in (torch.bfloat16, torch.float16) else _same
    if gram == "symmetric":
        from .kernels import gram_poly, gram_xxt   # Triton is imported on the first kernel launch only
        A, B = (torch.empty(*X.shape[:-1], X.shape[-2], dtype=X.dtype, device=X.device) for _ in range(2))
    for a, b, c in schedule:
        if gram == "symmetric":   # the tiles on and below the diagonal, mirrored; b A + c A^2 in one kernel
            gram_xxt(X, out=A)
            B = gram_poly(A, b, c, out=B) if c != 0 else b * A
        else:
            A = X @ X.mT
            # fused multiply-adds: one rounding each, which matters in bf16 (b A and c A^2 nearly cancel)
            # (c == 0, the cubic: torch 2.13's CPU baddbmm with alpha=0 ignores beta in bf16/fp16 for n >= 32)
            B = torch.baddbmm(A, A, right(A), beta=b, alpha=c) if c != 0 else b * A   # b A + c A^2
        X = torch.baddbmm(X, B, right(X), beta=a)            # a X + B X
    X = X.reshape(*G.shape[:-2], *X.shape[-2:])
    if tall:
        X = X.mT
    if X.dtype == G.dtype:  # (Tensor.to returns X itself for its own dtype, whatever the memory_format)
        return X.contiguous()
    return X.to(dtype=G.dtype, memory_format=torch.contiguous_format)  # cast and lay out in one copy


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """The exact polar factor ``U V^T`` of ``G = U S V^T`` from the SVD (the oracle).

    Singular values below ``max(m, n) * machine_eps * s_max`` are treated as zero, so a
    rank-deficient ``G`` maps to the partial isometry ``U_r V_r^T`` (what Newton–Schulz converges
    to) and a zero matrix maps to zeros.

    Args:
        G: ``(..., m, n)`` floating tensor.

    Returns:
        Tensor of ``G``'s shape and dtype.

    Raises:
        ValueError: ``G`` has fewer than 2 dimensions.
    """
    if G.ndim < 2:
        raise ValueError(f"Invalid G: expected shape (..., m, n), got {tuple(G.shape)}")
    work = G.to(torch.promote_types(G.dtype, torch.float32))
    U, S, Vh = torch.linalg.svd(work, full_matrices=False)
    tol = max(G.shape[-2:]) * torch.finfo(work.dtype).eps * S[..., :1]
    keep = (S > tol).to(work.dtype)
    return ((U * keep.unsqueeze(-2)) @ Vh).to(G.dtype)
