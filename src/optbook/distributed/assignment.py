"""Which rank owns which whole matrix: the Newton–Schulz cost model and longest-processing-time-first bin
packing. Chapter 14; used by :class:`optbook.distributed.LayerWiseMuon` and :class:`optbook.distributed.FSDP2Muon`
(and importable from :mod:`optbook.distributed.layerwise_muon`, where the chapter introduces them).
"""

from __future__ import annotations

import heapq
import math

from .._checks import check_int
from ..optim.muon import split_rows

__all__ = ["lpt_assign", "ns_cost", "rank_loads", "round_robin_assign"]


# --- assignment of whole matrices to ranks -----------------------------------------------------------------
def ns_cost(shape, head_split=None) -> int:
    """Newton–Schulz cost model of one ``(m, n)`` matrix: ``max(m, n) * min(m, n)**2`` (multiply-adds per
    iteration up to a constant: the Gram ``X X^T`` of the wide orientation is ``min**2 * max``, and so are
    the products with it). With ``head_split`` (:func:`optbook.optim.muon.split_rows`) the blocks are
    orthogonalised separately and their costs add up. Source: Megatron-LM ``layer_wise_optimizer.py``
    ``_ns_compute_cost`` (main branch, commit 85344907be, PR #6379; releases up to core_v0.19.0 pack by
    element count).

    Raises:
        ValueError: ``shape`` is not 2-D, or ``head_split`` does not tile the rows.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise ValueError(f"Invalid shape: expected (m, n), got {shape}")
    m, n = shape
    return sum(max(r, n) * min(r, n) ** 2 for r in split_rows(m, head_split)) if m else 0


def _check_costs(costs) -> list:
    costs = list(costs)
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"Invalid costs: element {i} is {c!r}, expected a finite number >= 0")
    return costs


def lpt_assign(costs, world_size: int) -> list[int]:
    """Longest processing time first (Graham 1969): the owner rank of each item.

    Items are taken in order of decreasing cost (ties: lower index first) and each goes to the rank with
    the smallest load so far (ties: lower rank). The largest load is at most ``(4/3 - 1/(3 d))`` times the
    optimum (Graham, "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17, 1969).

    Args:
        costs: one number ``>= 0`` per item (e.g. :func:`ns_cost` of each matrix).
        world_size: number of ranks ``d >= 1``.

    Returns:
        ``owners[i]`` in ``0 .. d - 1`` for each item ``i`` (a list of ints, the items' order).

    Raises:
        TypeError, ValueError: a bad ``world_size`` or cost, named in the message.
    """
    costs = _check_costs(costs)
    world_size = check_int("world_size", world_size, 1)
    heap = [(0, r) for r in range(world_size)]  # (load, rank): the smallest load, then the lowest rank
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def round_robin_assign(n_items: int, world_size: int) -> list[int]:
    """Item ``i`` to rank ``i mod d`` (the naive assignment LPT is compared with).

    Raises:
        TypeError, ValueError: a bad ``n_items`` or ``world_size``.
    """
    n_items = check_int("n_items", n_items, 0)
    world_size = check_int("world_size", world_size, 1)
    return [i % world_size for i in range(n_items)]


def rank_loads(costs, owners, world_size: int) -> list:
    """The total cost per rank of an assignment ``owners`` (as returned by :func:`lpt_assign`).

    Raises:
        ValueError: ``owners`` and ``costs`` differ in length or an owner is out of range.
    """
    costs = _check_costs(costs)
    world_size = check_int("world_size", world_size, 1)
    owners = list(owners)
    if len(owners) != len(costs):
        raise ValueError(f"Invalid owners: {len(owners)} owners for {len(costs)} costs")
    loads = [0] * world_size
    for c, r in zip(costs, owners):
        check_int("owners[i]", r, 0)
        if r >= world_size:
            raise ValueError(f"Invalid owners: {r!r} is not a rank in 0 .. {world_size - 1}")
        loads[r] += c
    return loads
