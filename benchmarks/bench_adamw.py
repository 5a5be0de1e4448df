"""Step time of optbook.optim.AdamW vs torch.optim.AdamW (for-loop, foreach, fused) on the CPU.

A transformer-shaped set of float32 tensors (about 17M parameters in about 100 tensors), each
optimizer stepping on the same gradients in the same process, measured with
``torch.utils.benchmark`` in interleaved rounds so that machine noise hits every contender alike.

The memory-traffic floor: an AdamW step must read p, g, m, v and write p, m, v -- 7 float32 arrays,
28 bytes per parameter. Dividing that by the bandwidth of a plain ``copy_`` of a buffer of the same
size (8 bytes per element moved) gives the time no implementation can beat by much.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_adamw.py --rounds 7 --threads 2``).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from recording import save
from torch.utils.benchmark import Timer

from optbook.optim import AdamW


def transformer_shapes(layers: int = 8, width: int = 384, vocab: int = 8192) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, width)]
    for _ in range(layers):
        shapes += [(3 * width, width), (3 * width,), (width, width), (width,),
                   (4 * width, width), (4 * width,), (width, 4 * width), (width,),
                   (width,), (width,), (width,), (width,)]  # two LayerNorms: gains and shifts
    return shapes + [(width,), (width,)]


def make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if kind == "optbook":
        return AdamW(params, **kw)
    mode = {"torch for-loop": dict(foreach=False), "torch foreach": dict(foreach=True),
            "torch fused": dict(fused=True)}[kind]
    return torch.optim.AdamW(params, **kw, **mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    shapes = transformer_shapes()
    base = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) * 1e-2 for s in shapes]
    numel = sum(p.numel() for p in base)
    kinds = ["optbook", "torch for-loop", "torch foreach", "torch fused"]
    optimizers, params = {}, {}
    for kind in kinds:
        params[kind] = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params[kind], grads):
            p.grad = g.clone()
        optimizers[kind] = make_optimizer(kind, params[kind])
        optimizers[kind].step()  # allocate state outside the timing

    src, dst = torch.randn(numel), torch.empty(numel)
    times: dict[str, list[float]] = {k: [] for k in kinds + ["copy"]}
    for _ in range(args.rounds):
        for kind in kinds:
            timer = Timer("opt.step()", globals={"opt": optimizers[kind]}, num_threads=args.threads)
            times[kind].append(timer.timeit(5).median)
        timer = Timer("dst.copy_(src)", globals={"src": src, "dst": dst}, num_threads=args.threads)
        times["copy"].append(timer.timeit(5).median)

    # the four trajectories must agree (same algorithm, same inputs): a benchmark of a wrong result is void
    reference = params["torch for-loop"]
    for kind in kinds:
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(params[kind], reference))
        assert diff < 1e-5, f"{kind} diverged from torch's for-loop AdamW by {diff}"

    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    bandwidth = 8 * numel / (median["copy"] / 1e3)  # bytes per second moved by copy_
    floor_ms = 28 * numel / bandwidth * 1e3
    baseline = min(median["torch for-loop"], median["torch foreach"])
    lines = [f"AdamW step, {numel / 1e6:.1f}M float32 parameters in {len(shapes)} tensors, "
             f"{args.threads} threads, median of {args.rounds} rounds",
             f"copy bandwidth {bandwidth / 1e9:.1f} GB/s -> memory-traffic floor {floor_ms:.1f} ms "
             "(28 bytes per parameter)",
             f"{'implementation':<16} {'ms/step':>8} {'vs optbook':>11} {'vs floor':>9}"]
    for kind in kinds:
        lines.append(f"{kind:<16} {median[kind]:8.1f} {median[kind] / median['optbook']:10.2f}x "
                     f"{median[kind] / floor_ms:8.2f}x")
    ratio = median["optbook"] / baseline
    verdict = "meets" if ratio <= 1.0 else "MISSES"
    lines.append(f"optbook / faster of torch for-loop and foreach = {ratio:.2f} ({verdict} the target <= 1.0); "
                 f"gap to fused {median['optbook'] / median['torch fused']:.2f}x, "
                 f"to the floor {median['optbook'] / floor_ms:.2f}x")
    save("bench_adamw", lines, threads=args.threads, rounds=args.rounds, ratio=round(ratio, 2),
         ms_per_step={k: round(median[k], 1) for k in kinds})


if __name__ == "__main__":
    main()
