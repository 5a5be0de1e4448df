"""What LayerWiseMuon and DistributedMuon share: the Muon hyperparameters of a group, byte counting, the
clip arithmetic, and the checkpoint helpers (consolidation on one rank, the plain Muon state-dict check).

Private to :mod:`optbook.distributed`; the names here are its internal interface.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.distributed as dist

from ..optim import muon
from ..optim._validation import check_int, check_number
from ._ranks import global_rank

__all__ = ["MUON_KEYS", "check_max_grad_norm", "check_muon_state_dict", "clip_coefficient", "consolidate",
           "consolidated_state", "hyper", "nbytes", "scale_", "sumsq"]

#: The hyperparameters the functional core :func:`optbook.optim.muon` takes from a param group.
MUON_KEYS = tuple(k for k, v in inspect.signature(muon).parameters.items() if v.kind is v.KEYWORD_ONLY)
#: ``torch.nn.utils.clip_grad_norm_``'s ``1e-6`` in ``max_norm / (norm + 1e-6)`` (as optbook.clipping).
_CLIP_EPS = 1e-6


def clip_coefficient(norm: float, max_grad_norm) -> float:
    """``min(1, max_norm / (norm + 1e-6))`` as :func:`optbook.clipping.clip_grad_norm_` (1 without clipping)."""
    if max_grad_norm is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_grad_norm / (norm + _CLIP_EPS))


def scale_(tensors, coef: float) -> None:
    """Multiply in float64 with one rounding back, as :func:`optbook.clipping.clip_grad_norm_` does."""
    if coef >= 1.0:
        return
    for g in tensors:
        if g.dtype == torch.float64:
            g.mul_(coef)
        else:
            g.copy_(g.to(torch.float64).mul_(coef))


def sumsq(tensors) -> float:
    """Float64 sum of squares, one ``vector_norm`` per tensor (as :func:`optbook.clipping.get_grad_norm`)."""
    total = torch.zeros((), dtype=torch.float64)
    for g in tensors:
        total += torch.linalg.vector_norm(g, dtype=torch.float64).cpu().square()
    return float(total)


def check_max_grad_norm(value):
    return None if value is None else check_number("max_grad_norm", value, low=0.0, low_open=True)


def hyper(group: dict) -> dict:
    return {k: group[k] for k in MUON_KEYS if k in group}


def nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()



def check_muon_state_dict(state_dict, params) -> None:
    """A plain Muon state dict whose momentum buffers have their parameters' shapes (the group and parameter
    counts are checked by ``torch.optim.Optimizer.load_state_dict``)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise TypeError("Invalid state_dict: expected a dict with 'state' and 'param_groups'")
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(ids) == len(params):
        for saved_id, p in zip(ids, params):
            buf = state_dict["state"].get(saved_id, {}).get("momentum_buffer")
            if isinstance(buf, torch.Tensor) and buf.shape != p.shape:
                raise ValueError(f"Invalid state_dict: momentum_buffer of parameter {saved_id!r} has shape "
                                 f"{tuple(buf.shape)}, the parameter {tuple(p.shape)}")


def consolidated_state(opt) -> dict:
    """``opt._consolidated``, or a RuntimeError saying how to get it."""
    if opt._consolidated is None:
        raise RuntimeError(f"{type(opt).__name__}.state_dict: nothing consolidated on rank {opt.rank}; call "
                           "consolidate_state_dict(to=rank) on every rank first, then state_dict() on that rank")
    return opt._consolidated


def consolidate(opt, local, to: int):
    """Gather ``local`` (picklable, per rank) on group rank ``to``; the list of every rank's, or None elsewhere."""
    to = check_int("to", to, 0)
    if to >= opt.world_size:
        raise ValueError(f"Invalid to: expected a rank in 0 .. {opt.world_size - 1}, got {to}")
    gathered = [None] * opt.world_size if opt.rank == to else None
    dist.gather_object(local, gathered, dst=global_rank(opt.process_group, to), group=opt.process_group)
    return gathered

