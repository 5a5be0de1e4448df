"""Cross-rank helpers every distributed wrapper shares: the group and rank mapping, agree-or-raise.

Private to :mod:`optbook.distributed`; the names here are its internal interface.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..contract import NonFiniteGradientError
from ..optim.optimizer import nonfinite_checked_by_caller

__all__ = ["check_same_params", "global_rank", "group_info", "params_difference", "sync_status",
           "validate_on_every_rank"]


def group_info(process_group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("needs an initialised torch.distributed process group "
                           "(optbook.distributed.launch, or init_from_env under torchrun)")
    group = dist.group.WORLD if process_group is None else process_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    return rank if group is dist.group.WORLD else dist.get_global_rank(group, rank)


def check_same_params(params, group, world_size, who: str) -> None:
    """Every rank must pass the same list of shapes and dtypes: one collective (``all_gather_object``), and
    on a difference a ``ValueError`` on every rank naming the first parameter (param-group order) that
    differs, its shape and dtype on each side and the ranks of each side (group ranks), e.g. ``parameter 2:
    shape (4, 3) torch.float32 on ranks [0], shape (3, 4) torch.float32 on ranks [1]``."""
    mine = [(tuple(p.shape), str(p.dtype)) for p in params]
    every = [None] * world_size
    dist.all_gather_object(every, mine, group=group)
    message = params_difference(every)
    if message is not None:
        raise ValueError(f"Invalid params: {who} needs the same parameters (shapes, dtypes, order) on every "
                         f"rank; {message}")


def params_difference(every: list) -> str | None:
    """``None`` when the ranks' ``[(shape, dtype name)]`` lists agree, else a sentence naming the first
    parameter index where they differ, each side's shape and dtype (or its absence) and its ranks."""
    if all(theirs == every[0] for theirs in every):
        return None
    i = 0
    while all(i < len(t) for t in every) and all(t[i] == every[0][i] for t in every):
        i += 1
    sides: dict = {}
    for r, theirs in enumerate(every):
        sides.setdefault(theirs[i] if i < len(theirs) else None, []).append(r)
    parts = [(f"absent ({len(every[ranks[0]])} parameters in all)" if side is None
              else f"shape {side[0]} {side[1]}") + f" on ranks {ranks}" for side, ranks in sides.items()]
    return f"parameter {i}: " + ", ".join(parts)


def validate_locally(opt) -> Exception | None:
    """Run ``opt._validate()`` on this rank with its non-finite check off (the caller judges inf/NaN across
    the ranks); return the error it raised (``TypeError``, ``ValueError``, ``RuntimeError``) or ``None``,
    so that every rank can agree on the outcome before any of them raises."""
    try:
        with nonfinite_checked_by_caller([opt]):
            opt._validate()
    except (TypeError, ValueError, RuntimeError) as e:
        return e
    return None


def group_position(param_groups: list[dict], index: int) -> tuple[int, int]:
    """``(group, position in the group)`` of parameter ``index`` in param-group order (for messages)."""
    for gi, g in enumerate(param_groups):
        if index < len(g["params"]):
            return gi, index
        index -= len(g["params"])
    raise IndexError(index)


def validate_on_every_rank(opt, name: str) -> list[bool]:
    """Validate ``opt``'s groups and gradients on this rank (non-finite values are judged later, after the
    mean), agree on the outcome with every rank (all raise if one does, before anything is written), and
    return which parameters have a gradient on any rank. Counts its control bytes in ``opt.comm_bytes``."""
    error = validate_locally(opt)
    has_grad = [p.grad is not None for p in opt._params]
    opt.comm_bytes["control"] += 8 * (1 + len(has_grad))
    return sync_status(error, opt.rank, has_grad, opt.process_group, opt.device, name)


def sync_status(error, rank, has_grad, group, device, who) -> list:
    """One all-reduce (MAX) of ``[code, has_grad...]``; raise on every rank if some rank failed.

    ``code`` is ``0`` without error, else ``2 (rank + 1) + k`` with ``k = 1`` for a
    :class:`optbook.contract.NonFiniteGradientError` and ``0`` for any other error, so that every rank raises
    the class of the error that the highest failing rank found (its own error on that rank)."""
    code = 0 if error is None else 2 * (rank + 1) + isinstance(error, NonFiniteGradientError)
    status = torch.tensor([code, *has_grad], dtype=torch.float64, device=device)
    dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    status = status.tolist()
    if error is not None:
        raise error
    if status[0]:
        bad, nonfinite = divmod(int(status[0]), 2)
        cls = NonFiniteGradientError if nonfinite else ValueError
        what = "a non-finite gradient (inf or NaN)" if nonfinite else "an invalid input"
        raise cls(f"{who}.step: rank {bad - 1} of the group found {what} (see its error); nothing was changed on "
                  "any rank")
    return [bool(s) for s in status[1:]]
