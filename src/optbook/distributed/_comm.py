"""What every distributed optimizer of :mod:`optbook.distributed` shares about its process group: the group
and rank mapping, the collective-call names, the check that every rank passed the same parameters, the one
way to agree on an outcome before anything is written (:func:`agree`), and the one way to find and name a
non-finite gradient across the ranks (:func:`first_nonfinite`, :func:`raise_nonfinite_across`), and the one
layout fingerprint every sharded checkpoint records (:func:`layout_fingerprint`, :func:`check_layout`).

Private to :mod:`optbook.distributed`; the names here are its internal interface (ZeRO-1, the Muon wrappers
and the chain import them, none imports another's private names).
"""

from __future__ import annotations

import hashlib

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


# --- checkpoint layout fingerprints ----------------------------------------------------------------------------
__all__ += ["check_layout", "check_one_save", "describe_layout", "layout_fingerprint"]

_LAYOUT_KEYS = ("class", "world_size", "mesh", "params", "owners", "buckets", "pieces", "parts")


def layout_fingerprint(opt, parts: dict | None = None, name: str | None = None,
                       mesh: tuple | None = None) -> dict:
    """The layout of ``opt``'s sharded checkpoint files, which every ``sharded_state_dict`` records under
    ``"layout"`` (LayerWiseMuon, DistributedMuon, ZeRO-1's DistributedOptimizer, DistributedChain) and every
    ``load_sharded_state_dict`` compares (:func:`check_layout`).

    Args:
        opt: the optimizer: its class name, ``world_size``, ``_params``, and ``owners`` (whole-matrix
            owners) or ``layout`` (a ZeRO-1 :class:`~optbook.distributed.zero1.Layout`) when it has them.
        parts: ``{name: fingerprint}`` of the members of a composite (DistributedChain), else ``None``.
        name: the class name to record (default ``type(opt).__name__``).
        mesh: the device mesh's shape (default ``(world_size,)``: a 1-D process group).

    Returns:
        ``{"class": str, "world_size": int, "mesh": the mesh shape (``(world_size,)`` for a process group),
        "params": [(shape, dtype name)] in param-group order, "owners": [rank per parameter] or None,
        "buckets": [(dtype name, start, numel, shard numel)] or None, "pieces": [[(index, param_start,
        param_end)] of each rank] or None, "parts": dict or None, "digest": 16 hex digits (SHA-256 of the
        rest)}``: plain Python values (``torch.save``/``torch.load(weights_only=True)`` round-trip them).
    """
    layout = getattr(opt, "layout", None)
    fp = {"class": name or type(opt).__name__, "world_size": int(opt.world_size),
          "mesh": tuple(mesh or (int(opt.world_size),)),
          "params": [(tuple(p.shape), str(p.dtype)) for p in opt._params],
          "owners": list(opt.owners) if getattr(opt, "owners", None) is not None else None,
          "buckets": None if layout is None else [(str(b.dtype), b.start, b.numel, b.shard_numel)
                                                  for b in layout.buckets],
          "pieces": None if layout is None else [[(q.index, q.param_start, q.param_end) for q in layout.pieces(r)]
                                                 for r in range(layout.world_size)],
          "parts": parts}
    fp["digest"] = hashlib.sha256(repr([fp[k] for k in _LAYOUT_KEYS]).encode()).hexdigest()[:16]
    return fp


def _short(values: list, n: int = 16) -> str:
    return str(values) if len(values) <= n else f"{str(values[:n])[:-1]}, ... ({len(values)} in all)]"


def describe_layout(fp: dict) -> str:
    """One line naming a :func:`layout_fingerprint`: class, world size, mesh, parameters and dtypes, owners or
    buckets and pieces per rank (members of a composite), digest."""
    if not isinstance(fp, dict) or not set(_LAYOUT_KEYS) <= set(fp):
        return f"no layout fingerprint ({type(fp).__name__})"
    dtypes = sorted({dtype.replace("torch.", "") for _, dtype in fp["params"]})
    text = (f"{fp['class']} at world size {fp['world_size']} (mesh {tuple(fp['mesh'])}), "
            f"{len(fp['params'])} parameters ({', '.join(dtypes) or 'none'})")
    if fp["owners"] is not None:
        text += f", owners {_short(fp['owners'])}"
    if fp["buckets"] is not None:
        buckets = [f"{d.replace('torch.', '')} {start}+{n}" for d, start, n, _ in fp["buckets"]]
        text += f", buckets {_short(buckets, 6)}, pieces per rank {_short([len(p) for p in fp['pieces']])}"
    if fp["parts"]:
        text += "; " + "; ".join(f"{k}: {describe_layout(v)}" for k, v in fp["parts"].items())
    return text + f", digest {fp['digest']}"


def check_layout(saved, mine: dict, who: str, *, own_file: bool, where: str = "the file") -> None:
    """Refuse a sharded checkpoint whose layout fingerprint cannot load into this optimizer, before anything
    is written. Loads: the same layout (this rank's own file); any layout of the same class over the same
    parameters when every rank's file is given (``own_file=False``: resharding, which the loaders define for
    another world size, other owners, other buckets). Errors name both layouts (:func:`describe_layout`).

    Args:
        saved: the file's ``"layout"`` entry; ``mine``: :func:`layout_fingerprint` of the loading optimizer;
        who: the class name for messages; own_file: one file (this rank's) rather than every rank's;
        where: how the message names the file (``"file 2"``).

    Raises:
        ValueError: not a fingerprint; another class; other parameter shapes or dtypes; with ``own_file``,
            another layout (the message says to pass the list of every rank's files).
    """
    both = f"{where}'s layout: {describe_layout(saved)}; this optimizer's layout: {describe_layout(mine)}"
    if not isinstance(saved, dict) or not set(_LAYOUT_KEYS) | {"digest"} <= set(saved):
        raise ValueError(f"Invalid shards: {where} records no layout fingerprint; {both}")
    if saved["class"] != mine["class"]:
        raise ValueError(f"Invalid shards: {where} was saved by a {saved['class']}, this is a {who}; {both}")
    difference = params_difference([mine["params"], [(tuple(s), d) for s, d in saved["params"]]])
    if difference is not None:
        where_ = difference.replace("on ranks [0]", "in this optimizer").replace("on ranks [1]", f"in {where}")
        raise ValueError(f"Invalid shards: {where} was saved for other parameters (a checkpoint of another "
                         f"model?): {where_}; {both}")
    if own_file and saved["digest"] != mine["digest"]:
        raise ValueError(f"Invalid shards: {where} was saved with another layout; to reshard, pass the list of "
                         f"all {saved['world_size']} files of that save; {both}")


def check_one_save(files: list, who: str) -> dict:
    """The layout fingerprint the files of one save share (every file records the same); files without one
    (saved before fingerprints) give ``None``.

    Raises:
        ValueError: some files have one and some not, or two files record different layouts (files of two
            saves), naming both layouts; ranks that are not ``0 .. W - 1`` of the layout's world size.
    """
    layouts = [sd.get("layout") for sd in files]
    if all(fp is None for fp in layouts):
        return None
    first = next((k for k, fp in enumerate(layouts) if isinstance(fp, dict)), 0)
    for k, fp in enumerate(layouts):
        if not isinstance(fp, dict) or fp.get("digest") != layouts[first].get("digest"):
            raise ValueError(f"Invalid shards: files {first} and {k} are not of one save: file {first}'s "
                             f"layout: {describe_layout(layouts[first])}; file {k}'s layout: {describe_layout(fp)}")
    size = layouts[first]["world_size"]
    ranks = sorted(r for r in (sd.get("rank") for sd in files) if isinstance(r, int))
    if len(ranks) != len(files) or ranks != list(range(size)):
        raise ValueError(f"Invalid shards: expected the files of ranks 0 .. W - 1 of one save at world size W, "
                         f"got ranks {ranks} saved at world sizes [{size}] ({who})")
    return layouts[first]
