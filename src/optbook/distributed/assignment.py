"""Which rank owns which whole matrix: the Newton–Schulz cost model and longest-processing-time-first bin
packing; Megatron-LM's earlier element-count ping-pong rule, to compare with; and how the owned matrices of
every dtype travel in **one** byte-packed all-gather (:func:`owned_pack`), with the collectives and bytes of
one :class:`optbook.distributed.LayerWiseMuon` step as a formula (:func:`owner_step_comm`). Chapter 14; used by
:class:`optbook.distributed.LayerWiseMuon` and :class:`optbook.distributed.FSDP2Muon` (and importable from
:mod:`optbook.distributed.layerwise_muon`, where the chapter introduces them).
"""

from __future__ import annotations

import heapq
import math
from fractions import Fraction

import torch

from .._checks import check_int
from ..optim.muon import split_rows

__all__ = ["lpt_assign", "ns_cost", "owned_pack", "owner_step_comm", "pingpong_assign", "rank_loads",
           "round_robin_assign"]


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


def pingpong_assign(numels, world_size: int) -> list[int]:
    """Megatron-LM core_v0.16.0's owner rule (``megatron/core/optimizer/layer_wise_optimizer.py``,
    ``LayerWiseDistributedOptimizer.shard_params``, tag core_v0.16.0, commit 3bec9aa97d): the items sorted
    by element count, ascending (a stable sort: ties keep their order), dealt to the ranks in the ping-pong
    order ``0, 1, .., d - 1, d - 1, .., 1, 0, 0, 1, ..`` ("so memory is more balanced"). It balances
    elements, not Newton–Schulz work: :func:`lpt_assign` on :func:`ns_cost` is compared with it in chapter 14.

    Args:
        numels: one element count ``>= 0`` per item; ``world_size``: ``d >= 1``.

    Returns:
        ``owners[i]`` in ``0 .. d - 1`` for each item (a list of ints, the items' order).

    Raises:
        TypeError, ValueError: a bad ``world_size`` or count, named in the message.
    """
    numels = _check_costs(numels)
    world_size = check_int("world_size", world_size, 1)
    loop = list(range(world_size)) + list(range(world_size))[::-1]
    owners = [0] * len(numels)
    for k, i in enumerate(sorted(range(len(numels)), key=lambda i: numels[i])):
        owners[i] = loop[k % len(loop)]
    return owners


def owned_pack(numels, dtypes, owners, world_size: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """The byte layout of the one all-gather that publishes the owned matrices of every dtype.

    Each rank packs the raw bytes of the matrices it owns into one ``uint8`` chunk: the largest element size
    first (float64, then float32, then bfloat16/float16; ties by index), so that every matrix starts at a
    multiple of its element size and can be read back through a ``view(dtype)`` of the received bytes. All
    chunks have the size of the largest rank's bytes rounded up to the largest element size ``A`` present
    (so rank ``r``'s chunk starts at ``r * chunk``, a multiple of ``A``); the tail is padding. With one dtype
    the chunk is exactly that dtype's per-rank all-gather buffer. Empty matrices are left out.

    Args:
        numels: elements per matrix; ``dtypes``: ``torch.dtype`` per matrix; ``owners``: owner rank per
            matrix (as :func:`lpt_assign` returns); ``world_size``: ``d``.

    Returns:
        ``(chunk, plan)``: ``chunk`` in bytes (0: nothing to gather); ``plan[r]``: ``[(index, byte offset in
        rank r's chunk)]`` in packing order.

    Raises:
        ValueError: the lists differ in length or an owner is out of range.
    """
    numels, dtypes, owners = list(numels), list(dtypes), list(owners)
    world_size = check_int("world_size", world_size, 1)
    if not len(numels) == len(dtypes) == len(owners):
        raise ValueError(f"Invalid owners: {len(owners)} owners for {len(numels)} numels and {len(dtypes)} dtypes")
    if any(not 0 <= o < world_size for o in owners):
        raise ValueError(f"Invalid owners: an owner is not a rank in 0 .. {world_size - 1}")
    size = [torch.empty((), dtype=d).element_size() for d in dtypes]
    plan, used = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: (-size[i], i)):
        if numels[i]:
            plan[owners[i]].append((i, used[owners[i]]))
            used[owners[i]] += numels[i] * size[i]
    align = max([size[i] for i in range(len(numels)) if numels[i]], default=1)
    return -(-max(used) // align) * align, plan


def owner_step_comm(numels, dtypes, owners, world_size: int, has_grad=None) -> dict:
    """The collectives of one :class:`optbook.distributed.LayerWiseMuon` step, in order, and the bytes each rank
    receives in them, by :class:`optbook.distributed.wire.CommCounter`'s rules (a ring all-reduce of ``B``
    bytes delivers ``2 (d - 1) / d B``; an all-gather the other ranks' ``(d - 1) chunk``):

    1. ``all_reduce`` (float64, MAX): the status, ``1 + n`` values (:func:`optbook.distributed._comm.agree`);
    2. one ``all_reduce`` (SUM) per reduce dtype (float32 for bfloat16/float32 gradients, float64 for float64
       ones) of the flat gradients with ``has_grad``, in the order of their first parameter;
    3. one ``all_gather`` (``uint8``) of every rank's owned matrices, all dtypes packed (:func:`owned_pack`).

    So at most 4 calls, whatever the number of matrices and the mix of bfloat16/float32/float64 (3 with one
    reduce dtype; the gather is left out when no rank owns an element). A non-finite mean gradient adds one
    all-reduce (MIN) before every rank raises.

    Args:
        numels, dtypes, owners, world_size: as :func:`owned_pack`; ``has_grad``: one bool per matrix, whether
            some rank has its gradient (``None``: all).

    Returns:
        ``{"calls": [(collective, dtype)], "received": {"all_reduce": int or Fraction, "all_gather": int},
        "buffers": {"all_reduce": 2 * bytes of the gradient buffers, "all_gather": d * chunk, "control":
        8 (1 + n)}}``: ``"calls"`` is what ``[(name, dtype) for name, dtype, _ in CommCounter.calls]`` reads
        over one step, ``"received"`` what ``CommCounter.received`` sums (``"all_gather"`` absent when there
        is no gather), ``"buffers"`` :attr:`LayerWiseMuon.comm_bytes`' convention.
    """
    numels, dtypes = list(numels), list(dtypes)
    world_size = check_int("world_size", world_size, 1)
    has_grad = [True] * len(numels) if has_grad is None else [bool(h) for h in has_grad]
    d = world_size
    control = 8 * (1 + len(numels))
    reduce: dict = {}
    for n, dt, h in zip(numels, dtypes, has_grad):
        if h and n:
            rd = torch.promote_types(dt, torch.float32)
            reduce[rd] = reduce.get(rd, 0) + n * torch.empty((), dtype=rd).element_size()
    chunk, _ = owned_pack(numels, dtypes, owners, d)
    calls = [("all_reduce", torch.float64)] + [("all_reduce", rd) for rd in reduce]
    if chunk:
        calls.append(("all_gather", torch.uint8))
    ring = Fraction(2 * (d - 1), d)
    received = ring * (control + sum(reduce.values()))
    received = {"all_reduce": int(received) if received.denominator == 1 else received}
    if chunk:
        received["all_gather"] = (d - 1) * chunk
    return {"calls": calls, "received": received,
            "buffers": {"all_reduce": 2 * sum(reduce.values()), "all_gather": d * chunk, "control": control}}
