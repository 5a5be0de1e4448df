"""Cross-rank helpers every distributed wrapper shares: the group and rank mapping, agree-or-raise.

Private to :mod:`optbook.distributed`; the names here are its internal interface.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["check_same_params", "global_rank", "group_info", "sync_status", "validate_on_every_rank"]


def group_info(process_group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("needs an initialised torch.distributed process group "
                           "(optbook.distributed.launch, or init_from_env under torchrun)")
    group = dist.group.WORLD if process_group is None else process_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    return rank if group is dist.group.WORLD else dist.get_global_rank(group, rank)


def check_same_params(params, group, world_size, who: str) -> None:
    """Every rank must pass the same list of shapes and dtypes (a collective; raises on every rank)."""
    mine = [(tuple(p.shape), str(p.dtype)) for p in params]
    every = [None] * world_size
    dist.all_gather_object(every, mine, group=group)
    for r, theirs in enumerate(every):
        if theirs != mine:
            raise ValueError(f"Invalid params: {who} needs the same parameters (shapes, dtypes, order) on every "
                             f"rank; rank {r} has {len(theirs)} parameters {theirs[:4]}..., this rank {len(mine)} "
                             f"{mine[:4]}...")


def validate_on_every_rank(opt, name: str) -> list[bool]:
    """Validate ``opt``'s groups and gradients on this rank (non-finite values are judged later, after the
    mean), agree on the outcome with every rank (all raise if one does, before anything is written), and
    return which parameters have a gradient on any rank. Counts its control bytes in ``opt.comm_bytes``."""
    try:
        saved, opt.refuse_nonfinite_grads = opt.refuse_nonfinite_grads, False  # judged after the mean
        try:
            opt._validate()
        finally:
            opt.refuse_nonfinite_grads = saved
        error = None
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    has_grad = [p.grad is not None for p in opt._params]
    opt.comm_bytes["control"] += 8 * (1 + len(has_grad))
    return sync_status(error, opt.rank, has_grad, opt.process_group, opt.device, name)


def sync_status(error, rank, has_grad, group, device, who) -> list:
    """One all-reduce (MAX) of ``[failing rank + 1, has_grad...]``; raise on every rank if some rank failed."""
    status = torch.tensor([rank + 1 if error is not None else 0, *has_grad], dtype=torch.float64, device=device)
    dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    status = status.tolist()
    if error is not None:
        raise error
    if status[0]:
        raise ValueError(f"{who}.step: rank {int(status[0]) - 1} of the group found an invalid input (see its "
                         "error); nothing was changed on any rank")
    return [bool(s) for s in status[1:]]
