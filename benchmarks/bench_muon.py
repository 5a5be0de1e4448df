"""Step time of optbook.optim.Muon vs torch.optim.Muon on the CPU.

A transformer-like set of hidden matrices (per layer: Q, K, V, O of d x d, MLP up 4d x d and down
d x 4d), float32 parameters, Newton–Schulz in bf16 for both, the same gradients, one process,
interleaved rounds timed with ``torch.utils.benchmark`` (every contender is timed once per round, in
turn, so that load from other processes hits all of them alike; medians over the rounds, and the median
of the per-round ratios to ``torch.optim.Muon``, which is steadier when the load changes within a run).

Contenders: ``torch.optim.Muon`` (one matrix at a time); ``optbook`` (default options: same-shaped
matrices, up to a transpose, orthogonalised in one batched call); ``optbook-auto`` (the same with
``ns_algorithm="auto"``: Gram Newton–Schulz for the 4:1 MLP matrices, 1.29x fewer FLOPs);
``optbook-turbo`` (``optbook-auto`` with AOL preconditioning and 4 steps of
``optbook.optim.TURBO_SCHEDULE``, Turbo-Muon's recipe: 4/5 of the products; a different polynomial, so it
is not checked against torch's result but for how close its update comes to the polar factor);
``optbook-compiled`` (``optbook.optim.compiled_muon_step`` over ``optbook-auto``: momentum, the
batched Newton–Schulz and the update in one ``torch.compile``-d graph; the compilation is done before
the timing and reported).

Quality, next to the times: the first step's update of every matrix (momentum at its first step is the
gradient), scaled by its least-squares factor onto the exact polar factor ``U V^T`` of the gradient
(float64 SVD), and the relative error ``||c O - U V^T||_F / ||U V^T||_F`` averaged over the matrices.
A faster Muon counts only at a quality no worse than torch's. The table is printed with the environment (threads, ``OMP_WAIT_POLICY``,
the CPU's bf16 support, the 1-minute load average) because on a shared machine it decides the numbers.

Run: ``make bench`` (or ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_muon.py --rounds 7``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from recording import save
from torch._dynamo.utils import counters
from torch.utils.benchmark import Timer

from optbook.optim import TURBO_SCHEDULE, Muon, compiled_muon_step

TARGET = 0.8   # optbook / torch.optim.Muon


def transformer_matrices(layers: int = 4, width: int = 192) -> list[tuple[int, int]]:
    d = width
    return [(d, d)] * 4 * layers + [(4 * d, d), (d, 4 * d)] * layers


def environment(threads: int) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"torch {torch.__version__}, {platform.machine()} CPU with {os.cpu_count()} cores, {threads} threads, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
            f"capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
            f"{'native' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'emulated'}, "
            f"load average (1 min) {load:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = transformer_matrices(args.layers, args.width)
    base = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) * 1e-2 for s in shapes]
    hyper = dict(lr=0.02, weight_decay=0.1, scale_mode="spectral", extra_scale_factor=0.2)
    kinds = {"torch": lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
             "optbook": lambda ps: Muon(ps, **hyper),
             "optbook-auto": lambda ps: Muon(ps, **hyper, ns_algorithm="auto"),
             "optbook-turbo": lambda ps: Muon(ps, **hyper, ns_algorithm="auto", ns_precondition="aol", ns_steps=4,
                                              coefficients=TURBO_SCHEDULE)}
    if not args.no_compile:
        kinds["optbook-compiled"] = lambda ps: Muon(ps, **hyper, ns_algorithm="auto")
    # quality: the first update of each matrix against the exact polar factor of its gradient
    polar = []
    for g in grads:
        U, _, Vh = torch.linalg.svd(g.double(), full_matrices=False)
        polar.append(U @ Vh)
    quality = {}
    for kind, make in kinds.items():
        if kind == "optbook-compiled":
            continue   # optbook-auto's arithmetic, compiled
        ps = [p.clone().requires_grad_() for p in base]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt = make(ps)
        lr, wd = opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]
        opt.step()
        errs = []
        for p, b, P in zip(ps, base, polar):
            O = (b.double() * (1 - lr * wd) - p.detach().double()) / lr    # a multiple of the orthogonalised step
            c = float((O * P).sum() / (O * O).sum())
            errs.append(float((c * O - P).norm() / P.norm()))
        quality[kind] = statistics.mean(errs)
    quality["optbook-compiled"] = quality["optbook-auto"]

    opts, params, steps = {}, {}, {}
    compile_seconds = None
    for kind, make in kinds.items():
        params[kind] = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params[kind], grads):
            p.grad = g.clone()
        opts[kind] = make(params[kind])
        steps[kind] = opts[kind].step
        if kind == "optbook-compiled":
            steps[kind] = compiled_muon_step(opts[kind])
            counters.clear()
            start = time.perf_counter()
            steps[kind]()
            compile_seconds = time.perf_counter() - start
        else:
            steps[kind]()

    times: dict[str, list[float]] = {k: [] for k in kinds}
    lrs = [0.02 * 0.9 ** r for r in range(args.rounds)]       # a schedule: a new lr every round
    for r in range(args.rounds):
        for kind in kinds:
            opts[kind].param_groups[0]["lr"] = lrs[r]
            timer = Timer("step()", globals={"step": steps[kind]}, num_threads=args.threads)
            times[kind].append(timer.timeit(5).median)

    # same algorithm, same inputs: the results agree to bf16 rounding, or the timing is void
    moved = max(float((a - b).detach().abs().max()) for a, b in zip(params["torch"], base))
    for kind in kinds:
        if kind == "optbook-turbo":
            continue   # another polynomial: judged by its quality below
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(params[kind], params["torch"]))
        assert diff <= 0.05 * moved, f"{kind} and torch Muon diverged: {diff} vs moved {moved}"

    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    n = sum(a * b for a, b in shapes)
    lines = [f"Muon step, {len(shapes)} matrices ({n / 1e6:.1f}M parameters, width {args.width}), median of "
          f"{args.rounds} interleaved rounds (5 steps each)"]
    lines.append(f"environment: {environment(args.threads)}")
    # per-round ratios: the two steps of one round ran seconds apart, under about the same load
    paired = {k: statistics.median(a / b for a, b in zip(times[k], times["torch"])) for k in kinds}
    lines.append(f"{'implementation':<18} {'ms/step':>8} {'min':>8} {'max':>8} {'vs torch':>9} {'paired':>7} "
                 f"{'polar error':>11}")
    for kind in kinds:
        lines.append(f"{kind:<18} {median[kind]:8.1f} {min(times[kind]) * 1e3:8.1f} {max(times[kind]) * 1e3:8.1f} "
              f"{median[kind] / median['torch']:8.2f}x {paired[kind]:6.2f}x {quality[kind]:11.3f}")
    if compile_seconds is not None:
        graphs = counters["stats"]["unique_graphs"]
        lines.append(f"optbook-compiled: first call (compilation) {compile_seconds:.1f} s; {graphs} graph(s) compiled "
              f"over {args.rounds} learning rates")
    for kind in kinds:
        if kind != "torch":
            ratio = median[kind] / median["torch"]
            if quality[kind] <= quality["torch"] * 1.01:
                verdict = f"{'meets' if ratio <= TARGET else 'MISSES'} the target <= {TARGET}"
            else:
                verdict = "does not count: its update is farther from the polar factor than torch's"
            lines.append(f"{kind} / torch = {ratio:.2f} (median of per-round ratios {paired[kind]:.2f}; {verdict})")
    save("bench_muon", lines, threads=args.threads, rounds=args.rounds,
         ratio=round(median["optbook"] / median["torch"], 2),
         ratios={k: round(median[k] / median["torch"], 2) for k in kinds if k != "torch"},
         paired={k: round(paired[k], 2) for k in kinds if k != "torch"},
         polar_error={k: round(quality[k], 3) for k in kinds},
         ms_per_step={k: round(median[k], 1) for k in kinds})


if __name__ == "__main__":
    main()
