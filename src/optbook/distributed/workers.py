"""Functions run on every rank by :func:`optbook.distributed.launch`, for the chapters and the tests.

They live in a module (not a notebook cell) because ``launch`` starts fresh processes (``spawn``) that
import the function by name. Each takes ``(rank, world_size, ...)`` and returns picklable values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..clipping import REPLICATED, clip_grad_norm_, get_grad_norm

__all__ = ["clip_problem", "raise_on_rank", "sharded_clip_worker"]


def clip_problem(seed: int = 0, n_params: int = 6, dtype: torch.dtype = torch.float64
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The same parameters with gradients on every rank, drawn from ``seed``.

    Returns:
        ``(params, replicated)``: ``n_params`` tensors of shapes ``(3 + i, 2)`` for ``i = 0 .. n_params - 1``
        (the ones to shard), and one tensor of shape ``(4,)`` that every rank holds whole, marked
        ``optbook_replicated = True``. Every gradient is ``N(0, 1)`` entries of ``dtype``, so the global norm
        is about ``sqrt(number of entries)`` (a few units).
    """
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i in range(n_params):
        p = torch.zeros(3 + i, 2, dtype=dtype, requires_grad=True)
        p.grad = torch.randn(3 + i, 2, generator=gen, dtype=dtype)
        params.append(p)
    replicated = torch.zeros(4, dtype=dtype, requires_grad=True)
    replicated.grad = torch.randn(4, generator=gen, dtype=dtype)
    setattr(replicated, REPLICATED, True)
    return params, replicated


def sharded_clip_worker(rank: int, world_size: int, *, seed: int = 0, n_params: int = 6,
                        max_norm: float = 1.0, dtype: torch.dtype = torch.float64) -> dict:
    """Clip gradients sharded over the ranks and report the norms seen with and without the all-reduce.

    Every rank builds :func:`clip_problem` ``(seed, n_params, dtype)``, keeps the parameters it owns (rank
    ``r`` owns ``r, r + world_size, r + 2 * world_size, ...``) plus the replicated one, and clips them by the
    norm over the whole group (``torch.distributed.group.WORLD``).

    Returns:
        A dict of floats and CPU tensors:
        ``rank``; ``owned`` (indices of this rank's parameters);
        ``full_norm``: :func:`~optbook.clipping.get_grad_norm` of all parameters in this one process (the
        reference every rank can compute alone);
        ``local_norm``: the norm of this rank's parameters without ``group`` (what a rank sees if it forgets
        the all-reduce: too small, about ``1 / sqrt(world_size)`` of the true norm for equal shards);
        ``group_norm``: the norm of this rank's parameters with ``group=WORLD`` (equals ``full_norm``);
        ``unmarked_norm``: the same with the replicated parameter's mark removed (it is then counted once
        per rank, so the norm is too large);
        ``clip_norm``: what :func:`~optbook.clipping.clip_grad_norm_` returned (the norm before clipping);
        ``clipped``: the clipped gradients of the owned parameters, in ``owned`` order;
        ``clipped_replicated``: the clipped gradient of the replicated parameter.
    """
    params, replicated = clip_problem(seed, n_params, dtype)
    full_norm = get_grad_norm(params + [replicated])
    owned = list(range(rank, n_params, world_size))
    mine = [params[i] for i in owned] + [replicated]
    world = dist.group.WORLD
    local_norm = get_grad_norm(mine)
    group_norm = get_grad_norm(mine, group=world)
    unmarked = torch.zeros_like(replicated, requires_grad=True)
    unmarked.grad = replicated.grad.clone()
    unmarked_norm = get_grad_norm(mine[:-1] + [unmarked], group=world)
    clip_norm = clip_grad_norm_(mine, max_norm, group=world)
    return {"rank": rank, "owned": owned, "full_norm": full_norm.item(), "local_norm": local_norm.item(),
            "group_norm": group_norm.item(), "unmarked_norm": unmarked_norm.item(),
            "clip_norm": clip_norm.item(),
            "clipped": [params[i].grad for i in owned], "clipped_replicated": replicated.grad}


def raise_on_rank(rank: int, world_size: int, bad_rank: int = 1) -> int:
    """Rank ``bad_rank`` raises ``ValueError``; the others wait in a barrier it never reaches.

    Shows that :func:`optbook.distributed.launch` reports the failing rank instead of hanging until the
    collective times out. Returns ``rank`` on the ranks that get past the barrier (none, when
    ``bad_rank < world_size``).
    """
    if rank == bad_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    dist.barrier()
    return rank
