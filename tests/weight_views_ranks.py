"""Rank programs of tests/test_weight_views_wrappers.py: conv kernels (``matrix_view="flatten"``) and stacks
(``matrix_view="stacked"``, with and without ``head_split``) in ``FSDP2Muon`` on 1-D and 2-D device meshes,
its checkpoints (``state_dict``, DCP across mesh shapes and world sizes); ``LayerWiseMuon`` (alone and in a
``DistributedChain``) on replicated kernels and stacks, its ``state_dict`` and ``sharded_state_dict``
(saved at 4 ranks, resumed at 2); the distributed wrappers that refuse the views; also the weights,
gradients and reference the single-process tests share.

Every FSDP2 case builds the parameters twice: plain tensors (the reference, :func:`muon_reference`:
``optbook.optim.Muon`` with the same groups) and the same values laid out by the parallel API
(``fully_shard``, ``distribute_tensor``). Both get the same gradients each step (the mean gradient: drawn
from a seeded generator and cut as the parameter is, or FSDP2's own from a real backward pass, whose
``full_tensor()`` the reference takes). Each rank compares its own elements and reports; an error is
reported as text, so one case cannot fail the launch.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from fsdp2_mesh_ranks import _mesh, _safe, dcp_checkpoint   # (one copy: the mesh, errors as text, DCP)
from optbook.optim import Muon

#: The weights the views meet: a conv kernel (also channels_last), stacks of matrices (also cut into heads).
VIEWS = ["conv", "conv-channels_last", "stack", "stack-head_split", "stack-4d"]
HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
STEPS = 3

_SHAPES = {"conv": (8, 4, 3, 3), "conv-channels_last": (8, 4, 3, 3), "stack": (3, 4, 6),
           "stack-head_split": (3, 8, 4), "stack-4d": (2, 2, 4, 6)}


def view_options(view: str) -> dict:
    """The param-group options of a kind of weight (``"matrix"``: a plain matrix, no options)."""
    if view.startswith("conv"):
        return {"matrix_view": "flatten", "lr": 0.04}
    if view in ("stack", "stack-4d"):
        return {"matrix_view": "stacked", "lr": 0.01}
    if view == "stack-head_split":
        return {"matrix_view": "stacked", "head_split": 2, "lr": 0.02}
    assert view == "matrix", view
    return {}


def _format(view: str, shape) -> torch.memory_format:
    last = view.endswith("channels_last") and len(shape) == 4
    return torch.channels_last if last else torch.contiguous_format


def weights_of(view: str, dtype, shape=None) -> torch.Tensor:
    """The starting weight of a kind (its shape in :data:`_SHAPES` unless given), in its memory format."""
    shape = shape or _SHAPES[view]
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=dtype)
    return w.to(memory_format=_format(view, shape))


def grads_of(view: str, shape, dtype, step: int, i: int) -> torch.Tensor:
    """The gradient of parameter ``i`` at ``step`` (seeded), in the kind's memory format."""
    g = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(1000 * step + i), dtype=dtype)
    return g.to(memory_format=_format(view, shape))


def groups_of(params, views) -> list[dict]:
    """One param group per run of consecutive parameters of one kind, with :func:`view_options`."""
    groups = []
    for p, v in zip(params, views):
        if groups and groups[-1]["view"] == v:
            groups[-1]["params"].append(p)
        else:
            groups.append({"view": v, "params": [p]})
    return [{"params": g["params"], **view_options(g["view"])} for g in groups]


def muon_reference(params, views, dtype) -> Muon:
    """Single-process ``optbook.optim.Muon`` with the groups :func:`groups_of` makes, Newton–Schulz in
    ``dtype``."""
    return Muon(groups_of(params, views), ns_dtype=dtype, **HP)


# ---------------------------------------------------------------- FSDP2 layouts

def two_d(world_size: int) -> tuple[int, int]:
    """``(2, d/2)`` for an even ``d``, else ``(1, d)``."""
    return (2, world_size // 2) if world_size % 2 == 0 else (1, world_size)


class Stacks(nn.Module):
    """Three stacks of matrices: ``(3, 4, 6)`` (3 experts: an empty shard at 4 ranks), ``(3, 8, 4)``
    (stepped with ``head_split=2``) and ``(2, 2, 4, 6)`` (layers of experts: 4 matrices)."""

    def __init__(self, dtype):
        super().__init__()
        self.a = nn.Parameter(weights_of("stack", dtype))
        self.b = nn.Parameter(weights_of("stack-head_split", dtype) + 1)
        self.c = nn.Parameter(weights_of("stack-4d", dtype) - 1)


def _convs(dtype):
    """``(8, 4, 3, 3)``, ``(3, 8, 3, 3)`` (3 rows: an empty shard at 4 ranks), ``(5, 3, 1, 1)``."""
    torch.manual_seed(11)
    return nn.Sequential(nn.Conv2d(4, 8, 3, bias=False), nn.Conv2d(8, 3, 3, bias=False),
                         nn.Conv2d(3, 5, 1, bias=False)).to(dtype)


def model_of(kind: str, dtype) -> tuple[nn.Module, list[str]]:
    """``kind``: ``"conv"`` (a Linear ``(8, 6)`` then three Conv2d), ``"stack"`` (a Linear, then
    :class:`Stacks`), ``"all"`` (a Linear, the convs, the stacks). Returns the module and each parameter's
    kind of weight (:func:`view_options`)."""
    torch.manual_seed(10)
    parts, views = [nn.Linear(6, 8, bias=False).to(dtype)], ["matrix"]
    if kind in ("conv", "all"):
        parts.append(_convs(dtype))
        views += ["conv"] * 3
    if kind in ("stack", "all"):
        parts.append(Stacks(dtype))
        views += ["stack", "stack-head_split", "stack-4d"]
    return nn.Sequential(*parts), views


#: ``(kind, layout)``: ``1d`` fully_shard on one mesh dimension; ``hsdp`` fully_shard on ``("replicate",
#: "shard")``; ``rows`` fully_shard with ``Shard(ndim - 2)`` for stacks (each expert's rows cut); ``2d``
#: ``distribute_tensor`` with ``(Shard(0), Shard(1))`` on ``("dp", "tp")``; ``cl`` channels_last kernels
#: laid out by ``distribute_tensor`` (``fully_shard`` refuses them); ``backward`` a real forward and
#: backward pass through a conv net ``fully_shard``-ed on HSDP with channels_last inputs.
LAYOUTS = [("conv", "1d"), ("conv", "hsdp"), ("conv", "2d"), ("conv", "cl"), ("conv", "backward"),
           ("stack", "1d"), ("stack", "hsdp"), ("stack", "rows"), ("stack", "2d")]
FSDP2_CASES = [f"{k}/{lay}/{dt}" for k, lay in LAYOUTS for dt in ("float64", "float32")]


def build(kind: str, layout: str, dtype, world_size: int):
    """``(model, reference tensors, sharded parameters, kinds of weight)`` of one case."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    if layout == "backward":
        model, views = _convs(dtype), ["conv"] * 3
    else:
        model, views = model_of(kind, dtype)
    reference = [p.detach().clone() for p in model.parameters()]
    if layout in ("1d", "hsdp", "rows", "backward"):
        mesh = (_mesh((world_size,), ("shard",)) if layout in ("1d", "rows")
                else _mesh(two_d(world_size), ("replicate", "shard")))
        placement = (lambda p: Shard(p.ndim - 2) if p.ndim >= 3 else None) if layout == "rows" else None
        for layer in model:
            fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
        return model, reference, list(model.parameters()), views
    if layout == "cl":
        mesh, placements = _mesh((world_size,), ("shard",)), [Shard(0)]
        reference = [r if r.ndim < 4 else r.contiguous(memory_format=torch.channels_last) for r in reference]
        views = [v if v == "matrix" else "conv-channels_last" for v in views]
    else:
        mesh, placements = _mesh(two_d(world_size), ("dp", "tp")), [Shard(0), Shard(1)]
    params = [nn.Parameter(distribute_tensor(r.clone(memory_format=torch.preserve_format), mesh, placements,
                                             src_data_rank=None)) for r in reference]
    return None, reference, params, views


def _mine(p, r) -> bool:
    """This rank's elements of DTensor ``p`` bitwise those of the whole tensor ``r``."""
    from optbook.distributed.mesh_exchange import local_element_indices

    return torch.equal(p.to_local().reshape(-1), r.reshape(-1)[local_element_indices(p)])


def _set_grads(reference, params, views, step):
    from torch.distributed.tensor import distribute_tensor

    for i, (r, p, v) in enumerate(zip(reference, params, views)):
        g = grads_of(v, r.shape, r.dtype, step, i)
        r.grad = g
        p.grad = distribute_tensor(g.clone(memory_format=torch.preserve_format), p.device_mesh, p.placements,
                                   src_data_rank=None)


def _backward(model, reference, step, rank):
    """A forward and backward pass of this rank's micro-batch (channels_last); the reference takes FSDP2's
    mean gradient whole."""
    x = torch.randn(2, 4, 7, 7, generator=torch.Generator().manual_seed(100 * step + rank),
                    dtype=reference[0].dtype).to(memory_format=torch.channels_last)
    model(x).square().mean().backward()
    for r, p in zip(reference, model.parameters()):
        r.grad = p.grad.full_tensor()


def run_case(kind: str, layout: str, dtype, world_size: int) -> dict:
    """FSDP2Muon against ``optbook.optim.Muon``: ``{"layout": this rank's elements are the reference's
    before any step, "params": after every step, "state": momentum after the last, "moved", "placements",
    "units", "local_channels_last"}``."""
    from optbook.distributed import FSDP2Muon

    model, reference, params, views = build(kind, layout, dtype, world_size)
    start = [r.clone() for r in reference]
    reference = [nn.Parameter(r) for r in reference]
    out = {"layout": all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference)),
           "placements": [str(tuple(p.placements)) for p in params],
           "local_channels_last": [p.to_local().is_contiguous(memory_format=torch.channels_last)
                                   and not p.to_local().is_contiguous() for p in params]}
    ref_opt = muon_reference(reference, views, dtype)
    opt = FSDP2Muon(groups_of(params, views), ns_dtype=dtype, **HP)
    ok = True
    for step in range(STEPS):
        if layout == "backward":
            _backward(model, reference, step, torch.distributed.get_rank())
        else:
            _set_grads(reference, params, views, step)
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        ok &= all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference))
    out["params"] = ok
    out["state"] = all(_mine(opt.state[p]["momentum_buffer"], ref_opt.state[r]["momentum_buffer"])
                       for p, r in zip(params, reference))
    out["moved"] = all(not torch.equal(r.detach(), r0) for r, r0 in zip(reference, start))
    out["units"] = [list(shape) for _, _, shape in opt.units]
    return out


def state_dict_case(world_size: int) -> dict:
    """Convs and stacks on HSDP: two steps, ``state_dict()``, a fresh FSDP2Muon loads it, one more step."""
    from optbook.distributed import FSDP2Muon

    dtype = torch.float64
    _, reference, params, views = build("all", "hsdp", dtype, world_size)
    reference = [nn.Parameter(r) for r in reference]
    ref_opt = muon_reference(reference, views, dtype)
    opt = FSDP2Muon(groups_of(params, views), ns_dtype=dtype, **HP)
    for step in range(STEPS):
        if step == STEPS - 1:
            saved = copy.deepcopy(opt.state_dict())
            opt = FSDP2Muon(groups_of(params, views), ns_dtype=dtype, **HP)
            opt.load_state_dict(saved)
        _set_grads(reference, params, views, step)
        ref_opt.step()
        opt.step()
    return {"equal": all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference)),
            "momentum": all(_mine(opt.state[p]["momentum_buffer"], ref_opt.state[r]["momentum_buffer"])
                            for p, r in zip(params, reference))}


def dcp_case(world_size: int, ckpt_dir: str, phase: str, mesh_shape, split: int = 2, steps: int = 4) -> dict:
    """Convs and stacks ``fully_shard``-ed on a mesh of ``mesh_shape`` (2-D: HSDP). ``"save"``: ``split``
    steps, then a DCP checkpoint of model and optimizer; ``"load"``: a fresh model loads it and takes the
    remaining steps. ``"equal"``/``"momentum"``: bitwise the uninterrupted single-process Muon's."""
    from torch.distributed.fsdp import fully_shard

    from optbook.distributed import FSDP2Muon

    dtype = torch.float64
    model, views = model_of("all", dtype)
    reference = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    mesh = _mesh(mesh_shape, ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    ref_opt = muon_reference(reference, views, dtype)
    opt = FSDP2Muon(groups_of(params, views), ns_dtype=dtype, **HP)
    first, last = (0, split) if phase == "save" else (split, steps)
    for step in range(first):   # the reference alone up to the checkpoint
        for i, (r, v) in enumerate(zip(reference, views)):
            r.grad = grads_of(v, r.shape, dtype, step, i)
        ref_opt.step()
    if phase == "load":
        dcp_checkpoint(model, opt, ckpt_dir, "load")
    for step in range(first, last):
        _set_grads(reference, params, views, step)
        ref_opt.step()
        opt.step()
    if phase == "save":
        dcp_checkpoint(model, opt, ckpt_dir, "save")
    return {"equal": all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference)),
            "momentum": all(_mine(opt.state[p]["momentum_buffer"], ref_opt.state[r]["momentum_buffer"])
                            for p, r in zip(params, reference))}


def edit_case(world_size: int) -> dict:
    """Group options edited between steps, as ``optbook.optim.Muon`` allows. After one step: ``head_split``
    set on the ``(3, 4, 6)`` stack's group and ``"flatten"`` on the Linear's (one and the same matrix): both
    optimizers follow (``"head_split"``: bitwise after every step). Then the stack's ``matrix_view`` changed
    from ``"stacked"`` to ``"flatten"`` (Muon steps one ``(3, 24)`` matrix): ``"matrix_view"`` is
    ``(message, nothing written)`` when FSDP2Muon refuses, ``("stepped", bitwise)`` when it steps. Before
    that, ``"load"``: the message of loading a state dict whose group says ``"flatten"``, and the group's
    view after it."""
    from optbook.distributed import FSDP2Muon

    dtype = torch.float64
    _, reference, params, views = build("stack", "1d", dtype, world_size)
    reference = [nn.Parameter(r) for r in reference]
    ref_opt = muon_reference(reference, views, dtype)
    opt = FSDP2Muon(groups_of(params, views), ns_dtype=dtype, **HP)
    ok = True
    for step in range(STEPS):
        if step == 1:   # (and "flatten" on the Linear's group: the same matrix, accepted)
            for o in (ref_opt, opt):
                o.param_groups[1]["head_split"] = 2
                o.param_groups[0]["matrix_view"] = "flatten"
        _set_grads(reference, params, views, step)
        ref_opt.step()
        opt.step()
        ok &= all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference))
    out = {"head_split": ok}
    saved = copy.deepcopy(opt.state_dict())   # a state dict whose group says another view
    saved["param_groups"][1].update(matrix_view="flatten", head_split=None)
    out["load"] = _message(lambda: opt.load_state_dict(saved)), opt.param_groups[1]["matrix_view"]
    for o in (ref_opt, opt):
        o.param_groups[1].update(matrix_view="flatten", head_split=None)
    _set_grads(reference, params, views, STEPS)
    ref_opt.step()
    before = [p.detach().to_local().clone() for p in params]
    momenta = [opt.state[p]["momentum_buffer"].to_local().clone() for p in params]
    try:
        opt.step()
        out["matrix_view"] = ("stepped", all(_mine(p.detach(), r.detach())
                                             for p, r in zip(params, reference)))
    except ValueError as e:
        untouched = (all(torch.equal(p.detach().to_local(), b) for p, b in zip(params, before))
                     and all(torch.equal(opt.state[p]["momentum_buffer"].to_local(), m)
                             for p, m in zip(params, momenta)))
        out["matrix_view"] = (str(e), untouched)
    return out


# ---------------------------------------------------------------- LayerWiseMuon: whole tensors per rank

#: ``(kind of weight, shape)`` of the LayerWiseMuon cases: a Linear, conv kernels (one channels_last, one
#: 1 x 1), a stack, a stack cut into heads, a 4-D stack.
OWNED = [("matrix", (8, 6)), ("conv", (8, 4, 3, 3)), ("conv-channels_last", (3, 8, 3, 3)),
         ("conv", (5, 3, 1, 1)), ("stack", (3, 4, 6)), ("stack-head_split", (3, 8, 4)),
         ("stack-4d", (2, 2, 4, 6))]
LW_STEPS, LW_SPLIT = 4, 2


def _grid(shape, seed: int) -> torch.Tensor:
    """Seeded float64 values on the grid ``k / 8`` (small ``|k|``): every partial sum of a few of them, and
    their half and quarter, is exact in bfloat16, float32 and float64."""
    g = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return g.mul(8).round().div(8)


def owned_grads(params, views, step: int, rank: int | None):
    """Step ``step``'s gradients: rank ``r`` gets ``G + (-1)**r N`` (grid values), so the mean over an even
    number of ranks is exactly ``G`` whatever the order of the sum; ``rank=None``: ``G`` (the reference's)."""
    for i, (p, v) in enumerate(zip(params, views)):
        g = _grid(p.shape, 1000 * step + i)
        if rank is not None:
            g = g + (-1) ** rank * _grid(p.shape, 1000 * step + i + 500)
        p.grad = g.to(p.dtype).to(memory_format=_format(v, p.shape))


def _owned_start(low: bool, dtype):
    views = [v for v, _ in OWNED]
    start = [(weights_of(v, torch.float64, shape) + i).to(memory_format=_format(v, shape))
             for i, (v, shape) in enumerate(OWNED)]
    return views, [t.to(torch.bfloat16 if low else dtype) for t in start]


def _owned_reference(start, views, low: bool, dtype):
    from optbook.precision import MixedPrecisionOptimizer

    params = [nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in start]
    opt = muon_reference(params, views, dtype)
    return params, (MixedPrecisionOptimizer(opt) if low else opt)


def layerwise_case(world_size: int, rank: int, dtype_name: str, ckpt_dir: str) -> dict:
    """LayerWiseMuon on :data:`OWNED` (``"bfloat16"``: a bfloat16 model, Newton–Schulz in float32, against
    ``MixedPrecisionOptimizer(Muon)``) against single-process Muon on the mean gradient, bitwise after every
    step (weights; momentum and float32 masters of the owned tensors). After :data:`LW_SPLIT` steps
    ``state_dict()`` goes into a fresh LayerWiseMuon (at 4 ranks also every rank's ``sharded_state_dict``
    to ``ckpt_dir``, which the 2-rank launch resumes from: :func:`resharded_case`); before the last step the
    ``(3, 4, 6)`` stack's group is edited from ``"stacked"`` to ``"flatten"`` in both (LayerWiseMuon
    follows it: the owner steps the tensor under its group's view of the moment)."""
    from optbook.distributed import LayerWiseMuon

    low = dtype_name == "bfloat16"
    dtype = torch.float32 if low else getattr(torch, dtype_name)
    views, start = _owned_start(low, dtype)
    ref_params, ref = _owned_reference(start, views, low, dtype)
    params = [nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in start]
    opt = LayerWiseMuon(groups_of(params, views), ns_dtype=dtype, **HP)
    out = {"costs": list(opt.costs), "owners": list(opt.owners)}

    def same() -> bool:
        ok = all(torch.equal(p.detach(), r.detach()) for p, r in zip(params, ref_params))
        for i, (p, r) in enumerate(zip(params, ref_params)):
            if opt.owners[i] != opt.rank:
                continue
            ok &= torch.equal(opt.state[p]["momentum_buffer"], ref.state[r]["momentum_buffer"])
            if low:
                ok &= torch.equal(opt.master_params[i], ref.copy_of(r).detach())
        return ok

    ok, path = True, _shard_path(ckpt_dir, dtype_name)
    for step in range(LW_STEPS):
        if step == LW_SPLIT:
            saved = copy.deepcopy(opt.state_dict())
            if world_size == 4:
                torch.save(opt.sharded_state_dict(), path.format(rank))
            opt = LayerWiseMuon(groups_of(params, views), ns_dtype=dtype, **HP)
            opt.load_state_dict(saved)
        if step == LW_STEPS - 1:
            for o in (ref, opt):
                o.param_groups[4]["matrix_view"] = "flatten"
        owned_grads(params, views, step, rank)
        owned_grads(ref_params, views, step, None)
        ref.step()
        opt.step()
        ok &= same()
    out["equal"] = ok
    out["moved"] = all(not torch.equal(p.detach(), t) for p, t in zip(params, start))
    out["channels_last"] = params[2].is_contiguous(memory_format=torch.channels_last)
    return out


def _shard_path(ckpt_dir: str, dtype_name: str) -> str:
    return os.path.join(ckpt_dir, f"layerwise_{dtype_name}_{{}}.pt")


def resharded_case(rank: int, dtype_name: str, ckpt_dir: str) -> dict:
    """The 4-rank launch's ``sharded_state_dict`` files (after :data:`LW_SPLIT` steps) loaded by a
    LayerWiseMuon at 2 ranks (other owners) on the reference's weights, the remaining steps:
    ``{"equal": bitwise the uninterrupted single-process Muon's weights}``."""
    from optbook.distributed import LayerWiseMuon

    low = dtype_name == "bfloat16"
    dtype = torch.float32 if low else getattr(torch, dtype_name)
    path = _shard_path(ckpt_dir, dtype_name)
    views, start = _owned_start(low, dtype)
    ref_params, ref = _owned_reference(start, views, low, dtype)
    for step in range(LW_SPLIT):
        owned_grads(ref_params, views, step, None)
        ref.step()
    params = [nn.Parameter(r.detach().clone(memory_format=torch.preserve_format)) for r in ref_params]
    opt = LayerWiseMuon(groups_of(params, views), ns_dtype=dtype, **HP)
    opt.load_sharded_state_dict([torch.load(path.format(r), weights_only=False) for r in range(4)])
    for step in range(LW_SPLIT, LW_STEPS):
        owned_grads(params, views, step, rank)
        owned_grads(ref_params, views, step, None)
        ref.step()
        opt.step()
    return {"equal": all(torch.equal(p.detach(), r.detach()) for p, r in zip(params, ref_params))}


def chain_case(world_size: int, rank: int) -> dict:
    """``DistributedChain(LayerWiseMuon(views), DistributedOptimizer(AdamW))`` (float64): the Muon
    member's tensors bitwise single-process Muon's after every step, also after ``state_dict()`` into a
    fresh chain."""
    from optbook.distributed import DistributedChain, DistributedOptimizer, LayerWiseMuon
    from optbook.optim import AdamW

    dtype = torch.float64
    views, start = _owned_start(False, dtype)
    ref_params, ref = _owned_reference(start, views, False, dtype)
    params = [nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in start]
    bias = nn.Parameter(torch.zeros(5, dtype=dtype))

    def chain():
        return DistributedChain(LayerWiseMuon(groups_of(params, views), ns_dtype=dtype, **HP),
                                DistributedOptimizer([bias], AdamW, lr=0.01))

    opt, ok = chain(), True
    for step in range(LW_STEPS):
        if step == LW_SPLIT:
            saved = copy.deepcopy(opt.state_dict())
            opt = chain()
            opt.load_state_dict(saved)
        owned_grads(params + [bias], views + ["matrix"], step, rank)
        owned_grads(ref_params, views, step, None)
        ref.step()
        opt.step()
        ok &= all(torch.equal(p.detach(), r.detach()) for p, r in zip(params, ref_params))
    return {"equal": ok, "bias_moved": bool(bias.detach().abs().sum() > 0)}


def _message(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the refusal's type and message are the result
        return f"{type(e).__name__}: {e}"
    return None


def refusals_case(world_size: int) -> dict:
    """The messages of the wrappers that refuse the views (``None``: accepted)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from optbook.distributed import DistributedMuon, DistributedOptimizer, FSDP2Muon
    from optbook.optim import AdamW
    from optbook.precision import MixedPrecisionOptimizer

    out = {}
    for view, kind in (("flatten", "conv"), ("stacked", "stack")):
        def groups():
            return [{"params": [nn.Parameter(weights_of(kind, torch.float32))], "matrix_view": view}]

        out[f"DistributedMuon/{view}"] = _message(lambda: DistributedMuon(groups(), lr=0.02))
    out["DistributedOptimizer"] = _message(lambda: DistributedOptimizer(
        [{"params": [nn.Parameter(weights_of("conv", torch.float32))], "matrix_view": "flatten"}], Muon))
    mesh = _mesh((world_size,), ("shard",))
    kernel = nn.Parameter(distribute_tensor(weights_of("conv", torch.float32), mesh, [Shard(0)],
                                            src_data_rank=None))
    out["MixedPrecisionOptimizer"] = _message(lambda: MixedPrecisionOptimizer(
        FSDP2Muon([{"params": [kernel], "matrix_view": "flatten"}], lr=0.02)))
    conv = nn.Conv2d(4, 8, 3, bias=False).to(memory_format=torch.channels_last)
    out["fully_shard_channels_last"] = _message(lambda: fully_shard(conv, mesh=mesh))
    return out


def suite(rank: int, world_size: int, *, ckpt_dir: str) -> dict:
    """Every case at this world size (one launch; 4, then 2). At 4 ranks: a DCP save on HSDP 2 x 2 and a
    load on a 1-D mesh of 4; at 2 ranks: the load of the same checkpoint on a 1-D mesh of 2, the refusals."""
    torch.set_num_threads(1)
    out = {}
    for kind, layout in LAYOUTS:
        for dtype in (torch.float64, torch.float32):
            out[f"{kind}/{layout}/{str(dtype)[6:]}"] = _safe(run_case, kind, layout, dtype, world_size)
    out["state_dict"] = _safe(state_dict_case, world_size)
    out["edit"] = _safe(edit_case, world_size)
    if world_size == 4:
        out["dcp/save"] = _safe(dcp_case, world_size, ckpt_dir, "save", (2, 2))
    saved = os.path.exists(os.path.join(ckpt_dir, ".metadata"))   # (no load of a checkpoint never written)
    out["dcp/load"] = (_safe(dcp_case, world_size, ckpt_dir, "load", (world_size,)) if saved
                       else {"error": "no checkpoint: the 4-rank launch saves it"})
    for name in ("float64", "float32", "bfloat16"):
        out[f"layerwise/{name}"] = _safe(layerwise_case, world_size, rank, name, ckpt_dir)
        if world_size == 2:   # the 4-rank launch's sharded files, resumed at 2 ranks
            out[f"layerwise/{name}/resharded"] = _safe(resharded_case, rank, name, ckpt_dir)
    out["chain"] = _safe(chain_case, world_size, rank)
    if world_size == 2:
        out["refusals"] = _safe(refusals_case, world_size)
    return out
