"""Rank programs of tests/test_checkpoint_layout.py: sharded checkpoints of LayerWiseMuon, DistributedMuon,
ZeRO-1 and DistributedChain with their layout fingerprints, loaded into the same and other layouts (imported
by name in the spawned processes, as :mod:`muon_rank_programs`)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from muon_rank_programs import _error, _state_tensors, bitwise
from optbook.distributed import DistributedMuon, LayerWiseMuon
from optbook.distributed.muon_workers import MUON_OPTIONS, muon_problem, set_grads

LAYOUT_KINDS = ("layerwise", "moonlight", "zero1", "chain")


def _layout_params(kind: str) -> list[torch.Tensor]:
    from optbook.distributed.muon_workers import chain_problem

    if kind == "chain":
        matrices, others = chain_problem()
        return matrices + others
    return muon_problem()[0]


def _layout_build(kind: str, variant: int, params, group):
    """``kind``'s optimizer over ``params`` in layout ``variant`` (0 or 1: another assignment or bucketing)."""
    from optbook.distributed import DistributedChain, DistributedOptimizer

    assignment = "lpt" if variant == 0 else "round_robin"
    buckets = {"bucket_size": None if variant == 0 else 64, "param_alignment": 1, "bucket_alignment": 4}
    if kind == "layerwise":
        return LayerWiseMuon(params, process_group=group, assignment=assignment, **MUON_OPTIONS)
    if kind == "moonlight":
        return DistributedMuon(params, process_group=group, gather_dtype=torch.float64, **buckets, **MUON_OPTIONS)
    if kind == "zero1":
        return DistributedOptimizer(params, process_group=group, lr=0.01, weight_decay=0.1, **buckets)
    return DistributedChain(LayerWiseMuon(params[:7], process_group=group, assignment=assignment, **MUON_OPTIONS),
                            DistributedOptimizer(params[7:], process_group=group, lr=0.01, **buckets))


def _layout_grads(params, step: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """Dyadic gradients whose mean over the ranks is exact in any order."""
    gen = torch.Generator().manual_seed(1009 * step + 7)
    out = []
    for p in params:
        g = torch.randint(-512, 512, p.shape, generator=gen) / 256
        d = torch.randint(-512, 512, p.shape, generator=gen) / 256
        out.append((g + (rank - (world_size - 1) / 2) * d).to(p.dtype))
    return out


def _layout_steps(opt, params, steps, rank, world_size) -> None:
    for t in steps:
        set_grads(params, _layout_grads(params, t, rank, world_size))
        opt.step()


def _layout_snapshot(opt, params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params] + _state_tensors(opt)


def layout_suite(rank: int, world_size: int) -> dict:
    """For each kind of :data:`LAYOUT_KINDS` on every process: save after 2 steps in layout 0 (``files``, every
    rank's) and layout 1 (``other``), then load into fresh optimizers.

    Returns:
        ``{kind: {"fingerprint": this rank's file's "layout" or None, "expected": checkpoint_layout() or None,
        "other_fingerprint", "own": params after the own file and 2 steps, "uninterrupted": params after
        4 steps, "resharded": params after layout 1 loaded every layout-0 file and ran 2 steps,
        "resharded_layout": its next file's layout; "own_other_layout", "two_saves", "tampered",
        "other_class": ((type, message), nothing changed)}}``.
    """
    from optbook.distributed import _comm

    describe = getattr(_comm, "describe_layout", repr)   # (repr: code without fingerprints, to show its failures)
    torch.set_num_threads(1)
    out = {}
    for kind in LAYOUT_KINDS:
        rep = {}
        saved = {}
        for variant in (0, 1):
            params = _layout_params(kind)
            opt = _layout_build(kind, variant, params, None)
            _layout_steps(opt, params, (0, 1), rank, world_size)
            every = [None] * world_size
            dist.all_gather_object(every, opt.sharded_state_dict())
            saved[variant] = (every, [p.detach().clone() for p in params], opt)
            if variant == 0:
                rep["expected"] = getattr(opt, "checkpoint_layout", lambda: None)()
                _layout_steps(opt, params, (2, 3), rank, world_size)
                rep["uninterrupted"] = [p.detach().clone() for p in params]
            else:
                rep["expected_other"] = getattr(opt, "checkpoint_layout", lambda: None)()
        files, weights, _ = saved[0]
        other, _, _ = saved[1]
        rep["fingerprint"] = files[rank].get("layout")
        rep["other_fingerprint"] = other[rank].get("layout")
        rep["describe"] = {v: describe(rep["expected" if v == 0 else "expected_other"]) for v in (0, 1)}

        def fresh(variant, kind=kind, weights=weights):
            ps = [w.clone().requires_grad_() for w in weights]
            return ps, _layout_build(kind, variant, ps, None)

        def attempt(variant, shards):
            ps, loader = fresh(variant)
            before = _layout_snapshot(loader, ps)
            err = _error(lambda: loader.load_sharded_state_dict(shards))
            return err, bitwise(before, _layout_snapshot(loader, ps))

        rep["own_other_layout"] = attempt(1, files[rank])
        rep["two_saves"] = attempt(0, [files[0], other[1]] + files[2:])
        tampered = [copy.deepcopy(sd) for sd in files]
        _tamper(kind, tampered)
        rep["tampered"] = attempt(0, tampered)
        foreign = "moonlight" if kind == "layerwise" else "layerwise"
        fps = _layout_params(foreign)
        fopt = _layout_build(foreign, 0, fps, None)
        rep["other_class"] = attempt(0, fopt.sharded_state_dict())
        for case, variant, shards in (("own", 0, files[rank]), ("resharded", 1, files)):
            ps, loader = fresh(variant)
            loader.load_sharded_state_dict(shards)
            _layout_steps(loader, ps, (2, 3), rank, world_size)
            rep[case] = [p.detach().clone() for p in ps]
            if case == "resharded":
                rep["resharded_layout"] = loader.sharded_state_dict().get("layout")
        out[kind] = rep
    return out


def _tamper(kind: str, files: list) -> None:
    """Make rank 1's file hold what its recorded layout gives rank 0 (a file edited or mixed by hand)."""
    sd = files[1]["muon"] if kind == "chain" else files[1]
    src = files[0]["muon"] if kind == "chain" else files[0]
    if kind in ("layerwise", "chain"):
        i = next(iter(src["state"]))
        sd["state"][i] = src["state"][i]
    elif kind == "moonlight":
        sd["momentum"] = sd["momentum"] + src["momentum"][:1]
    else:
        sd["pieces"] = sd["pieces"] + src["pieces"][:1]
