"""Newton–Schulz on a matrix split across tensor-parallel ranks: three modes. Explained in chapter 14.

With tensor parallelism a weight ``W`` of shape ``(m, n)`` is split into ``t`` equal shards along one
dimension (``partition_dim`` 0: row blocks, as a column-parallel linear layer's ``fan_out``; 1: column
blocks, as a row-parallel layer's ``fan_in``). Muon needs the polar factor of the whole matrix. Megatron-LM's
``TensorParallelMuon`` (``megatron/core/optimizer/emerging_optimizers.py``, with the iteration in NVIDIA's
Emerging-Optimizers package, ``newton_schulz_tp``) offers three modes, reproduced here:

* ``"blockwise"``: each rank orthogonalises its own shard; no communication, but the result is the polar
  factor of each block, not the block of the polar factor (chapter 14 measures the difference).
* ``"duplicated"``: all-gather the shards into ``W``, every rank runs the full Newton–Schulz, keeps its
  block. Exactly the single-device result; one all-gather of ``W`` per step.
* ``"distributed"``: the shards stay local and the iteration's Gram matrix is all-reduced at each of its
  ``k`` steps. In the wide orientation ``X`` (``p <= q``), split along ``q`` (columns)::

      A = X X^T = sum_r X_r X_r^T      (all-reduce of a p x p matrix)
      X_r <- a X_r + (b A + c A^2) X_r  (local)

  and split along ``p`` (rows) the same with the right Gram ``X^T X = sum_r X_r^T X_r`` and
  ``X_r <- a X_r + X_r (b A + c A^2)``, the same polynomial (``X (X^T X)^j = (X X^T)^j X``). The Frobenius
  normalisation is one all-reduce of a number. Equal to the single-device result up to the order of the sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..polar import newton_schulz, ns_schedule
from ._comm import all_gather

__all__ = ["TP_MODES", "tensor_parallel_newton_schulz"]

TP_MODES = ("blockwise", "duplicated", "distributed")


def _count(comm_bytes, key, t: torch.Tensor, factor: int = 1) -> None:
    if comm_bytes is not None:
        comm_bytes[key] = comm_bytes.get(key, 0) + factor * t.numel() * t.element_size()


def tensor_parallel_newton_schulz(shard: torch.Tensor, partition_dim: int, mode: str = "duplicated", group=None, *,
                                  steps: int = 5, coefficients="simple", eps: float = 1e-7,
                                  dtype: torch.dtype = torch.bfloat16, comm_bytes: dict | None = None
                                  ) -> torch.Tensor:
    """This rank's block of Newton–Schulz of the matrix whose equal shards the ranks of ``group`` hold.

    Args:
        shard: this rank's ``(m / t, n)`` (``partition_dim=0``) or ``(m, n / t)`` (``partition_dim=1``) block,
            a real floating 2-D tensor; every rank's block has the same shape (rank ``r`` holds block ``r``).
        partition_dim: 0 or 1, the dimension ``W`` is split along.
        mode: ``"blockwise"``, ``"duplicated"`` or ``"distributed"`` (module docstring).
        group: the tensor-parallel process group (``None``: WORLD). A collective except for ``"blockwise"``.
        steps, coefficients, eps, dtype: as :func:`optbook.newton_schulz` (``dtype`` of the iteration).
        comm_bytes: optional dict; the bytes of each collective are added under ``"all_gather"`` or
            ``"all_reduce"`` (an all-reduce counted twice, as :mod:`optbook.distributed.layerwise_muon`).

    Returns:
        A tensor of ``shard``'s shape and dtype.

    Raises:
        ValueError: bad ``mode`` or ``partition_dim``, ``shard`` not 2-D, or (a collective check, on every
            rank) shards of different shapes.
        TypeError: ``shard`` not a real floating tensor.
    """
    if mode not in TP_MODES:
        raise ValueError(f"Invalid mode: expected one of {TP_MODES}, got {mode!r}")
    if partition_dim not in (0, 1) or isinstance(partition_dim, bool):
        raise ValueError(f"Invalid partition_dim: expected 0 or 1, got {partition_dim!r}")
    if not isinstance(shard, torch.Tensor) or not shard.is_floating_point():
        raise TypeError(f"Invalid shard: expected a real floating tensor, got {getattr(shard, 'dtype', shard)!r}")
    if shard.ndim != 2:
        raise ValueError(f"Invalid shard: expected a 2-D block, got shape {tuple(shard.shape)}")
    schedule = ns_schedule(coefficients, steps)
    if mode == "blockwise":
        return newton_schulz(shard, steps=steps, coefficients=coefficients, eps=eps, dtype=dtype)
    group = dist.group.WORLD if group is None else group
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    shapes = torch.tensor(shard.shape, dtype=torch.float64, device=shard.device)
    lo, hi = shapes.clone(), shapes.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise ValueError(f"Invalid shard: the ranks' blocks differ in shape (this rank {tuple(shard.shape)}); "
                         "tensor parallelism splits into equal blocks")
    if mode == "duplicated":
        flat = torch.empty(t * shard.numel(), dtype=shard.dtype, device=shard.device)
        all_gather(flat, shard.contiguous().reshape(-1), group=group)
        _count(comm_bytes, "all_gather", flat)
        full = torch.cat(list(flat.view(t, *shard.shape)), dim=partition_dim)
        out = newton_schulz(full, steps=steps, coefficients=coefficients, eps=eps, dtype=dtype)
        return out.chunk(t, dim=partition_dim)[rank].contiguous()
    # distributed: the Gram matrix is summed over the ranks at each step
    m, n = (shard.shape[0] * t, shard.shape[1]) if partition_dim == 0 else (shard.shape[0], shard.shape[1] * t)
    norm_dtype = torch.promote_types(shard.dtype, torch.float32)
    X = shard.to(norm_dtype)
    sumsq = X.square().sum().reshape(1)
    dist.all_reduce(sumsq, group=group)
    _count(comm_bytes, "all_reduce", sumsq, 2)
    X = (X / sumsq.sqrt().clamp_min(eps)).to(dtype)
    tall = m > n
    split = partition_dim
    if tall:  # the wide orientation, as newton_schulz
        X, split = X.mT, 1 - partition_dim
    for a, b, c in schedule:
        A = X @ X.mT if split == 1 else X.mT @ X
        dist.all_reduce(A, group=group)
        _count(comm_bytes, "all_reduce", A, 2)
        B = b * A + c * (A @ A)
        X = a * X + (B @ X if split == 1 else X @ B)
    if tall:
        X = X.mT
    return X.to(shard.dtype).contiguous()
