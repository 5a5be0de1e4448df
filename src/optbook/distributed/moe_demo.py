"""The model and the rank functions of chapter 14c (Muon on MoE and 2-D meshes).

:class:`ConvMoENet` is the chapter's small model with every kind of weight Muon meets in a real network: a
convolution kernel ``(out, in, kh, kw)``, a stack of expert matrices ``(E, M, N)``, a router, a norm and
an output head; :func:`optbook.optim.muon_param_groups` routes it (``conv="flatten"``, ``stacked=...``).

:func:`chapter14c` runs on every rank of :func:`optbook.distributed.launch` (a module-level function: the
spawned processes import it by name) and counts, at PyTorch's dispatcher
(:class:`optbook.distributed.wire.CommCounter`), the collectives of one optimizer step:

* Muon's owner design on ``fully_shard``-ed matrices three ways, for a growing number of matrices:
  :func:`per_matrix_step` (a gather to the owner and a scatter back per matrix, section 14b's equation
  written out), :class:`~optbook.distributed.FSDP2Muon` (one all-to-all each way for all matrices) and
  :class:`~optbook.distributed.LayerWiseMuon` on replicated matrices (one all-reduce of all gradients, one
  all-gather of all owned matrices, chapter 14); each run also compared, bit for bit, with single-process
  :class:`~optbook.optim.Muon` on the same gradients;
* :func:`optbook.qk_clip_` after each rank's forwards on its own share of the batch, for a growing number
  of attention layers: the per-head maxima of every layer reduced by one packed MAX all-reduce, and the
  clipped weights compared, bit for bit, with the clip of one process that saw the whole batch;
* :class:`~optbook.distributed.FSDP2Muon` on 2-D meshes (:func:`shard_on_mesh`: HSDP, tensor parallelism
  under FSDP2, experts held whole on an expert-parallel mesh), against single-process Muon.

Explained in chapter 14c. Sources: torchtitan pull request #4243 (one packed MAX all-reduce for QK-clip);
NVIDIA/Megatron-LM issue #6676 (a layer-sharded Muon's NCCL calls per step bucketed down to 4).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

__all__ = ["ConvMoENet", "Experts", "MESH_LAYOUTS", "chapter14c", "dyadic", "matrix_list", "demo_shape",
           "mesh_model", "per_matrix_step", "shard_on_mesh"]

#: The 2-D layouts of :func:`shard_on_mesh` (4 ranks).
MESH_LAYOUTS = ("hsdp", "tp_fsdp")

#: Muon's hyperparameters in every run of :func:`chapter14c` (float64 Newton–Schulz: bitwise comparisons).
MUON_OPTIONS = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_dtype=torch.float64)


class Experts(nn.Module):
    """``E`` expert MLPs ``x + W_out[e] relu(W_in[e] x)`` stored as two stacks, with a top-1 router.

    Args:
        n_experts, d_model, d_ff: ``E``, the width and the experts' hidden width.

    Parameters: ``w_in`` ``(E, d_ff, d_model)``, ``w_out`` ``(E, d_model, d_ff)`` (one matrix per expert, in
    ``nn.Linear``'s ``(out, in)`` layout) and ``router.weight`` ``(E, d_model)``. ``forward`` takes
    ``(T, d_model)`` tokens and sends each to its highest-scoring expert.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int):
        super().__init__()
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(n_experts, d_ff, d_model) / d_model**0.5)
        self.w_out = nn.Parameter(torch.randn(n_experts, d_model, d_ff) / d_ff**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.router(x).argmax(-1)                                   # (T,) expert of each token
        h = torch.einsum("tfd,td->tf", self.w_in[e], x).relu()
        return x + torch.einsum("tdf,tf->td", self.w_out[e], h)


class ConvMoENet(nn.Module):
    """Chapter 14c's model: ``Conv2d(2, 8, 3)`` -> ReLU -> mean over the pixels -> ``LayerNorm(8)`` ->
    :class:`Experts` (4 experts of hidden width 6) -> ``Linear(8, 3)``; input ``(B, 2, H, W)``, output
    ``(B, 3)``. Float32 (``.double()`` for float64)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(2, 8, 3)
        self.norm = nn.LayerNorm(8)
        self.moe = Experts(4, 8, 6)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.norm(self.conv(x).relu().mean((-2, -1)))))


def dyadic(shape, seed: int) -> torch.Tensor:
    """A float64 tensor of multiples of ``2**-10`` in ``[-1, 1)``: sums of a few of them, and their halves
    and quarters, are exact, so a mean over 1, 2 or 4 ranks of equal copies is the value itself."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1024, 1024, tuple(shape), generator=g, dtype=torch.int64).double() / 1024


def demo_shape(i: int) -> tuple[int, int]:
    """The shape of matrix ``i`` of :func:`matrix_list`: ``(8 + i, 6 + i % 3)``. No two are equal (or
    transposes): single-process Muon orthogonalises matrices of one shape in one batched call, whose last
    bits can differ from one call per matrix, so equal shapes would make an owner's unbatched result
    differ from the single-process one in the last bit. The rows (8 to 23 for 16 matrices) split unevenly
    over 3 and 4 ranks."""
    return 8 + i, 6 + i % 3


def matrix_list(n: int) -> list[torch.Tensor]:
    """``n`` float64 matrices of the shapes :func:`demo_shape`, entries from :func:`dyadic`."""
    return [dyadic(demo_shape(i), 100 + i) for i in range(n)]


def _grads(n: int, step: int) -> list[torch.Tensor]:
    return [dyadic(demo_shape(i), 1000 * step + i) for i in range(n)]


def _reference(n: int, steps: int) -> list[torch.Tensor]:
    from optbook.optim import Muon

    params = [w.clone().requires_grad_() for w in matrix_list(n)]
    opt = Muon(params, **MUON_OPTIONS)
    for step in range(steps):
        for p, g in zip(params, _grads(n, step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def per_matrix_step(params, buffers, owners, *, lr: float, momentum: float, nesterov: bool,
                    weight_decay: float, ns_dtype: torch.dtype) -> None:
    """One Muon step over ``fully_shard``-ed matrices, per matrix: section 14b's owner design written out.

    For each matrix ``W`` (a ``DTensor`` sharded by rows, ``Shard(0)`` on a 1-D mesh) with owner
    ``owners[i]``: the momentum and the step direction on the local rows (:func:`momentum_directions`,
    element-wise), the direction's rows padded to ``ceil(m / d)`` and gathered to the owner
    (``torch.distributed.gather``), Muon's update of the whole matrix there
    (:func:`optbook.optim.muon.orthogonalized_blocks`, the arithmetic of single-process Muon), its rows
    scattered back (``torch.distributed.scatter``) and ``W_r <- W_r (1 - lr wd) - lr U_r`` on every rank:
    two collective calls per matrix. Every element sees single-process Muon's operations, so the result is
    bitwise :class:`optbook.optim.Muon`'s (for matrices of distinct shapes, :func:`demo_shape`). Call it
    under ``torch.no_grad()`` (it writes the parameters in place), on every rank of the mesh.

    Args:
        params: 2-D ``DTensor`` parameters with ``.grad`` set, the same list on every rank.
        buffers: each parameter's momentum on the local rows (plain tensors, updated in place).
        owners: the rank (of the parameters' mesh) that orthogonalises each parameter.
        lr, momentum, nesterov, weight_decay, ns_dtype: Muon's hyperparameters.
    """
    import torch.distributed as dist

    from optbook.optim._functional import momentum_directions
    from optbook.optim.muon import orthogonalized_blocks

    for p, buf, owner in zip(params, buffers, owners):
        group = p.device_mesh.get_group()
        rank, d = dist.get_rank(group), dist.get_world_size(group)
        src = dist.get_global_rank(group, owner)
        w, g = p.to_local(), p.grad.to_local()   # the same storage: writes land in the DTensor
        (direction,) = momentum_directions([buf], [g], momentum, nesterov)
        m, n = p.shape
        pad = math.ceil(m / d)
        send = torch.zeros(pad, n, dtype=w.dtype)
        send[:w.shape[0]] = direction
        recv = [torch.empty_like(send) for _ in range(d)] if rank == owner else None
        dist.gather(send, recv, dst=src, group=group)
        pieces = None
        if rank == owner:
            sizes = [c.shape[0] for c in torch.empty(m, 0).chunk(d)]
            sizes += [0] * (d - len(sizes))
            whole = torch.cat([r[:k] for r, k in zip(recv, sizes)])
            (blocks,) = orthogonalized_blocks([whole], ns_dtype=ns_dtype)
            pieces = [torch.zeros(pad, n, dtype=w.dtype) for _ in range(d)]
            for piece, rows in zip(pieces, blocks[0].split(sizes)):
                piece[:rows.shape[0]] = rows
        mine = torch.empty(pad, n, dtype=w.dtype)
        dist.scatter(mine, pieces, src=src, group=group)
        w.mul_(1 - lr * weight_decay)
        w.sub_(mine[:w.shape[0]], alpha=lr)


def _count(counter) -> dict:
    """What one step issued: the names of its calls in order, the bytes each delivered to this rank, and
    the bytes received per collective."""
    return {"calls": [name for name, _, _ in counter.calls],
            "sizes": [got for _, _, got in counter.calls], "bytes": dict(counter.received)}


def _sharded_matrices(n: int) -> list:
    """The :func:`matrix_list` matrices as parameters ``fully_shard``-ed on the default 1-D mesh (each a
    ``Shard(0)`` DTensor)."""
    from torch.distributed.fsdp import fully_shard

    holder = nn.Module()
    holder.w = nn.ParameterList([nn.Parameter(w) for w in matrix_list(n)])
    fully_shard(holder)
    return list(holder.parameters())


def _fsdp2_steps(n: int, steps: int) -> dict:
    from torch.distributed.tensor import distribute_tensor

    from optbook.distributed import FSDP2Muon
    from optbook.distributed.wire import CommCounter

    params = _sharded_matrices(n)
    opt = FSDP2Muon(params, **MUON_OPTIONS)
    out = {"steps": [], "owners": list(opt.owners),
           "rows": [p.to_local().shape[0] for p in params]}
    for step in range(steps):
        for p, g in zip(params, _grads(n, step)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        with CommCounter() as counter:
            opt.step()
        out["steps"].append(_count(counter))
    whole = [p.full_tensor() for p in params]
    out["equal"] = all(torch.equal(a, b) for a, b in zip(whole, _reference(n, steps)))
    return out


def _per_matrix_steps(n: int, steps: int) -> dict:
    from torch.distributed.tensor import distribute_tensor

    from optbook.distributed import lpt_assign, ns_cost
    from optbook.distributed.wire import CommCounter

    params = _sharded_matrices(n)
    owners = lpt_assign([ns_cost(p.shape) for p in params], params[0].device_mesh.size())
    buffers = [torch.zeros_like(p.to_local()) for p in params]
    out = {"steps": [], "owners": owners}
    for step in range(steps):
        for p, g in zip(params, _grads(n, step)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        with torch.no_grad(), CommCounter() as counter:
            per_matrix_step(params, buffers, owners, **MUON_OPTIONS)
        out["steps"].append(_count(counter))
    whole = [p.full_tensor() for p in params]
    out["equal"] = all(torch.equal(a, b) for a, b in zip(whole, _reference(n, steps)))
    return out


def _layerwise_steps(n: int, steps: int) -> dict:
    from optbook.distributed import LayerWiseMuon
    from optbook.distributed.wire import CommCounter

    params = [w.clone().requires_grad_() for w in matrix_list(n)]
    opt = LayerWiseMuon(params, **MUON_OPTIONS)
    out = {"steps": [], "owners": list(opt.owners)}
    for step in range(steps):
        for p, g in zip(params, _grads(n, step)):
            p.grad = g.clone()                # every rank the same dyadic gradient: the mean is exact
        with CommCounter() as counter:
            opt.step()
        out["steps"].append(_count(counter))
    out["equal"] = all(torch.equal(p.detach(), r) for p, r in zip(params, _reference(n, steps)))
    return out


def _qk_clip_model(n_layers: int) -> nn.Module:
    from optbook.models import TinyTransformer, attention_modules
    from optbook.qk_clip import clipped_blocks

    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=16, d_model=16, n_layers=n_layers, n_heads=4,
                            max_seq_len=8, mlp_ratio=2).double()
    with torch.no_grad():   # large query and key weights: logits of several units, some heads above tau
        for attn in attention_modules(model):
            for weight in clipped_blocks(attn):
                attn.get_parameter(weight).mul_(20.0)
    return model


def _qk_clip_steps(rank: int, world_size: int, n_layers: int, tau: float) -> dict:
    from optbook.distributed.wire import CommCounter
    from optbook.qk_clip import qk_clip_

    reference = _qk_clip_model(n_layers)
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, 16, (2 * world_size, 8), generator=torch.Generator().manual_seed(7))
    reference(tokens)                        # one process: the whole batch
    model(tokens.chunk(world_size)[rank])    # this rank: its share of the batch only
    with CommCounter() as counter:
        report = qk_clip_(model, tau)
    # the reference's own all-reduce meets the same maxima on every rank and changes nothing
    ref_report = qk_clip_(reference, tau)
    return {**_count(counter), "dtypes": [str(dtype) for _, dtype, _ in counter.calls],
            "clipped": len(report), "same_report": report == ref_report,
            "equal": all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))}


def mesh_model(weights=None) -> nn.Module:
    """Section 14c's float64 MLP for 2-D meshes: ``up`` ``Linear(12, 10)``, ``down`` ``Linear(10, 9)`` (no
    biases) and ``experts``, a stack ``(8, 6, 5)`` of 8 expert matrices; dyadic weights
    (:func:`dyadic`), or ``weights``, three tensors of those shapes (a model whose weights are a step's
    gradients is sharded as the model is, which gives each rank its part of every gradient)."""
    model = nn.Module()
    model.up = nn.Linear(12, 10, bias=False, dtype=torch.float64)
    model.down = nn.Linear(10, 9, bias=False, dtype=torch.float64)
    model.experts = nn.Parameter(torch.zeros(8, 6, 5, dtype=torch.float64))
    weights = weights or [dyadic((10, 12), 1), dyadic((9, 10), 2), dyadic((8, 6, 5), 3)]
    with torch.no_grad():
        for p, w in zip(_mesh_params(model), weights):
            p.copy_(w)
    return model


def _mesh_params(model: nn.Module) -> list:
    """``[up.weight, down.weight, experts]``: the order of :func:`mesh_model`'s ``weights``."""
    return [model.up.weight, model.down.weight, model.experts]


def shard_on_mesh(model: nn.Module, layout: str) -> nn.Module:
    """Shard section 14c's model on 4 ranks (the chapter prints this function's source).

    ``layout="hsdp"``: 2 replicas of 2 shards. ``layout="tp_fsdp"``: 2-way tensor
    parallelism inside 2-way FSDP. Either way the experts go whole to the ranks of a
    1-D expert-parallel mesh of 4 (2 experts each). Returns ``model``, sharded.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    ep = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    experts = distribute_tensor(model.experts.detach(), ep, [Shard(0)])
    model.experts = nn.Parameter(experts)     # expert-local: whole experts per rank
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.up, mesh=mesh)      # (Replicate(), Shard(0))
        fully_shard(model.down, mesh=mesh)
    elif layout == "tp_fsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)   # Shard(0) / Shard(1) on tp
        fully_shard(model.up, mesh=mesh["dp"])        # then rows on dp
        fully_shard(model.down, mesh=mesh["dp"])
    else:
        raise ValueError(f"Invalid layout: expected one of {MESH_LAYOUTS}, got {layout!r}")
    return model


def _mesh_grads(step: int) -> list[torch.Tensor]:
    return [dyadic((10, 12), 10 + step), dyadic((9, 10), 20 + step), dyadic((8, 6, 5), 30 + step)]


def _mesh_steps(layout: str, steps: int) -> dict:
    import logging

    from optbook.distributed import FSDP2Muon
    from optbook.distributed.wire import CommCounter
    from optbook.optim import Muon

    # full_tensor() of a _StridedShard weight warns that it takes two all-gathers: the check's, not the step's
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    reference = mesh_model()
    ref_params = _mesh_params(reference)
    ref_opt = Muon([{"params": ref_params[:2]}, {"params": ref_params[2:], "matrix_view": "stacked"}],
                   **MUON_OPTIONS)
    model = shard_on_mesh(mesh_model(), layout)
    params = _mesh_params(model)
    opt = FSDP2Muon([{"params": params[:2]}, {"params": params[2:], "matrix_view": "stacked"}],
                    **MUON_OPTIONS)
    out = {"placements": [str(tuple(p.placements)) for p in params],
           "local": [tuple(p.to_local().shape) for p in params],
           "owners": list(opt.owners), "steps": []}
    for step in range(steps):
        grads = _mesh_grads(step)
        for p, g in zip(ref_params, grads):
            p.grad = g
        ref_opt.step()
        # the step's gradients, sharded exactly as the parameters
        sharded = _mesh_params(shard_on_mesh(mesh_model(grads), layout))
        for p, g in zip(params, sharded):
            p.grad = g.detach()
        with CommCounter() as counter:
            opt.step()
        out["steps"].append(_count(counter))
    out["equal"] = all(torch.equal(p.full_tensor(), r.detach()) for p, r in zip(params, ref_params))
    return out


def chapter14c(rank: int, world_size: int, *, counts=(1, 2, 4, 8, 16), layers=(1, 2, 4, 8),
               steps: int = 2, tau: float = 5.0, meshes: bool = True) -> dict:
    """Everything chapter 14c counts on ``world_size`` gloo ranks (run it with :func:`launch`).

    Args:
        counts: numbers of matrices (:func:`matrix_list`) stepped by FSDP2Muon and by LayerWiseMuon.
        layers: numbers of attention layers (4 heads each) clipped by :func:`optbook.qk_clip_`.
        steps: optimizer steps per run; each step's collectives are counted alone.
        tau: QK-clip's threshold.
        meshes: also step :func:`mesh_model` sharded by :func:`shard_on_mesh` in each of
            :data:`MESH_LAYOUTS` with FSDP2Muon (``world_size`` must then be 4).

    Returns:
        ``{"per_matrix": {n: run}, "fsdp2": {n: run}, "layerwise": {n: run}, "qk_clip": {L: run},
        "mesh": {layout: run}}`` (``"per_matrix"``: :func:`per_matrix_step` on the same sharded matrices
        as ``"fsdp2"``; ``"mesh"`` only with ``meshes``). A Muon run: ``"steps"`` (per step ``"calls"``,
        the collective names in order, ``"sizes"``, the bytes each call delivered to this rank, and
        ``"bytes"``, those bytes per collective, as :class:`~optbook.distributed.wire.CommCounter` counts
        them), ``"owners"``, ``"equal"`` (bitwise single-process Muon after the last step) and, for FSDP2,
        ``"rows"`` (this rank's rows of each matrix). A QK-clip run: ``"calls"``, ``"sizes"``,
        ``"bytes"``, ``"dtypes"`` (of each call), ``"clipped"`` (heads clipped), ``"same_report"`` and
        ``"equal"`` (the weights bitwise those of one process that saw the whole batch). A mesh run:
        ``"placements"`` and ``"local"`` (this rank's shape) of each parameter, ``"owners"``, ``"steps"``
        and ``"equal"`` as a Muon run (the reference: single-process Muon, the experts in a ``"stacked"``
        group).

    Raises:
        ValueError: ``meshes`` with ``world_size`` other than 4 (raised by ``init_device_mesh``).
    """
    torch.set_num_threads(1)
    out = {"per_matrix": {n: _per_matrix_steps(n, steps) for n in counts},
           "fsdp2": {n: _fsdp2_steps(n, steps) for n in counts},
           "layerwise": {n: _layerwise_steps(n, steps) for n in counts},
           "qk_clip": {L: _qk_clip_steps(rank, world_size, L, tau) for L in layers}}
    if meshes:
        out["mesh"] = {layout: _mesh_steps(layout, steps) for layout in MESH_LAYOUTS}
    return out
