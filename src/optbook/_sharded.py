"""Parameters sharded by PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): ``DTensor`` with ``Shard(0)``.

An element-wise optimizer (SGD, Adam, AdamW, Lion, Schedule-Free AdamW: every element updated from that
element's own gradient and state) steps such a parameter by stepping its local shard: the arithmetic on
each element is the single-process arithmetic, so the result is bitwise the same (``tests/test_fsdp2.py``).
What must cross ranks is only a decision: whether any shard of any gradient holds ``inf`` or ``NaN``, so
that every rank raises (or none does) and the replicas never diverge. An optimizer that needs the whole
matrix (Muon, Shampoo, SOAP, Adafactor's factored statistics, ...) would compute something else on a shard
and refuses it (:func:`refuse_sharded`).

Private to the package: the optimizers, the wrappers, clipping and FSDP2Muon import it from this ground floor.
"""

from __future__ import annotations

import torch

__all__ = ["any_flag_across_meshes", "is_dtensor", "is_sharded_dtensor", "local", "meshes", "refuse_sharded"]


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return None
    return DTensor


def is_dtensor(t) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def is_sharded_dtensor(t) -> bool:
    """Whether ``t`` is a ``DTensor`` with a ``Shard`` placement on some mesh dimension (FSDP2's parameters)."""
    return is_dtensor(t) and any(p.is_shard() for p in t.placements)


def local(tensors: list) -> list:
    """Each ``DTensor`` replaced by its local tensor (the same storage: in-place writes land in the
    ``DTensor``), every other entry (a plain tensor, ``None``) as it is."""
    return [t.to_local() if is_dtensor(t) else t for t in tensors]


def meshes(tensors: list) -> list:
    """The distinct device meshes of the ``DTensor`` entries of ``tensors``, in order of first appearance."""
    out = []
    for t in tensors:
        if is_dtensor(t) and all(t.device_mesh is not m for m in out):
            out.append(t.device_mesh)
    return out


def any_flag_across_meshes(flags: torch.Tensor, device_meshes: list) -> torch.Tensor:
    """``flags`` (a float tensor of 0/1 entries) with each entry the maximum over every rank of every mesh in
    ``device_meshes``: one ``all_reduce`` (MAX) per mesh dimension. A collective: every rank of the meshes
    calls it with a tensor of the same shape. Returns ``flags`` unchanged when ``device_meshes`` is empty."""
    import torch.distributed as dist

    for mesh in device_meshes:
        flags = flags.to(mesh.device_type)   # gloo reduces CPU tensors, NCCL CUDA ones
        for dim in range(mesh.ndim):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return flags


def refuse_sharded(params: list, optimizer_name: str, why: str) -> None:
    """Raise ``TypeError`` naming the first sharded ``DTensor`` parameter: ``optimizer_name`` needs whole
    matrices (``why``), and a shard is not one. Nothing is modified."""
    for i, p in enumerate(params):
        if is_sharded_dtensor(p):
            raise TypeError(f"Invalid params: parameter {i} (shape {tuple(p.shape)}) is a DTensor sharded as "
                            f"{tuple(p.placements)} (FSDP2's fully_shard); {optimizer_name} {why}, so it cannot "
                            "step a shard. Element-wise optimizers (SGD, Adam, AdamW, Lion, ScheduleFreeAdamW) "
                            "step sharded parameters")
