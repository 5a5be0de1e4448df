"""What the step contract's per-step checks cost inside each single-process wrapper, on the CPU.

The step contract (``optbook.contract``, chapter 10) adds two checks to every ``step()``: the outside-write
check (``VersionTracker.changed``: one host-integer comparison per parameter, the tensor's ``_version``,
no device synchronisation) and, for a step without a loss scaler, the non-finite check (``all_finite``:
one ``torch._foreach_norm(ord=inf)`` reduction per device over the gradients, one synchronisation per
device). This benchmark times each of the two on the wrapper's real parameters and gradients, next to the
wrapper's whole ``step()``, on the README benchmark's parameter set (``bench_adamw.transformer_shapes``:
17.3M parameters in 99 tensors):

- ``MixedPrecisionOptimizer(AdamW)`` over bfloat16 parameters (float32 masters; the checks run over the
  16-bit model parameters and gradients);
- ``OffloadOptimizer(AdamW)`` over float32 parameters (host copies: on a CPU-only machine the host is the
  device, so only the bookkeeping differs from a plain step);
- ``ChainedOptimizer([AdamW])`` over float32 parameters.

``DistributedOptimizer`` runs the same two checks over its parameters; its whole step is timed by
``bench_zero1.py``. Timings are medians of interleaved rounds (``torch.utils.benchmark``).

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_contract_overhead.py --rounds 5 --threads 2``).
"""

from __future__ import annotations

import statistics

import torch
from bench_adamw import timing_setup
from recording import save
from torch.utils.benchmark import Timer

from optbook.contract import VersionTracker
from optbook.memory import OffloadOptimizer
from optbook.optim import AdamW, ChainedOptimizer
from optbook.optim.optimizer import all_finite
from optbook.precision import MixedPrecisionOptimizer

KW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def build(kind: str, base: list[torch.Tensor], grads: list[torch.Tensor]):
    dtype = torch.bfloat16 if kind == "MixedPrecisionOptimizer" else torch.float32
    params = [p.to(dtype).requires_grad_() for p in base]
    for p, g in zip(params, grads):
        p.grad = g.to(dtype)
    if kind == "MixedPrecisionOptimizer":
        opt = MixedPrecisionOptimizer(AdamW(params, **KW))
    elif kind == "OffloadOptimizer":
        opt = OffloadOptimizer(params, AdamW, **KW)
    else:
        opt = ChainedOptimizer([AdamW(params, **KW)])
    opt.step()  # state allocated outside the timing
    return params, opt


def main() -> None:
    args, shapes, base, grads = timing_setup(__doc__, rounds=5)
    numel = sum(p.numel() for p in base)

    kinds = ("MixedPrecisionOptimizer", "OffloadOptimizer", "ChainedOptimizer")
    timers = {}
    for kind in kinds:
        params, opt = build(kind, base, grads)
        tracker = VersionTracker()
        tracker.record(params)
        assert tracker.changed(params) == [] and all_finite([p.grad for p in params])
        g = {"step": opt.step, "tracker": tracker, "params": params, "grads": [p.grad for p in params],
             "all_finite": all_finite}
        timers[kind] = {"step": Timer("step()", globals=g, num_threads=args.threads),
                        "versions": Timer("tracker.changed(params)", globals=g, num_threads=args.threads),
                        "finite": Timer("all_finite(grads)", globals=g, num_threads=args.threads)}
    times = {k: {c: [] for c in ("step", "versions", "finite")} for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            for check, timer in timers[kind].items():
                times[kind][check].append(timer.timeit(3 if check == "step" else 20).median)
    ms = {k: {c: statistics.median(v) * 1e3 for c, v in row.items()} for k, row in times.items()}

    lines = [f"Per-step checks of the step contract, {numel / 1e6:.1f}M parameters in {len(shapes)} tensors, "
             f"{args.threads} threads, median of {args.rounds} rounds",
             f"{'wrapper':<25} {'step ms':>8} {'version check ms':>17} {'non-finite check ms':>20} {'checks / step':>14}"]
    shares = {}
    for kind in kinds:
        row = ms[kind]
        shares[kind] = (row["versions"] + row["finite"]) / row["step"]
        lines.append(f"{kind:<25} {row['step']:8.1f} {row['versions']:17.3f} {row['finite']:20.2f} "
                     f"{100 * shares[kind]:13.1f}%")
    lines.append("version check: host integers only (tensor._version), no device synchronisation; "
                 "non-finite check: one fused reduction and one synchronisation per device")
    save("bench_contract_overhead", lines, threads=args.threads, rounds=args.rounds,
         ms={k: {c: round(v, 3) for c, v in row.items()} for k, row in ms.items()},
         share={k: round(v, 4) for k, v in shares.items()})


if __name__ == "__main__":
    main()
