"""The Triton kernel behind :mod:`optbook.kernels` (imported only when ``triton`` is installed).

One kernel computes one square tile of the symmetric output per program, and only the tiles on and
below the diagonal are launched: for ``nb = ceil(m / BLOCK)`` tile rows the grid is
``nb (nb + 1) / 2`` tiles (not ``nb^2``) times the batch, in one axis. Each program accumulates its
tile in float32 over the shared dimension, optionally adds the epilogue ``b A`` (the second Newton–Schulz
line), rounds once to the output dtype and writes the tile twice: at ``(i, j)`` and, transposed, at
``(j, i)``. On a diagonal tile the first store keeps the elements on and below the diagonal and the
mirrored store the ones strictly below it, so every output element is written exactly once and
``out[p, q]`` and ``out[q, p]`` are the same rounded number: the result is symmetric bit for bit.

The technique is that of modded-nanogpt's ``XXT`` and ``ba_plus_cAA`` (@byronxu99's symmetric matmul
kernels), microsoft/dion's ``ns_line_1`` / ``ns_line_2`` (``dion/newton_schulz_triton.py``) and NVIDIA
Emerging-Optimizers' ``tsyrk_ex`` (``emerging_optimizers/triton_kernels/syrk.py``). Those launch the
full ``nb x nb`` grid and return early above the diagonal, and store a diagonal tile whole (dion and
modded-nanogpt twice, as itself and transposed), so its two triangles are symmetric only as far as the
hardware's tile product is; here both triangles come from the same half of the tile. The code here is
our own.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

__all__ = ["launch"]


def _sym_gram_kernel(X_ptr, A_ptr, Out_ptr, M, K,
                     x_stride_b, x_stride_r, x_stride_c,
                     a_stride_b, a_stride_r, a_stride_c,
                     o_stride_b, o_stride_r, o_stride_c,
                     coef_b, coef_c,
                     BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EPILOGUE: tl.constexpr,
                     INTERPRET: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # out = X X^T                      (EPILOGUE False; coef_* unused)
    # out = coef_c X X^T + coef_b A    (EPILOGUE True; A symmetric, only its lower tiles are read)
    # one program per (matrix, lower tile), matrix-major in one grid axis (2^31 programs; axis 1 has 65535)
    tiles = (M + BLOCK - 1) // BLOCK
    tiles = tiles * (tiles + 1) // 2
    pid = tl.program_id(0)
    batch = (pid // tiles).to(tl.int64)
    pid = pid % tiles
    # tile pid -> (i, j), j <= i, row by row through the lower triangle: pid = i (i + 1) / 2 + j
    i = ((tl.sqrt((8 * pid + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)   # float rounding of the sqrt, either way
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    j = pid - i * (i + 1) // 2

    X_ptr += batch * x_stride_b
    Out_ptr += batch * o_stride_b
    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    # both operands are row blocks of X (rows i and rows j), loaded along the shared dimension
    x_rows = X_ptr + rows[:, None] * x_stride_r + ks[None, :] * x_stride_c
    x_cols = X_ptr + cols[:, None] * x_stride_r + ks[None, :] * x_stride_c
    row_ok = rows < M
    col_ok = cols < M

    # tl.full and (K + BLOCK_K - 1) // BLOCK_K, not tl.zeros and tl.cdiv: those are @triton.jit helpers,
    # made interpretable only when TRITON_INTERPRET=1 was set before triton was imported (builtins always are)
    acc = tl.full((BLOCK, BLOCK), 0.0, dtype=tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_ok = ks < K - k * BLOCK_K
        xr = tl.load(x_rows, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        xc = tl.load(x_cols, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if INTERPRET:  # the interpreter holds bf16 as uint16 bits and its dot is a numpy matmul of those
            # bits (garbage); products of bf16/fp16 numbers are exact in float32, so upcasting is safe
            xr = xr.to(tl.float32)
            xc = xc.to(tl.float32)
        acc = tl.dot(xr, tl.trans(xc), acc, input_precision=INPUT_PRECISION)
        x_rows += BLOCK_K * x_stride_c
        x_cols += BLOCK_K * x_stride_c

    tile_ok = row_ok[:, None] & col_ok[None, :]
    if EPILOGUE:
        A_ptr += batch * a_stride_b
        a = tl.load(A_ptr + rows[:, None] * a_stride_r + cols[None, :] * a_stride_c, mask=tile_ok, other=0.0)
        acc = coef_c * acc + coef_b * a.to(tl.float32)
    if INTERPRET and Out_ptr.dtype.element_ty == tl.bfloat16:
        # the interpreter's float32 -> bf16 cast truncates (a GPU rounds to nearest even): round the
        # float32 bits to nearest even at bf16's 8-bit significand first, so the cast is exact
        bits = acc.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        acc = bits.to(tl.float32, bitcast=True)
    tile = acc.to(Out_ptr.dtype.element_ty)

    # the tile at (i, j) and its transpose at (j, i); each output element is written once
    direct = Out_ptr + rows[:, None] * o_stride_r + cols[None, :] * o_stride_c
    mirror = Out_ptr + cols[:, None] * o_stride_r + rows[None, :] * o_stride_c
    mirror_ok = col_ok[:, None] & row_ok[None, :]
    if i == j:  # a diagonal tile: its lower half, then the strictly lower half again, transposed
        tl.store(direct, tile, mask=tile_ok & (rows[:, None] >= cols[None, :]))
        tl.store(mirror, tl.trans(tile), mask=mirror_ok & (cols[:, None] < rows[None, :]))
    else:       # below the diagonal: bounds masks only, so the stores can be vectorised
        tl.store(direct, tile, mask=tile_ok)
        tl.store(mirror, tl.trans(tile), mask=mirror_ok)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    """The jitted kernel; ``triton.jit`` picks the interpreter when ``TRITON_INTERPRET=1`` at decoration."""
    del interpret  # part of the cache key only: triton.jit reads the environment itself
    return triton.jit(_sym_gram_kernel)


def _default_blocks(M: int, K: int, interpret: bool, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """``(BLOCK, BLOCK_K)`` when the caller gives none.

    On a GPU the kernel must fit the shared memory one block may have (Triton refuses a launch above it:
    ``OutOfResources``): 99 KiB = 101376 bytes on compute capability 8.6, 8.9 and 12.0 (RTX 30xx/40xx/50xx,
    A10, L4), 64 KiB on 7.5 (T4). The software pipeline keeps two or three operand tile pairs there, so
    float32 128 x 64 tiles need 128 KiB; float32 therefore steps 32 along ``K`` at ``BLOCK = 128`` (64 KiB).
    ``tests/test_kernels.py`` compiles these defaults for sm_75 to sm_120 and checks each against its limit."""
    if interpret:   # numpy: fewer, larger tiles are faster; at least 16 (tl.dot's minimum)
        return 32, 64
    if M <= 1024:
        return 64, 64
    return (128, 32) if dtype == torch.float32 else (128, 64)


def _launch_options(BLOCK: int, interpret: bool) -> dict:
    """The compile options of a GPU launch (none under the interpreter)."""
    # enable_fp_fusion: c acc + b A as one fma (also silences Triton 3.9's warning about its default)
    return {} if interpret else dict(num_warps=8 if BLOCK >= 128 else 4, num_stages=3, enable_fp_fusion=True)


def launch(X: torch.Tensor, out: torch.Tensor, A: torch.Tensor | None, b: float, c: float,
           blocks: tuple[int, int] | None, interpret: bool) -> torch.Tensor:
    """Run the kernel on validated 3-D tensors: ``out = X X^T``, or ``c X X^T + b A`` when ``A`` is given.

    ``X``: ``(batch, M, K)``, any strides; ``out``: ``(batch, M, M)`` contiguous, X's dtype and device;
    ``A`` (the epilogue): ``(batch, M, M)``, symmetric. ``blocks``: ``(BLOCK, BLOCK_K)`` powers of two
    >= 16, or ``None`` for the defaults (``(32, 64)`` under the interpreter, :func:`_default_blocks`
    on a GPU).
    ``interpret``: ``TRITON_INTERPRET=1`` is set (the kernel runs in Triton's numpy interpreter).
    """
    batch, M, K = X.shape
    BLOCK, BLOCK_K = blocks or _default_blocks(M, K, interpret, X.dtype)
    nb = triton.cdiv(M, BLOCK)
    grid = (batch * (nb * (nb + 1) // 2),)
    epilogue = A is not None
    A_arg = A if epilogue else X
    a_strides = A.stride() if epilogue else (0, 0, 0)
    # float32 inputs: full-precision products (tl.dot's default on NVIDIA is TF32), as X @ X.mT with
    # torch's default torch.backends.cuda.matmul.allow_tf32 = False; ROCm accepts only "ieee" (dion notes it)
    precision = "ieee" if X.dtype == torch.float32 or interpret or torch.version.hip else "tf32"
    kwargs = _launch_options(BLOCK, interpret)
    # Triton launches on torch's current device and stream, not on X's: make X's device the current one
    with torch.cuda.device(X.device) if X.is_cuda else contextlib.nullcontext():
        _kernel(interpret)[grid](X, A_arg, out, M, K, *X.stride(), *a_strides, *out.stride(), float(b), float(c),
                                 BLOCK=BLOCK, BLOCK_K=BLOCK_K, EPILOGUE=epilogue, INTERPRET=interpret,
                                 INPUT_PRECISION=precision, **kwargs)
    return out
