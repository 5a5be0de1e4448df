"""Whole matrices to their owners and back in one all-to-all each way, for ``DTensor`` parameters on any
device mesh. The exchange behind :class:`optbook.distributed.FSDP2Muon`; chapter 14b.

A parameter sharded by FSDP2 (``fully_shard``), HSDP (``Replicate()`` then ``Shard(0)``), tensor parallelism
under FSDP2 (``Shard(0)``/``Shard(1)`` on the TP dimension and the ``_StridedShard`` FSDP2 puts on the
data-parallel dimension over a row-sharded TP weight) or expert parallelism (whole experts of a stack
``(E, M, N)`` per rank) is, on each rank, a set of its elements. :class:`MeshExchange` finds that set once,
at construction, as the global row-major (flat) index of each local element: the ``DTensor`` layout of an
index tensor, ``distribute_tensor(arange(numel).view(shape), mesh, placements, src_data_rank=None)``, which
cuts the index tensor on every rank as the parameter is cut, without communication (``_StridedShard``
included: checked against the layout FSDP2 of torch 2.13.0 produces over column-parallel weights, uneven
shards included, in ``tests/test_fsdp2_mesh.py``). The ranks exchange these
index maps once (``all_gather_object``); from them every rank derives the same plan:

* the *units* (the matrices Newton–Schulz sees: one per 2-D parameter, ``prod(E)`` per stacked parameter,
  :func:`optbook.optim.matrix_views.matrix_shape`), each with an owner rank: longest processing time first
  on the Newton–Schulz cost (:func:`optbook.distributed.assignment.ns_cost`, Graham's rule as in
  :func:`~optbook.distributed.assignment.lpt_assign`), except that a unit some rank holds whole goes to
  the least loaded such rank (expert-local weights do not move);
* per element, one *sender*: the owner if it holds the element, else the lowest rank holding it (a
  replicated element is sent once);
* the order of the elements in each message: by parameter, then by global index.

Per step :meth:`MeshExchange.to_owners` packs every parameter's local elements into one buffer and one
``all_to_all_single`` (uneven splits) brings each unit whole to its owner; :meth:`MeshExchange.from_owners`
sends each rank every element it holds of the owners' updates, in one more ``all_to_all_single``. Two
collectives per step whatever the number of matrices. Bytes received per rank: the elements of its units
that other ranks send, plus the elements it holds of units other ranks own (:meth:`MeshExchange.received`).

Primary source: microsoft/dion, ``dion/muon.py`` at commit 0c20549 (FSDP2 Muon: whole matrices to owners by
all-to-all, in batches of ``d`` matrices padded to equal pieces, each rank orthogonalising one per batch; it
takes a 1-D mesh, the shard sub-mesh for HSDP, refuses parameters sharded in both matrix dimensions, and
steps a stack sharded only along its batch dimension locally). Here every matrix goes in one all-to-all with
uneven pieces, on any mesh whose placements the index maps describe.
The index maps take ``O(numel)`` int64 memory per rank and parameter for every rank (a teaching
implementation: a production one would describe shards by their boxes).
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist

from ..optim.matrix_views import matrix_shape
from .assignment import ns_cost

__all__ = ["MeshExchange", "local_element_indices", "local_first_lpt"]


def local_element_indices(p) -> torch.Tensor:
    """The global row-major index of each element of ``p.to_local()``, in its (logical, row-major) order.

    Args:
        p: a ``DTensor`` (placements ``Shard``, ``_StridedShard`` or ``Replicate`` on each mesh dimension).

    Returns:
        int64 tensor of ``p.to_local().numel()`` entries in ``0 .. p.numel() - 1`` (no communication).

    Raises:
        TypeError: ``p`` has a ``Partial`` placement (a pending sum is not a parameter's layout).
        ValueError: the index tensor's local shape is not ``p``'s local shape (a layout this cannot read).
    """
    from torch.distributed.tensor import distribute_tensor

    if any(pl.is_partial() for pl in p.placements):
        raise TypeError(f"a Partial placement ({tuple(p.placements)}) is a pending reduction, not a "
                        "parameter's layout")
    index = torch.arange(p.numel(), dtype=torch.int64).view(tuple(p.shape))
    local = distribute_tensor(index, p.device_mesh, p.placements, src_data_rank=None).to_local()
    if tuple(local.shape) != tuple(p.to_local().shape):
        raise ValueError(f"placements {tuple(p.placements)}: the index tensor's local shape "
                         f"{tuple(local.shape)} is not the parameter's {tuple(p.to_local().shape)}")
    return local.reshape(-1)


def local_first_lpt(costs: list, holders: list, world_size: int) -> list[int]:
    """Owners by longest processing time first (Graham 1969), units in order of decreasing cost (ties:
    lower index), each to the least loaded rank (ties: lower rank) among ``holders[u]`` when that is not
    empty (the ranks holding unit ``u`` whole), else among all ranks. Without holders it is
    :func:`optbook.distributed.assignment.lpt_assign`.

    Returns:
        ``owners[u]`` in ``0 .. world_size - 1``.
    """
    loads = [0] * world_size
    heap = [(0, r) for r in range(world_size)]
    owners = [0] * len(costs)
    for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        if holders[u]:
            r = min(holders[u], key=lambda r: (loads[r], r))
        else:
            while True:   # the heap may hold stale loads of ranks that took a local unit
                load, r = heapq.heappop(heap)
                if load == loads[r]:
                    break
        owners[u] = r
        loads[r] += costs[u]
        heapq.heappush(heap, (loads[r], r))
    return owners


class MeshExchange:
    """The plan of one optimizer's parameters: owners of every matrix, and the two all-to-alls of a step.

    Args:
        params: ``DTensor`` parameters (any meshes whose ranks are ranks of ``group``), the same list
            (shapes, views) on every rank of ``group``.
        views: each parameter's ``matrix_view`` (``"matrix"``, ``"flatten"``, ``"stacked"``).
        head_splits: each parameter's group ``head_split`` (for the cost model).
        group: the process group of the exchange (every rank of it constructs the plan: a collective,
            one ``all_gather_object``).

    Attributes:
        units: ``[(parameter index, matrix index within it, (M, N))]`` in parameter order.
        owners: ``owners[u]``, the rank of ``group`` that orthogonalises unit ``u``.
        rank, world_size: this rank in ``group`` and its size.

    Raises:
        TypeError: a ``Partial`` placement (named by parameter index).
        ValueError: the ranks disagree on the parameters (shapes or views), or some element of a parameter
            is held by no rank of ``group`` (its mesh is not inside ``group``), naming the parameter.
    """

    def __init__(self, params: list, views: list, head_splits: list, group):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        mine = []
        for i, p in enumerate(params):
            try:
                mine.append(local_element_indices(p))
            except (TypeError, ValueError) as e:
                raise type(e)(f"Invalid params: parameter {i} (shape {tuple(p.shape)}): {e}") from None
        described = [(tuple(p.shape), v) for p, v in zip(params, views)]
        every = [None] * self.world_size
        dist.all_gather_object(every, (described, mine), group=group)
        for r, (d, _) in enumerate(every):
            if d != described:
                i = next((i for i, (a, b) in enumerate(zip(d, described)) if a != b),
                         min(len(d), len(described)))
                raise ValueError(f"Invalid params: the ranks of the process group pass different parameters: "
                                 f"parameter {i} is {d[i] if i < len(d) else 'missing'} on rank {r} and "
                                 f"{described[i] if i < len(described) else 'missing'} on rank {self.rank} "
                                 "((shape, matrix_view))")
        self.maps = [[every[r][1][i] for r in range(self.world_size)] for i in range(len(params))]
        self.numels = [p.numel() for p in params]
        self.local_numels = [m.numel() for m in mine]
        self.unit_numel, self.units, costs, holders, self.first_unit = [], [], [], [], []
        for i, (p, view) in enumerate(zip(params, views)):
            shape = matrix_shape(tuple(p.shape), view) if p.dim() >= 2 else tuple(p.shape)
            size = shape[0] * shape[1]
            count = p.numel() // size if size else 0
            held = torch.zeros(p.numel(), dtype=torch.int64)
            for r, index in enumerate(self.maps[i]):
                held.index_add_(0, index, torch.ones_like(index))
            if p.numel() and int(held.min()) == 0:
                raise ValueError(f"Invalid params: parameter {i} (shape {tuple(p.shape)}): element "
                                 f"{int((held == 0).nonzero()[0])} (row-major) is held by no rank of the "
                                 "process group; its device mesh must lie inside the group")
            whole = [torch.bincount(index // size, minlength=count) if count else index
                     for index in self.maps[i]]
            self.first_unit.append(len(self.units))
            self.unit_numel.append(size)
            for k in range(count):
                self.units.append((i, k, shape))
                costs.append(ns_cost(shape, head_splits[i]))
                holders.append([r for r in range(self.world_size) if int(whole[r][k]) == size])
        self.owners = local_first_lpt(costs, holders, self.world_size)
        self.senders = [self._senders(i) for i in range(len(params))]
        self._plans: dict = {}

    def __getstate__(self) -> dict:
        """Without the process group (it does not pickle; the owner sets :attr:`group` again) and the
        cached plans (made again on use)."""
        return {**self.__dict__, "group": None, "_plans": {}}

    # --- the plan -------------------------------------------------------------------------------------------
    def _unit_owner(self, i: int, index: torch.Tensor) -> torch.Tensor:
        """The owner of the unit of each global index ``index`` of parameter ``i``."""
        first, size = self.first_unit[i], self.unit_numel[i]
        owners = torch.tensor(self.owners[first:first + self.numels[i] // size] if size else [],
                              dtype=torch.int64)
        return owners[index // size] if size else index.new_zeros(index.shape)

    def _senders(self, i: int) -> torch.Tensor:
        """Per global element of parameter ``i``: the rank that sends it to its owner."""
        sender = torch.full((self.numels[i],), self.world_size, dtype=torch.int64)
        for r in reversed(range(self.world_size)):
            sender[self.maps[i][r]] = r      # the lowest holder
        for r, index in enumerate(self.maps[i]):
            sender[index[self._unit_owner(i, index) == r]] = r   # the owner, where it holds the element
        return sender

    def primary(self, i: int) -> torch.Tensor:
        """The local positions of parameter ``i``'s elements that this rank sends (each element of the
        parameter is primary on exactly one rank: norms summed over ranks count it once)."""
        return (self.senders[i][self.maps[i][self.rank]] == self.rank).nonzero().reshape(-1)

    def plan(self, present: tuple) -> dict:
        """The index lists and split sizes of a step in which the parameters with ``present[i]`` take part
        (cached per pattern; no communication)."""
        if present in self._plans:
            return self._plans[present]
        me, world = self.rank, self.world_size
        local_off = [0]
        for i, n in enumerate(self.local_numels):
            local_off.append(local_off[-1] + (n if present[i] else 0))
        owned = [u for u, (i, _, _) in enumerate(self.units) if present[i] and self.owners[u] == me]
        owned_off, total = {}, 0
        for u in owned:
            owned_off[u] = total
            total += self.unit_numel[self.units[u][0]]
        out = {"owned": owned, "owned_off": owned_off, "owned_numel": total, "local_numel": local_off[-1],
               "local_off": local_off}
        fwd_send, fwd_recv, back_send, back_recv = [], [], [], []   # (peer, positions) per parameter
        for i in range(len(self.numels)):
            if not present[i] or not self.numels[i]:
                continue
            size, sender, maps = self.unit_numel[i], self.senders[i], self.maps[i]
            index = maps[me]
            order = torch.argsort(index, stable=True)
            g = index[order]
            owner = self._unit_owner(i, g)
            keep = sender[g] == me                               # forward, me as sender
            fwd_send.append((owner[keep], local_off[i] + order[keep]))
            back_recv.append((owner, local_off[i] + order))     # backward, me as receiver: all my elements
            mine = [u for u in owned if self.units[u][0] == i]
            if mine:
                base = torch.tensor([owned_off[u] for u in mine], dtype=torch.int64)
                ks = torch.tensor([self.units[u][1] for u in mine], dtype=torch.int64)
                gs = (ks[:, None] * size + torch.arange(size)).reshape(-1)
                fwd_recv.append((sender[gs], (base[:, None] + torch.arange(size)).reshape(-1)))
                lookup = torch.full((self.numels[i],), -1, dtype=torch.int64)
                lookup[gs] = (base[:, None] + torch.arange(size)).reshape(-1)
                for r in range(world):
                    gr = torch.sort(maps[r]).values
                    pos = lookup[gr]
                    pos = pos[pos >= 0]
                    back_send.append((torch.full_like(pos, r), pos))
        for name, parts in (("fwd_send", fwd_send), ("fwd_recv", fwd_recv), ("back_send", back_send),
                            ("back_recv", back_recv)):
            peers = torch.cat([a for a, _ in parts]) if parts else torch.zeros(0, dtype=torch.int64)
            pos = torch.cat([b for _, b in parts]) if parts else torch.zeros(0, dtype=torch.int64)
            order = torch.argsort(peers, stable=True)     # by peer, then parameter, then global index
            out[name] = pos[order]
            out[name + "_splits"] = torch.bincount(peers, minlength=world).tolist()
        self._plans[present] = out
        return out

    def received(self, present: tuple, element_size: int) -> int:
        """Bytes this rank receives from other ranks in the two all-to-alls of a step (``present`` as in
        :meth:`plan`; ``element_size`` the parameters' bytes per element): what
        :class:`optbook.distributed.wire.CommCounter` counts."""
        plan = self.plan(present)
        me = self.rank
        elements = (sum(plan["fwd_recv_splits"]) - plan["fwd_recv_splits"][me]
                    + sum(plan["back_recv_splits"]) - plan["back_recv_splits"][me])
        return elements * element_size

    # --- a step ---------------------------------------------------------------------------------------------
    @staticmethod
    def _index(plan: dict, key: str, device: torch.device) -> torch.Tensor:
        """``plan[key]`` (an index list made on the CPU) on ``device``, copied there once."""
        if device.type == "cpu":
            return plan[key]
        cached = plan.setdefault("_on", {})
        if (key, device) not in cached:
            cached[key, device] = plan[key].to(device)
        return cached[key, device]

    def _all_to_all(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        if self.world_size == 1:
            return send
        recv = send.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        return recv

    def to_owners(self, local_tensors: list, present: tuple) -> dict:
        """One all-to-all: ``{unit: the whole (M, N) matrix}`` for the units this rank owns.

        Args:
            local_tensors: per parameter, this rank's local tensor (its elements in the parameter's local
                shape; any memory format), or ``None`` where ``present`` is ``False``. One dtype, one
                device (the index lists are copied to it once); at least one present.
            present: which parameters take part (the same on every rank).
        """
        plan = self.plan(present)
        flats = [t.reshape(-1) for t, here in zip(local_tensors, present) if here]
        flat = torch.cat(flats)
        send = flat[self._index(plan, "fwd_send", flat.device)]
        recv = self._all_to_all(send, plan["fwd_send_splits"], plan["fwd_recv_splits"])
        owned = recv.new_empty(plan["owned_numel"])
        owned[self._index(plan, "fwd_recv", owned.device)] = recv
        return {u: owned[plan["owned_off"][u]:plan["owned_off"][u] + self.unit_numel[self.units[u][0]]]
                .view(self.units[u][2]) for u in plan["owned"]}

    def from_owners(self, updates: dict, present: tuple, like: torch.Tensor) -> list:
        """One all-to-all: per parameter, this rank's elements of the owners' updates (1-D, in the local
        tensor's row-major order: ``.view(local shape)``; ``like``'s dtype and device), ``None`` where
        ``present`` is ``False``.

        Args:
            updates: ``{unit: (M, N) update}`` for every unit this rank owns (any strides).
        """
        plan = self.plan(present)
        owned = like.new_empty(plan["owned_numel"])
        for u in plan["owned"]:
            off = plan["owned_off"][u]
            owned[off:off + self.unit_numel[self.units[u][0]]].view(self.units[u][2]).copy_(updates[u])
        send = owned[self._index(plan, "back_send", owned.device)]
        recv = self._all_to_all(send, plan["back_send_splits"], plan["back_recv_splits"])
        flat = like.new_empty(plan["local_numel"])
        flat[self._index(plan, "back_recv", flat.device)] = recv
        return [flat[plan["local_off"][i]:plan["local_off"][i] + n] if here else None
                for i, (n, here) in enumerate(zip(self.local_numels, present))]
