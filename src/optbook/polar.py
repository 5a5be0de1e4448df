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
import numbers
import operator
from collections.abc import Sequence

import torch
from ._checks import check_int

__all__ = ["ALGORITHMS", "COEFFICIENTS", "GRAM_RESTARTS", "PRECONDITIONERS", "check_restarts", "newton_schulz",
           "ns_schedule", "optimal_odd_quintic", "polar_express_band", "polar_express_coefficients", "polar_factor"]

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

    Pitfall: cycling back to the first triple (``schedule[i % len(schedule)]``, what NVIDIA-NeMo/
    Emerging-Optimizers' ``newton_schulz``, which Megatron-LM's Muon calls, does for ``steps`` beyond the
    quintic schedule's five: ``iter_mode = "cycle"`` at commit a045ea1, ``muon_utils.py``) restarts the aggressive
    opening polynomials on an iterate whose singular values are already near 1. The first quintic
    triple maps 1 to ``4.0848 - 6.8946 + 2.9270 = 0.117``, so ``"quintic"`` with ``steps=6`` ends with
    singular values of 0.07-0.14 instead of about 1. The closing triples are built to keep values near
    1 where they are, so repeating the last one is safe.

    Raises:
        ValueError: unknown name, ``steps < 1`` or not an int, a triple that is not 3 finite numbers,
            ``"deepseek_v4"`` with ``steps != 10``.
    """
    check_int("steps", steps, 1)
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENTS:
            raise ValueError(f"Invalid coefficients: unknown schedule {coefficients!r}; expected one of "
                             f"{sorted(COEFFICIENTS)} or a sequence of (a, b, c)")
        base = COEFFICIENTS[coefficients]
        if coefficients == "deepseek_v4" and steps != len(base):
            raise ValueError(f"Invalid steps: coefficients='deepseek_v4' is a 10-step schedule "
                             f"(8 x simple + 2 x (2, -1.5, 0.5)); pass steps=10, got {steps}")
    else:
        def finite_triple(c) -> bool:
            return (len(c) == 3 and all(not isinstance(x, bool) and isinstance(x, (numbers.Real, torch.Tensor))
                                        and math.isfinite(float(x)) for x in c))
        try:
            base = tuple(tuple(c) for c in coefficients)
            valid = bool(base) and all(finite_triple(c) for c in base)
        except (TypeError, ValueError, RuntimeError):  # not a sequence of sequences of numbers
            valid = False
        if not valid:
            raise ValueError(f"Invalid coefficients: expected a schedule name or a non-empty sequence of (a, b, c) "
                             f"triples of finite numbers, got {coefficients!r}")
    return [tuple(float(x) for x in base[min(i, len(base) - 1)]) for i in range(steps)]


def _same(Y: torch.Tensor) -> torch.Tensor:
    return Y


def _column_major(Y: torch.Tensor) -> torch.Tensor:
    """``Y`` with the same values, stored column-major (a transpose copy, O(mn) of the O(m^2 n) product).

    On CPUs without bf16/fp16 matrix instructions, PyTorch's low-precision ``bmm`` is 5-10x faster
    when its right operand is column-major (measured with torch 2.13 on an AVX2-only CPU: B X of
    8 x (192, 192) @ (192, 768) in bf16 takes 350 ms row-major, 46 ms column-major). The values,
    and so the mathematics, are unchanged; only the order of the rounding inside the kernel may differ.
    Where oneDNN has the dtype natively (``_NATIVE_CPU_MATMUL``) the copy is skipped: there the
    row-major product is the faster one (bf16 on an AVX512-BF16 CPU: 6.9 ms row-major, 10.7 ms
    column-major for the product above, one thread).
    """
    return Y.mT.contiguous().mT


def _native_cpu_matmul(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs CPU matmuls of ``dtype`` (bfloat16/float16) with native instructions.

    ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` (AVX512-BF16 or AMX) and ``..._fp16_supported``; both
    honour ``ONEDNN_MAX_CPU_ISA``, so the AVX2 and generic kernel configurations report ``False``.
    """
    try:
        check = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}[dtype]
        return bool(check())
    except (KeyError, AttributeError, RuntimeError):
        return False


# read once at import: a module constant is also a constant for torch.compile (a compiled Muon step)
_NATIVE_CPU_MATMUL = {dtype: _native_cpu_matmul(dtype) for dtype in (torch.bfloat16, torch.float16)}


#: The iterations :func:`newton_schulz` runs (its ``algorithm``).
ALGORITHMS = ("standard", "gram")
#: The preconditioners :func:`newton_schulz` applies before its first step (its ``precondition``).
PRECONDITIONERS = (None, "aol")
#: Where Gram Newton–Schulz restarts by default: before steps 1 and 3 (0-based). Dao-AILab's
#: ``GramNewtonSchulz`` defaults to ``[2]`` (one restart, tuned for float16); measured here
#: (``tests/test_gram_newton_schulz.py``; 30 spectra down to 1e-4..1e-5, m = 16, 32, 64, aspect 4, 5 steps
#: of simple, quintic or polar_express), ``(2,)`` leaves errors up to 4x the standard iteration's in bfloat16
#: (and 2.5x in float16), ``(2, 4)`` up to 1.9x in float16, ``(1, 3)`` within 1.1x in both.
GRAM_RESTARTS = (1, 3)


def check_restarts(restarts) -> frozenset[int]:
    """The set of Gram restart step indices in ``restarts`` (see :func:`newton_schulz`).

    Raises:
        ValueError: ``restarts`` is not a sequence of ints ``>= 1``.
    """
    try:
        values = tuple(restarts)
    except TypeError:
        raise ValueError(f"Invalid restarts: expected a sequence of step indices >= 1, got {restarts!r}") from None
    for k, r in enumerate(values):   # step 0 starts from X itself
        check_int(f"restarts[{k}]", r, 1)
    return frozenset(values)


def _aol(X: torch.Tensor, A: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """AOL rescaling: ``D X`` and ``D A D`` with ``D = diag(1 / sqrt(sum_j |A_ij|))`` and ``A = X X^T``.

    ``||D X||_2 <= 1`` for any ``X`` (Prach & Lampert 2022, *Almost-Orthogonal Layers*, Thm. 1). Proof:
    ``D A D`` is similar to ``D^2 A = D (D A D) D^-1``, whose absolute row sums are exactly 1 (row ``i``
    of ``A`` divided by its own absolute row sum); a matrix's spectral radius is at most its largest
    absolute row sum, and for the symmetric positive semi-definite ``D A D`` the spectral radius is
    ``||D A D||_2 = ||D X||_2^2``. (The row sums of ``|D A D|`` itself can exceed 1: 1.19 for
    ``A = [[100, 9], [9, 1]]``.) The iteration then approximates the polar factor of ``D X``, which is
    that of ``X`` exactly when ``D`` commutes with ``A``. Explained in chapter 15b (AOL preconditioning).

    Args:
        X: ``(batch, m, n)`` floating tensor, ``m <= n``.
        A: ``X X^T``, ``(batch, m, m)``, same dtype as ``X``.
        eps: floor of the absolute row sums (a zero row gets the finite scale ``eps ** -0.5``).

    Returns:
        ``(D X, D A D)`` in the dtypes of ``X`` and ``A``. The scales are computed in at least float32 and
        each result is rounded once to its tensor's dtype; a zero row stays zero.
    """
    work = torch.promote_types(A.dtype, torch.float32)
    s = A.abs().sum(dim=-1, dtype=work).clamp_min(eps).rsqrt()           # (batch, m), summed in >= float32
    # a low-precision tensor times a float32 one is computed in float32 (type promotion), element by element:
    # the same numbers as converting first, without the converted copies
    X = (X * s.unsqueeze(-1)).to(X.dtype)
    A = (A * s.unsqueeze(-1) * s.unsqueeze(-2)).to(A.dtype)
    return X, A


def _standard_iteration(X, schedule, xxt, poly, right, A=None):
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, per triple; ``A``, when given, is step 0's."""
    for i, (a, b, c) in enumerate(schedule):
        if i > 0 or A is None:
            A = xxt(X)
        X = torch.baddbmm(X, poly(A, b, c), right(X), beta=a)            # a X + B X
    return X


def _gram_iteration(X, schedule, restart_at, xxt, poly, right, R=None):
    """Gram Newton–Schulz: iterate on ``R = X X^T`` and ``Q`` (``X_k = Q X_0``), restarting at ``restart_at``.

    With ``h_t(R) = a_t I + b_t R + c_t R^2`` the standard step is ``X_{t+1} = h_t(X_t X_t^T) X_t``, so
    ``X_t = Q_t X_0`` with ``Q_{t+1} = Q_t h_t(R_t)`` and ``R_{t+1} = h_t(R_t) R_t h_t(R_t)`` (``h_t(R_t)``
    and ``R_t`` commute, both being polynomials in ``R_0``). Only ``m x m`` products remain inside the
    loop; ``X`` is touched again at a restart (``X <- Q X``, ``R <- X X^T``, ``Q <- I``) and at the end.
    """
    if R is None:
        R = xxt(X)
    Q = None                                    # None stands for the identity
    last = len(schedule) - 1
    for i, (a, b, c) in enumerate(schedule):
        if i in restart_at:                     # i >= 1, so Q holds at least one step
            X = torch.bmm(Q, right(X))
            R, Q = xxt(X), None
        Z = poly(R, b, c)                                                 # b R + c R^2
        if i < last and i + 1 not in restart_at:
            RZ = torch.baddbmm(R, R, right(Z), beta=a)                    # R Z + a R = R h(R)
            R = torch.baddbmm(RZ, Z, right(RZ), beta=a)                   # Z RZ + a RZ = h(R) R h(R)
        if Q is None:
            Q = Z
            Q.diagonal(dim1=-2, dim2=-1).add_(a)                          # h(R) = Z + a I (Z is fresh)
        else:
            Q = torch.baddbmm(Q, Q, right(Z), beta=a)                     # Q Z + a Q = Q h(R)
    return torch.bmm(Q, right(X))


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: str | Sequence = "simple", eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16, gram: str = "plain", *, algorithm: str = "standard",
                  restarts: Sequence[int] = GRAM_RESTARTS, precondition: str | None = None,
                  overwrite: bool = False) -> torch.Tensor:
    """Approximate the polar factor ``U V^T`` of ``G`` by ``steps`` Newton–Schulz iterations.

    Args:
        G: ``(..., m, n)`` floating tensor; leading dimensions are a batch (one matrix each).
        steps: number of iterations (``>= 1``).
        coefficients: ``"simple"``, ``"quintic"``, ``"deepseek_v4"``, ``"cubic"``, ``"polar_express"``
            or a sequence of ``(a, b, c)`` (see :func:`ns_schedule`; :func:`polar_express_coefficients`
            computes Polar Express schedules for other step counts and lower bounds).
        eps: floor of the normaliser: ``X = G / max(||G||_F, eps)`` (per matrix), so the result is
            scale invariant for ``||G||_F >= eps`` and a zero matrix maps to zeros, never NaN.
        dtype: dtype of the iteration (bf16 by default, as in Muon; float64 for exactness demos).
            The normalisation runs in at least float32 *before* the cast, so a gradient of size
            ~1e5 cannot overflow a low-precision dtype.
        gram: how the symmetric products are formed. ``"plain"`` (default): torch's
            ``X @ X.mT`` and ``torch.baddbmm``. ``"symmetric"``: :func:`optbook.kernels.gram_xxt` and
            :func:`optbook.kernels.gram_poly`, Triton kernels that compute only the tiles on and below
            the diagonal (chapter 15); on a CPU tensor they run only under ``TRITON_INTERPRET=1`` and
            otherwise fall back to torch's products (see :func:`optbook.kernels.gram_backend`). Needs a
            float16, bfloat16 or float32 ``dtype``, and no autograd (the kernels have no backward: call
            it under ``torch.no_grad()``, as an optimizer step does). Same mathematics; the roundings
            differ. With ``algorithm="gram"`` it forms ``R = X X^T`` and ``b R + c R^2``.
        algorithm: ``"standard"`` (default): ``X <- a X + (b A + c A^2) X`` on the ``m x n`` matrix
            (``m <= n`` after the transpose of a tall input), ``4 m^2 n + 2 m^3`` FLOPs a step.
            ``"gram"``: Gram Newton–Schulz (Zhang, Amsel, Chen & Dao 2026), the same polynomial in exact
            arithmetic, iterated on the ``m x m`` Gram matrix ``R = X X^T`` and an accumulated ``Q``
            with ``X_k = Q X``: ``O(m^3)`` per step plus ``2 m^2 n`` at the start, at each restart
            (twice) and at the end (:func:`optbook.bench.ns_flops`): 5 steps with the default restarts cost
            ``12 m^2 n + 22 m^3`` against ``20 m^2 n + 10 m^3``, fewer FLOPs for aspect ratios ``n / m``
            above 1.5, 1.29x fewer at ``n = 4 m``, 1.44x at ``n = 8 m`` (one restart, ``(2,)``: 1.5x, 1.85x).
        restarts: ``algorithm="gram"`` only: step indices (ints ``>= 1``) before which the Gram
            iteration restarts from ``X <- Q X``, ``R <- X X^T``, ``Q <- I`` (default ``(1, 3)``; indices
            at or past ``steps`` have no effect, ``()`` never restarts; see :data:`GRAM_RESTARTS`). In
            float16/bfloat16, ``R`` is updated as ``h(R) R h(R)``; its rounding errors (about ``u ||R||``, ``u`` the unit roundoff)
            swamp eigenvalues below that size and can turn them *negative*, and the polynomials, built
            for ``[0, 1]``, grow a negative eigenvalue at every step instead of pulling it to 1: the
            output gains singular values far above 1 (``tests/test_gram_newton_schulz.py`` shows it on
            singular values down to 1e-4). A restart recomputes ``R`` from ``X``, PSD to rounding, after
            the first steps have lifted the small singular values above the rounding level.
        precondition: ``None`` (default) or ``"aol"``: before the first step, rescale the rows of the
            wide orientation, ``X <- D X`` with ``D = diag(1 / sqrt(sum_j |(X X^T)_ij|))`` (AOL, Prach &
            Lampert 2022; Boissin et al. 2025, *Turbo-Muon*, arXiv:2512.04632, sec. 3), which bounds
            ``||D X||_2 <= 1`` and pushes the small singular values up, so a schedule may start one step
            later (Turbo-Muon drops the first quintic triple; do so: ``||D X||_2`` may sit at 1, where
            a schedule's aggressive first polynomial is steep, and in bfloat16 a value rounded just past 1
            is flung far above it: measured 1.53 for the five ``"polar_express"`` triples). The product ``X X^T`` is reused as step 0's
            ``A`` (or as the Gram ``R``), so AOL adds no matrix product. *Different mathematics*: the
            result is ``U' phi(S') V'^T`` for the SVD of ``D X``, an approximation of the polar factor
            of ``D X``, not of ``X`` (equal when the rows of ``X`` are orthogonal). After the Frobenius
            normalisation, which keeps float16 from overflowing and leaves ``D X`` unchanged.
        overwrite: allow the normalisation to divide a float32/float64 ``G`` in place (as SciPy's
            ``overwrite_a``: ``G``'s values are then undefined; saves a copy of ``G``). Same result.

    Returns:
        A tensor of ``G``'s shape and dtype: ``U phi_k(S) V^T`` where ``phi_k`` composes the
        schedule's odd polynomials (singular values near 1, not exactly 1).

    Raises:
        ValueError: ``G`` has fewer than 2 dimensions, ``eps <= 0``, a bad ``steps``/``coefficients``, an
            unknown ``gram``, ``algorithm`` or ``precondition``, bad ``restarts``, or ``gram="symmetric"``
            with a ``dtype`` other than float16/bfloat16/float32 or with a ``G`` that requires grad while
            grad mode is on.
        TypeError: ``G`` is not a real floating-point tensor; ``dtype`` is not a floating-point dtype.

    Sources: Gram Newton–Schulz and its restart: Dao-AILab/gram-newton-schulz at commit f08f25e
    (``gram_newton_schulz/gram_newton_schulz.py``, README's algorithm box), the implementation
    microsoft/dion at commit 0a059a4 selects with ``use_gram_newton_schulz=True``
    (``dion/megabatch_base.py``), also merged into DeepSpeed (deepspeedai/DeepSpeed#7953). AOL:
    Turbo-Muon's reference code, thib-s/flash-newton-schulz ``newton_schulz_triton.py`` (``NS_ours``).
    The code here is our own.
    """
    schedule = ns_schedule(coefficients, steps)
    if gram not in ("plain", "symmetric"):
        raise ValueError(f"Invalid gram: expected 'plain' or 'symmetric', got {gram!r}")
    if gram == "symmetric" and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"Invalid gram: 'symmetric' needs dtype float16, bfloat16 or float32, got {dtype}")
    if gram == "symmetric" and isinstance(G, torch.Tensor) and G.requires_grad and torch.is_grad_enabled():
        raise ValueError("Invalid gram: 'symmetric' has no backward and G requires grad; call under "
                         "torch.no_grad() (as an optimizer step does) or pass G.detach()")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Invalid algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    if precondition not in PRECONDITIONERS:
        raise ValueError(f"Invalid precondition: expected one of {PRECONDITIONERS}, got {precondition!r}")
    restart_at = check_restarts(restarts)
    if not isinstance(G, torch.Tensor) or not G.is_floating_point():
        raise TypeError(f"Invalid G: expected a real floating-point tensor, got "
                        f"{getattr(G, 'dtype', type(G).__name__)}")
    if G.ndim < 2:
        raise ValueError(f"Invalid G: expected shape (..., m, n), got {tuple(G.shape)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"Invalid dtype: expected a floating-point torch.dtype, got {dtype!r}")
    if not eps > 0:
        raise ValueError(f"Invalid eps: expected > 0, got {eps!r}")
    if G.numel() == 0:   # no singular value: the polar factor of an empty matrix is the empty matrix
        return torch.empty(G.shape, dtype=G.dtype, device=G.device)
    norm_dtype = torch.promote_types(G.dtype, torch.float32)
    X = G.to(norm_dtype)
    norm = torch.linalg.matrix_norm(X, keepdim=True).clamp_min_(eps)
    # divide in place when G.to made a copy, or when the caller gave G up (overwrite)
    X = (X.div_(norm) if X is not G or overwrite else X / norm).to(dtype)
    tall = G.shape[-2] > G.shape[-1]
    if tall:  # work on the wide orientation: the Gram matrix is min(m, n) squared
        X = X.mT
    X = X.reshape(-1, *X.shape[-2:]).contiguous()  # one batch dimension for baddbmm, rows in memory
    right = _column_major if X.device.type == "cpu" and X.dtype in (torch.bfloat16, torch.float16) \
        and not _NATIVE_CPU_MATMUL[X.dtype] else _same
    if gram == "symmetric":   # the tiles on and below the diagonal, mirrored; b A + c A^2 in one kernel
        from .kernels import gram_poly, gram_xxt  # Triton is imported on the first kernel launch only

        def xxt(Y):
            return gram_xxt(Y)

        def poly(A, b, c):
            return gram_poly(A, b, c) if c != 0 else b * A
    else:
        def xxt(Y):
            return Y @ Y.mT

        def poly(A, b, c):
            # fused multiply-adds: one rounding each, which matters in bf16 (b A and c A^2 nearly cancel)
            # (c == 0, the cubic: torch 2.13's CPU baddbmm with alpha=0 ignores beta in bf16/fp16 for n >= 32)
            return torch.baddbmm(A, A, right(A), beta=b, alpha=c) if c != 0 else b * A
    A = None
    if precondition == "aol":
        X, A = _aol(X, xxt(X), eps)
    if algorithm == "gram":
        X = _gram_iteration(X, schedule, restart_at, xxt, poly, right, A)
    else:
        X = _standard_iteration(X, schedule, xxt, poly, right, A)
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
        TypeError: ``G`` is not a real floating-point tensor.
    """
    if not isinstance(G, torch.Tensor) or not G.is_floating_point():
        raise TypeError(f"Invalid G: expected a real floating-point tensor, got "
                        f"{getattr(G, 'dtype', type(G).__name__)}")
    if G.ndim < 2:
        raise ValueError(f"Invalid G: expected shape (..., m, n), got {tuple(G.shape)}")
    work = G.to(torch.promote_types(G.dtype, torch.float32))
    U, S, Vh = torch.linalg.svd(work, full_matrices=False)
    tol = max(G.shape[-2:]) * torch.finfo(work.dtype).eps * S[..., :1]
    keep = (S > tol).to(work.dtype)
    return ((U * keep.unsqueeze(-2)) @ Vh).to(G.dtype)


# ---------------------------------------------------------------- Polar Express coefficients

#: The lower bound on the normalised singular values the published 5-step schedule was built for.
POLAR_EXPRESS_LOWER_BOUND = 1e-3
#: Its cushion (modded-nanogpt's comment says "cushion=2", i.e. 2 %): each step's polynomial is fitted
#: on ``[max(l, 0.02 u), u]``, not on ``[l, u]``, and then rescaled about 1 (see
#: :func:`polar_express_coefficients`).
POLAR_EXPRESS_CUSHION = 0.02


def _solve4(M: list[list[float]], y: list[float]) -> list[float]:
    """``M x = y`` for a 4 x 4 system by Gaussian elimination with partial pivoting (float64)."""
    A = [row[:] + [v] for row, v in zip(M, y)]
    for k in range(4):
        p = max(range(k, 4), key=lambda i: abs(A[i][k]))
        A[k], A[p] = A[p], A[k]
        for i in range(k + 1, 4):
            f = A[i][k] / A[k][k]
            A[i] = [x - f * z for x, z in zip(A[i], A[k])]
    x = [0.0] * 4
    for k in range(3, -1, -1):
        x[k] = (A[k][4] - sum(A[k][j] * x[j] for j in range(k + 1, 4))) / A[k][k]
    return x


def _odd_quintic(abc, x: float) -> float:
    a, b, c = abc
    return a * x + b * x ** 3 + c * x ** 5


def optimal_odd_quintic(lower: float, upper: float, max_iters: int = 100) -> tuple[float, float, float]:
    """The odd quintic ``p(x) = a x + b x^3 + c x^5`` closest to 1 on ``[lower, upper]`` in the max norm.

    Remez exchange (Amsel et al. 2025, arXiv:2505.16932, sec. 4 and their ``optimal_quintic``): the
    minimax error ``E`` is attained with alternating signs at ``lower``, the two positive critical
    points ``q < r`` of ``p`` and ``upper``; solve the 4 x 4 linear system ``p(x_i) + (-1)^i E = 1`` for
    ``(a, b, c, E)`` at the current points, move ``q, r`` to the roots of ``p'(x) = a + 3 b x^2 +
    5 c x^4``, repeat until ``E`` changes by less than 1e-15. Within a relative width of 5e-6 the
    answer is the limit ``p(x) = (15 t - 10 t^3 + 3 t^5) / 8``, ``t = x / upper``.

    Raises:
        ValueError: not ``0 <= lower <= upper``, ``upper <= 0``.
        RuntimeError: the exchange does not converge in ``max_iters`` rounds.
    """
    lower, upper = float(lower), float(upper)
    if not (math.isfinite(lower) and math.isfinite(upper) and 0 <= lower <= upper and upper > 0):
        raise ValueError(f"Invalid interval: expected 0 <= lower <= upper, upper > 0, got [{lower}, {upper}]")
    if lower / upper >= 1 - 5e-6:
        return 15 / 8 / upper, -10 / 8 / upper ** 3, 3 / 8 / upper ** 5
    q, r = (3 * lower + upper) / 4, (lower + 3 * upper) / 4   # exact in the limit lower -> upper
    error = math.inf
    for _ in range(max_iters):
        rows = [[x, x ** 3, x ** 5, sign] for x, sign in ((lower, 1.0), (q, -1.0), (r, 1.0), (upper, -1.0))]
        a, b, c, new_error = _solve4(rows, [1.0] * 4)
        disc = 9 * b * b - 20 * a * c
        if c == 0 or disc < 0:
            break
        roots = sorted(((-3 * b - sgn * math.sqrt(disc)) / (10 * c)) for sgn in (1.0, -1.0))
        if roots[0] <= 0:
            break
        q, r = math.sqrt(roots[0]), math.sqrt(roots[1])
        converged = abs(new_error - error) <= 1e-15
        error = new_error
        if converged:
            return float(a), float(b), float(c)
    raise RuntimeError(f"optimal_odd_quintic: the Remez exchange did not converge on [{lower}, {upper}]")


def _real(value):
    """``value`` as a Python float if it is a real number (NumPy and 0-d tensor scalars included; not a
    bool), else ``None``."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (
            value.ndim or value.dtype == torch.bool or value.is_complex())):
        return None
    if isinstance(value, (numbers.Real, torch.Tensor)):
        return float(value)
    return None


def _got(value) -> str:
    """``value`` for an error message, with its type when the repr does not show it."""
    return f"{value!r} ({type(value).__name__})"


def _polar_express(steps, lower_bound, safety, cushion):
    try:   # operator.index: an int, a NumPy integer or an integer 0-d tensor; never a float truncated
        n_steps = None if isinstance(steps, bool) else operator.index(steps)
    except TypeError:
        n_steps = None
    if n_steps is None:
        raise TypeError(f"Invalid steps: expected an integer >= 1, got {_got(steps)}")
    check_int("steps", n_steps, 1)
    steps = n_steps
    values = {}
    for name, value, ok, expected in (
            ("lower_bound", lower_bound, lambda x: 0 < x <= 1, "a number in (0, 1]"),
            ("safety", safety, lambda x: math.isfinite(x) and x >= 1, "a finite number >= 1 (1 is none)"),
            ("cushion", cushion, lambda x: 0 <= x < 1, "a number in [0, 1)")):
        x = _real(value)
        if x is None:
            raise TypeError(f"Invalid {name}: expected {expected} (a real number), got {_got(value)}")
        if not ok(x):
            raise ValueError(f"Invalid {name}: expected {expected}, got {x!r}")
        values[name] = x
    lower_bound, safety, cushion = values["lower_bound"], values["safety"], values["cushion"]
    low, up = float(lower_bound), 1.0
    schedule = []
    for i in range(steps):
        abc = optimal_odd_quintic(max(low, cushion * up), up)
        # centre on 1 over [low, up]: 1 - k p(low) = k p(up) - 1 (k = 1 unless the cushion was active)
        k = 2 / (_odd_quintic(abc, low) + _odd_quintic(abc, up))
        a, b, c = (k * v for v in abc)
        if i < steps - 1:   # p(x / safety): headroom for values rounding pushed above `up`
            a, b, c = a / safety, b / safety ** 3, c / safety ** 5
        schedule.append((a, b, c))
        low = _odd_quintic((a, b, c), low)
        up = 2 - low
    return tuple(schedule), (low, up)


def polar_express_coefficients(steps: int = 5, lower_bound: float = POLAR_EXPRESS_LOWER_BOUND,
                               safety: float = POLAR_EXPRESS_SAFETY, *, cushion: float = POLAR_EXPRESS_CUSHION,
                               input_scale: float = 1.0) -> tuple[tuple[float, float, float], ...]:
    """The Polar Express schedule: one minimax odd quintic per step, for any ``steps`` and ``lower_bound``.

    The greedy procedure of Amsel, Persson, Musco & Gower (2025), *The Polar Express*
    (arXiv:2505.16932, sec. 4.1, Alg. 2 and App. G): start from ``[l, u] = [lower_bound, 1]``, the range
    of the normalised singular values; at each step take :func:`optimal_odd_quintic` on
    ``[max(l, cushion u), u]`` (the cushion keeps the first polynomials from becoming too steep when
    ``l`` is tiny), rescale it so that ``p(l)`` and ``p(u)`` lie symmetrically about 1, divide its input
    by ``safety`` on every step but the last (``p(x / safety)``: values that rounding pushed a little
    above ``u`` are not flung far past 1), then map the interval: ``l <- p(l)``, ``u <- 2 - l``.

    Defaults reproduce :data:`POLAR_EXPRESS_PUBLISHED` (lower bound 1e-3, cushion 0.02, safety 1.02) to
    ~1e-14; ``input_scale=POLAR_EXPRESS_SAFETY`` folds the published code's ``1 / (1.02 ||G||_F)``
    normalisation into the first triple and gives :data:`POLAR_EXPRESS`. ``safety=1, cushion=0.024073...``
    gives Dao-AILab's ``_unmodified_polar_express_coefficients`` (gram-newton-schulz at f08f25e,
    ``coefficients.py``).

    Args:
        steps: number of polynomials (an integer >= 1: a Python int, a NumPy integer or an integer 0-d
            tensor; a float such as ``5.0`` is refused, never truncated).
        lower_bound: the smallest singular value to bring up, after ``G / ||G||_F`` (in ``(0, 1]``).
        safety: input scale of every polynomial but the last (``>= 1``; 1 is none).
        cushion: relative floor of the fitting interval (``[0, 1)``; 0 is none).
        input_scale: the first polynomial is applied to ``x / input_scale`` (``> 0``): for an input
            normalised by ``input_scale ||G||_F`` instead of ``||G||_F``.

    Returns:
        ``steps`` triples ``(a, b, c)`` (floats), for :func:`newton_schulz`'s ``coefficients``.

    The real-valued arguments may be Python, NumPy or 0-d tensor scalars (read as Python floats).

    Raises:
        ValueError: an argument out of its range, naming it.
        TypeError: an argument of the wrong kind (a float ``steps``, a string), naming it and its type.
    """
    s = _real(input_scale)
    if s is None:
        raise TypeError(f"Invalid input_scale: expected a finite number > 0 (a real number), "
                         f"got {_got(input_scale)}")
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"Invalid input_scale: expected a finite number > 0, got {s!r}")
    schedule, _ = _polar_express(steps, lower_bound, safety, cushion)
    a, b, c = schedule[0]
    return ((a / s, b / s ** 3, c / s ** 5),) + schedule[1:]


def polar_express_band(steps: int = 5, lower_bound: float = POLAR_EXPRESS_LOWER_BOUND,
                       safety: float = POLAR_EXPRESS_SAFETY, *,
                       cushion: float = POLAR_EXPRESS_CUSHION) -> tuple[float, float]:
    """The band ``[l, u]`` that :func:`polar_express_coefficients`'s schedule maps ``[lower_bound, 1]`` into.

    ``l`` is the image of ``lower_bound`` (attained) and ``u = 2 - l`` an upper bound: each step's
    polynomial is equioscillating (or recentred) on its interval, so its maximum there is at most
    ``2 - p(l)``, and ``p(x / safety) <= max p`` on the same interval. Exact arithmetic; a float64
    evaluation agrees to ~1e-15 (``tests/test_polar_express_solver.py``).

    Raises:
        ValueError: as :func:`polar_express_coefficients`.
    """
    return _polar_express(steps, lower_bound, safety, cushion)[1]
