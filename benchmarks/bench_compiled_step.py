"""Step time of a compiled optbook AdamW vs torch.optim.AdamW(fused=True) vs optbook eager, on the CPU.

The README benchmark's parameter set (``bench_adamw.transformer_shapes``: 17.3M float32 parameters in
99 transformer-shaped tensors), the same gradients for every contender, in one process, measured with
``torch.utils.benchmark`` in interleaved rounds (median reported). ``optbook compiled`` is
``optbook.optim.compiled_step(AdamW(...))``: the optimizer's validation and bookkeeping in Python, the
arithmetic in one ``torch.compile``-d graph with the step count and ``lr`` as tensors (chapter 15).

Checks before timing: the compiled trajectory equals the eager one to float32 rounding, and stepping
with a new ``lr`` (as a scheduler does) and a new step count compiles nothing new (Dynamo's
``error_on_recompile``). Target: compiled optbook at most 1.2x the time of ``fused=True``.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_compiled_step.py --rounds 5 --threads 2``;
the first step compiles: tens of seconds, minutes on 2 busy cores).
"""

from __future__ import annotations

import statistics
import time

import torch
from bench_adamw import timing_setup
from recording import save
from torch.utils.benchmark import Timer

from optbook.optim import AdamW, compiled_step

KW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def main() -> None:
    args, shapes, base, grads = timing_setup(__doc__, rounds=5)

    numel = sum(p.numel() for p in base)
    kinds = ["optbook eager", "optbook compiled", "torch fused"]
    params, steps = {}, {}
    for kind in kinds:
        params[kind] = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params[kind], grads):
            p.grad = g.clone()
        if kind == "torch fused":
            steps[kind] = torch.optim.AdamW(params[kind], **KW, fused=True).step
        elif kind == "optbook compiled":
            opt = AdamW(params[kind], **KW)
            steps[kind] = compiled_step(opt)
            start = time.perf_counter()
            steps[kind]()  # compiles
            compile_seconds = time.perf_counter() - start
        else:
            steps[kind] = AdamW(params[kind], **KW).step
        if kind != "optbook compiled":
            steps[kind]()  # allocate state outside the timing

    # a second step with another lr must reuse the graph; then the trajectories must agree
    for kind in kinds:
        opt = getattr(steps[kind], "optimizer", None) or steps[kind].__self__
        for group in opt.param_groups:
            group["lr"] = 5e-4
    with torch._dynamo.config.patch(error_on_recompile=True):
        for kind in kinds:
            steps[kind]()
    reference = params["optbook eager"]
    for kind in kinds:
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(params[kind], reference))
        assert diff < 1e-5, f"{kind} diverged from optbook eager by {diff}"

    times: dict[str, list[float]] = {k: [] for k in kinds}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(args.rounds):
            for kind in kinds:
                timer = Timer("step()", globals={"step": steps[kind]}, num_threads=args.threads)
                times[kind].append(timer.timeit(5).median)

    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    lines = [f"AdamW step, {numel / 1e6:.1f}M float32 parameters in {len(shapes)} tensors, "
             f"{args.threads} threads, median of {args.rounds} rounds; first compiled step (compiling) "
             f"{compile_seconds:.0f} s",
             f"{'implementation':<18} {'ms/step':>8} {'vs fused':>9}"]
    for kind in kinds:
        lines.append(f"{kind:<18} {median[kind]:8.1f} {median[kind] / median['torch fused']:8.2f}x")
    ratio = median["optbook compiled"] / median["torch fused"]
    verdict = "meets" if ratio <= 1.2 else "MISSES"
    lines.append(f"optbook compiled / torch fused = {ratio:.2f} ({verdict} the target <= 1.2); "
                 f"compiled / eager = {median['optbook compiled'] / median['optbook eager']:.2f}")
    save("bench_compiled_step", lines, threads=args.threads, rounds=args.rounds, ratio=round(ratio, 2),
         compile_seconds=round(compile_seconds), ms_per_step={k: round(median[k], 1) for k in kinds})


if __name__ == "__main__":
    main()
