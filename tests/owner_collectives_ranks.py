"""Rank programs of tests/test_owner_collectives.py: LayerWiseMuon's and DistributedMuon's collective calls
and bytes per step, counted at the dispatcher, for few and many matrices and mixed dtypes (imported by name
in the spawned processes, as :mod:`muon_rank_programs`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from optbook.distributed import DistributedMuon, LayerWiseMuon
from optbook.distributed.muon_workers import MUON_OPTIONS, set_grads

#: The process groups of :func:`collectives_suite` on 4 processes: world size -> global ranks.
COLLECTIVE_GROUPS = {2: [1, 3], 4: [0, 1, 2, 3]}


def collectives_problem(n_matrices: int, dtypes: tuple, seed: int = 0) -> list[torch.Tensor]:
    """``n_matrices`` matrices of mixed shapes (rows and columns drawn from 1..24, every 7th with 3 times the
    rows, so owner loads are uneven; no two with one shape or transposed shapes, so that no owner batches
    matrices the single-process reference does not), dtypes cycling through ``dtypes``; entries ``k / 64``."""
    gen = torch.Generator().manual_seed(seed + 1000 * n_matrices)
    params, seen = [], set()
    for i in range(n_matrices):
        while True:   # no two with one shape (or its transpose): no matrices batched together in Newton–Schulz
            m, n = (int(v) for v in torch.randint(1, 25, (2,), generator=gen))
            m *= 3 if i % 7 == 3 else 1
            if (m, n) not in seen and (n, m) not in seen:
                seen.add((m, n))
                break
        params.append((torch.randint(-64, 64, (m, n), generator=gen) / 64).to(dtypes[i % len(dtypes)])
                      .requires_grad_())
    return params


def collectives_grads(params, step: int, rank: int, world_size: int, seed: int = 0) -> tuple[list, list]:
    """``(this rank's gradients, their mean)``: float32/float64 matrices get ``G + (rank - (d - 1)/2) D``
    (dyadic, the mean exactly ``G``); bfloat16 ones the same ``G`` on every rank (exact in bfloat16); the
    matrix at index 1 has no gradient on any rank."""
    gen = torch.Generator().manual_seed(7919 * seed + 104729 * step + 13)
    mine, mean = [], []
    for i, p in enumerate(params):
        g = (torch.randint(-128, 128, p.shape, generator=gen) / 256).to(p.dtype)
        d = (torch.randint(-128, 128, p.shape, generator=gen) / 256).to(p.dtype)
        if i == 1:
            g = None
        mean.append(g)
        if g is None or p.dtype == torch.bfloat16:
            mine.append(g)
        else:
            mine.append(g + (rank - (world_size - 1) / 2) * d)
    return mine, mean


def collectives_reference(n_matrices: int, dtypes: tuple, steps: int) -> list[torch.Tensor]:
    """Single process: ``optbook.optim.Muon`` over the float32/float64 matrices and
    ``MixedPrecisionOptimizer(Muon)`` over the bfloat16 ones, on the mean gradients, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the ranks: the float64 products of the larger matrices depend on the threads
    try:
        return _collectives_reference(n_matrices, dtypes, steps)
    finally:
        torch.set_num_threads(threads)


def _collectives_reference(n_matrices: int, dtypes: tuple, steps: int) -> list[torch.Tensor]:
    from optbook.optim import Muon
    from optbook.precision import MixedPrecisionOptimizer

    params = collectives_problem(n_matrices, dtypes)
    low = [p for p in params if p.dtype == torch.bfloat16]
    high = [p for p in params if p.dtype != torch.bfloat16]
    opts = ([Muon(high, **MUON_OPTIONS)] if high else []) + (
        [MixedPrecisionOptimizer(Muon(low, **MUON_OPTIONS))] if low else [])
    for t in range(steps):
        set_grads(params, collectives_grads(params, t, 0, 1)[1])
        for o in opts:
            o.step()
    return [p.detach().clone() for p in params]


def _counted_steps(opt, params, steps, rank, world_size) -> list[dict]:
    """``steps`` steps, each inside its own :class:`~optbook.distributed.wire.CommCounter`: per step
    ``{"calls": [(name, dtype)], "received": {name: bytes}}``."""
    from optbook.distributed.wire import CommCounter

    out = []
    for t in range(steps):
        set_grads(params, collectives_grads(params, t, rank, world_size)[0])
        with CommCounter() as counter:
            opt.step()
        out.append({"calls": [(name, dtype) for name, dtype, _ in counter.calls], "received": dict(counter.received),
                    "other_calls": counter.other_calls})
    return out


def collectives_suite(rank: int, world_size: int, *, steps: int = 3) -> dict:
    """LayerWiseMuon (bfloat16 + float32 + float64 matrices) and DistributedMuon (float32 + float64) on 3 and
    on 60 matrices, on groups of 2 and 4 of the 4 processes (:data:`COLLECTIVE_GROUPS`), each step counted.

    Returns:
        ``{size: {(kind, n): {"steps": [counted step], "predicted": opt.step_comm(has_grad), "params",
        "owners" (LayerWiseMuon) or "buckets" (DistributedMuon: non-empty buckets)} or None}``.
    """
    torch.set_num_threads(1)
    groups = {size: dist.new_group(ranks) for size, ranks in COLLECTIVE_GROUPS.items()}
    out = {}
    for size, ranks in COLLECTIVE_GROUPS.items():
        report = None
        if rank in ranks:
            g, r = groups[size], ranks.index(rank)
            report = {}
            for kind, dtypes in (("layerwise", (torch.bfloat16, torch.float32, torch.float64)),
                                 ("moonlight", (torch.float32, torch.float64))):
                for n in (3, 60):
                    params = collectives_problem(n, dtypes)
                    if kind == "layerwise":
                        opt = LayerWiseMuon(params, process_group=g, **MUON_OPTIONS)
                    else:
                        opt = DistributedMuon(params, process_group=g, gather_dtype=torch.float64, **MUON_OPTIONS)
                    counted = _counted_steps(opt, params, steps, r, size)
                    has_grad = [i != 1 for i in range(n)]
                    report[kind, n] = {"steps": counted, "predicted": opt.step_comm(has_grad),
                                       "params": [p.detach().clone() for p in params],
                                       "owners": getattr(opt, "owners", None),
                                       "buckets": None if kind == "layerwise" else
                                       sum(1 for b in opt.layout.buckets if b.numel)}
        out[size] = report
    return out
