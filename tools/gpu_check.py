"""One command for a reader with a CUDA GPU: is Newton–Schulz fast on this card? (Chapter 15.)

Measures, in bfloat16 with :func:`optbook.bench.run_benchmark` (median of ``--repeat`` timed runs after a
warm-up, CUDA-synchronised):

1. Newton–Schulz TFLOP/s on a 4096 x 16384 matrix against the measured cuBLAS bf16 rate of the same
   run's Gram product (a 4096 x 4096 x 16384 ``bmm``). Target: >= 75 % of it.
2. The symmetric Gram kernel :func:`optbook.kernels.gram_xxt` against ``torch.bmm(X, X.mT)`` at
   ``n >= 4096``. Target: >= 1.6x (it computes the tiles on and below the diagonal only: at most 2x).
3. Gram Newton–Schulz (``algorithm="gram"``) against the standard iteration at aspect ratios 4 and 8.
   Target: >= 1.4x at every aspect ratio >= 4 tried (the FLOP model, :func:`optbook.bench.ns_flops`, gives
   1.29x at 4:1 and 1.44x at 8:1 with the default restarts; a symmetric kernel for the m x m products
   would add more).

Writes a JSON report (``--json``, default ``gpu_check.json``) and prints one verdict line; the exit status
is 1 when the verdict is FAIL (a target missed), so that ``make gpu-check`` fails with it. ``--dry-run``
runs the same code on the CPU with small shapes (seconds; ``TRITON_INTERPRET=1`` so that the Triton
kernel itself runs when triton is installed): every path is exercised, no verdict is given on targets.

Run: ``python tools/gpu_check.py`` (a CUDA GPU) or ``python tools/gpu_check.py --dry-run``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys

import torch

TARGETS = {"ns_fraction_of_matmul": 0.75, "symmetric_speedup": 1.6, "gram_ns_speedup": 1.4}
#: (shapes, the size from which the symmetric kernel is judged, the NS shape) per mode.
MODES = {"gpu": ([(4096, 16384), (4096, 4096), (1024, 4096), (1024, 8192)], 4096, (4096, 16384)),
         "dry-run": ([(32, 128), (32, 32), (16, 64), (16, 128)], 32, (32, 128))}


def summarise(rows: list[dict], symmetric_from: int, ns_shape: tuple[int, int]) -> dict:
    """The three measured quantities from :func:`optbook.bench.run_benchmark`'s rows.

    Returns ``ns_fraction_of_matmul`` (batched Newton–Schulz at ``ns_shape``), ``symmetric_speedup`` (the
    smallest ``gram_xxt`` speed-up over ``bmm`` at ``min(m, n) >= symmetric_from``), ``gram_ns_speedup``
    (the smallest standard-over-Gram time ratio at aspect ratio >= 4), each ``None`` if not measured.
    """
    def rows_of(path):
        return [r for r in rows if r["path"] == path]

    ns = [r["fraction_of_matmul"] for r in rows_of("batched") if tuple(r["shape"]) == tuple(ns_shape)]
    sym = [r["fraction_of_matmul"] for r in rows_of("gram_symmetric") if min(r["shape"]) >= symmetric_from]
    standard = {tuple(r["shape"]): r["seconds"] for r in rows_of("batched")}
    gram = [standard[tuple(r["shape"])] / r["seconds"] for r in rows_of("gram")
            if max(r["shape"]) >= 4 * min(r["shape"]) and tuple(r["shape"]) in standard]
    return {"ns_fraction_of_matmul": min(ns) if ns else None, "symmetric_speedup": min(sym) if sym else None,
            "gram_ns_speedup": min(gram) if gram else None}


def verdict(measured: dict, dry_run: bool) -> str:
    parts = [f"{k} {'n/a' if v is None else f'{v:.3g}'} (target >= {TARGETS[k]})" for k, v in measured.items()]
    if dry_run:
        return "VERDICT: dry run on CPU with small shapes, no verdict on targets; " + "; ".join(parts)
    ok = all(v is not None and v >= TARGETS[k] for k, v in measured.items())
    return f"VERDICT: {'PASS' if ok else 'FAIL'}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, small shapes, no verdict on targets")
    parser.add_argument("--json", metavar="PATH", default="gpu_check.json", help="report path (gpu_check.json)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per measurement (5; dry run 1)")
    args = parser.parse_args(argv)
    mode = "dry-run" if args.dry_run else "gpu"
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device on this machine; run with --dry-run to exercise the script on the CPU")
    if args.repeat is not None and args.repeat < 1:
        parser.error(f"Invalid --repeat: expected >= 1, got {args.repeat}")
    if args.dry_run and importlib.util.find_spec("triton") is not None:
        os.environ["TRITON_INTERPRET"] = "1"   # read at every kernel call: the Triton kernel runs in numpy
    from optbook.bench import run_benchmark
    from optbook.kernels import gram_backend

    shapes, symmetric_from, ns_shape = MODES[mode]
    device = torch.device("cpu" if args.dry_run else "cuda")
    repeat = args.repeat or (1 if args.dry_run else 5)

    def progress(row):
        print(f"  {row['shape'][0]}x{row['shape'][1]} {row['path']:>14}: {row['seconds'] * 1e3:9.3f} ms "
              f"{row['tflops']:8.4f} TFLOP/s ({100 * row['fraction_of_matmul']:5.1f}% of matmul)", flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU"
    backend = gram_backend(torch.empty(0, device=device))
    print(f"gpu_check ({mode}) on {name}, torch {torch.__version__}, Gram kernel: {backend}", flush=True)
    rows = run_benchmark(shapes, ["bfloat16"], batch=1, repeat=repeat, device=device, progress=progress,
                         paths=("batched", "symmetric", "gram"))
    measured = summarise(rows, symmetric_from, ns_shape)
    line = verdict(measured, args.dry_run)
    report = {"mode": mode, "device": name, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gram_backend": backend, "targets": TARGETS,
              "measured": measured, "verdict": line, "results": rows}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(line, flush=True)
    return report


def exit_status(report: dict) -> int:
    """0 for a PASS or a dry run, 1 for a FAIL verdict (a target missed or not measured)."""
    return 1 if report["verdict"].startswith("VERDICT: FAIL") else 0


if __name__ == "__main__":
    sys.exit(exit_status(main()))
