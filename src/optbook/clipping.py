"""Global gradient-norm clipping, safe in low precision and across processes. Explained in chapter 12.

Sources: global-norm clipping is Pascanu, Mikolov and Bengio (2013), "On the difficulty of training
recurrent neural networks" (ICML, arXiv:1211.5063, section 3.2): rescale the *whole* gradient ``g``
(every parameter's gradient viewed as one vector) to ``g * max_norm / ||g||`` when ``||g|| > max_norm``.
The coefficient ``max_norm / (||g|| + 1e-6)``, applied only when it is below 1, and returning the norm
*before* clipping follow PyTorch's ``torch.nn.utils.clip_grad_norm_``. The distributed part (one sum
of squares all-reduced over the ranks, parameters held by every rank counted on one rank only) follows
Megatron-LM's ``megatron/core/optimizer/clip_grads.py`` (``get_grad_norm_fp32``,
``clip_grad_by_total_norm_fp32``) and ``param_is_not_tensor_parallel_duplicate`` in
``megatron/core/tensor_parallel/layers.py``, both at core_v0.16.0.

What differs from ``torch.nn.utils.clip_grad_norm_``:

* The norm is accumulated in float64 whatever the gradients' dtype, and the clip multiplies in float64
  with one rounding back per element, so float16/bfloat16/float32 gradients neither overflow (a float32
  ``1e20 * ones(100)`` has norm ``1e21``, not ``inf``) nor underflow to zero when scaled. (torch 2.13's
  ``vector_norm`` sums a float32 gradient's squares in float32, so its norm is ``inf`` above about
  ``1.8e19``; a float16 gradient's squares are summed in float32 too and only the norm is rounded to
  float16, so its norm is ``inf`` exactly when it exceeds 65504, however large the sum of squares.) Should the
  float64 sum of squares itself overflow (float64 gradients with a norm above about ``1.3e154``; float32
  gradients cannot get there), the norm is recomputed as ``amax * ||g / amax||``, so every finite
  gradient has a finite norm up to float64's largest number.
* A non-finite norm (an ``inf`` or ``NaN`` in any gradient) leaves every gradient untouched, instead
  of writing ``inf * 0 = NaN`` into them; the caller can skip the step.
* The same tensor listed twice (tied weights) is counted and scaled once.
* ``group=`` sums the squares over the ranks of a ``torch.distributed`` process group.

What a global clip does to the *other* parameters: every gradient is multiplied by the same factor, so
one huge gradient in a single tensor (a bad batch through one embedding row, an overflowed partial
result) shrinks the step of every other tensor by that factor. Optimizers that normalise their update
are not immune: Adam's first step ``g / (|g| + eps)`` falls from ``lr`` towards 0 once the clipped
``|g|`` nears ``eps``, and Muon's momentum then holds a clipped gradient next to unclipped ones. Where
one tensor's spike should not silence the rest, check each tensor's norm before clipping (compare it
with that tensor's recent norms, e.g. ``get_grad_norm(p)`` per parameter, and skip the step or drop that
tensor's gradient), or clip the groups separately, accepting that the whole gradient's direction then
changes (chapter 12 shows both).

Convention for parameters held by every rank (``group`` given): a parameter with the attribute
``optbook_replicated = True`` (see :data:`REPLICATED`) holds the same gradient on every rank of the group
and is counted on the group's rank 0 only; every other parameter is taken to be this rank's own (a
shard, or a parameter no other rank holds) and is counted on every rank. Megatron-LM (core_v0.16.0) marks the opposite
set (``tensor_model_parallel = True`` on split parameters, every unmarked parameter counted on
tensor-parallel rank 0 only) because there most parameters are replicated; here the common case is
sharding (each rank passes the parameters it owns), which then needs no marking. Without ``group`` the
attribute is ignored.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_bool, check_number
from ._sharded import is_dtensor

__all__ = ["REPLICATED", "clip_coefficient", "clip_grad_norm_", "get_grad_norm", "grad_sumsq", "scale_grads_"]

#: Marks a parameter held identically by every rank of the group: ``p.optbook_replicated = True``.
REPLICATED = "optbook_replicated"

#: Added to the norm in the coefficient ``max_norm / (norm + EPS)``, as ``torch.nn.utils.clip_grad_norm_``.
EPS = 1e-6


def clip_coefficient(norm: float, max_norm) -> float:
    """The factor global-norm clipping multiplies every gradient by: ``min(1, max_norm / (norm + 1e-6))``.

    Args:
        norm: the global gradient norm before clipping (a Python number, units of the gradient).
        max_norm: the largest allowed norm (``> 0``), or ``None`` for no clipping.

    Returns:
        A Python float in ``(0, 1]``: ``1.0`` when ``max_norm`` is ``None`` or ``norm`` is ``inf``/``NaN``
        (scaling would write ``inf * 0 = NaN`` into the gradients). Not validated: callers check
        ``max_norm`` where the user gives it.

    Source: ``torch.nn.utils.clip_grad_norm_`` (torch 2.13, ``clip_coef = max_norm / (total_norm + 1e-6)``,
    clamped to 1).
    """
    if max_norm is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + EPS))


@torch.no_grad()
def scale_grads_(grads, coef: float) -> None:
    """Multiply each tensor of ``grads`` in place by ``coef``, in float64 with one rounding back.

    Args:
        grads: an iterable of floating-point tensors (any shape; float16, bfloat16, float32 or float64).
        coef: a Python float, usually :func:`clip_coefficient`'s. ``coef >= 1`` leaves every tensor bitwise
            untouched (clipping never scales up).

    A float16 gradient is therefore not flushed to zero by a coefficient below float16's smallest number
    before it is rounded; the float64 copy of one tensor at a time is the memory cost.
    """
    if coef >= 1.0:
        return
    for g in grads:
        if g.dtype == torch.float64:
            g.mul_(coef)
        else:
            g.copy_(g.to(torch.float64).mul_(coef))


@torch.no_grad()
def grad_sumsq(grads, device=None) -> torch.Tensor:
    """The float64 sum of squares of every element of ``grads``: ``sum ||g||^2``, one ``vector_norm`` each.

    Args:
        grads: an iterable of floating-point tensors (any shape and dtype; accumulated in float64, so no
            float16/bfloat16/float32 tensor can overflow).
        device: where the result lives (default: the first tensor's device; the CPU when there is none).

    Returns:
        A 0-dim float64 tensor on ``device`` (units: gradient squared); ``inf``/``NaN`` when a tensor holds
        one (or when the float64 sum overflows, above about ``1.3e154`` squared norm). Local only: for a
        norm over ranks all-reduce it (SUM), as :func:`get_grad_norm` does.
    """
    grads = list(grads)
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g, dtype=torch.float64).to(device).square()
    return total


def _unique_params(params) -> list[torch.Tensor]:
    """``params`` as a list, each tensor object once (first occurrence kept, order kept)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    seen, out = set(), []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"Invalid params: element {i} is a {type(p).__name__}, expected a torch.Tensor")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _grads(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(param, grad)`` for every parameter with a gradient, after checking the gradient is usable."""
    pairs = []
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        if g.layout != torch.strided:
            raise TypeError(f"Invalid grad of parameter {i} (shape {tuple(p.shape)}): sparse gradients are "
                            "not supported; use dense gradients (e.g. nn.Embedding(sparse=False))")
        if g.is_complex() or not g.is_floating_point():
            raise TypeError(f"Invalid grad of parameter {i}: dtype {g.dtype}; expected a real floating-point "
                            "dtype (float16, bfloat16, float32 or float64)")
        pairs.append((p, g))
    return pairs


def _local_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]], group) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pairs`` with every ``DTensor`` gradient (FSDP2's ``fully_shard``) replaced by its local shard.

    A shard holds disjoint elements, so the squares of the shards summed over the mesh's group are the
    squares of the whole gradient; that needs ``group`` when the mesh has more than one rank, and every
    placement a ``Shard`` (a replicated placement would be counted once per rank).

    Raises:
        TypeError: a ``DTensor`` gradient with a placement that is not a ``Shard``.
        ValueError: a ``DTensor`` gradient on a mesh of several ranks and ``group`` is ``None``.
    """

    out = []
    for p, g in pairs:
        if is_dtensor(g):
            if not all(pl.is_shard() for pl in g.placements):
                raise TypeError(f"Invalid grad of parameter of shape {tuple(p.shape)}: a DTensor placed as "
                                f"{tuple(g.placements)}; only sharded DTensors (Shard placements, as fully_shard "
                                "makes them) are supported: a replicated placement would be counted on every rank")
            if g.device_mesh.size() > 1 and group is None:
                raise ValueError(f"Invalid group: the gradient of the parameter of shape {tuple(p.shape)} is a "
                                 f"DTensor shard on a mesh of {g.device_mesh.size()} ranks; pass "
                                 "group=mesh.get_group() so that the shards' squares are summed over the mesh "
                                 "(group=None would return this rank's shards' norm)")
            g = g.to_local()
        out.append((p, g))
    return out


def _group_rank(group) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("Invalid group: a process group was given but torch.distributed is not "
                           "initialised (call torch.distributed.init_process_group, or "
                           "optbook.distributed.launch, first)")
    return dist.get_rank(group)


def _all_reduce(t: torch.Tensor, group, op) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, op=op, group=group)
    return t


def _reduce_device(grads: list[torch.Tensor], group) -> torch.device:
    """Where the norm lives: the first gradient's device; with no gradient, CPU (the current CUDA device
    for an NCCL group, which cannot reduce CPU tensors)."""
    if grads:
        return grads[0].device
    if group is not None:
        import torch.distributed as dist

        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def get_grad_norm(params, group=None) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` as one vector: ``sqrt(sum of ||p.grad||^2)``.

    Args:
        params: a tensor or an iterable of tensors (parameters); their ``.grad`` is read (any shape;
            float16, bfloat16, float32 or float64). Parameters whose ``grad`` is ``None`` are skipped; the
            same tensor object listed more than once is counted once.
        group: ``None`` for this process's gradients only, or a ``torch.distributed`` process group
            (``torch.distributed.group.WORLD`` for all processes): the float64 sums of squares of the
            ranks are all-reduced (SUM) before the square root, so every rank gets the same norm.
            Parameters with ``optbook_replicated = True`` are then counted on the group's rank 0 only
            (module docstring). Every rank of the group must call this function (it is a collective).

    Returns:
        A 0-dim float64 tensor (units of the gradient) on the first gradient's device (CPU when there
        is no gradient: norm 0). ``inf`` if a gradient holds ``inf`` and no ``NaN``, ``NaN`` if one
        holds ``NaN`` (on any rank of ``group``: every rank returns the same value).

    Raises:
        TypeError: an element of ``params`` is not a tensor, or a gradient is sparse, complex or integer.
        RuntimeError: ``group`` is given but ``torch.distributed`` is not initialised.
        ValueError: ``DTensor`` gradients (FSDP2's ``fully_shard``) on a mesh of several ranks without
            ``group``; a ``DTensor`` gradient that is not sharded raises ``TypeError``. Sharded ``DTensor``
            gradients are read through their local shards, summed over ``group`` (pass the mesh's group).

    Precision: each gradient is summed in float64 (``torch.linalg.vector_norm(g, dtype=float64)``), so no
    float16/bfloat16/float32 gradient can overflow. When the float64 sum of squares overflows although
    every entry is finite (float64 gradients of norm above ~1.3e154), the norm is recomputed as
    ``amax * ||g / amax||`` with ``amax`` the largest ``|entry|`` over all ranks, which is finite up to
    ``1.8e308``.

    Source: ``torch.nn.utils.get_total_norm``; Megatron-LM ``get_grad_norm_fp32`` (clip_grads.py).
    """
    import torch.distributed as dist

    pairs = _local_grads(_grads(_unique_params(params)), group)
    device = _reduce_device([g for _, g in pairs], group)
    if group is not None and _group_rank(group) != 0:
        pairs = [(p, g) for p, g in pairs if not getattr(p, REPLICATED, False)]
    grads = [g for _, g in pairs]
    sumsq = grad_sumsq(grads, device)
    if group is not None:
        _all_reduce(sumsq, group, dist.ReduceOp.SUM)
    if torch.isfinite(sumsq):  # the common case: one pass, one collective
        return sumsq.sqrt()
    # Non-finite: an inf/NaN entry somewhere, or an overflow of the float64 sum. Every rank sees the same
    # reduced value, so every rank takes this branch and the collectives below stay matched.
    found = torch.zeros(2, dtype=torch.float64, device=device)  # [any NaN, any inf] on this rank
    for g in grads:
        found[0] += g.isnan().any().to(device)
        found[1] += g.isinf().any().to(device)
    if group is not None:
        _all_reduce(found, group, dist.ReduceOp.SUM)
    if found[0] > 0:
        return torch.full((), math.nan, dtype=torch.float64, device=device)
    if found[1] > 0:
        return torch.full((), math.inf, dtype=torch.float64, device=device)
    amax = torch.zeros((), dtype=torch.float64, device=device)  # every entry finite: rescale by the max
    for g in grads:
        if g.numel():
            amax = torch.maximum(amax, g.abs().max().to(device, torch.float64))
    if group is not None:
        _all_reduce(amax, group, dist.ReduceOp.MAX)
    scaled = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        scaled += torch.linalg.vector_norm(g.to(torch.float64) / amax.to(g.device)).to(device).square()
    if group is not None:
        _all_reduce(scaled, group, dist.ReduceOp.SUM)
    return amax * scaled.sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm, group=None, error_if_nonfinite=False) -> torch.Tensor:
    """Scale all gradients of ``params`` in place by ``min(1, max_norm / (norm + 1e-6))``; return the norm.

    ``norm`` is :func:`get_grad_norm` ``(params, group)``: one L2 norm over every gradient (over every rank
    of ``group``), so the direction of the whole gradient is kept and only its length is capped
    (Pascanu et al., 2013). The gradients are scaled only when the coefficient is below 1; otherwise they
    are left bitwise untouched. With ``group``, every rank applies the same coefficient to all of its
    gradients, replicated ones included.

    Args:
        params: a tensor or an iterable of tensors whose ``.grad`` is clipped (any shape; float16,
            bfloat16, float32 or float64); ``grad is None`` is skipped, a tensor listed twice is scaled once.
        max_norm: the largest allowed global norm (units of the gradient), a finite number ``> 0``
            (a Python number or a one-element real tensor).
        group: as in :func:`get_grad_norm` (``None``: this process only); a collective when given.
        error_if_nonfinite: raise instead of returning a non-finite norm.

    Returns:
        The global norm *before* clipping: a 0-dim float64 tensor. When it is ``inf`` or ``NaN`` no
        gradient is changed (scaling would write ``inf * 0 = NaN`` or ``NaN`` into them); the caller
        should skip the optimizer step (as :func:`optbook.training.train_sequence_model` does).

    Raises:
        TypeError: ``max_norm`` is not a real number (bool, str, ...), ``error_if_nonfinite`` is not a
            bool, or a parameter or gradient as in :func:`get_grad_norm`.
        ValueError: ``max_norm`` is ``<= 0``, ``NaN`` or infinite; the message names ``max_norm``.
        RuntimeError: ``error_if_nonfinite=True`` and the norm is ``inf`` or ``NaN`` (as
            ``torch.nn.utils.clip_grad_norm_``).
        Every error is raised before any gradient is written.

    Precision: the coefficient is a float64 number and each gradient is multiplied in float64 and
    rounded once to its own dtype, so a float16 gradient is not zeroed by a coefficient below float16's
    smallest number; the float64 copy of one gradient at a time is the memory cost.

    One factor for all: a spike in a single tensor shrinks every other tensor's gradient by the same
    coefficient (and an Adam-type step towards 0 once the clipped entries near its ``eps``). To keep one
    bad tensor from silencing the rest, check per-tensor norms first (``get_grad_norm(p)`` for each
    ``p``, against that tensor's recent values) or call this function once per group (module docstring).

    Source: ``torch.nn.utils.clip_grad_norm_``; Megatron-LM ``clip_grad_by_total_norm_fp32`` (clip_grads.py).
    """
    max_norm = check_number("max_norm", max_norm, low=0.0, low_open=True)
    check_bool("error_if_nonfinite", error_if_nonfinite)
    params = _unique_params(params)
    norm = get_grad_norm(params, group=group)
    if not torch.isfinite(norm):
        if error_if_nonfinite:
            raise RuntimeError(f"Non-finite gradient norm: got {norm.item()} (a gradient holds inf or NaN); "
                               "no gradient was changed. Skip this step, or pass error_if_nonfinite=False to "
                               "get the norm back instead")
        return norm
    scale_grads_([g for _, g in _local_grads(_grads(params), group)], clip_coefficient(norm.item(), max_norm))
    return norm
