"""FSDP2 step time: FSDP2 + optbook Muon vs FSDP2 + torch AdamW vs LayerWiseMuon, on 2 gloo processes.

The model is a module holding the tensors of ``bench_zero1.transformer_shapes`` (an 8-layer, width-384
decoder, 18.9M parameters), every transformer block ``fully_shard``-ed on its own and the root (embedding,
final norm) last, as one shards a real model. Its "forward" is ``sum(p * c)`` over the parameters with a
fixed random ``c`` per rank and tensor, so each rank's gradient is its own ``c`` and the compute between the
collectives is one multiply-add per element: what is timed is FSDP2's work (all-gather of the parameters
in the forward, reduce-scatter of the mean gradient in the backward) plus the optimizer step.

Timed per contender, one step = forward + backward + optimizer step (slowest rank, median over rounds):

* ``FSDP2 + torch AdamW``: ``torch.optim.AdamW`` on every sharded parameter;
* ``FSDP2 + optbook Muon``: :class:`optbook.distributed.FSDP2Muon` (bfloat16 Newton–Schulz, 5 steps) on the
  2-D block matrices, ``torch.optim.AdamW`` on the embedding, norms and biases;
* ``FSDP2 + Muon, turbo``: the same with the Newton–Schulz options that cost the fewest matrix products
  at the same or better closeness to the polar factor (``benchmarks/bench_muon.py``'s quality column):
  Gram Newton–Schulz for the 4:1 MLP matrices (``ns_algorithm="auto"``), AOL preconditioning and 4 steps of
  :data:`optbook.optim.TURBO_SCHEDULE`;
* ``LayerWiseMuon``: no FSDP2 (every rank holds every parameter); :class:`optbook.distributed.LayerWiseMuon`
  on the same matrices (gradients all-reduced, each matrix stepped by its owner, updated matrices
  all-gathered) and an all-reduce + ``torch.optim.AdamW`` for the rest.

Newton–Schulz is a large share of Muon's step on a CPU (matrix products, single-threaded here); on a GPU it
is a small one. So the table also gives the time of the orthogonalisation the slowest rank runs (the step's
own call on the matrices it owns, timed alone on the same shapes) and Muon's step without it, an *estimate*
of what the owner design costs beyond the mathematics. Target (GPU-minded, from Megatron-FSDP's Muon prototype,
NVIDIA/Megatron-LM#4486, 1.5-2.7x slower than Adam): FSDP2 + Muon <= 1.5x FSDP2 + AdamW.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_fsdp2.py --rounds 3 --steps 2``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from bench_zero1 import distributed_setup
from recording import save
from torch import nn

from optbook.distributed import launch

KINDS = ["FSDP2 + torch AdamW", "FSDP2 + optbook Muon", "FSDP2 + Muon, turbo", "LayerWiseMuon"]
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
TURBO = dict(ns_algorithm="auto", ns_precondition="aol", ns_steps=4)   # with coefficients=TURBO_SCHEDULE


class Tensors(nn.Module):
    """A module that owns tensors of the given shapes and returns ``sum(p * c)`` for given ``c``."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(t.clone()) for t in tensors)

    def forward(self, cs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.params, cs))


class Model(nn.Module):
    """Root tensors (embedding, final norm) and one :class:`Tensors` per block, in the shapes' order."""

    def __init__(self, base: list[torch.Tensor], per_block: int):
        super().__init__()
        blocks = (len(base) - 3) // per_block
        self.root = Tensors([base[0], *base[-2:]])
        self.blocks = nn.ModuleList(Tensors(base[1 + i * per_block:1 + (i + 1) * per_block]) for i in range(blocks))

    def forward(self, cs: list[torch.Tensor]) -> torch.Tensor:
        k = len(self.blocks[0].params) if len(self.blocks) else 0
        loss = self.root([cs[0], *cs[-2:]])
        for i, block in enumerate(self.blocks):
            loss = loss + block(cs[1 + i * k:1 + (i + 1) * k])
        return loss

    def ordered(self) -> list[nn.Parameter]:
        """The parameters in the shapes' order."""
        root = list(self.root.params)
        return [root[0], *[p for b in self.blocks for p in b.params], *root[1:]]


def worker(rank: int, world_size: int, shapes: list, per_block: int, rounds: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optbook.distributed import FSDP2Muon, LayerWiseMuon
    from optbook.distributed._muon_common import scaled_orthogonal
    from optbook.optim import TURBO_SCHEDULE

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    gen.manual_seed(1000 + rank)   # each rank its own gradient
    cs = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    mesh = init_device_mesh("cpu", (world_size,))
    is_matrix = [len(s) == 2 and i > 0 for i, s in enumerate(shapes)]   # block matrices (not the embedding)

    def sharded_model():
        model = Model(base, per_block)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    models, opts = {}, {}
    models["FSDP2 + torch AdamW"] = m = sharded_model()
    opts["FSDP2 + torch AdamW"] = [torch.optim.AdamW(m.ordered(), **ADAMW)]
    models["FSDP2 + optbook Muon"] = m = sharded_model()
    ps = m.ordered()
    opts["FSDP2 + optbook Muon"] = [FSDP2Muon([p for p, mat in zip(ps, is_matrix) if mat], **MUON),
                                    torch.optim.AdamW([p for p, mat in zip(ps, is_matrix) if not mat], **ADAMW)]
    models["FSDP2 + Muon, turbo"] = m = sharded_model()
    ps = m.ordered()
    opts["FSDP2 + Muon, turbo"] = [FSDP2Muon([p for p, mat in zip(ps, is_matrix) if mat], **MUON, **TURBO,
                                             coefficients=TURBO_SCHEDULE),
                                   torch.optim.AdamW([p for p, mat in zip(ps, is_matrix) if not mat], **ADAMW)]
    models["LayerWiseMuon"] = m = Model(base, per_block)
    ps = m.ordered()
    rest = [p for p, mat in zip(ps, is_matrix) if not mat]
    opts["LayerWiseMuon"] = [LayerWiseMuon([p for p, mat in zip(ps, is_matrix) if mat], **MUON),
                             torch.optim.AdamW(rest, **ADAMW)]

    def one_step(kind):
        models[kind](cs).backward()
        if kind == "LayerWiseMuon":   # the AdamW part is plain data parallelism: all-reduce the mean
            for p in rest:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        for o in opts[kind]:
            o.step()
        for o in opts[kind]:
            o.zero_grad()

    for kind in KINDS:   # first step: allocates the state; untimed
        one_step(kind)
    times = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                one_step(kind)
            elapsed = torch.tensor([(time.perf_counter() - t0) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[kind].append(elapsed.item())

    # the orthogonalisation of the matrices this rank owns under FSDP2Muon, timed alone: the step's own call
    # (scaled_orthogonal: Muon's batching, power-of-two rescale, bfloat16 Newton-Schulz, scale) on matrices
    # of the same shapes
    muon = opts["FSDP2 + optbook Muon"][0]
    owned = [tuple(p.shape) for p, o in zip(muon._params, muon.owners) if o == rank]
    directions = [torch.randn(shape, generator=gen) for shape in owned]
    ns_times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        scaled_orthogonal(directions, muon.param_groups[0])   # (reads the directions only)
        ns_times.append(time.perf_counter() - t0)
    ns = torch.tensor([statistics.median(ns_times)])
    dist.all_reduce(ns, op=dist.ReduceOp.MAX)

    # the updated parameters of the two FSDP2 runs must be finite and every rank's full view the same
    full = {k: [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in models[k].ordered()]
            for k in KINDS}
    finite = all(bool(torch.isfinite(t).all()) for k in KINDS for t in full[k])
    # FSDP2 + Muon and LayerWiseMuon apply the same algorithm to the same gradients (the mean over ranks)
    gap = max(float((a - b).abs().max()) for a, b in zip(full["FSDP2 + optbook Muon"], full["LayerWiseMuon"]))
    return {"times": times, "ns_seconds": ns.item(), "owned": len(owned), "finite": finite, "muon_gap": gap}


def main() -> None:
    args, shapes = distributed_setup(__doc__, rounds=3, steps=2)
    per_block = (len(shapes) - 3) // args.layers
    numel = sum(torch.Size(s).numel() for s in shapes)
    d = args.world_size
    out = launch(worker, d, shapes, per_block, args.rounds, args.steps, timeout=1800.0)
    assert all(o["finite"] for o in out), "a contender wrote inf/NaN into the parameters"
    # the same Muon + AdamW algorithm, two distributions of the work: the parameters must agree closely
    # (bfloat16 Newton-Schulz on differently summed float32 gradients: not bitwise)
    assert max(o["muon_gap"] for o in out) < 1e-3, f"FSDP2Muon and LayerWiseMuon disagree by {out[0]['muon_gap']}"
    median = {k: statistics.median(out[0]["times"][k]) * 1e3 for k in KINDS}
    ns_ms = out[0]["ns_seconds"] * 1e3
    adamw = median["FSDP2 + torch AdamW"]
    lines = [f"FSDP2 step (forward all-gather + backward reduce-scatter + optimizer step), {d} gloo processes, "
             f"1 thread each",
             f"{numel / 1e6:.1f}M float32 parameters in {len(shapes)} tensors ({args.layers} blocks sharded "
             f"separately), median of {args.rounds} rounds of {args.steps} steps (slowest rank)",
             f"{'implementation':<24} {'ms/step':>8} {'vs FSDP2 + AdamW':>17}"]
    for kind in KINDS:
        lines.append(f"{kind:<24} {median[kind]:8.1f} {median[kind] / adamw:16.2f}x")
    turbo = median["FSDP2 + Muon, turbo"] / adamw
    muon = median["FSDP2 + optbook Muon"]
    lines.append(f"Orthogonalisation of the matrices the slowest rank owns (the step's own call, bfloat16 Newton-Schulz, "
                 f"5 steps, timed alone): {ns_ms:.1f} ms; "
                 f"FSDP2 + Muon without it (estimate): {muon - ns_ms:.1f} ms = {(muon - ns_ms) / adamw:.2f}x FSDP2 + AdamW")
    ratio = muon / adamw
    lines.append(f"FSDP2 + optbook Muon / FSDP2 + torch AdamW = {ratio:.2f}, turbo {turbo:.2f} "
                 f"({'meets' if ratio <= 1.5 else 'MISSES'} the target <= 1.5 on this CPU: the orthogonalisation "
                 f"is {ns_ms / muon:.0%} of Muon's step here)")
    save("bench_fsdp2", lines, threads=1, rounds=args.rounds, processes=d, ratio=round(ratio, 2),
         ratio_turbo=round(turbo, 2),
         ratio_without_ns=round((muon - ns_ms) / adamw, 2), ms_per_step={k: round(median[k], 1) for k in KINDS},
         ns_ms=round(ns_ms, 1))


if __name__ == "__main__":
    main()
