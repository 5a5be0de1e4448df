"""Rank programs of tests/test_distributed_ownership.py: who owns the weights of bfloat16 parameters under the
distributed wrappers, and how DistributedChain composes its members.

The reference is the single-process :class:`optbook.precision.MixedPrecisionOptimizer` around the same
optimizer (float32 masters, the model rounded from them once per step). Every rank sets the **same** bfloat16
gradient, so the mean over the ranks (summed in float32, divided by ``d``) is exactly that gradient, and the
distributed runs must equal the reference bit for bit. The matrices have distinct shapes, so Newton–Schulz
never batches two of them together on one side and not on the other.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from optbook.clipping import clip_coefficient
from optbook.distributed import DistributedChain, DistributedMuon, DistributedOptimizer, FSDP2Muon, LayerWiseMuon
from optbook.optim import AdamW, ChainedOptimizer, Muon
from optbook.precision import MixedPrecisionOptimizer

#: Distinct shapes: (16, 8), (8, 12), (12, 16): 448 weights; with the vectors 464.
MATRIX_SHAPES = ((16, 8), (8, 12), (12, 16))
VECTOR_SHAPES = ((16,),)
#: a small lr: most single updates are below half a bfloat16 unit in the last place of the weight, so a run
#: without float32 masters loses them (the weights hardly move) and a run with masters accumulates them.
MUON = dict(lr=2e-3, momentum=0.95, nesterov=True, weight_decay=0.0, ns_dtype=torch.float32)
ADAMW = dict(lr=1e-3, weight_decay=0.01)
STEPS = 20


def _params(shapes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).bfloat16().requires_grad_() for s in shapes]


def _clones(params) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


def _grads(params, step: int) -> list[torch.Tensor]:
    """The same bfloat16 gradients on every rank (seeded by the step)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).bfloat16() for p in params]


def _set(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b))


def _changed(params, start) -> int:
    return sum(int((p.detach() != s).sum()) for p, s in zip(params, start))


def _error(call):
    try:
        call()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def _shared(obj, group, rank_in_group: int):
    """``obj`` of the group's rank 0 on every rank of ``group``."""
    box = [obj if rank_in_group == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def layerwise_bfloat16(rank: int, world_size: int) -> dict:
    """LayerWiseMuon on bfloat16 matrices against MixedPrecisionOptimizer(Muon), on groups of 2 ranks (0, 1)
    and of every rank; the larger group resumes from the smaller group's checkpoint.

    Returns ``{"equal": bitwise equal to the reference after every step (group of 2), "changed": weights
    changed over the run, "reference_changed": the same for the reference, "masters_equal": this rank's
    masters equal the reference's, "resumed_equal": after the load at world size ``world_size`` and 5 more
    steps (consolidated), "sharded_equal": the same from every rank's sharded file, "float16": the error
    for a float16 matrix}``.
    """
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    out = {}
    start = _params(MATRIX_SHAPES, 0)
    ref_params = _clones(start)
    reference = MixedPrecisionOptimizer(Muon(ref_params, **MUON))
    if rank in (0, 1):
        params = _clones(start)
        opt = LayerWiseMuon(params, process_group=pair, **MUON)
        equal = True
    for t in range(STEPS):
        grads = _grads(start, t)
        _set(ref_params, grads)
        reference.step()
        if rank in (0, 1):
            _set(params, grads)
            opt.step()
            equal &= _equal(params, ref_params)
    ckpt = sharded = None
    if rank in (0, 1):
        out["equal"] = equal
        out["changed"], out["reference_changed"] = _changed(params, start), _changed(ref_params, start)
        masters = dict(zip([id(p) for p in ref_params], reference.master_params()))
        own = getattr(opt, "master_params", {})   # (none before LayerWiseMuon kept masters)
        out["masters_equal"] = bool(own) and all(torch.equal(m, masters[id(ref_params[i])]) for i, m in own.items())
        opt.consolidate_state_dict(to=0)
        ckpt = opt.state_dict() if rank == 0 else None
        every = [None, None]
        dist.all_gather_object(every, opt.sharded_state_dict(), group=pair)
        sharded = every
    ckpt = _shared(ckpt, dist.group.WORLD, rank)
    sharded = _shared(sharded, dist.group.WORLD, rank)
    # resume at world size `world_size` from the 2-rank checkpoint: model weights = the reference's
    for kind, load in (("resumed_equal", lambda o: o.load_state_dict(ckpt)),
                       ("sharded_equal", lambda o: o.load_sharded_state_dict(sharded))):
        params = _clones(ref_params)
        resumed = LayerWiseMuon(params, **MUON)
        load(resumed)
        ref2 = _clones(ref_params)
        reference2 = MixedPrecisionOptimizer(Muon(ref2, **MUON))
        reference2.load_state_dict(reference.state_dict())
        equal = True
        for t in range(STEPS, STEPS + 5):
            grads = _grads(start, t)
            _set(ref2, grads)
            reference2.step()
            _set(params, grads)
            resumed.step()
            equal &= _equal(params, ref2)
        out[kind] = equal
    half = [torch.zeros(4, 4, dtype=torch.float16, requires_grad=True)]
    out["float16"] = _error(lambda: LayerWiseMuon(half, **MUON))
    return out


def chain_bfloat16(rank: int, world_size: int) -> dict:
    """DistributedChain(LayerWiseMuon, ZeRO-1 AdamW) on a bfloat16 model against
    MixedPrecisionOptimizer(ChainedOptimizer([Muon, AdamW])), no clip.

    Returns ``{"equal": bitwise after every step, "changed", "reference_changed"}``."""
    torch.set_num_threads(1)
    mats, vecs = _params(MATRIX_SHAPES, 0), _params(VECTOR_SHAPES, 1)
    rm, rv = _clones(mats), _clones(vecs)
    reference = MixedPrecisionOptimizer(ChainedOptimizer([Muon(rm, **MUON), AdamW(rv, **ADAMW)]))
    pm, pv = _clones(mats), _clones(vecs)
    chain = DistributedChain(LayerWiseMuon(pm, **MUON), DistributedOptimizer(pv, AdamW, **ADAMW))
    equal = True
    for t in range(STEPS):
        grads = _grads(mats + vecs, t)
        _set(rm + rv, grads)
        reference.step()
        _set(pm + pv, grads)
        chain.step()
        equal &= _equal(pm + pv, rm + rv)
    return {"equal": equal, "changed": _changed(pm, mats), "reference_changed": _changed(rm, mats)}


def chain_composition(rank: int, world_size: int) -> dict:
    """How DistributedChain drives its members, in float64.

    Returns ``{"member_writes": the attributes of the ZeRO-1 member written while the chain stepped (its
    max_grad_norm among them, on the old code), "hook_calls": what a step pre and post hook saw over the
    steps, "phases_equal": the members' public phases composed by hand
    (prepare, one clip, step) equal the chain bit for bit, "norm_equal": their norms equal,
    "fsdp2_refusal": the error of a chain given an FSDP2Muon}``."""
    torch.set_num_threads(1)
    written: list = []

    class Watched(DistributedOptimizer):
        def __setattr__(self, name, value):
            if getattr(self, "_watching", False) and name == "max_grad_norm":
                written.append(name)
            super().__setattr__(name, value)

    gen = torch.Generator().manual_seed(3)
    mats = [torch.randn(s, generator=gen, dtype=torch.float64) for s in MATRIX_SHAPES]
    vecs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in VECTOR_SHAPES]
    muon64 = {**MUON, "ns_dtype": torch.float64, "lr": 0.02}

    def build(cls):
        pm = [m.clone().requires_grad_() for m in mats]
        pv = [v.clone().requires_grad_() for v in vecs]
        return pm, pv, LayerWiseMuon(pm, **muon64), cls(pv, AdamW, **ADAMW)

    pm, pv, muon, adamw = build(Watched)
    chain = DistributedChain(muon, adamw, max_grad_norm=0.5)
    calls: list = []
    chain.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    chain.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    adamw._watching = True
    qm, qv, muon2, adamw2 = build(DistributedOptimizer)
    equal, norms = True, True
    for t in range(3):
        grads = [g.double() * (1 + rank) for g in _grads(mats + vecs, t)]   # different on each rank
        _set(pm + pv, grads)
        chain.step()
        _set(qm + qv, grads)
        members = (muon2, adamw2)
        try:
            found = [m.prepare_grads() for m in members]
            norm = math.sqrt(sum(m.grad_sumsq() for m in members))
            for m in members:
                m.scale_grads(clip_coefficient(norm, 0.5))
            for m in members:
                m.step_with_ready_grads()
            for m in members:
                m.publish_weights()
        except AttributeError:   # members without public phases
            return {"member_writes": written, "phases_equal": False, "norm_equal": False, "hook_calls": calls,
                    "fsdp2_refusal": _fsdp2_chain_refusal(adamw)}
        equal &= found == [False, False] and _equal(pm + pv, qm + qv)
        norms &= norm == chain.last_grad_norm
    out = {"member_writes": written, "phases_equal": equal, "norm_equal": norms, "hook_calls": calls}
    out["fsdp2_refusal"] = _fsdp2_chain_refusal(adamw)
    return out


def _fsdp2_model(dtype):
    from torch import nn

    from optbook.distributed.fsdp2_workers import shard_model

    torch.manual_seed(0)
    return shard_model(nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 4, bias=False)).to(dtype))


def _fsdp2_chain_refusal(adamw):
    model = _fsdp2_model(torch.float32)
    return _error(lambda: DistributedChain(FSDP2Muon(list(model.parameters()), lr=0.02), adamw))


def low_precision_refusals(rank: int, world_size: int) -> dict:
    """``{"fsdp2": the error of FSDP2Muon on bfloat16 DTensors, "moonlight": DistributedMuon's on a bfloat16
    matrix}`` (each ``(type, message)`` or ``None`` when accepted)."""
    torch.set_num_threads(1)
    model = _fsdp2_model(torch.bfloat16)
    out = {"fsdp2": _error(lambda: FSDP2Muon(list(model.parameters()), lr=0.02))}
    mats = [torch.zeros(4, 4, requires_grad=True), torch.zeros(3, 4, dtype=torch.bfloat16, requires_grad=True)]
    out["moonlight"] = _error(lambda: DistributedMuon(mats, lr=0.02))
    return out


def zero1_schedule_free(rank: int, world_size: int) -> dict:
    """ZeRO-1 around ScheduleFreeAdamW against the single-process ScheduleFreeAdamW (float32 and bfloat16
    parameters; the bfloat16 reference is MixedPrecisionOptimizer around it).

    Returns ``{dtype name: {"eval_equal": after 3 steps and eval(), the parameters equal the reference's
    (the average x), "train_equal": after train() and 2 more steps, "refused_in_eval": the error of a step
    in eval mode}}``."""
    from optbook.optim import ScheduleFreeAdamW

    torch.set_num_threads(1)
    options = dict(lr=0.01, warmup_steps=1, weight_decay=0.01)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(4)
        start = [torch.randn(s, generator=gen).to(dtype) for s in ((5, 3), (7,))]
        ref = [s.clone().requires_grad_() for s in start]
        params = [s.clone().requires_grad_() for s in start]
        inner = ScheduleFreeAdamW(ref, **options)
        reference = MixedPrecisionOptimizer(inner) if dtype == torch.bfloat16 else inner
        opt = DistributedOptimizer(params, ScheduleFreeAdamW, **options)
        for t in range(3):
            grads = [g.to(dtype) for g in _grads(start, t)]
            _set(ref, grads)
            reference.step()
            _set(params, grads)
            opt.step()
        inner.eval()
        if dtype == torch.bfloat16:   # the masters moved to x: the model rounded from them, as the wrapper does
            with torch.no_grad():
                for p, m in reference._pairs:
                    p.copy_(m)
        opt.eval()
        report = {"eval_equal": _equal(params, ref)}
        try:
            opt.step()
            report["refused_in_eval"] = None
        except RuntimeError as e:
            report["refused_in_eval"] = str(e)
        inner.train()
        if dtype == torch.bfloat16:
            with torch.no_grad():
                for p, m in reference._pairs:
                    p.copy_(m)
        opt.train()
        for t in range(3, 5):
            grads = [g.to(dtype) for g in _grads(start, t)]
            _set(ref, grads)
            reference.step()
            _set(params, grads)
            opt.step()
        report["train_equal"] = _equal(params, ref)
        out[str(dtype).removeprefix("torch.")] = report
    return out
