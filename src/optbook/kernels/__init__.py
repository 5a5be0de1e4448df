"""Triton kernels: the symmetric Gram product of Newton–Schulz. Explained in chapter 15.

Each Newton–Schulz step (:func:`optbook.newton_schulz`) forms ``A = X X^T`` and ``B = b A + c A^2``.
Both are symmetric, so a kernel needs only the tiles on and below the diagonal: it computes those and
writes each one a second time, transposed, above the diagonal. That about halves the FLOPs of the two
products: with tiles of ``BLOCK`` rows and ``BLOCK`` dividing ``m``, ``m (m + BLOCK) n`` instead of
``2 m^2 n`` for ``X X^T`` and ``m (m + BLOCK) m`` instead of ``2 m^3`` for ``A^2``. ``B X`` is a plain
product and stays with ``torch``.

* :func:`gram_xxt` — ``X X^T``, the first line;
* :func:`gram_poly` — ``b A + c A A^T`` (``= b A + c A^2`` for a symmetric ``A``), the second line,
  fused: the ``b A`` term is added to the float32 accumulator before the one rounding;
* :func:`gram_backend` — which implementation a call would run.

Where each runs (the same on every call; :func:`gram_backend` tells):

* CUDA tensors: the compiled Triton kernel (``"triton"``).
* CPU tensors with ``TRITON_INTERPRET=1`` in the environment: the *same* kernel, run by Triton's
  numpy interpreter (``"triton-interpreter"``; slow, for tests: this is how CI checks the kernel without
  a GPU). The variable is read on every call (the kernel is jitted once per mode), so it may be set
  at any time before a call, whether or not triton was already imported.
* Otherwise (CPU without the variable, or ``triton`` not installed): torch's ``X @ X.mT`` and
  ``torch.baddbmm`` (``"torch"``). These are the same mathematics but *not* bit-for-bit symmetric.

Precision: products of float16/bfloat16 inputs are accumulated in float32 and rounded once to the
input dtype (torch's CUDA matmul may instead reduce split-K partial sums in the low precision while
``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` / ``..._fp16_...`` are True, their
default); float32 inputs use full float32 products (no TF32), as torch's
default on CUDA. The order of the float32 sums differs from cuBLAS's, so results agree with ``X @ X.mT``
to rounding, not bit for bit. (Triton's interpreter casts float32 to bfloat16 by truncation; under it
the kernel rounds to nearest even itself first, so it rounds as a GPU and torch do.)

Sources (see ``book/references.bib``): the symmetric-tile technique of modded-nanogpt's Triton ``XXT``
and ``ba_plus_cAA`` kernels (``jordan2024moddednanogpt``, ``triton_kernels.py``), microsoft/dion's
``ns_line_1`` / ``ns_line_2`` (``dion2025code``, ``dion/newton_schulz_triton.py``) and NVIDIA
Emerging-Optimizers' ``tsyrk_ex`` (``nvidia2025emergingoptimizers``,
``emerging_optimizers/triton_kernels/syrk.py``); Triton itself (``tillet2019triton``). Ours differs
in launching only the lower-triangular tiles (those launch the full grid and return early) and in
writing each output element once, both triangles of a diagonal tile from its lower half, so the output
is symmetric by construction. The code is our own.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["gram_backend", "gram_poly", "gram_xxt"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def gram_backend(X: torch.Tensor) -> str:
    """Which implementation :func:`gram_xxt` / :func:`gram_poly` run for a tensor on ``X``'s device.

    Returns:
        ``"triton"`` (CUDA tensor, triton installed, no ``TRITON_INTERPRET=1``), ``"triton-interpreter"``
        (``TRITON_INTERPRET=1`` and triton installed: any device, the kernel runs in numpy) or ``"torch"``
        (otherwise: torch's own products).
    """
    if not _HAS_TRITON:
        return "torch"
    if _interpreting():
        return "triton-interpreter"
    return "triton" if X.device.type == "cuda" else "torch"


def _check_blocks(blocks):
    if blocks is None:
        return None
    def power_of_two(b):
        return isinstance(b, int) and not isinstance(b, bool) and b >= 16 and b & (b - 1) == 0
    if not (isinstance(blocks, (tuple, list)) and len(blocks) == 2 and all(map(power_of_two, blocks))):
        raise ValueError(f"Invalid blocks: expected (BLOCK, BLOCK_K), two powers of two >= 16, "
                         f"got {blocks!r}")
    return tuple(blocks)


def _check_input(name: str, X) -> None:
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"Invalid {name}: expected a torch.Tensor, got {type(X).__name__}")
    if X.dtype not in _DTYPES:
        raise TypeError(f"Invalid {name}: expected dtype float16, bfloat16 or float32, got {X.dtype}")
    if X.ndim not in (2, 3):
        raise ValueError(f"Invalid {name}: expected a 2-D (m, n) or batched 3-D (batch, m, n) tensor, "
                         f"got shape {tuple(X.shape)}")
    if X.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"Invalid {name}: it requires grad and the kernels have no backward; call under "
                         f"torch.no_grad() (as an optimizer step does) or pass {name}.detach()")
    if any(s == 0 for s in X.shape):
        raise ValueError(f"Invalid {name}: expected every size >= 1, got shape {tuple(X.shape)}")
    # the kernel indexes within one matrix, input or (m, m) result, in int32 (the batch offset is int64)
    span = max(sum((s - 1) * abs(st) for s, st in zip(X.shape[-2:], X.stride()[-2:])), X.shape[-2] ** 2)
    if span >= 2 ** 31:
        raise ValueError(f"Invalid {name}: one matrix or its (m, m) result spans {span} elements; the "
                         f"kernel indexes fewer than 2**31")


def _check_out(out, X: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=X.dtype, device=X.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"Invalid out: expected a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != X.dtype or out.device != X.device:
        raise ValueError(f"Invalid out: expected shape {shape}, dtype {X.dtype} on {X.device}, got shape "
                         f"{tuple(out.shape)}, dtype {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("Invalid out: expected a contiguous tensor")
    if out.untyped_storage().data_ptr() == X.untyped_storage().data_ptr():
        raise ValueError("Invalid out: it shares memory with the input")
    return out


def _run(X: torch.Tensor, out: torch.Tensor, A: torch.Tensor | None, b: float, c: float,
         blocks) -> torch.Tensor:
    from . import _triton_gram   # imports triton (on first use only)

    batched = X.ndim == 3
    X3 = X if batched else X.unsqueeze(0)
    out3 = out if batched else out.unsqueeze(0)
    A3 = None if A is None else (A if batched else A.unsqueeze(0))
    _triton_gram.launch(X3, out3, A3, b, c, blocks, interpret=_interpreting())
    return out


def gram_xxt(X: torch.Tensor, out: torch.Tensor | None = None, *,
             blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """The symmetric Gram product ``A = X X^T``, computing only the tiles on and below the diagonal.

    Args:
        X: ``(m, n)`` or ``(batch, m, n)``, float16, bfloat16 or float32, any strides (a transposed
            view works; nothing is copied).
        out: optional ``(m, m)`` / ``(batch, m, m)`` contiguous tensor of ``X``'s dtype and device,
            not sharing ``X``'s memory; written and returned.
        blocks: ``(BLOCK, BLOCK_K)``, the output tile and the step along ``n``, powers of two >= 16
            (``None``: chosen by size, dtype and device). Tests use small tiles to cross tile edges.

    Returns:
        ``A`` of shape ``(m, m)`` / ``(batch, m, m)`` in ``X``'s dtype: float32 accumulation, one
        rounding. On the Triton backends ``A`` equals ``A^T`` bit for bit; on the torch fallback (a CPU
        tensor without ``TRITON_INTERPRET=1``, see :func:`gram_backend`) it is ``X @ X.mT``.

    Raises:
        TypeError: ``X`` (or ``out``) not a tensor, or ``X`` of another dtype.
        ValueError: ``X`` not 2-D/3-D, with a size 0, or requiring grad while grad mode is on (no
            backward); a bad ``out`` (shape, dtype, device, layout, shares ``X``'s memory) or ``blocks``.
    """
    _check_input("X", X)
    blocks = _check_blocks(blocks)
    m = X.shape[-2]
    out = _check_out(out, X, (*X.shape[:-1], m))
    if gram_backend(X) == "torch":
        return torch.matmul(X, X.mT, out=out)
    return _run(X, out, None, 0.0, 1.0, blocks)


def gram_poly(A: torch.Tensor, b: float, c: float, out: torch.Tensor | None = None, *,
              blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """The second Newton–Schulz line ``B = b A + c A^2`` for a symmetric ``A``, fused and symmetric.

    Computes ``c A A^T + b A`` tile by tile on and below the diagonal (``A A^T = A^2`` because ``A`` is
    symmetric), adding ``b A`` to the float32 accumulator before the single rounding (a fused
    multiply-add, like ``torch.baddbmm(A, A, A, beta=b, alpha=c)``), and mirrors each tile.

    Args:
        A: ``(m, m)`` or ``(batch, m, m)``, float16, bfloat16 or float32, symmetric (e.g. from
            :func:`gram_xxt`). Only its tiles on and below the diagonal are read for the ``b A`` term;
            an ``A`` that is not symmetric gets the lower triangle's values mirrored there.
        b, c: the step's coefficients (Python numbers).
        out, blocks: as in :func:`gram_xxt`.

    Returns:
        ``B`` of ``A``'s shape and dtype; symmetric bit for bit on the Triton backends. The torch
        fallback (see :func:`gram_backend`) is ``torch.baddbmm(A, A, A.mT, beta=b, alpha=c)``
        (``b * A`` when ``c == 0``).

    Raises:
        TypeError: ``A`` not a tensor or of another dtype; ``b`` or ``c`` not a real number.
        ValueError: ``A`` not square 2-D/3-D or requiring grad (as for ``X`` in :func:`gram_xxt`);
            ``b`` or ``c`` not finite; a bad ``out`` or ``blocks``.
    """
    _check_input("A", A)
    if A.shape[-1] != A.shape[-2]:
        raise ValueError(f"Invalid A: expected square matrices (..., m, m), got shape {tuple(A.shape)}")
    for name, value in (("b", b), ("c", c)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"Invalid {name}: expected a real number, got {type(value).__name__}")
        if not abs(float(value)) < float("inf"):
            raise ValueError(f"Invalid {name}: expected a finite number, got {value!r}")
    blocks = _check_blocks(blocks)
    out = _check_out(out, A, tuple(A.shape))
    if gram_backend(A) == "torch":
        if c == 0:   # b A, as newton_schulz does (it reports CPU baddbmm with alpha=0 dropping beta)
            return torch.mul(A, b, out=out)
        if A.ndim == 2:
            return torch.addmm(A, A, A.mT, beta=b, alpha=c, out=out)
        return torch.baddbmm(A, A, A.mT, beta=b, alpha=c, out=out)
    return _run(A, out, A, float(b), float(c), blocks)
