"""Muon across data-parallel ranks: whole matrices per rank, or element shards with a gather. Chapter 14.

Newton–Schulz orthogonalises a *whole* matrix: the polar factor of a matrix is not the concatenation of
the polar factors of its pieces, so the ZeRO-1 layout of chapter 13 (element shards that ignore parameter
boundaries) cannot step Muon shard by shard. Two ways out:

* :class:`LayerWiseMuon` -- **whole-matrix ownership**. Each 2-D parameter is owned by one rank, chosen by
  longest-processing-time-first bin packing (:func:`lpt_assign`) on the Newton–Schulz cost
  ``max(m, n) * min(m, n)**2`` (:func:`ns_cost`). The gradients are averaged over the ranks (one
  all-reduce, as ``DistributedDataParallel``); the owner of a matrix keeps its momentum and runs the Muon
  step on it (the functional core :func:`optbook.optim.functional.muon`); the updated matrices are all-gathered so
  every rank holds the same parameters. This is Megatron-LM's ``LayerWiseDistributedOptimizer``
  (``megatron/core/optimizer/layer_wise_optimizer.py``, core_v0.16.0: gradients all-reduced, parameters
  all-gathered with variable sizes; its owners are assigned by element count, ping-pong over the ranks in
  order of size; core_v0.19.0's shard-aligned path packs by element count with LPT, and only Megatron-LM's
  main branch since commit 85344907be, PR #6379, after core_v0.19.0, packs by the ``max(m, n) * min(m, n)**2``
  used here) and the ownership DeepSeek-V4 describes (whole logical matrices assigned to ranks).
* :class:`DistributedMuon` (:mod:`optbook.distributed.distributed_muon`) -- **Moonlight's distributed
  Muon** (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982, section 2.3 and
  Algorithm 1): the ZeRO-1 layout of
  :func:`optbook.distributed.shard_layout`; gradients reduce-scattered; the momentum kept for the local
  element shard only; each step the momentum-updated shards are all-gathered (in bfloat16 by default) into
  full matrices, each matrix is orthogonalised, and each rank keeps the part of the update that falls in its
  shard; parameters all-gathered as in ZeRO-1. It communicates one gather more than ZeRO-1 AdamW:
  :attr:`DistributedMuon.comm_bytes` counts it, :func:`zero1_comm_bytes` gives the formula.

:class:`DistributedChain` (:mod:`optbook.distributed.chain`) chains one of them with a ZeRO-1
``DistributedOptimizer`` (AdamW for embeddings, norms, biases) so that both clip by **one** global norm of
the averaged raw gradients (not of the orthogonalised updates). This module holds :class:`LayerWiseMuon` and
the assignment functions and re-exports the other two classes and :func:`zero1_comm_bytes`.

Communication volume convention (:attr:`LayerWiseMuon.comm_bytes`, :attr:`DistributedMuon.comm_bytes`,
:func:`zero1_comm_bytes`): a collective counts the bytes of the full buffer it reduces or gathers
(``numel * element_size``); an all-reduce counts twice that (it is a reduce-scatter followed by an
all-gather). A ring implementation sends ``(d - 1) / d`` of the counted bytes from each rank, the same factor
for every collective, so ratios are unchanged.
"""

from __future__ import annotations

import copy
import heapq
import math

import torch
import torch.distributed as dist

from ..clipping import _reduce_device, clip_coefficient, grad_sumsq, scale_grads_
from ..optim import Muon
from ..optim.functional import muon
from .._checks import check_int
from ..optim.muon import split_rows
from ._collectives import all_gather
from ._muon_common import (
    check_max_grad_norm,
    check_muon_state_dict,
    consolidate,
    consolidated_state,
    first_nonfinite,
    hyper,
    nbytes,
    nonfinite_error,
    shard_parts,
)
from ._ranks import check_same_params, global_rank, group_info, validate_on_every_rank
from .chain import DistributedChain  # re-exported: the other two classes of chapter 14 have their own modules
from .distributed_muon import DistributedMuon, zero1_comm_bytes
from ..contract import closure_loss

__all__ = ["DistributedChain", "DistributedMuon", "LayerWiseMuon", "lpt_assign", "ns_cost", "rank_loads",
           "round_robin_assign", "zero1_comm_bytes"]


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


# --- layer-wise: whole matrices per rank --------------------------------------------------------------------
class LayerWiseMuon(Muon):
    """Muon with whole-matrix ownership across the ranks of a process group (module docstring).

    Build it on every rank with the same parameters (each rank a replica of the model), run the backward
    pass on each rank's micro-batch, call :meth:`step` on every rank (it averages the gradients itself; do
    not also wrap the model in ``DistributedDataParallel``), then ``zero_grad``.

    Args:
        params: 2-D real floating tensors ``(fan_out, fan_in)`` or param-group dicts, as
            :class:`optbook.optim.Muon`; the same shapes, dtypes and order on every rank (checked: a
            collective at construction). All on one device (CPU for gloo, the rank's GPU for NCCL). At
            construction every parameter is broadcast from the group's rank 0.
        process_group: the data-parallel group (``None``: ``torch.distributed.group.WORLD``).
        assignment: ``"lpt"`` (:func:`lpt_assign` on :func:`ns_cost`, the default) or ``"round_robin"``.
        max_grad_norm: if set (``> 0``), clip the averaged gradients of these parameters by their global
            L2 norm before the momentum (in a :class:`DistributedChain`, leave it ``None``: the chain clips).
        **muon_defaults: ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``,
            ``coefficients``, ``scale_mode``, ``extra_scale_factor``, ``eps``, ``ns_dtype``, ``head_split``
            (as :class:`optbook.optim.Muon`).

    Attributes:
        owners: the owner rank of each parameter, in param-group order; ``costs``: their :func:`ns_cost`;
            ``loads``: the total cost per rank.
        state: momentum buffers of the parameters this rank owns only (``1/d`` of Muon's state).
        comm_bytes: ``{"all_reduce": ..., "all_gather": ..., "control": ...}`` bytes counted since
            construction (module docstring's convention); :meth:`predicted_comm_bytes` per step.
        last_grad_norm: the L2 norm of the averaged gradients at the last step, before clipping (float;
            ``None`` before the first step).
        found_inf: always ``False``: a non-finite mean gradient raises, it is never skipped (``found_inf``
            reports a skipped step, as in every wrapper; :mod:`optbook.contract`).
        skipped_steps: steps skipped for non-finite gradients: always 0, as there is no loss scaler to skip
            with (kept in the state dict, as every optbook wrapper's).

    The step (a collective)::

        all_reduce([failing rank + 1, has_grad...], MAX)      every rank raises together on bad input
        g = all_reduce(flat local gradients, SUM) / d          the mean gradient, on every rank
        clip g by its norm (max_grad_norm)                    replicated: no further communication
        owner of W:  M, W <- Muon(W, M, g_W)                  optbook.optim.functional.muon on the owned matrices
        all_gather(owned matrices, padded to the largest rank) every rank gets every W

    The owners' arithmetic is the single-process Muon's, on the same mean gradient: with an exact mean
    (float64, dyadic gradients) the result equals ``optbook.optim.Muon`` to rounding of the batched
    Newton–Schulz products (bit for bit in the tests here).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError, TypeError: what :class:`optbook.optim.Muon` raises; parameters that differ between
            ranks or sit on several devices; a bad ``assignment`` or ``max_grad_norm``. Before anything is
            written. :meth:`step` raises on **every** rank when one rank's input is invalid (hyperparameter,
            gradient shape/dtype), with nothing written on any rank.
        optbook.contract.NonFiniteGradientError: :meth:`step`, when a mean gradient holds ``inf`` or ``NaN``
            (on every rank, naming the parameter, nothing written; the step contract of
            :mod:`optbook.contract`).

    Outside writes to the parameters (``model.load_state_dict``, :func:`optbook.qk_clip_`) need no care:
    the owners step the model's parameters themselves, so this class keeps no copy of the weights.
    """

    def __init__(self, params, process_group=None, *, assignment: str = "lpt", max_grad_norm=None,
                 **muon_defaults):
        group, rank, world_size = group_info(process_group)
        if assignment not in ("lpt", "round_robin"):
            raise ValueError(f"Invalid assignment: expected 'lpt' or 'round_robin', got {assignment!r}")
        max_grad_norm = check_max_grad_norm(max_grad_norm)
        super().__init__(params, **muon_defaults)  # validates parameters and hyperparameters
        all_params = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in all_params}
        if len(devices) > 1:
            raise ValueError(f"Invalid params: they are on several devices {sorted(map(str, devices))}")
        check_same_params(all_params, group, world_size, "LayerWiseMuon")
        self.process_group, self.rank, self.world_size = group, rank, world_size
        self.max_grad_norm = max_grad_norm
        self.assignment = assignment
        self._params = all_params
        # no parameter: the CPU, or the current GPU for NCCL (its status all-reduce takes no CPU tensor)
        self.device = next(iter(devices)) if devices else _reduce_device([], group)
        self.costs = [ns_cost(p.shape, g["head_split"]) for g in self.param_groups for p in g["params"]]
        self.owners = (lpt_assign(self.costs, world_size) if assignment == "lpt"
                       else round_robin_assign(len(self.costs), world_size))
        self.loads = rank_loads(self.costs, self.owners, world_size)
        self.comm_bytes = {"all_reduce": 0, "all_gather": 0, "control": 0}
        self.last_grad_norm: float | None = None
        self.found_inf, self.skipped_steps = False, 0
        self._consolidated: dict | None = None
        self._mean_grads: list | None = None
        with torch.no_grad():
            src = global_rank(group, 0)
            for p in all_params:
                if p.numel():
                    dist.broadcast(p.data, src=src, group=group)

    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing (the assignment is fixed then).

        Raises:
            NotImplementedError: after construction.
        """
        if getattr(self, "owners", None) is not None:
            raise NotImplementedError("LayerWiseMuon.add_param_group: the owners are assigned at construction; "
                                      "build a new LayerWiseMuon with every group")
        super().add_param_group(param_group)

    def predicted_comm_bytes(self, has_grad=None) -> dict:
        """Bytes one :meth:`step` communicates: the all-reduce of every gradient (counted twice, module
        docstring; a parameter without a gradient on every rank is left out), the all-gather of ``d`` times
        the largest rank's owned elements per dtype, and the status all-reduce of ``1 + n_params`` float64
        values.

        Args:
            has_grad: one bool per parameter (param-group order), whether some rank has its gradient
                (``None``: all)."""
        has_grad = [True] * len(self._params) if has_grad is None else list(has_grad)
        reduce = sum(2 * nbytes(p.numel(), self._reduce_dtype(p.dtype)) for p, h in zip(self._params, has_grad) if h)
        gather = 0
        for dtype in dict.fromkeys(p.dtype for p in self._params):
            per_rank = [sum(p.numel() for p, o in zip(self._params, self.owners) if o == r and p.dtype == dtype)
                        for r in range(self.world_size)]
            gather += self.world_size * nbytes(max(per_rank), dtype)
        return {"all_reduce": reduce, "all_gather": gather, "control": 8 * (1 + len(self._params))}

    @staticmethod
    def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    # --- the step in two halves (DistributedChain calls them separately) --------------------------------
    def _reduce(self) -> tuple[float, int | None]:
        """Validate, agree on errors, average the gradients. Returns ``(sum of squares of the mean gradient,
        index of the first parameter whose mean gradient is not finite, or None)``, the same on every rank.
        Writes nothing but internal buffers."""
        self._consolidated = None
        self._mean_grads = None
        has_grad = validate_on_every_rank(self, "LayerWiseMuon")
        mean: list = [None] * len(self._params)
        by_dtype: dict = {}
        for i, p in enumerate(self._params):
            if has_grad[i] and p.numel():
                by_dtype.setdefault(self._reduce_dtype(p.dtype), []).append(i)
        for dtype, idx in by_dtype.items():
            flat = torch.zeros(sum(self._params[i].numel() for i in idx), dtype=dtype, device=self.device)
            views = flat.split([self._params[i].numel() for i in idx])
            for i, v in zip(idx, views):
                if self._params[i].grad is not None:
                    v.copy_(self._params[i].grad.reshape(-1))
            dist.all_reduce(flat, group=self.process_group)
            self.comm_bytes["all_reduce"] += 2 * nbytes(flat.numel(), dtype)
            flat.div_(self.world_size)
            for i, v in zip(idx, views):
                mean[i] = v.view(self._params[i].shape)
        self._mean_grads = mean
        return float(grad_sumsq([g for g in mean if g is not None])), first_nonfinite(mean)

    def _apply(self, coef: float) -> None:
        """Clip the mean gradients by ``coef``, step the owned matrices, all-gather every matrix."""
        mean, self._mean_grads = self._mean_grads, None
        scale_grads_([g for g in mean if g is not None], coef)
        i = 0
        for group in self.param_groups:
            group = self._read_floats(group)
            params, grads = [], []
            for p in group["params"]:
                if self.owners[i] == self.rank and mean[i] is not None:
                    params.append(p)
                    grads.append(mean[i].to(p.dtype))
                i += 1
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            muon(params, grads, [self.state[p]["momentum_buffer"] for p in params], **hyper(group))
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        """Every rank packs its owned matrices (per dtype) into a buffer padded to the largest rank's size;
        one all-gather; every rank copies the others' matrices out."""
        for dtype in dict.fromkeys(p.dtype for p in self._params):
            per_rank = [[p for p, o in zip(self._params, self.owners) if o == r and p.dtype == dtype and p.numel()]
                        for r in range(self.world_size)]
            size = max(sum(p.numel() for p in ps) for ps in per_rank)
            if size == 0:
                continue
            send = torch.zeros(size, dtype=dtype, device=self.device)
            mine = per_rank[self.rank]
            if mine:
                send[:sum(p.numel() for p in mine)].copy_(torch.cat([p.detach().reshape(-1) for p in mine]))
            recv = torch.empty(self.world_size * size, dtype=dtype, device=self.device)
            all_gather(recv, send, group=self.process_group)
            self.comm_bytes["all_gather"] += nbytes(recv.numel(), dtype)
            for r, ps in enumerate(per_rank):
                if r == self.rank:
                    continue
                offset = r * size
                for p in ps:
                    p.data.copy_(recv[offset:offset + p.numel()].view(p.shape))
                    offset += p.numel()

    @torch.no_grad()
    def step(self, closure=None):
        """One layer-wise Muon step (a collective; the class docstring's sequence).

        Args:
            closure: optional callable that recomputes the loss and calls ``backward``; run with gradients
                enabled on every rank.

        Returns:
            The closure's loss, or ``None``.

        A parameter whose ``grad`` is ``None`` on some ranks contributes zeros from those ranks (the mean
        still divides by ``d``, as ``DistributedDataParallel``); one whose ``grad`` is ``None`` on every rank
        is not stepped.

        Raises:
            ValueError, TypeError: an invalid hyperparameter or gradient on any rank: on every rank, before
                anything is written (parameters, state and ``.grad`` are bitwise unchanged).
            optbook.contract.NonFiniteGradientError: a mean gradient holds ``inf`` or ``NaN``: on every rank,
                naming the parameter, before anything is written.
        """
        loss = closure_loss(closure)
        total, bad = self._reduce()
        if bad is not None:
            self._mean_grads = None
            raise nonfinite_error("LayerWiseMuon", bad, self._params[bad])
        norm = math.sqrt(total)
        self.last_grad_norm = norm
        self._apply(clip_coefficient(norm, self.max_grad_norm))
        return loss

    # --- checkpoints ------------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every owner's momentum on group rank ``to`` (a collective), for :meth:`state_dict`.

        Raises:
            TypeError, ValueError: ``to`` is not a rank of the group (on every rank, before communicating).
        """
        local = {i: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                     for k, v in self.state[p].items()}
                 for i, p in enumerate(self._params) if self.owners[i] == self.rank and p in self.state}
        gathered = consolidate(self, local, to)
        if gathered is None:
            self._consolidated = None
            return
        state = {}
        for part in gathered:
            state.update(part)
        plain = super().state_dict()  # param_groups with indices in param-group order
        self._consolidated = {"state": {i: state[i] for i in sorted(state)}, "param_groups": plain["param_groups"],
                              "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        """The consolidated state on the rank :meth:`consolidate_state_dict` sent it to: the plain
        ``optbook.optim.Muon`` layout (``{"state": {index: {"momentum_buffer": tensor}}, "param_groups":
        [...]}``, parameters numbered in param-group order, tensors on the CPU) plus ``"skipped_steps"``
        (which ``torch.optim`` ignores). It loads into a single-process :class:`optbook.optim.Muon` over the
        same parameters and into a LayerWiseMuon at any world size.

        Raises:
            RuntimeError: not consolidated on this rank since the last step.
        """
        return consolidated_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a plain Muon state dict (from :meth:`state_dict` at any world size, or from
        :meth:`optbook.optim.Muon.state_dict`); each rank keeps the momentum of the matrices it owns. Not a
        collective: call it on every rank with the same dict.

        Raises:
            TypeError, ValueError: the whole dict is validated first (``check_muon_state_dict`` of
                :mod:`optbook.distributed._muon_common`: group and parameter counts, hyperparameters, state
                keys, momentum shapes -- a checkpoint of another model or optimizer is refused); nothing is
                loaded then.
        """
        skipped = check_muon_state_dict(state_dict, self)
        super().load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        for i, p in enumerate(self._params):
            if self.owners[i] != self.rank:
                self.state.pop(p, None)
        self.skipped_steps = skipped
        self._consolidated = None

    # --- sharded checkpoints: one file per rank --------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's part of the state, for one checkpoint file per rank. Not a collective.

        Returns:
            ``{"format": SHARDED_FORMAT, "rank", "world_size", "owners", "params": [(shape, dtype name)] in
            param-group order, "state": {index: {"momentum_buffer": CPU tensor}} for the matrices this rank
            owns, "param_groups": as :meth:`state_dict`, "skipped_steps"}``.
        """
        plain = super().state_dict()
        return {"format": SHARDED_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "owners": list(self.owners), "params": [(tuple(p.shape), str(p.dtype)) for p in self._params],
                "state": {i: {k: v.detach().cpu().clone() for k, v in s.items()} for i, s in plain["state"].items()},
                "param_groups": plain["param_groups"], "skipped_steps": self.skipped_steps}

    def _plain_from_shards(self, shards) -> dict:
        """The plain Muon dict that :meth:`load_sharded_state_dict` loads, after every check that does not
        need it loaded (format, ranks, owners, parameter shapes and dtypes). Writes nothing."""
        parts = shard_parts(shards, self, SHARDED_FORMAT, "owners", list(self.owners))
        state = {}
        for sd in parts:
            state.update(sd["state"])
        return {"state": state, "param_groups": parts[0]["param_groups"], "skipped_steps": parts[0]["skipped_steps"]}

    def load_sharded_state_dict(self, shards) -> None:
        """Load :meth:`sharded_state_dict` files. Not a collective.

        Args:
            shards: **this rank's own** dict (saved by the same rank at the same world size and assignment),
                or the list of **every** rank's dicts of one save at any world size (resharding).

        Raises:
            TypeError, ValueError: not dicts of this format; a file of another rank, world size or
                assignment (the message says to pass the list); files saved for other parameter shapes or
                dtypes (naming the first); what :meth:`load_state_dict` raises. All before anything is loaded.
        """
        self.load_state_dict(self._plain_from_shards(shards))


#: The ``"format"`` entry of :meth:`LayerWiseMuon.sharded_state_dict`.
SHARDED_FORMAT = "optbook.LayerWiseMuon.sharded/1"
