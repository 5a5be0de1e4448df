"""Rank programs of tests/test_fsdp2_mesh.py: FSDP2Muon and optbook's element-wise optimizers on ``DTensor``
parameters of 1-D and 2-D device meshes (FSDP2, HSDP, TP under FSDP2, expert-parallel stacks), against the
single-process optimizers on whole tensors.

Every case builds the parameters twice: plain tensors (the reference) and the same values laid out as the
parallel API lays them out (``fully_shard``, ``parallelize_module``, ``distribute_tensor``). Each step both
get
the same gradients (drawn from a seeded generator, the sharded copy cut as its parameter is), so the two runs
differ only in how the optimizer steps. Each rank compares its own elements (their global indices:
:func:`optbook.distributed.mesh_exchange.local_element_indices`, itself checked against the layout the
parallel API produced) and reports; every case runs in one launch per world size and reports an error as a
string instead of failing the launch.
"""

from __future__ import annotations

import traceback

import torch
from torch import nn

from optbook.optim import SGD, AdamW, Muon

STEPS = 3
MUON = dict(momentum=0.95, nesterov=True, weight_decay=0.01)


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def two_d(world_size: int) -> tuple[int, int]:
    """The 2-D mesh shape of a world size: ``(2, d/2)`` for an even ``d``, else ``(1, d)``."""
    return (2, world_size // 2) if world_size % 2 == 0 else (1, world_size)


def _linears(shapes, dtype, seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(n, m, bias=False) for m, n in shapes]).to(dtype)


#: (rows, cols): rows 8 (two heads), uneven rows, and 2 and 1 rows (empty shards at 3 and 4 ranks).
DENSE = [(8, 6), (7, 8), (9, 7), (2, 9), (1, 2)]


def _fsdp(dtype, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _linears(DENSE, dtype, 1)
    reference = [p.detach().clone() for p in model.parameters()]
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return reference, list(model.parameters())


def _tp_fsdp(dtype, mesh):
    """Colwise/rowwise tensor parallelism on ``tp``, then ``fully_shard`` over ``dp``: (7, 6) colwise
    (``Shard(0)`` on tp, FSDP2's ``_StridedShard(0)`` on dp), (5, 7) rowwise (``Shard(1)`` on tp, ``Shard(0)``
    on dp), (3, 5) colwise (an empty shard at 2 x 2), (2, 3) rowwise."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _linears([(7, 6), (5, 7), (3, 5), (2, 3)], dtype, 2)
    reference = [p.detach().clone() for p in model.parameters()]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                           "2": ColwiseParallel(), "3": RowwiseParallel()})
    for layer in model:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return reference, list(model.parameters())


def _experts(dtype, world_size):
    """Dense matrices ``fully_shard``-ed on a 1-D ``dp`` mesh, and a stack of 6 experts ``(6, 5, 4)`` whole
    experts per rank on a 1-D ``ep`` mesh (``Shard(0)``; torch.chunk sizes, an empty rank at 4)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    reference, params = _fsdp(dtype, _mesh((world_size,), ("dp",)))
    torch.manual_seed(3)
    stack = torch.randn(6, 5, 4, dtype=dtype)
    ep = _mesh((world_size,), ("ep",))
    params.append(nn.Parameter(distribute_tensor(stack.clone(), ep, [Shard(0)], src_data_rank=None)))
    reference.append(stack)
    return reference, params


def _submeshes(dtype, world_size):
    """One 2-D root mesh ``("dp", "ep")``: dense matrices ``fully_shard``-ed on its ``dp`` sub-mesh
    (replicated over ``ep``: each ``ep`` coordinate has its own ``dp`` group), the stack of 6 experts
    ``Shard(0)`` on its ``ep`` sub-mesh (replicated over ``dp``)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(two_d(world_size), ("dp", "ep"))
    reference, params = _fsdp(dtype, mesh["dp"])
    torch.manual_seed(3)
    stack = torch.randn(6, 5, 4, dtype=dtype)
    params.append(nn.Parameter(distribute_tensor(stack.clone(), mesh["ep"], [Shard(0)], src_data_rank=None)))
    reference.append(stack)
    return reference, params


def _groups(params, layout: str) -> list[dict]:
    if layout in ("experts", "submesh"):
        return [{"params": params[:1], "head_split": 2, "lr": 0.02}, {"params": params[1:-1], "lr": 0.01},
                {"params": params[-1:], "matrix_view": "stacked", "lr": 0.03}]
    if layout == "tp":
        return [{"params": params, "lr": 0.02}]
    return [{"params": params[:1], "head_split": 2, "lr": 0.02}, {"params": params[1:], "lr": 0.01}]


def build(layout: str, dtype, world_size: int):
    """``(reference tensors, sharded DTensor parameters)`` of one layout: ``"1d"`` (fully_shard on a 1-D
    mesh), ``"hsdp"`` (fully_shard on a ``("replicate", "shard")`` mesh), ``"tp"`` (TP x FSDP on ``("dp",
    "tp")``), ``"experts"`` (dense on a 1-D ``dp`` mesh, experts on a 1-D ``ep`` mesh), ``"submesh"``
    (the same on the two sub-meshes of one ``("dp", "ep")`` mesh)."""
    if layout == "1d":
        return _fsdp(dtype, _mesh((world_size,), ("shard",)))
    if layout == "hsdp":
        return _fsdp(dtype, _mesh(two_d(world_size), ("replicate", "shard")))
    if layout == "tp":
        return _tp_fsdp(dtype, _mesh(two_d(world_size), ("dp", "tp")))
    return _experts(dtype, world_size) if layout == "experts" else _submeshes(dtype, world_size)


def _grad(shape, dtype, step: int, i: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + i), dtype=dtype)


def _set_grads(reference, params, step):
    from torch.distributed.tensor import distribute_tensor

    for i, (r, p) in enumerate(zip(reference, params)):
        g = _grad(tuple(r.shape), r.dtype, step, i)
        r.grad = g
        p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements, src_data_rank=None)


def local_element_indices(p) -> torch.Tensor:
    """The global row-major index of each element of ``p.to_local()``: the index tensor laid out as ``p``
    (no communication). Written here, not imported, so that the element-wise cases do not depend on
    FSDP2Muon's module; ``"layout"`` checks it against the values the parallel API laid out."""
    from torch.distributed.tensor import distribute_tensor

    index = torch.arange(p.numel()).view(tuple(p.shape))
    return distribute_tensor(index, p.device_mesh, p.placements, src_data_rank=None).to_local().reshape(-1)


def _mine(p, r) -> bool:
    """This rank's elements of DTensor ``p`` bitwise those of the whole tensor ``r``."""
    return torch.equal(p.to_local().reshape(-1), r.reshape(-1)[local_element_indices(p)])


def _same_state(v, ref) -> bool:
    """A state entry: a DTensor placed as its parameter (this rank's elements), or a number (``step``)."""
    if hasattr(v, "to_local"):
        return _mine(v, ref)
    return float(v) == float(ref)


def run_case(layout: str, dtype, world_size: int, kind: str = "muon", max_grad_norm=None) -> dict:
    """``kind``: ``"muon"`` (FSDP2Muon against optbook.optim.Muon, ns in the parameters' dtype),
    ``"adamw"`` or ``"sgd"`` (the same optimizer on both). Returns ``{"layout": this rank's elements are
    the reference's before any step (the index map is the parallel API's layout), "params": bitwise after
    every step, "state": bitwise after the last, "placements": the placements, "norm": (the norm
    FSDP2Muon clipped by, the reference's)}``."""
    from optbook.clipping import clip_grad_norm_
    from optbook.distributed import FSDP2Muon

    reference, params = build(layout, dtype, world_size)
    reference = [nn.Parameter(r) for r in reference]
    out = {"layout": all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference)),
           "placements": [str(tuple(p.placements)) for p in params]}
    if kind == "muon":
        ref_opt = Muon(_groups(reference, layout), ns_dtype=dtype, **MUON)
        opt = FSDP2Muon(_groups(params, layout), ns_dtype=dtype, max_grad_norm=max_grad_norm, **MUON)
    elif kind == "adamw":
        ref_opt, opt = (AdamW(ps, lr=0.01, weight_decay=0.1) for ps in (reference, params))
    else:
        ref_opt, opt = (SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01) for ps in (reference,
                                                                                                   params))
    ok = True
    for step in range(STEPS):
        _set_grads(reference, params, step)
        if max_grad_norm is not None:
            ref_norm = float(clip_grad_norm_(reference, max_grad_norm))
        ref_opt.step()
        opt.step()
        ok &= all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference))
    out["params"] = ok
    out["state"] = all(set(opt.state[p]) == set(ref_opt.state[r])
                       and all(_same_state(v, ref_opt.state[r][k]) for k, v in opt.state[p].items())
                       for p, r in zip(params, reference))
    if max_grad_norm is not None:
        out["norm"] = (opt.last_grad_norm, ref_norm)
        out["diff"] = max(float((p.detach().to_local().reshape(-1)
                                 - r.detach().reshape(-1)[local_element_indices(p)]).abs().amax())
                          for p, r in zip(params, reference) if p.to_local().numel())
    if kind == "muon":
        out["owners"], out["units"], out["ns_calls"] = opt.owners, opt.units, opt.ns_calls
        if layout in ("experts", "submesh"):   # what the stack alone moves in a step
            alone = [False] * (len(params) - 1) + [True]
            out["experts_bytes"] = opt.predicted_received_bytes(with_grad=alone)["all_to_all"]
            first = next(u for u, (i, _, _) in enumerate(opt.units) if i == len(params) - 1)
            # the experts this rank holds (5 x 4 = 20 elements each)
            experts = (local_element_indices(params[-1].detach()) // 20).unique().tolist()
            out["experts_held"] = experts
            out["experts_here_owned_here"] = all(opt.owners[first + e] == torch.distributed.get_rank()
                                                 for e in experts)
    return out


def collectives_case(world_size: int, n_matrices: int) -> dict:
    """FSDP2Muon (with ``max_grad_norm``) on ``n_matrices`` HSDP matrices (shapes cycling through uneven and
    empty shards): the c10d calls of one step (after the first), the bytes :class:`CommCounter` counted on
    this rank and :meth:`FSDP2Muon.predicted_received_bytes`."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from optbook.distributed import FSDP2Muon
    from optbook.distributed.wire import CommCounter

    shapes = [(7, 5), (3, 6), (1, 4), (6, 6)]
    model = _linears([shapes[k % 4] for k in range(n_matrices)], torch.float64, 4)
    mesh = _mesh(two_d(world_size), ("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    params = list(model.parameters())
    opt = FSDP2Muon(params, lr=0.02, ns_dtype=torch.float64, max_grad_norm=1.0, **MUON)
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = distribute_tensor(_grad(tuple(p.shape), p.dtype, step, i), mesh, p.placements,
                                       src_data_rank=None)
        counter = CommCounter()
        with counter:
            opt.step()
    return {"calls": len(counter.calls) + counter.other_calls, "names": [c[0] for c in counter.calls],
            "received": dict(counter.received), "predicted": opt.predicted_received_bytes()}


def _dcp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _linears(DENSE, torch.float64, 5)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dcp_checkpoint(model, opt, ckpt_dir: str, phase: str) -> None:
    """``phase="save"``: a DCP checkpoint of ``model`` and ``opt`` (their sharded state dicts) in
    ``ckpt_dir``; ``"load"``: read it into them, resharded to their current placements."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if phase == "save":
        dcp.save(state, checkpoint_id=ckpt_dir)
        return
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def dcp_case(world_size: int, ckpt_dir: str, phase: str, mesh_shape, split: int = 2, steps: int = 4) -> dict:
    """``phase="save"``: ``split`` steps of FSDP2Muon on a model ``fully_shard``-ed on a mesh of
    ``mesh_shape`` (2-D: HSDP), then a DCP checkpoint of the model and optimizer. ``phase="load"``: a fresh
    model on ``mesh_shape``, loaded, ``steps - split`` more steps. Returns ``"equal"``: parameters and
    momentum bitwise the uninterrupted single-process Muon's after the last step."""

    from optbook.distributed import FSDP2Muon

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    model = _dcp_model(_mesh(mesh_shape, names))
    params = list(model.parameters())
    reference = [nn.Parameter(r.detach().clone()) for r in _linears(DENSE, torch.float64, 5).parameters()]
    ref_opt = Muon(_groups(reference, "1d"), ns_dtype=torch.float64, **MUON)
    opt = FSDP2Muon(_groups(params, "1d"), ns_dtype=torch.float64, **MUON)
    first, last = (0, split) if phase == "save" else (split, steps)
    for step in range(first):   # the reference alone up to the checkpoint
        for i, r in enumerate(reference):
            r.grad = _grad(tuple(r.shape), r.dtype, step, i)
        ref_opt.step()
    if phase == "load":
        dcp_checkpoint(model, opt, ckpt_dir, "load")
    for step in range(first, last):
        _set_grads(reference, params, step)
        ref_opt.step()
        opt.step()
    if phase == "save":
        dcp_checkpoint(model, opt, ckpt_dir, "save")
    equal = all(_mine(p.detach(), r.detach()) for p, r in zip(params, reference))
    momentum = all(_mine(opt.state[p]["momentum_buffer"], ref_opt.state[r]["momentum_buffer"])
                   for p, r in zip(params, reference))
    return {"equal": equal, "momentum": momentum, "placements": str(tuple(params[0].placements))}


def refusals_case(world_size: int) -> dict:
    """FSDP2Muon's errors on mesh parameters: mixed dtypes, a ``Partial`` placement. Each: the message."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from optbook.distributed import FSDP2Muon

    mesh = _mesh(two_d(world_size), ("replicate", "shard"))
    a = nn.Parameter(distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Shard(0), Shard(1)],
                                       src_data_rank=None))
    b = nn.Parameter(distribute_tensor(torch.ones(4, 3, dtype=torch.float32), mesh, [Shard(0), Shard(1)],
                                       src_data_rank=None))
    c = nn.Parameter(DTensor.from_local(torch.ones(4, 3, dtype=torch.float64), mesh, [Partial(), Shard(0)]))
    out = {}
    for name, ps in (("dtypes", [a, b]), ("partial", [a, c])):
        try:
            FSDP2Muon(ps, lr=0.02)
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def layout_case(world_size: int) -> dict:
    """A state dict of FSDP2Muon holds this rank's shards and records its layout: it loads into the same
    layout (HSDP 2 x 2, the state then equal to the saver's) and is refused, with nothing loaded, by the
    same model on a 1-D mesh of 4: with its layout entry (the message names both layouts) and without it
    (the momentum's placements differ from the parameter's)."""
    from optbook.distributed import FSDP2Muon

    def opt_on(mesh_shape, names):
        reference, params = _fsdp(torch.float64, _mesh(mesh_shape, names))
        return reference, FSDP2Muon(_groups(params, "1d"), ns_dtype=torch.float64, **MUON)

    reference, saver = opt_on(two_d(world_size), ("replicate", "shard"))
    _set_grads(reference, saver._params, 0)
    saver.step()
    sd = saver.state_dict()
    out = {"recorded": sd["layout"]["placements"][0][2]}
    _, same = opt_on(two_d(world_size), ("replicate", "shard"))
    same.load_state_dict(sd)
    out["same_loads"] = all(torch.equal(same.state[q]["momentum_buffer"].to_local(),
                                        saver.state[p]["momentum_buffer"].to_local())
                            for p, q in zip(saver._params, same._params))
    _, other = opt_on((world_size,), ("shard",))
    for name, d in (("other", sd), ("stripped", {k: v for k, v in sd.items() if k != "layout"})):
        try:
            other.load_state_dict(d)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    out["nothing_loaded"] = len(other.state) == 0
    return out


def _safe(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- reported to the test as text, so one case cannot fail the others
        return {"error": traceback.format_exc()}


def suite(rank: int, world_size: int, *, ckpt_dir: str) -> dict:
    """Every case at this world size (one launch). ``ckpt_dir``: the DCP directory; at 4 ranks the HSDP
    2 x 2 save and the 1-D load, and a 1-D save the 2-rank launch loads on a (1, 2) HSDP mesh."""
    torch.set_num_threads(1)
    out = {}
    for layout in ("1d", "hsdp", "tp", "experts", "submesh"):
        for dtype in (torch.float64, torch.float32):
            out[f"muon/{layout}/{str(dtype)[6:]}"] = _safe(run_case, layout, dtype, world_size)
    for layout in ("hsdp", "tp"):
        for kind in ("adamw", "sgd"):
            out[f"{kind}/{layout}"] = _safe(run_case, layout, torch.float64, world_size, kind)
    out["clip/hsdp"] = _safe(run_case, "hsdp", torch.float64, world_size, max_grad_norm=0.5)
    if world_size == 4:
        out["collectives/2"] = _safe(collectives_case, world_size, 2)
        out["collectives/40"] = _safe(collectives_case, world_size, 40)
        out["dcp/hsdp-save"] = _safe(dcp_case, world_size, ckpt_dir + "/hsdp", "save", (2, 2))
        saved = "error" not in out["dcp/hsdp-save"]   # (no load of a checkpoint that was not written)
        out["dcp/1d-load"] = _safe(dcp_case, world_size, ckpt_dir + "/hsdp", "load", (4,)) if saved else \
            {"error": "not saved"}
        out["dcp/1d-save"] = _safe(dcp_case, world_size, ckpt_dir + "/1d", "save", (4,))
        out["layout"] = _safe(layout_case, world_size)
    if world_size == 2:
        import os

        saved = os.path.exists(ckpt_dir + "/1d/.metadata")
        out["dcp/hsdp-load"] = _safe(dcp_case, world_size, ckpt_dir + "/1d", "load", (1, 2)) if saved else \
            {"error": "not saved"}
        out["refusals"] = _safe(refusals_case, world_size)
    return out
