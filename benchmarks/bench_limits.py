#!/usr/bin/env python3
"""Every element-wise optimizer's step against the machine's memory-traffic limit, and Newton–Schulz against
the same matrix products timed bare, all measured in one run: a benchmark, not a test.

**Element-wise steps.** An element-wise step must read every gradient and every parameter and full-size state
tensor once and write the parameter and the state once: ``bytes per parameter = 4 (g) + 8 (p) + 8 x (full-size
state tensors per parameter)`` in float32, counted from the optimizer's own state after a step (Adafactor's
factored statistics are a few bytes; its update needs the gradient three times: the row and column
statistics, the update's RMS for the clipping, the update itself, so it counts 8 more). The limit is that
many bytes per parameter times the parameters, divided by the best bandwidth measured in the same run by
passes over the same memory (``copy_`` of one flat buffer: 8 bytes per element; ``torch._foreach_lerp_(m,
g)``: 12; ``torch._foreach_addcmul_(p, m, v)``: 16, over the parameter list), as ``bench_adamw.py`` does.
Rows: the default eager step of ``optbook.optim``, torch's ``foreach`` and ``fused`` steps where
``torch.optim`` has the algorithm, and the compiled step (``optbook.optim.compiled_step``, which covers
Adam and AdamW). A ratio under 1.0 means the passes stream worse than the step (parts stay in cache): the
limit is an estimate, not a bound, and the table says so.

**Newton–Schulz.** ``optbook.newton_schulz`` (5 steps, ``"simple"`` coefficients) on the book's shapes against
the same products timed bare in the same run: per step ``A = X X^T`` (m x n x m), ``A A`` (m x m x m) and
``B X`` (m x m x n) as ``torch.bmm`` into preallocated outputs, in float32 and, where the CPU has bfloat16
instructions (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``), in bfloat16.

Prints the tables and records them with the CPU, its flags, the threads and the load average
(``benchmarks/recording.py``; ``benchmarks/results/bench_limits.json``).

    .venv/bin/python benchmarks/bench_limits.py [--rounds 5] [--threads 2] [--no-compile]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
from bench_adamw import transformer_shapes
from recording import save
from torch.utils.benchmark import Timer

import optbook
from optbook.optim import SGD, Adafactor, Adam, AdamW, Lion, ScheduleFreeAdamW, compiled_step

#: name -> (optbook class and options, torch.optim class or None, options shared with torch, extra g reads)
OPTIMIZERS = {
    "SGD (momentum 0.9)": (SGD, torch.optim.SGD, dict(lr=1e-3, momentum=0.9), 0),
    "Adam": (Adam, torch.optim.Adam, dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8), 0),
    "AdamW": (AdamW, torch.optim.AdamW, dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), 0),
    "Lion": (Lion, None, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1), 0),
    "Adafactor": (Adafactor, None, dict(lr=1e-2), 2),
    "ScheduleFreeAdamW": (ScheduleFreeAdamW, None, dict(lr=2.5e-3, betas=(0.9, 0.999)), 0),
}
NS_SHAPES = [(128, 512), (256, 256), (256, 1024), (512, 2048)]


def cpu_flags() -> list[str]:
    """The CPU flags that decide these numbers (vector width, bf16 and AMX units), from ``/proc/cpuinfo``."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def median_ms(stmt: str, env: dict, threads: int, number: int = 3) -> float:
    return Timer(stmt, globals=env, num_threads=threads).timeit(number).median * 1e3


def elementwise(args, lines: list[str]) -> dict:
    shapes = transformer_shapes(layers=4, width=256, vocab=4096)
    torch.manual_seed(0)
    base = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) * 1e-2 for s in shapes]
    numel = sum(p.numel() for p in base)

    def fresh():
        params = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params

    contenders, state_per_param = {}, {}
    for name, (ours, theirs, options, _) in OPTIMIZERS.items():
        opt = ours(fresh(), **options)
        opt.step()   # allocate the state outside the timing
        full = sum(t.numel() for s in opt.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor) and t.numel() > 1)
        state_per_param[name] = full / numel
        contenders[(name, "optbook eager")] = opt
        if theirs is not None:
            for mode in ("foreach", "fused"):
                other = theirs(fresh(), **options, **{mode: True})
                other.step()
                contenders[(name, f"torch {mode}")] = other
        if ours in (Adam, AdamW) and args.compile:
            compiled = ours(fresh(), **options)
            compiled_step(compiled)   # from here on, compiled.step() runs the compiled kernel
            compiled.step()           # compiles here (seconds to minutes), outside the timing
            contenders[(name, "optbook compiled")] = compiled

    ref = contenders[("AdamW", "torch fused")]
    plist = [p.detach() for group in ref.param_groups for p in group["params"]]
    glist = [p.grad for p in plist] if plist[0].grad is not None else grads
    mlist = [ref.state[p]["exp_avg"] for group in ref.param_groups for p in group["params"]]
    vlist = [ref.state[p]["exp_avg_sq"] for group in ref.param_groups for p in group["params"]]
    src, dst = torch.randn(numel), torch.empty(numel)
    passes = {"copy_": ("dst.copy_(src)", {"src": src, "dst": dst}, 8),
              "foreach lerp_ (m, g)": ("torch._foreach_lerp_(m, g, 0.0)",
                                       {"torch": torch, "m": mlist, "g": [g.clone() for g in grads]}, 12),
              "foreach addcmul_ (p, m, v)": ("torch._foreach_addcmul_(p, m, v, value=0.0)",
                                             {"torch": torch, "p": plist, "m": mlist, "v": vlist}, 16)}
    del glist
    times: dict = {key: [] for key in [*contenders, *passes]}
    for _ in range(args.rounds):
        for key, opt in contenders.items():
            times[key].append(median_ms("opt.step()", {"opt": opt}, args.threads))
        for name, (stmt, env, _) in passes.items():
            times[name].append(median_ms(stmt, env, args.threads))
    ms = {k: statistics.median(v) for k, v in times.items()}
    bandwidth = {name: nbytes * numel / (ms[name] / 1e3) for name, (_, _, nbytes) in passes.items()}
    best = max(bandwidth, key=bandwidth.get)
    lines += [f"Element-wise steps, {numel / 1e6:.2f}M float32 parameters in {len(shapes)} tensors, {args.threads} "
              f"threads, median of {args.rounds} interleaved rounds",
              "bandwidth of passes over the same memory: " + ", ".join(
                  f"{n} {bandwidth[n] / 1e9:.1f} GB/s" for n in passes) + f"; the limit uses {best}",
              f"{'optimizer':<20} {'step':<17} {'bytes/param':>11} {'limit ms':>9} {'ms/step':>8} {'vs limit':>9}"]
    rows = {}
    for name, (_, _, _, extra_g) in OPTIMIZERS.items():
        nbytes = 4 * (1 + extra_g) + 8 + 8 * state_per_param[name]
        limit = nbytes * numel / bandwidth[best] * 1e3
        for (opt_name, kind), _ in contenders.items():
            if opt_name != name:
                continue
            ratio = ms[(name, kind)] / limit
            rows[f"{name} / {kind}"] = round(ratio, 3)
            lines.append(f"{name:<20} {kind:<17} {nbytes:11.1f} {limit:9.2f} {ms[(name, kind)]:8.2f} {ratio:8.2f}x")
    verdicts = []
    for name in OPTIMIZERS:
        fused, foreach = rows.get(f"{name} / torch fused"), rows.get(f"{name} / torch foreach")
        eager, compiled = rows[f"{name} / optbook eager"], rows.get(f"{name} / optbook compiled")
        if fused is not None:
            verdicts.append(f"{name} fused {fused:.2f}x (<= 1.1: {'met' if fused <= 1.1 else 'missed'})")
        if compiled is not None:
            verdicts.append(f"{name} compiled {compiled:.2f}x (<= 1.5: {'met' if compiled <= 1.5 else 'missed'})")
        if foreach is not None:
            verdicts.append(f"{name} eager / torch foreach {eager / foreach:.2f} "
                            f"(<= 1.05: {'met' if eager / foreach <= 1.05 else 'missed'})")
    lines.append("targets in this run: " + "; ".join(verdicts))
    if any(r < 1 for r in rows.values()):
        lines.append("a ratio under 1.00x: that step streamed better than the measured passes (the limit is an "
                     "estimate here, not a bound)")
    if not args.compile:
        lines.append("compiled steps not measured (--no-compile)")
    lines.append("not measured: a compiled step for SGD, Lion, Adafactor and Schedule-Free (compiled_step covers "
                 "Adam and AdamW), and the element-wise parts of NorMuon and AdaMuon on their own")
    return {"bandwidth_gb_s": {n: round(b / 1e9, 2) for n, b in bandwidth.items()}, "vs_limit": rows}


def newton_schulz_vs_gemms(args, lines: list[str], flags: list[str]) -> dict:
    dtypes = [torch.float32] + ([torch.bfloat16] if {"avx512_bf16", "amx_bf16"} & set(flags) else [])
    lines += ["", f"Newton-Schulz (5 steps, simple) against the same GEMMs timed bare (3 bmm per step), "
              f"{args.threads} threads, median of {args.rounds} interleaved rounds",
              f"{'shape':<10} {'dtype':<9} {'newton_schulz ms':>16} {'bare GEMMs ms':>14} {'ratio':>6}"]
    out = {}
    for shape in NS_SHAPES:
        for dtype in dtypes:
            m, n = shape
            G = torch.randn(1, m, n)
            X = torch.randn(1, m, n, dtype=dtype)
            A, A2, Y = (torch.empty(1, m, m, dtype=dtype), torch.empty(1, m, m, dtype=dtype),
                        torch.empty(1, m, n, dtype=dtype))
            ns = ("newton_schulz(G, steps=5, dtype=dtype)", {"newton_schulz": optbook.newton_schulz, "G": G,
                                                              "dtype": dtype})
            bare = ("for _ in range(5):\n    torch.bmm(X, X.mT, out=A)\n    torch.bmm(A, A, out=A2)\n"
                    "    torch.bmm(A2, X, out=Y)", {"torch": torch, "X": X, "A": A, "A2": A2, "Y": Y})
            t_ns, t_bare = [], []
            for _ in range(args.rounds):
                t_ns.append(median_ms(*ns, args.threads))
                t_bare.append(median_ms(*bare, args.threads))
            a, b = statistics.median(t_ns), statistics.median(t_bare)
            key = f"{m}x{n} {str(dtype).replace('torch.', '')}"
            out[key] = round(a / b, 3)
            lines.append(f"{m}x{n:<6} {str(dtype).replace('torch.', ''):<9} {a:16.3f} {b:14.3f} {a / b:5.2f}x")
    lines.append("target newton_schulz <= 1.15x its bare GEMMs, in this run: " + ", ".join(
        f"{k} {'met' if v <= 1.15 else 'missed'}" for k, v in out.items()))
    if len(dtypes) == 1:
        lines.append("bfloat16 not measured: this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled steps")
    args = parser.parse_args()
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    load_before = round(os.getloadavg()[0], 2)
    lines = [f"CPU flags: {' '.join(flags) or 'none of avx2/avx512f/avx512_bf16/amx'}; capability "
             f"{torch.backends.cpu.get_cpu_capability()}; load average (1 min) {load_before} at the start"]
    vs_limit = elementwise(args, lines)
    ns = newton_schulz_vs_gemms(args, lines, flags)
    lines.append(f"load average (1 min) {round(os.getloadavg()[0], 2)} at the end")
    save("bench_limits", lines, threads=args.threads, cpu_flags=flags, elementwise=vs_limit, newton_schulz=ns)


if __name__ == "__main__":
    main()
