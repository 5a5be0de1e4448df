#!/usr/bin/env python3
"""Every element-wise optimizer's step against the machine's memory-traffic limit, and Newton–Schulz against
the same matrix products timed bare, all measured in one run: a benchmark, not a test.

**Element-wise steps.** An element-wise step must read every gradient and every parameter and full-size state
tensor once and write the parameter and the state once: ``bytes per parameter = 4 (g) + 8 (p) + 8 x (full-size
state tensors per parameter)`` in float32, counted from the optimizer's own state after a step. Adafactor's
factored statistics are a few bytes, but its update needs three passes, one after the other: the row and
column statistics and the parameter's RMS (g and p read), the update's RMS for the clipping (g read), the
update itself (g and p read, p written); it counts 12 more (g twice, p once). The limit is that many bytes per
parameter times the parameters, divided by the best bandwidth measured in the same run by passes over the
same memory (``copy_`` between two flat buffers of 3 x the parameters, larger than a CPU's last-level cache
as a step's working set is: 8 bytes per element; ``torch._foreach_lerp_(m, g)``: 12;
``torch._foreach_addcmul_(p, m, v)``: 16, over the parameter list), as ``bench_adamw.py`` does. Rows, for
SGD, Adam, AdamW, Lion, Adafactor and Schedule-Free AdamW: the default eager step of ``optbook.optim``,
optbook's ``fused=True`` (SGD, Adam, AdamW), torch's ``foreach`` and ``fused`` steps where ``torch.optim``
has the algorithm (and the mode: torch's Adafactor has no fused kernel), and the compiled step
(``optbook.optim.compiled_step``).

**The element-wise parts of NorMuon and AdaMuon**, over the 2-D tensors of the same set, timed alone: the lines
before Newton–Schulz (EMA momentum, Nesterov; AdaMuon's sign) and after it (the second moment, the
normalisation, the Frobenius rescale, the decayed update), given a fixed ``O`` in place of Newton–Schulz's
output; eager (rows ``optbook eager``), and each half ``torch.compile``-d (``optbook compiled``). Before timing, the two halves around ``orthogonalize`` are
checked against the functional twins (``optbook.optim.functional.normuon``/``adamuon``). Their limits: before
Newton–Schulz read ``G`` and ``M``, write ``M`` and ``D`` (16 bytes); after it NorMuon reads ``O`` twice (row
statistics and both norms: ``||N||^2`` follows from the row sums; then the update) and reads and writes ``p``
(16), AdaMuon reads ``O`` and ``v`` twice (``v`` and ``||A||``, then the update) and writes ``v`` and ``p``,
reading ``p`` (28): 32 and 44 bytes per parameter.

A ratio under 1.0 means the passes stream worse than the step (parts stay in cache): the limit is an
estimate, not a bound, and the table says so.

**Newton–Schulz.** ``optbook.newton_schulz`` (5 steps, ``"simple"`` coefficients) on the book's shapes against
the same products timed bare in the same run: per step ``A = X X^T`` (m x n x m), ``A A`` (m x m x m) and
``B X`` (m x m x n) as ``torch.bmm`` into preallocated outputs, in float32 and, where the CPU has bfloat16
instructions (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``), in bfloat16.

Prints the tables and records them with the CPU, its flags, the threads and the load average
(``benchmarks/recording.py``; ``benchmarks/results/bench_limits.json``).

    .venv/bin/python benchmarks/bench_limits.py [--rounds 5] [--threads 2] [--no-compile] [--quick]

``--quick``: small shapes and one Newton–Schulz shape, to check that the benchmark runs (seconds to minutes,
most of it compiling); it prints the tables and records nothing in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import torch
from bench_adamw import transformer_shapes
from recording import describe, environment, save
from torch.utils.benchmark import Timer

import optbook
from optbook.optim import SGD, Adafactor, Adam, AdamW, Lion, ScheduleFreeAdamW, compiled_step
from optbook.optim._functional import momentum_directions
from optbook.optim.functional import adamuon, normuon
from optbook.optim.muon import muon_scale
from optbook.optim.normuon import orthogonalize

#: name -> (optbook class, options, torch.optim class or None, torch's modes, extra bytes per parameter)
OPTIMIZERS = {
    "SGD (momentum 0.9)": (SGD, dict(lr=1e-3, momentum=0.9), torch.optim.SGD, ("foreach", "fused"), 0),
    "Adam": (Adam, dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8), torch.optim.Adam, ("foreach", "fused"), 0),
    "AdamW": (AdamW, dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), torch.optim.AdamW,
              ("foreach", "fused"), 0),
    "Lion": (Lion, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1), None, (), 0),
    "Adafactor": (Adafactor, dict(lr=1e-2), torch.optim.Adafactor, ("foreach",), 12),
    "ScheduleFreeAdamW": (ScheduleFreeAdamW, dict(lr=2.5e-3, betas=(0.9, 0.999)), None, (), 0),
}
#: the classes with a ``fused=True`` option (torch's fused kernels)
OPTBOOK_FUSED = (SGD, Adam, AdamW)
#: the element-wise parts of the matrix optimizers: name -> (bytes per parameter, options of the functional twin)
MATRIX_PARTS = {
    "NorMuon (element-wise)": (32, dict(lr=0.02, momentum=0.95, beta2=0.95, weight_decay=0.1, eps=1e-8,
                                        scale_mode="shape_scaling", extra_scale_factor=1.0)),
    "AdaMuon (element-wise)": (44, dict(lr=0.02, momentum=0.95, beta2=0.95, weight_decay=0.1, eps=1e-8,
                                        scale_mode="spectral", extra_scale_factor=0.2)),
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


# ---------------------------------------------------------------- NorMuon's and AdaMuon's element-wise lines

@torch.no_grad()
def before_newton_schulz(grads, momentum_buffers, momentum: float, sign: bool):
    """The lines of ``normuon``/``adamuon`` before Newton–Schulz: EMA momentum with Nesterov (in place),
    and AdaMuon's (version 2025-08) sign; returns the directions Newton–Schulz would take."""
    directions = momentum_directions(momentum_buffers, grads, momentum, True)
    return [torch.sign(d) for d in directions] if sign else directions


@torch.no_grad()
def normuon_after(params, Os, variance_buffers, *, lr, beta2, weight_decay, eps, scales):
    """The lines of ``optbook.optim.functional.normuon`` after Newton–Schulz (``Os``: its outputs), in place."""
    for p, O, v, scale in zip(params, Os, variance_buffers, scales):
        v.lerp_((O * O).mean(dim=1, keepdim=True), 1 - beta2)
        N = O / (v.sqrt() + eps)
        N.mul_(torch.linalg.vector_norm(O) / torch.linalg.vector_norm(N).clamp_min(eps))
        p.mul_(1 - lr * weight_decay).sub_(N, alpha=lr * scale)


@torch.no_grad()
def adamuon_after(params, Os, exp_avg_sqs, *, lr, beta2, weight_decay, eps, scales):
    """The lines of ``optbook.optim.functional.adamuon`` (version 2025-08) after Newton–Schulz, in place
    (``Os`` are left as they are: the functional twin divides its temporary ``O`` in place)."""
    for p, O, v, scale in zip(params, Os, exp_avg_sqs, scales):
        v.mul_(beta2).addcmul_(O, O, value=1 - beta2)
        A = O / (v.sqrt() + eps)
        A.mul_(math.sqrt(min(p.shape)) / (torch.linalg.vector_norm(A) + eps))
        p.mul_(1 - lr * weight_decay).sub_(A, alpha=lr * scale)


def matrix_part(name: str, base: list[torch.Tensor], grads: list[torch.Tensor], compiled: bool) -> dict:
    """Buffers and the two halves of ``name``'s element-wise lines, checked against its functional twin:
    one step of the twin (``ns_dtype`` float32) and the two halves around the same ``orthogonalize`` agree."""
    _, options = MATRIX_PARTS[name]
    ada = name.startswith("AdaMuon")
    scales = [muon_scale(p.shape, options["scale_mode"], options["extra_scale_factor"]) for p in base]
    after_options = dict(lr=options["lr"], beta2=options["beta2"], weight_decay=options["weight_decay"],
                         eps=options["eps"], scales=scales)
    before, after = before_newton_schulz, adamuon_after if ada else normuon_after
    if compiled:
        before, after = (torch.compile(f, fullgraph=True) for f in (before, after))

    def buffers():
        return ([p.clone() for p in base], [torch.zeros_like(p) for p in base],
                [torch.zeros_like(p) if ada else p.new_zeros(p.shape[0], 1) for p in base])

    ref, ref_m, ref_v = buffers()
    twin = adamuon if ada else normuon
    extra = dict(steps=[1] * len(base)) if ada else {}
    twin(ref, grads, ref_m, ref_v, **extra, nesterov=True, ns_steps=5, coefficients="simple",
         ns_dtype=torch.float32, **options)
    ps, ms, vs = buffers()
    Os = [orthogonalize(d, ns_steps=5, coefficients="simple", ns_dtype=torch.float32)
          for d in before(grads, ms, options["momentum"], ada)]
    after(ps, Os, vs, **after_options)
    for a, b in zip(ps + ms + vs, ref + ref_m + ref_v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name}: the timed lines left the twin")
    env = {"before": before, "after": after, "g": grads, "m": ms, "p": ps, "O": Os, "v": vs,
           "momentum": options["momentum"], "sign": ada, "kw": after_options}
    return {"stmt": "before(g, m, momentum, sign); after(p, O, v, **kw)", "env": env}


def elementwise(args, lines: list[str]) -> dict:
    shapes = transformer_shapes(layers=1, width=64, vocab=256) if args.quick else transformer_shapes(
        layers=4, width=256, vocab=4096)
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
    for name, (ours, options, theirs, modes, _) in OPTIMIZERS.items():
        opt = ours(fresh(), **options)
        opt.step()   # allocate the state outside the timing
        full = sum(t.numel() for s in opt.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor) and t.numel() > 1 and t.shape in {p.shape for p in base})
        state_per_param[name] = full / numel
        contenders[(name, "optbook eager")] = opt
        if ours in OPTBOOK_FUSED:
            fused = ours(fresh(), **options, fused=True)
            fused.step()
            contenders[(name, "optbook fused")] = fused
        for mode in modes:
            other = theirs(fresh(), **options, **{mode: True})
            other.step()
            contenders[(name, f"torch {mode}")] = other
        if args.compile:
            compiled = ours(fresh(), **options)
            compiled_step(compiled)   # from here on, compiled.step() runs the compiled kernel
            compiled.step()           # compiles here (seconds to minutes), outside the timing
            contenders[(name, "optbook compiled")] = compiled

    matrices = [i for i, s in enumerate(shapes) if len(s) == 2]
    matrix_numel = sum(base[i].numel() for i in matrices)
    parts = {}
    for name in MATRIX_PARTS:
        for compiled in (False, True) if args.compile else (False,):
            parts[(name, "optbook compiled" if compiled else "optbook eager")] = matrix_part(
                name, [base[i] for i in matrices], [grads[i] for i in matrices], compiled)

    ref = contenders[("AdamW", "torch fused")]
    plist = [p.detach() for group in ref.param_groups for p in group["params"]]
    mlist = [ref.state[p]["exp_avg"] for group in ref.param_groups for p in group["params"]]
    vlist = [ref.state[p]["exp_avg_sq"] for group in ref.param_groups for p in group["params"]]
    # copy_ over 3 x numel elements per buffer: 2 x 50 MB here, past any L3 cache, as a step's own working set
    # is (p, g, m, v: 67 MB for Adam). Over 2 x 17 MB the pass ran from the cache (67 GB/s on a 32 MB L3).
    copy_factor = 3
    src, dst = torch.randn(copy_factor * numel), torch.empty(copy_factor * numel)
    passes = {"copy_": ("dst.copy_(src)", {"src": src, "dst": dst}, 8 * copy_factor),
              "foreach lerp_ (m, g)": ("torch._foreach_lerp_(m, g, 0.0)",
                                       {"torch": torch, "m": mlist, "g": [g.clone() for g in grads]}, 12),
              "foreach addcmul_ (p, m, v)": ("torch._foreach_addcmul_(p, m, v, value=0.0)",
                                             {"torch": torch, "p": plist, "m": mlist, "v": vlist}, 16)}
    times: dict = {key: [] for key in [*contenders, *parts, *passes]}
    with torch._dynamo.config.patch(error_on_recompile=True):   # no compile inside a timing
        for _ in range(args.rounds):
            for key, opt in contenders.items():
                times[key].append(median_ms("opt.step()", {"opt": opt}, args.threads))
            for key, part in parts.items():
                times[key].append(median_ms(part["stmt"], part["env"], args.threads))
            for name, (stmt, env, _) in passes.items():
                times[name].append(median_ms(stmt, env, args.threads))
    ms = {k: statistics.median(v) for k, v in times.items()}
    bandwidth = {name: nbytes * numel / (ms[name] / 1e3) for name, (_, _, nbytes) in passes.items()}
    best = max(bandwidth, key=bandwidth.get)
    lines += [f"Element-wise steps, {numel / 1e6:.2f}M float32 parameters in {len(shapes)} tensors ("
              f"{matrix_numel / 1e6:.2f}M in the {len(matrices)} matrices for NorMuon and AdaMuon), {args.threads} "
              f"threads, median of {args.rounds} interleaved rounds",
              "bandwidth of passes over the same memory: " + ", ".join(
                  f"{n} {bandwidth[n] / 1e9:.1f} GB/s" for n in passes) + f"; the limit uses {best}",
              f"{'optimizer':<23} {'step':<17} {'bytes/param':>11} {'limit ms':>9} {'ms/step':>8} {'vs limit':>9}"]
    rows = {}

    def row(name, kind, nbytes, count):
        limit = nbytes * count / bandwidth[best] * 1e3
        ratio = ms[(name, kind)] / limit
        rows[f"{name} / {kind}"] = round(ratio, 3)
        lines.append(f"{name:<23} {kind:<17} {nbytes:11.1f} {limit:9.2f} {ms[(name, kind)]:8.2f} {ratio:8.2f}x")

    for name, (_, _, _, _, extra) in OPTIMIZERS.items():
        for (opt_name, kind) in contenders:
            if opt_name == name:
                row(name, kind, 4 + 8 + 8 * state_per_param[name] + extra, numel)
    for (name, kind) in parts:
        row(name, kind, MATRIX_PARTS[name][0], matrix_numel)
    verdicts = []
    for name in [*OPTIMIZERS, *MATRIX_PARTS]:
        fused, foreach = rows.get(f"{name} / optbook fused"), rows.get(f"{name} / torch foreach")
        eager = rows.get(f"{name} / optbook eager")
        compiled = rows.get(f"{name} / optbook compiled")
        if fused is not None:
            verdicts.append(f"{name} optbook fused {fused:.2f}x (<= 1.1: {'met' if fused <= 1.1 else 'missed'})")
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
    return {"bandwidth_gb_s": {n: round(b / 1e9, 2) for n, b in bandwidth.items()}, "vs_limit": rows}


def newton_schulz_vs_gemms(args, lines: list[str], flags: list[str]) -> dict:
    dtypes = [torch.float32] + ([torch.bfloat16] if {"avx512_bf16", "amx_bf16"} & set(flags) else [])
    lines += ["", f"Newton-Schulz (5 steps, simple) against the same GEMMs timed bare (3 bmm per step), "
              f"{args.threads} threads, median of {args.rounds} interleaved rounds",
              f"{'shape':<10} {'dtype':<9} {'newton_schulz ms':>16} {'bare GEMMs ms':>14} {'ratio':>6}"]
    out = {}
    for shape in NS_SHAPES[:1] if args.quick else NS_SHAPES:
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
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, to check that it runs; records nothing in benchmarks/results")
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
    if args.quick:   # a check that it runs: its numbers are not a record
        print(describe(environment(args.threads)), *lines, "not recorded (--quick)", sep="\n")
        return
    save("bench_limits", lines, threads=args.threads, cpu_flags=flags, elementwise=vs_limit, newton_schulz=ns)


if __name__ == "__main__":
    main()
