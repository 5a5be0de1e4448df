"""What every distributed optimizer of :mod:`optbook.distributed` shares about its process group: the group
and rank mapping, the collective-call names, the check that every rank passed the same parameters, the one
way to agree on an outcome before anything is written (:func:`agree`), and the one way to find and name a
non-finite gradient across the ranks (:func:`first_nonfinite`, :func:`raise_nonfinite_across`).

Private to :mod:`optbook.distributed`; the names here are its internal interface (ZeRO-1, the Muon wrappers
and the chain import them, none imports another's private names).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..contract import NonFiniteGradientError
from .._checks import LOW_PRECISION, check_int
from ..optim.optimizer import all_finite, nonfinite_checked_by_caller

__all__ = ["LOW_PRECISION", "agree", "all_gather", "check_int", "check_same_params", "consolidated_here",
           "first_nonfinite", "global_rank", "group_info", "group_position", "param_name", "params_difference",
           "raise_nonfinite_across", "reduce_scatter", "validate_locally", "validate_on_every_rank"]

# torch 2.13 renamed the two tensor collectives; older versions (the CUDA builds >= 2.9) have the old names.
#: ``all_gather(output, input, group=)``: every rank's ``input`` concatenated into ``output``.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: ``reduce_scatter(output, input, group=)``: rank ``r`` receives the SUM of the ranks' ``input`` chunk ``r``.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_info(process_group):
    """``(group, rank in it, its size)`` for ``process_group`` (``None``: WORLD).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """
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


def group_position(param_groups: list[dict], index: int) -> tuple[int, int]:
    """``(group, position in the group)`` of parameter ``index`` in param-group order (for messages)."""
    for gi, g in enumerate(param_groups):
        if index < len(g["params"]):
            return gi, index
        index -= len(g["params"])
    raise IndexError(index)


def param_name(param_groups: list[dict], index: int) -> str:
    """``"parameter 3 (param_groups[1]['params'][0], shape (4, 3))"``: how every message here names one."""
    gi, pi = group_position(param_groups, index)
    shape = tuple(param_groups[gi]["params"][pi].shape)
    return f"parameter {index} (param_groups[{gi}]['params'][{pi}], shape {shape})"


# --- agree or raise ------------------------------------------------------------------------------------------
def agree(error: Exception | None, rank: int, group, device, who: str, flags=(), *, verdict: bool = False,
          dtype: torch.dtype = torch.float64, group_name: str = "group") -> list:
    """One all-reduce (MAX) of ``[code, *flags]`` over ``group``; raise on every rank if some rank failed.

    ``code`` is ``verdict`` (0 or 1) without ``error``, else ``2 (rank + 1) + k`` with ``k = 1`` for a
    :class:`optbook.contract.NonFiniteGradientError` and ``0`` for any other error: the rank with ``error``
    raises it, every other rank raises the class of the highest failing rank's error (a ``ValueError`` or a
    ``NonFiniteGradientError``) naming that rank, so that no rank is left waiting in a later collective and
    nothing is written on any rank. ``flags``: numbers ``>= 0`` whose maximum over the ranks the caller
    needs (which parameters have a gradient somewhere, whether some rank must check for ``inf``); ``dtype``
    the tensor's (``int32`` for 4-byte flags). One device synchronisation.

    Returns:
        ``[verdict on some rank, *the flags' maxima]`` over the group, as Python numbers (the verdict rides
        in the code's low bit: a caller's local finding, e.g. a non-finite shard, costs no extra element).
    """
    code = int(bool(verdict)) if error is None else 2 * (rank + 1) + isinstance(error, NonFiniteGradientError)
    status = torch.tensor([code, *flags], dtype=dtype, device=device)
    if group is not None:
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    status = status.tolist()
    if error is not None:
        raise error
    if status[0] >= 2:
        bad, nonfinite = divmod(int(status[0]), 2)
        cls = NonFiniteGradientError if nonfinite else ValueError
        what = "a non-finite gradient (inf or NaN)" if nonfinite else "an invalid input"
        raise cls(f"{who}.step: rank {bad - 1} of the {group_name} found {what} (see its error); nothing was "
                  "changed on any rank")
    return [bool(status[0]), *status[1:]]


def validate_locally(opt) -> Exception | None:
    """Run ``opt._validate()`` on this rank with its non-finite check off (the caller judges inf/NaN across
    the ranks); return the error it raised (``TypeError``, ``ValueError``, ``RuntimeError``) or ``None``,
    so that every rank can agree on the outcome (:func:`agree`) before any of them raises."""
    try:
        with nonfinite_checked_by_caller([opt]):
            opt._validate()
    except (TypeError, ValueError, RuntimeError) as e:
        return e
    return None


def validate_on_every_rank(opt, who: str) -> list[bool]:
    """Validate ``opt``'s groups and gradients on this rank (non-finite values are judged later, after the
    mean), agree on the outcome with every rank (:func:`agree`: all raise if one does, before anything is
    written), and return which parameters have a gradient on any rank. Counts its control bytes in
    ``opt.comm_bytes``."""
    error = validate_locally(opt)
    has_grad = [p.grad is not None for p in opt._params]
    opt.comm_bytes["control"] += 8 * (1 + len(has_grad))
    return [bool(h) for h in agree(error, opt.rank, opt.process_group, opt.device, who, has_grad)[1:]]


# --- non-finite gradients ------------------------------------------------------------------------------------
def first_nonfinite(tensors) -> int | None:
    """The index of the first tensor of ``tensors`` (``None`` and empty entries skipped) holding ``inf`` or
    ``NaN``, or ``None``; one device synchronisation when all are finite."""
    present = [(i, t) for i, t in enumerate(tensors) if t is not None and t.numel()]
    if not present or all_finite([t for _, t in present]):
        return None
    return next(i for i, t in present if not bool(torch.isfinite(t).all()))


def raise_nonfinite_across(who: str, index: int | None, param_groups: list[dict], group, device, *,
                           advice: str = "Without a loss scaler a non-finite gradient is an error: find its source"
                           ) -> None:
    """Every rank knows that some mean gradient holds ``inf``/``NaN`` (the ranks agreed on it); ``index`` is
    the first such parameter this rank sees (param-group order; ``None``: none here). One all-reduce (MIN)
    agrees on the first over the group; every rank raises the same
    :class:`optbook.contract.NonFiniteGradientError` naming it (:func:`param_name`), then ``advice``."""
    count = sum(len(g["params"]) for g in param_groups)
    first = torch.tensor([count if index is None else index], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    first = int(first.item())
    where = param_name(param_groups, first) if first < count else "a parameter"
    raise NonFiniteGradientError(
        f"{who}.step: the mean gradient of {where} holds inf or NaN, on every rank; nothing was written on any "
        f"rank. {advice}")


def consolidated_here(who: str, consolidated: tuple, rank: int) -> dict:
    """The state dict ``consolidate_state_dict(to)`` left on this rank: ``consolidated`` is ``(to, the dict on
    rank to, None on the others)`` (ZeRO-1, LayerWiseMuon and DistributedMuon keep it so).

    Raises:
        RuntimeError: it was consolidated on another rank (naming both ranks and what to call).
    """
    to, state_dict = consolidated
    if state_dict is None:
        raise RuntimeError(f"{who}.state_dict: the state was consolidated on rank {to}, this is rank {rank}; call "
                           f"state_dict() on rank {to}, or consolidate_state_dict(to={rank}) on every rank first")
    return state_dict
