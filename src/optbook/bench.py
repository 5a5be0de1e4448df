"""The Newton–Schulz FLOP model and its share of a training step. Explained in chapter 15.

Counting convention: one multiply-add is 2 FLOPs, and only matrix products are counted (what
``torch.utils.flop_counter.FlopCounterMode`` counts); the normalisation and the ``a X + ...`` axpys
are O(mn) per step against the products' O(m^2 n) and are left out.

One Newton–Schulz step on an ``m x n`` matrix, oriented so that ``m <= n`` (``newton_schulz``
transposes a tall input first, so the Gram matrix is ``min(m, n)`` square), costs

* ``A = X X^T``: ``2 m^2 n``,
* ``A^2``: ``2 m^3`` (skipped by a cubic step, ``c = 0``),
* ``B X`` with ``B = b A + c A^2``: ``2 m^2 n``,

so ``4 m^2 n + 2 m^3`` FLOPs per step. A training step costs about ``6 N T`` FLOPs for ``N``
parameters and ``T`` tokens (Kaplan et al. 2020, *Scaling Laws for Neural Language Models*, sec. 2.1:
2 N T forward, 4 N T backward; attention's context term left out). :func:`ns_overhead` gives the
ratio of the two counts for a decoder: ``(25/6) width / T`` for 5 steps when one rank does each
matrix's work, ``dp`` times that when every data-parallel rank does all of it.

``python -m optbook.bench`` measures the achieved rate of :func:`optbook.newton_schulz` against this
model; see :func:`main`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kernels import gram_backend, gram_xxt
from .polar import ALGORITHMS, GRAM_RESTARTS, check_restarts, newton_schulz, ns_schedule
from ._checks import check_int

__all__ = ["NSOverhead", "main", "ns_flops", "ns_overhead", "orthogonality_error", "run_benchmark",
           "transformer_muon_shapes"]


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise ValueError(f"Invalid shape: expected a sequence of ints (..., m, n), got {shape!r}") from None
    if len(dims) < 2 or any(d < 1 for d in dims) or any(d != s for d, s in zip(dims, shape)):
        raise ValueError(f"Invalid shape: expected (..., m, n) with every size a positive int, got {shape!r}")
    return dims


def ns_flops(shape: Sequence[int], steps: int = 5, coefficients="simple", *, algorithm: str = "standard",
             restarts: Sequence[int] = GRAM_RESTARTS) -> int:
    """Matrix-product FLOPs of one :func:`optbook.newton_schulz` call on a tensor of ``shape``.

    Args:
        shape: ``(..., m, n)``; leading sizes are a batch of matrices (a ``torch.Size`` works).
        steps, coefficients, algorithm, restarts: as in :func:`optbook.newton_schulz`; a step whose
            ``c`` is 0 (the cubic) has no ``A^2`` (or ``R^2``) product. ``precondition="aol"`` reuses
            step 0's Gram product and adds no product, so it is not an argument here.

    Returns:
        FLOPs (int; a multiply-add counts 2), with ``m = min`` and ``n = max`` of the last two sizes,
        times the batch. ``"standard"``: the sum over steps of ``4 m^2 n + 2 m^3 [c != 0]``.
        ``"gram"``: ``2 m^2 n`` for ``R = X X^T``, then per step ``t``: ``2 m^3 [c != 0]`` for ``R^2``,
        ``2 m^3`` for ``Q h(R)`` unless ``Q`` is the identity (``t = 0`` or a restart), ``4 m^3`` for
        ``R <- h(R) R h(R)`` unless ``t`` is the last step or the next one restarts, ``4 m^2 n`` at a
        restart (``Q X``, then ``X X^T``), and ``2 m^2 n`` for the final ``Q X``. Equals what
        ``FlopCounterMode`` counts for the real call (``tests/test_bench.py``,
        ``tests/test_gram_newton_schulz.py``).

    Raises:
        ValueError: a bad ``shape`` (fewer than 2 sizes, a size < 1), ``steps``, ``coefficients``,
            ``algorithm`` or ``restarts``.
    """
    dims = _shape(shape)
    schedule = ns_schedule(coefficients, steps)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Invalid algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    restart_at = check_restarts(restarts)
    m, n = sorted(dims[-2:])
    batch = math.prod(dims[:-2])
    if algorithm == "standard":
        return batch * sum(4 * m * m * n + (2 * m ** 3 if c != 0 else 0) for _, _, c in schedule)
    total = 2 * m * m * n + 2 * m * m * n                      # R = X X^T at the start, Q X at the end
    for t, (_, _, c) in enumerate(schedule):
        if t in restart_at:
            total += 4 * m * m * n
        total += 2 * m ** 3 if c != 0 else 0
        total += 2 * m ** 3 if t > 0 and t not in restart_at else 0
        total += 4 * m ** 3 if t < len(schedule) - 1 and t + 1 not in restart_at else 0
    return batch * total


def transformer_muon_shapes(width: int, depth: int, mlp_ratio: float = 4.0) -> list[tuple[int, int]]:
    """The Muon matrices ``(fan_out, fan_in)`` of a GPT-style decoder (what ``muon_param_groups`` routes).

    Per layer: Q, K, V and the output projection, each ``width x width`` (multi-head attention,
    orthogonalised as whole matrices), and the MLP's ``(h, width)`` and ``(width, h)`` with
    ``h = round(mlp_ratio * width)``. Embeddings, the output head, norms and biases go to AdamW.

    Raises:
        ValueError: ``width``, ``depth`` not ints >= 1, or ``mlp_ratio * width`` below 1.
    """
    for name, value in (("width", width), ("depth", depth)):
        check_int(name, value, 1)
    hidden = round(mlp_ratio * width)
    if hidden < 1:
        raise ValueError(f"Invalid mlp_ratio: mlp_ratio * width must round to >= 1, got {mlp_ratio!r}")
    return [(width, width)] * (4 * depth) + [(hidden, width), (width, hidden)] * depth


@dataclass(frozen=True)
class NSOverhead:
    """Newton–Schulz FLOPs of one optimizer step against the training FLOPs of that step.

    Every FLOP count is summed over all ``dp`` data-parallel ranks, per optimizer step.

    Attributes:
        params: ``N``, the parameters in the ``6 N T`` count (the Muon matrices plus the output
            head ``vocab_size * width``; the input embedding is a lookup, 0 FLOPs).
        muon_params: parameters in Muon matrices.
        train_flops: ``6 N T`` with ``T = batch_tokens`` (the global batch).
        ns_flops: Newton–Schulz FLOPs of all Muon matrices, times ``dp`` when every rank
            orthogonalises every matrix (replicated), once when each matrix has one owner (sharded).
        ratio: ``ns_flops / train_flops`` (0.01 is 1 %).
    """

    params: int
    muon_params: int
    train_flops: int
    ns_flops: int
    ratio: float


def ns_overhead(width: int, depth: int, batch_tokens: int, dp: int = 1, *, sharded: bool = False,
                steps: int = 5, coefficients="simple", mlp_ratio: float = 4.0,
                vocab_size: int = 0) -> NSOverhead:
    """Newton–Schulz cost of one Muon step for a decoder of ``depth`` layers of ``width``, vs ``6 N T``.

    With replicated work (every one of the ``dp`` ranks orthogonalises every full matrix, the plain
    way to run Muon under DDP) the ratio is about
    ``dp * 5 * 60 width^3 depth / (6 * 12 width^2 depth * T) = 4.2 dp width / T`` for 5 steps,
    ``mlp_ratio=4`` and no head: it grows with width and data parallelism and shrinks with the batch.
    With sharded work (each matrix orthogonalised by one rank, then gathered, as modded-nanogpt's
    Muon splits its parameters over the ranks) the factor ``dp`` goes away; the communication is
    not counted here. Depth cancels unless ``vocab_size`` adds the head to ``N``.

    Args:
        width: model width ``d`` (int >= 1).
        depth: number of layers (int >= 1).
        batch_tokens: tokens per optimizer step over all ranks and micro-batches, ``T`` (int >= 1).
        dp: data-parallel degree (int >= 1).
        sharded: ``True`` when each matrix's Newton–Schulz runs on one rank only.
        steps, coefficients: the schedule (see :func:`ns_flops`).
        mlp_ratio: MLP hidden size over width.
        vocab_size: output-head rows counted in ``N`` (0 leaves the head out, Kaplan's non-embedding ``N``).

    Returns:
        :class:`NSOverhead` (FLOPs as ints, ``ratio`` a float).

    Raises:
        ValueError: a size argument that is not an int >= 1 (``vocab_size`` may be 0), naming it.
    """
    for name, value, low in (("batch_tokens", batch_tokens, 1), ("dp", dp, 1), ("vocab_size", vocab_size, 0)):
        check_int(name, value, low)
    shapes = transformer_muon_shapes(width, depth, mlp_ratio)
    muon_params = sum(m * n for m, n in shapes)
    params = muon_params + vocab_size * width
    ns = sum(ns_flops(s, steps, coefficients) for s in shapes) * (1 if sharded else dp)
    train = 6 * params * batch_tokens
    return NSOverhead(params=params, muon_params=muon_params, train_flops=train, ns_flops=ns,
                      ratio=ns / train)


# ---------------------------------------------------------------- the benchmark CLI

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float64": torch.float64}
_CPU_SHAPES = "64x64,64x256,128x512"
_PATHS = ("plain", "batched", "symmetric", "gram")
_SYMMETRIC_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GPU_SHAPES = "1024x1024,1024x4096,4096x4096,4096x16384"


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"Invalid --shapes: expected MxN[,MxN...] of positive ints, "
                                             f"got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def _names(flag: str, allowed):
    """An argparse type: a comma-separated list of names from ``allowed``, refused naming ``flag``."""
    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",")]
        bad = [t for t in names if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"Invalid {flag}: {bad} not in {sorted(allowed)}")
        return names
    return parse


_parse_dtypes = _names("--dtypes", _DTYPES)
_parse_paths = _names("--paths", _PATHS)


def _timer(device: torch.device):
    """Seconds of ``fn()``, the median of ``repeat`` runs after one warm-up (CUDA: synchronised)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(fn, repeat: int) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    return measure


def orthogonality_error(O: torch.Tensor) -> float:
    """``||O O^T - I||_2`` (spectral norm) of the wide orientation of ``O``, the max over a batch.

    Equals ``max_i |s_i^2 - 1|`` over the singular values ``s_i`` of ``O`` (``min(m, n)`` of them):
    0 for the exact polar factor of a full-rank input, 1 where a direction is lost (``s_i = 0``),
    about 0.54 after five "simple" steps on inputs whose singular values reach down to 1e-2 (their
    band starts at 0.68).

    Args:
        O: ``(..., m, n)`` real floating tensor (any dtype; computed in float64 on its device).

    Returns:
        A Python float (dimensionless).

    Raises:
        ValueError: ``O`` has fewer than 2 dimensions.
    """
    if O.ndim < 2:
        raise ValueError(f"Invalid O: expected shape (..., m, n), got {tuple(O.shape)}")
    X = O.double()
    if X.shape[-2] > X.shape[-1]:
        X = X.mT
    eye = torch.eye(X.shape[-2], dtype=X.dtype, device=X.device)
    # X X^T - I is symmetric: its spectral norm is its largest |eigenvalue| (eigvalsh, cheaper than an SVD)
    return float(torch.linalg.eigvalsh(X @ X.mT - eye).abs().max())


def run_benchmark(shapes: Sequence[tuple[int, int]], dtypes: Sequence[str], batch: int = 4, steps: int = 5,
                  coefficients="simple", repeat: int = 3, device: str | torch.device = "cpu", seed: int = 0,
                  progress=None, paths: Sequence[str] = ("plain", "batched")) -> list[dict]:
    """Time :func:`optbook.newton_schulz` per shape, dtype and path; one dict per measurement.

    Paths: ``"plain"`` calls ``newton_schulz`` once per matrix of a batch of ``batch`` same-shape
    matrices; ``"batched"`` makes one call on the ``(batch, m, n)`` stack (one ``bmm`` per product).
    ``"matmul"`` is the reference rate of the same run, in the same dtype on the same device: the Gram
    product ``W W^T`` of the wide orientation ``W`` (``(batch, k, l)``, ``k = min(m, n)``,
    ``l = max(m, n)``) in one ``torch.bmm``, ``2 k^2 l`` FLOPs per matrix (a ``k x k x l`` matmul).
    ``"symmetric"`` (in ``paths``) adds two rows: ``"gram_symmetric"``, the same Gram product by
    :func:`optbook.kernels.gram_xxt` (tiles on and below the diagonal only; its ``fraction_of_matmul`` is
    the Gram step's speed-up over ``bmm``, as it is credited the full ``2 k^2 l``), and ``"symmetric"``,
    the batched call with ``gram="symmetric"``. Both only for float16/bfloat16/float32; on a CPU they time
    torch's products unless ``TRITON_INTERPRET=1`` (:func:`optbook.kernels.gram_backend`). ``"gram"``: the
    batched call with ``algorithm="gram"`` (Gram Newton–Schulz, default restarts), credited its own
    :func:`ns_flops`; its speed-up over the standard iteration is the ratio of the two ``seconds``.

    Args:
        shapes: ``(m, n)`` pairs. dtypes: names, keys of ``bfloat16 float16 float32 float64``.
        batch: same-shape matrices per measurement. steps, coefficients: the schedule.
        repeat: timed runs per measurement after one warm-up; the median is kept.
        device: where to run (CUDA timings are synchronised). seed: of the Gaussian inputs.
        progress: called with each result dict as it is measured (``None``: silent).
        paths: of ``"plain"``, ``"batched"``, ``"symmetric"``, ``"gram"`` (the matmul row is always measured).

    Raises:
        ValueError: an unknown dtype name or path, ``batch`` or ``repeat`` below 1, a bad ``steps`` or
            ``coefficients`` (before anything is timed).

    Returns:
        Dicts with ``shape`` ([m, n]), ``batch``, ``dtype``, ``path``, ``seconds`` (median wall time of
        one call over the batch), ``flops`` (model, :func:`ns_flops`), ``tflops`` (achieved, 1e12 FLOP/s),
        ``matmul_tflops``, ``fraction_of_matmul`` and ``orthogonality_error`` (:func:`orthogonality_error`
        of the batched output; ``None`` for the matmul rows).
    """
    bad = [name for name in dtypes if name not in _DTYPES]
    if bad:
        raise ValueError(f"Invalid dtypes: {bad} not in {sorted(_DTYPES)}")
    for name, value in (("batch", batch), ("repeat", repeat)):
        check_int(name, value, 1)
    bad = [name for name in paths if name not in _PATHS]
    if bad or not paths:
        raise ValueError(f"Invalid paths: expected a non-empty subset of {list(_PATHS)}, got {list(paths)}")
    ns_schedule(coefficients, steps)
    device = torch.device(device)
    measure = _timer(device)
    rows = []

    def add(**row):
        rows.append(row)
        if progress is not None:
            progress(row)

    generator = torch.Generator(device="cpu").manual_seed(seed)
    for m, n in shapes:
        G32 = torch.randn(batch, m, n, generator=generator).to(device)
        small, large = min(m, n), max(m, n)  # the wide orientation newton_schulz works on
        for name in dtypes:
            dtype = _DTYPES[name]
            G = G32.to(dtype)
            W = (G if m <= n else G.mT).contiguous()
            # W W^T with the transpose as a view, as newton_schulz's X @ X.mT (CPU bf16/fp16 bmm is
            # several times faster with a column-major right operand: the rate newton_schulz gets)
            mm_seconds = measure(lambda: torch.bmm(W, W.mT), repeat)
            mm_flops = 2 * batch * small * small * large
            mm_tflops = mm_flops / mm_seconds / 1e12
            add(shape=[m, n], batch=batch, dtype=name, path="matmul", seconds=mm_seconds, flops=mm_flops,
                tflops=mm_tflops, matmul_tflops=mm_tflops, fraction_of_matmul=1.0, orthogonality_error=None)
            flops = ns_flops((batch, m, n), steps, coefficients)
            if "symmetric" in paths and dtype in _SYMMETRIC_DTYPES:
                gram_seconds = measure(lambda: gram_xxt(W), repeat)
                add(shape=[m, n], batch=batch, dtype=name, path="gram_symmetric", seconds=gram_seconds,
                    flops=mm_flops, tflops=mm_flops / gram_seconds / 1e12, matmul_tflops=mm_tflops,
                    fraction_of_matmul=mm_seconds / gram_seconds, orthogonality_error=None)
            calls = {"plain": lambda: [newton_schulz(g, steps, coefficients, dtype=dtype) for g in G],
                     "batched": lambda: newton_schulz(G, steps, coefficients, dtype=dtype),
                     "symmetric": lambda: newton_schulz(G, steps, coefficients, dtype=dtype,
                                                        gram="symmetric"),
                     "gram": lambda: newton_schulz(G, steps, coefficients, dtype=dtype, algorithm="gram")}
            for path, fn in calls.items():
                if path not in paths or (path == "symmetric" and dtype not in _SYMMETRIC_DTYPES):
                    continue
                seconds = measure(fn, repeat)
                path_flops = ns_flops((batch, m, n), steps, coefficients, algorithm="gram") if path == "gram" \
                    else flops
                tflops = path_flops / seconds / 1e12
                error = orthogonality_error(fn()) if path != "plain" else None
                add(shape=[m, n], batch=batch, dtype=name, path=path, seconds=seconds, flops=path_flops,
                    tflops=tflops, matmul_tflops=mm_tflops, fraction_of_matmul=tflops / mm_tflops,
                    orthogonality_error=error)
    return rows


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def main(argv: Sequence[str] | None = None) -> dict:
    """``python -m optbook.bench``: Newton–Schulz TFLOP/s per shape and path, against the matmul rate.

    Prints one line per measurement as it is made (the progress of a long run) and returns the report; with
    ``--json PATH`` also writes it there (device, torch version, date, arguments, rows as in
    :func:`run_benchmark`). Defaults: CUDA when present (shapes up to 4096 x 16384), else CPU with
    small shapes (seconds on 2 cores); paths plain and batched, plus symmetric where the Triton kernel
    compiles (a CUDA device with triton installed). ``--help`` lists the options.
    """
    parser = argparse.ArgumentParser(prog="python -m optbook.bench",
                                     description=main.__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--shapes", type=_parse_shapes, default=None,
                        help=f"MxN,... (default CPU {_CPU_SHAPES}; GPU {_GPU_SHAPES})")
    parser.add_argument("--dtypes", type=_parse_dtypes, default=_parse_dtypes("bfloat16,float32"),
                        help="comma-separated, of " + ", ".join(_DTYPES) + " (default bfloat16,float32)")
    parser.add_argument("--batch", type=int, default=4,
                        help="same-shape matrices per measurement (default 4)")
    parser.add_argument("--steps", type=int, default=5, help="Newton-Schulz steps (default 5)")
    parser.add_argument("--coefficients", default="simple", help="schedule name (default simple)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs per measurement, median kept (default 3)")
    parser.add_argument("--paths", type=_parse_paths, default=None,
                        help="comma-separated, of " + ", ".join(_PATHS) + " (default plain,batched, and "
                             "symmetric on a GPU with triton)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON to PATH")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeat < 1:
        parser.error(f"Invalid --batch/--repeat: expected >= 1, got {args.batch}/{args.repeat}")
    try:
        ns_schedule(args.coefficients, args.steps)
    except ValueError as err:
        parser.error(str(err))
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        parser.error(f"Invalid --device: {err}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("Invalid --device: CUDA is not available on this machine (use --device cpu)")
    shapes = args.shapes or _parse_shapes(_GPU_SHAPES if device.type == "cuda" else _CPU_SHAPES)
    backend = gram_backend(torch.empty(0, device=device))
    paths = args.paths or ["plain", "batched"] + (["symmetric"] if backend == "triton" else [])

    def progress(row):
        print(f"  {row['shape'][0]}x{row['shape'][1]} x{row['batch']} {row['dtype']:>8} {row['path']:>14}: "
              f"{row['seconds'] * 1e3:9.3f} ms {row['tflops']:8.4f} TFLOP/s "
              f"({100 * row['fraction_of_matmul']:5.1f}% of matmul)"
              + ("" if row["orthogonality_error"] is None
                 else f"  ||OO^T-I||_2 {row['orthogonality_error']:.3g}"),
              flush=True)

    print(f"optbook.bench on {_device_name(device)}, torch {torch.__version__}"
          + (f"; symmetric Gram kernels: {backend}" if "symmetric" in paths else ""), flush=True)
    rows = run_benchmark(shapes, args.dtypes, batch=args.batch, steps=args.steps,
                         coefficients=args.coefficients, repeat=args.repeat, device=device, progress=progress,
                         paths=paths)
    report = dict(device=_device_name(device), device_type=device.type, torch=torch.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  arguments=dict(shapes=[list(s) for s in shapes], dtypes=args.dtypes, batch=args.batch,
                                 steps=args.steps, coefficients=args.coefficients, repeat=args.repeat,
                                 paths=paths),
                  gram_backend=backend if "symmetric" in paths else None, results=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
