"""ZeRO-1 step time and optimizer-state bytes: optbook's DistributedOptimizer vs PyTorch's
ZeroRedundancyOptimizer, on 2 gloo processes (1 CPU thread each), same run.

Timed per contender: the whole gradient sync + optimizer step + parameter sync, from gradients in
``p.grad`` on every rank to updated parameters on every rank:

* ours: ``DistributedOptimizer.step()`` -- reduce-scatter (mean; the gradients are views of the flat
  buffer, ``use_grad_buffer()``, so nothing is copied), check for inf/NaN, AdamW on this rank's shard,
  all-gather the parameters (with ``optbook.optim.AdamW`` inside, and with ``torch.optim.AdamW`` inside).
  On gloo the reduce-scatter is an ``all_reduce`` of the bucket (each rank keeps its shard) and the
  all-gather one ``broadcast`` from each shard's owner: gloo's ``reduce_scatter`` and
  ``all_gather_into_tensor`` are several times slower, and a ``reduce`` to each owner was slower than
  its pipelined all-reduce;
* ``ZeroRedundancyOptimizer(torch.optim.AdamW)``: an all-reduce of the gradients (one flat buffer whose
  views are the ``.grad`` tensors, as DDP's ``gradient_as_bucket_view``: no copies, the most favourable
  case for it) and ``step()`` (AdamW on the parameters this rank owns, then a broadcast from each owner), in
  its default mode (one broadcast per parameter) and with ``parameters_as_bucket_view=True`` (one per
  bucket);
* for orientation, plain data parallelism (the same all-reduce and ``torch.optim.AdamW`` on every rank),
  and ours around ``torch.optim.AdamW(fused=True)`` (not part of the comparison: ZeroRedundancyOptimizer
  above runs the unfused AdamW).

Every contender starts from the same parameters and the same per-rank gradients; after the first
(untimed) step their parameters must agree to 1e-6, or the benchmark stops. Then interleaved rounds of
``--steps`` steps each; per round the time is the slowest rank's; the median over rounds is reported.
State bytes per rank are counted from the real state tensors (float32 ``exp_avg``, ``exp_avg_sq``, step
counters; for the bfloat16 line also the float32 master shards, after one step of a bfloat16 copy).

Targets: state bytes per rank = 12P/DP (+ padding) for bfloat16
parameters with float32 masters (8P/DP for float32 parameters, which are their own masters); time at most
0.8x ZeroRedundancyOptimizer's default mode and at most 1.0x its bucket-view mode.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_zero1.py --rounds 5 --steps 3``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from recording import save

from optbook.distributed import DistributedOptimizer, launch

KINDS = ["ours (optbook AdamW)", "ours (torch AdamW)", "ZeRO default", "ZeRO bucket view",
         "DDP-style (no sharding)", "ours (torch fused AdamW)"]


def transformer_shapes(layers: int = 8, width: int = 384, vocab: int = 12288) -> list[tuple[int, ...]]:
    """A decoder's tensors: embedding, per block QKV, output projection, MLP, two LayerNorms (18.9M)."""
    shapes: list[tuple[int, ...]] = [(vocab, width)]
    for _ in range(layers):
        shapes += [(3 * width, width), (3 * width,), (width, width), (width,),
                   (4 * width, width), (4 * width,), (width, 4 * width), (width,),
                   (width,), (width,), (width,), (width,)]
    return shapes + [(width,), (width,)]


def _state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


class _FlatGrads:
    """``.grad`` tensors that are views of one flat buffer (DDP's ``gradient_as_bucket_view``)."""

    def __init__(self, params: list[torch.Tensor]):
        self.flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = self.flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    def all_reduce_mean(self) -> None:
        dist.all_reduce(self.flat)
        self.flat.div_(dist.get_world_size())


def worker(rank: int, world_size: int, shapes: list, rounds: int, steps: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from optbook.optim import AdamW

    torch.set_num_threads(1)
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    gen.manual_seed(1000 + rank)  # each rank its own gradient
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    params = {k: [b.clone().requires_grad_() for b in base] for k in KINDS}
    flat = {}
    for k in ("ZeRO default", "ZeRO bucket view", "DDP-style (no sharding)"):
        flat[k] = _FlatGrads(params[k])
    opts = {
        "ours (optbook AdamW)": DistributedOptimizer(params["ours (optbook AdamW)"], AdamW, **kw),
        "ours (torch AdamW)": DistributedOptimizer(params["ours (torch AdamW)"], torch.optim.AdamW, **kw),
        "ZeRO default": ZeroRedundancyOptimizer(params["ZeRO default"], torch.optim.AdamW, **kw),
        "ZeRO bucket view": ZeroRedundancyOptimizer(params["ZeRO bucket view"], torch.optim.AdamW,
                                                    parameters_as_bucket_view=True, **kw),
        "DDP-style (no sharding)": torch.optim.AdamW(params["DDP-style (no sharding)"], **kw),
        "ours (torch fused AdamW)": DistributedOptimizer(params["ours (torch fused AdamW)"], torch.optim.AdamW,
                                                         fused=True, **kw),
    }

    for kind in [k for k in KINDS if k.startswith("ours")]:  # gradients live in the flat buffer
        for p, g in zip(params[kind], grads):
            p.grad = g.clone()
        assert opts[kind].use_grad_buffer() == len(shapes)

    def set_grads(kind):
        if kind in flat or kind.startswith("ours"):
            for p, g in zip(params[kind], grads):
                p.grad.copy_(g)  # in place: the views stay views of the flat buffer
        else:
            for p, g in zip(params[kind], grads):
                p.grad = g

    def one_step(kind):
        if kind in flat:
            flat[kind].all_reduce_mean()
        opts[kind].step()

    for kind in KINDS:  # first step: allocates the state; untimed
        set_grads(kind)
        one_step(kind)
    reference = params["DDP-style (no sharding)"]
    diffs = {k: max(float((a - b).detach().abs().max()) for a, b in zip(params[k], reference)) for k in KINDS}

    times = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            set_grads(kind)  # outside the timing: ZeRO's all-reduce overwrote them with the mean
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                one_step(kind)
            elapsed = torch.tensor([(time.perf_counter() - t0) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            times[kind].append(elapsed.item())

    state = {k: _state_bytes(opts[k].optimizer if isinstance(opts[k], DistributedOptimizer) else
                             opts[k].optim if hasattr(opts[k], "optim") else opts[k]) for k in KINDS}
    padding = opts["ours (optbook AdamW)"].layout.padding(rank)
    # bfloat16 parameters with float32 masters: masters + m + v per rank after one step
    bf16 = [b.to(torch.bfloat16).requires_grad_() for b in base]
    for p, g in zip(bf16, grads):
        p.grad = g.to(torch.bfloat16)
    from optbook.precision import ConstantLossScaler

    opt16 = DistributedOptimizer(bf16, AdamW, loss_scaler=ConstantLossScaler(1.0), **kw)
    opt16.step()
    mem16 = opt16.memory_bytes()
    return {"times": times, "diffs": diffs, "state": state, "padding": padding,
            "bf16_state": mem16["optimizer_state"] + mem16["master_params"]}


def distributed_setup(doc: str, rounds: int, steps: int) -> tuple[argparse.Namespace, list[tuple[int, ...]]]:
    """What the multi-process benchmarks share: ``--rounds``, ``--steps``, ``--world-size`` and the model's
    ``--layers``/``--width``/``--vocab`` parsed with ``doc``'s first line as the description. Returns
    ``(args, transformer_shapes(...))``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (median reported)")
    parser.add_argument("--steps", type=int, default=steps, help="steps per contender and round")
    parser.add_argument("--world-size", type=int, default=2, help="gloo processes (default 2)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=12288)
    args = parser.parse_args()
    return args, transformer_shapes(args.layers, args.width, args.vocab)


def main() -> None:
    args, shapes = distributed_setup(__doc__, rounds=5, steps=3)
    numel = sum(torch.Size(s).numel() for s in shapes)
    d = args.world_size
    out = launch(worker, d, shapes, args.rounds, args.steps, timeout=1800.0)
    for kind, diff in out[0]["diffs"].items():
        assert diff < 1e-6, f"{kind} diverged from plain AdamW by {diff} after one step"
    median = {k: statistics.median(out[0]["times"][k]) * 1e3 for k in KINDS}  # the same on every rank
    zd, zb = median["ZeRO default"], median["ZeRO bucket view"]
    lines = [f"ZeRO-1 step (gradient sync + optimizer step + parameter sync), {d} gloo processes, 1 thread each",
             f"{numel / 1e6:.1f}M float32 parameters in {len(shapes)} tensors, median of {args.rounds} rounds "
             f"of {args.steps} steps (slowest rank)",
             f"{'implementation':<26} {'ms/step':>8} {'vs ZeRO default':>16} {'vs ZeRO bucket view':>20}"]
    for kind in KINDS:
        lines.append(f"{kind:<26} {median[kind]:8.1f} {median[kind] / zd:15.2f}x {median[kind] / zb:19.2f}x")
    lines.append(f"optimizer-state bytes per rank (float32 parameters; ideal 8P/{d} = {8 * numel / d:,.0f}):")
    for kind in ("ours (optbook AdamW)", "ZeRO default", "DDP-style (no sharding)"):
        lines.append(f"  {kind:<24} " + ", ".join(f"rank {r}: {o['state'][kind]:,}" for r, o in enumerate(out)))
    lines.append(f"  padding elements per rank (ours): {[o['padding'] for o in out]}")
    bf16 = [o["bf16_state"] for o in out]
    lines.append(f"bfloat16 parameters, float32 master + m + v per rank (ours): "
                 f"{', '.join(f'rank {r}: {b:,}' for r, b in enumerate(bf16))}; 12P/{d} = {12 * numel / d:,.0f} "
                 f"(max / ideal = {max(bf16) / (12 * numel / d):.4f})")
    ours = min(median["ours (optbook AdamW)"], median["ours (torch AdamW)"])
    ratios = {}
    for name, ratio, bound in (("ZeRO default", median["ours (optbook AdamW)"] / zd, 0.8),
                               ("ZeRO bucket view", median["ours (optbook AdamW)"] / zb, 1.0)):
        verdict = "meets" if ratio <= bound else "MISSES"
        lines.append(f"ours (optbook AdamW) / {name} = {ratio:.2f} ({verdict} the target <= {bound})")
        ratios[name] = round(ratio, 2)
    lines.append(f"best of ours / ZeRO default = {ours / zd:.2f}, / ZeRO bucket view = {ours / zb:.2f}")
    save("bench_zero1", lines, threads=1, rounds=args.rounds, processes=d, ratios=ratios,
         ms_per_step={k: round(median[k], 1) for k in KINDS})


if __name__ == "__main__":
    main()
