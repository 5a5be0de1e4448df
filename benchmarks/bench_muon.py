"""Step time of optbook.optim.Muon vs torch.optim.Muon on the CPU.

A transformer-like set of hidden matrices (per layer: Q, K, V, O of d x d, MLP up 4d x d and down
d x 4d), float32 parameters, Newton–Schulz in bf16 for both, the same gradients, one process,
interleaved rounds timed with ``torch.utils.benchmark``. ``optbook`` stacks same-shaped matrices and
orthogonalises each stack in one batched call; ``torch.optim.Muon`` loops over matrices.
``optbook-auto`` adds ``ns_algorithm="auto"``: Gram Newton–Schulz for the 4:1 MLP matrices.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_muon.py --rounds 5``).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from recording import save
from torch.utils.benchmark import Timer

from optbook.optim import Muon


def transformer_matrices(layers: int = 4, width: int = 192) -> list[tuple[int, int]]:
    d = width
    return [(d, d)] * 4 * layers + [(4 * d, d), (d, 4 * d)] * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=192)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = transformer_matrices(args.layers, args.width)
    base = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) * 1e-2 for s in shapes]
    kinds = {"optbook": lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, scale_mode="spectral", extra_scale_factor=0.2),
             "optbook-auto": lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, scale_mode="spectral",
                                             extra_scale_factor=0.2, ns_algorithm="auto"),
             "torch": lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")}
    opts, params = {}, {}
    for kind, make in kinds.items():
        params[kind] = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params[kind], grads):
            p.grad = g.clone()
        opts[kind] = make(params[kind])
        opts[kind].step()

    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            timer = Timer("opt.step()", globals={"opt": opts[kind]}, num_threads=args.threads)
            times[kind].append(timer.timeit(3).median)

    # same algorithm, same inputs: the results agree to bf16 rounding, or the timing is void
    moved = max(float((a - b).detach().abs().max()) for a, b in zip(params["torch"], base))
    for kind in ("optbook", "optbook-auto"):
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(params[kind], params["torch"]))
        assert diff <= 0.05 * moved, f"{kind} and torch Muon diverged: {diff} vs moved {moved}"

    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    n = sum(a * b for a, b in shapes)
    lines = [f"Muon step, {len(shapes)} matrices ({n / 1e6:.1f}M parameters, width {args.width}), "
             f"{args.threads} threads, median of {args.rounds} rounds"]
    for kind in kinds:
        lines.append(f"{kind:<12} {median[kind]:8.1f} ms/step")
    ratios = {}
    for kind in ("optbook", "optbook-auto"):
        ratios[kind] = median[kind] / median["torch"]
        lines.append(f"{kind} / torch = {ratios[kind]:.2f} "
                     f"({'meets' if ratios[kind] <= 1.0 else 'MISSES'} the target <= 1.0)")
    save("bench_muon", lines, threads=args.threads, rounds=args.rounds, ratio=round(ratios["optbook"], 2),
         ratio_auto=round(ratios["optbook-auto"], 2), ms_per_step={k: round(median[k], 1) for k in kinds})


if __name__ == "__main__":
    main()
