"""Newton–Schulz throughput per shape, dtype and path (``python -m optbook.bench``), recorded for the README.

Runs :func:`optbook.bench.main` with the arguments given (``--help`` lists them; default: CUDA when
present, else the small CPU shapes, seconds on 2 cores), then prints one table -- achieved TFLOP/s from
the FLOP model and the fraction of a plain matmul's rate measured in the same run and dtype -- with the
environment line, and records both in ``benchmarks/results/bench_newton_schulz.json``.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_newton_schulz.py --device cpu``).
"""

from __future__ import annotations

import sys

import torch
from recording import save

from optbook.bench import main as bench_main


def main(argv: list[str] | None = None) -> None:
    report = bench_main(sys.argv[1:] if argv is None else argv)
    lines = [f"Newton-Schulz ({report['arguments']['steps']} steps, {report['arguments']['coefficients']}) "
             f"on {report['device']}, batches of {report['arguments']['batch']}, "
             f"median of {report['arguments']['repeat']}",
             f"{'shape':<10} {'dtype':<9} {'path':<15} {'ms':>9} {'TFLOP/s':>8} {'of matmul':>10}"]
    for row in report["results"]:
        shape = "x".join(map(str, row["shape"]))
        lines.append(f"{shape:<10} {row['dtype']:<9} {row['path']:<15} {row['seconds'] * 1e3:9.3f} "
                     f"{row['tflops']:8.4f} {100 * row['fraction_of_matmul']:9.0f}%")
    save("bench_newton_schulz", lines, threads=torch.get_num_threads(), device=report["device"],
         rows=report["results"])


if __name__ == "__main__":
    main()
