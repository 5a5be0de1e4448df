"""Muon across data-parallel ranks: whole matrices per rank, or element shards with a gather. Chapter 14.

Newton–Schulz orthogonalises a *whole* matrix: the polar factor of a matrix is not the concatenation of
the polar factors of its pieces, so the ZeRO-1 layout of chapter 13 (element shards that ignore parameter
boundaries) cannot step Muon shard by shard. Two ways out, both here:

* :class:`LayerWiseMuon` -- **whole-matrix ownership**. Each 2-D parameter is owned by one rank, chosen by
  longest-processing-time-first bin packing (:func:`lpt_assign`) on the Newton–Schulz cost
  ``max(m, n) * min(m, n)**2`` (:func:`ns_cost`). The gradients are averaged over the ranks (one
  all-reduce, as ``DistributedDataParallel``); the owner of a matrix keeps its momentum and runs the Muon
  step on it (the functional core :func:`optbook.optim.muon`); the updated matrices are all-gathered so
  every rank holds the same parameters. This is Megatron-LM's ``LayerWiseDistributedOptimizer``
  (``megatron/core/optimizer/layer_wise_optimizer.py``: "legacy" path, gradients all-reduced, parameters
  all-gathered with variable sizes; LPT packing by ``max(m, n) * min(m, n)**2``) and the ownership DeepSeek-V4
  describes (whole logical matrices assigned to ranks).
* :class:`DistributedMuon` -- **Moonlight's distributed Muon** (Liu et al. 2025, "Muon is Scalable for LLM
  Training", arXiv:2502.16982, section 2.3 and Algorithm 1): the ZeRO-1 layout of
  :func:`optbook.distributed.shard_layout`; gradients reduce-scattered; the momentum kept for the local
  element shard only; each step the momentum-updated shards are all-gathered (in bfloat16 by default) into
  full matrices, each matrix is orthogonalised, and each rank keeps the part of the update that falls in its
  shard; parameters all-gathered as in ZeRO-1. It communicates one gather more than ZeRO-1 AdamW:
  :attr:`DistributedMuon.comm_bytes` counts it, :func:`zero1_comm_bytes` gives the formula.

:class:`DistributedChain` chains one of them with a ZeRO-1 ``DistributedOptimizer`` (AdamW for embeddings,
norms, biases) so that both clip by **one** global norm of the averaged raw gradients (not of the
orthogonalised updates).

Communication volume convention (:attr:`LayerWiseMuon.comm_bytes`, :attr:`DistributedMuon.comm_bytes`,
:func:`zero1_comm_bytes`): a collective counts the bytes of the full buffer it reduces or gathers
(``numel * element_size``); an all-reduce counts twice that (it is a reduce-scatter followed by an
all-gather). A ring implementation sends ``(d - 1) / d`` of the counted bytes from each rank, the same factor
for every collective, so ratios are unchanged.
"""

from __future__ import annotations

import copy
import heapq
import inspect
import math

import torch
import torch.distributed as dist

from ..optim import Muon, muon
from ..optim._functional import momentum_directions
from ..optim.muon import split_rows
from ..optim.optimizer import all_finite
from .zero1 import _LOW_PRECISION, _all_gather, _check_int, _reduce_scatter, shard_layout
from ._ranks import check_same_params, global_rank, group_info, validate_on_every_rank

__all__ = ["DistributedChain", "DistributedMuon", "LayerWiseMuon", "lpt_assign", "ns_cost", "rank_loads",
           "round_robin_assign", "zero1_comm_bytes"]

#: The hyperparameters the functional core :func:`optbook.optim.muon` takes from a param group.
_MUON_KEYS = tuple(k for k, v in inspect.signature(muon).parameters.items() if v.kind is v.KEYWORD_ONLY)
#: ``torch.nn.utils.clip_grad_norm_``'s ``1e-6`` in ``max_norm / (norm + 1e-6)`` (as optbook.clipping).
_CLIP_EPS = 1e-6


# --- assignment of whole matrices to ranks -----------------------------------------------------------------
def ns_cost(shape, head_split=None) -> int:
    """Newton–Schulz cost model of one ``(m, n)`` matrix: ``max(m, n) * min(m, n)**2`` (multiply-adds per
    iteration up to a constant: the Gram ``X X^T`` of the wide orientation is ``min**2 * max``, and so are
    the products with it). With ``head_split`` (:func:`optbook.optim.muon.split_rows`) the blocks are
    orthogonalised separately and their costs add up. Source: Megatron-LM
    ``layer_wise_optimizer.py`` (its bin-packing weight).

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
    world_size = _check_int("world_size", world_size, 1)
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
    n_items = _check_int("n_items", n_items, 0)
    world_size = _check_int("world_size", world_size, 1)
    return [i % world_size for i in range(n_items)]


def rank_loads(costs, owners, world_size: int) -> list:
    """The total cost per rank of an assignment ``owners`` (as returned by :func:`lpt_assign`).

    Raises:
        ValueError: ``owners`` and ``costs`` differ in length or an owner is out of range.
    """
    costs = _check_costs(costs)
    world_size = _check_int("world_size", world_size, 1)
    owners = list(owners)
    if len(owners) != len(costs):
        raise ValueError(f"Invalid owners: {len(owners)} owners for {len(costs)} costs")
    loads = [0] * world_size
    for c, r in zip(costs, owners):
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ValueError(f"Invalid owners: {r!r} is not a rank in 0 .. {world_size - 1}")
        loads[r] += c
    return loads


# --- helpers shared by both optimizers ----------------------------------------------------------------------
def _clip_coefficient(norm: float, max_grad_norm) -> float:
    """``min(1, max_norm / (norm + 1e-6))`` as :func:`optbook.clipping.clip_grad_norm_` (1 without clipping)."""
    if max_grad_norm is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_grad_norm / (norm + _CLIP_EPS))


def _scale_(tensors, coef: float) -> None:
    """Multiply in float64 with one rounding back, as :func:`optbook.clipping.clip_grad_norm_` does."""
    if coef >= 1.0:
        return
    for g in tensors:
        if g.dtype == torch.float64:
            g.mul_(coef)
        else:
            g.copy_(g.to(torch.float64).mul_(coef))


def _sumsq(tensors) -> float:
    """Float64 sum of squares, one ``vector_norm`` per tensor (as :func:`optbook.clipping.get_grad_norm`)."""
    total = torch.zeros((), dtype=torch.float64)
    for g in tensors:
        total += torch.linalg.vector_norm(g, dtype=torch.float64).cpu().square()
    return float(total)


def _check_max_grad_norm(value):
    from ..optim._validation import check_number

    return None if value is None else check_number("max_grad_norm", value, low=0.0, low_open=True)


def _hyper(group: dict) -> dict:
    return {k: group[k] for k in _MUON_KEYS if k in group}


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


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
        last_grad_norm: the L2 norm of the averaged gradients at the last step (0-dim float64 tensor).

    The step (a collective)::

        all_reduce([failing rank + 1, has_grad...], MAX)      every rank raises together on bad input
        g = all_reduce(flat local gradients, SUM) / d          the mean gradient, on every rank
        clip g by its norm (max_grad_norm)                    replicated: no further communication
        owner of W:  M, W <- Muon(W, M, g_W)                  optbook.optim.muon on the owned matrices
        all_gather(owned matrices, padded to the largest rank) every rank gets every W

    The owners' arithmetic is the single-process Muon's, on the same mean gradient: with an exact mean
    (float64, dyadic gradients) the result equals ``optbook.optim.Muon`` to rounding of the batched
    Newton–Schulz products (bit for bit in the tests here).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError, TypeError: what :class:`optbook.optim.Muon` raises; parameters that differ between
            ranks or sit on several devices; a bad ``assignment`` or ``max_grad_norm``. Before anything is
            written. :meth:`step` raises on **every** rank when one rank's input is invalid (hyperparameter,
            gradient shape/dtype, non-finite gradient), with nothing written on any rank.
    """

    def __init__(self, params, process_group=None, *, assignment: str = "lpt", max_grad_norm=None,
                 **muon_defaults):
        group, rank, world_size = group_info(process_group)
        if assignment not in ("lpt", "round_robin"):
            raise ValueError(f"Invalid assignment: expected 'lpt' or 'round_robin', got {assignment!r}")
        max_grad_norm = _check_max_grad_norm(max_grad_norm)
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
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self.costs = [ns_cost(p.shape, g["head_split"]) for g in self.param_groups for p in g["params"]]
        self.owners = (lpt_assign(self.costs, world_size) if assignment == "lpt"
                       else round_robin_assign(len(self.costs), world_size))
        self.loads = rank_loads(self.costs, self.owners, world_size)
        self.comm_bytes = {"all_reduce": 0, "all_gather": 0, "control": 0}
        self.last_grad_norm: torch.Tensor | None = None
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
        reduce = sum(2 * _nbytes(p.numel(), self._reduce_dtype(p.dtype)) for p, h in zip(self._params, has_grad) if h)
        gather = 0
        for dtype in dict.fromkeys(p.dtype for p in self._params):
            per_rank = [sum(p.numel() for p, o in zip(self._params, self.owners) if o == r and p.dtype == dtype)
                        for r in range(self.world_size)]
            gather += self.world_size * _nbytes(max(per_rank), dtype)
        return {"all_reduce": reduce, "all_gather": gather, "control": 8 * (1 + len(self._params))}

    @staticmethod
    def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    # --- the step in two halves (DistributedChain calls them separately) --------------------------------
    def _reduce(self) -> tuple[float, bool]:
        """Validate, agree on errors, average the gradients. Returns ``(sum of squares of the mean gradient,
        all finite)``, the same on every rank. Writes nothing but internal buffers."""
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
            self.comm_bytes["all_reduce"] += 2 * _nbytes(flat.numel(), dtype)
            flat.div_(self.world_size)
            for i, v in zip(idx, views):
                mean[i] = v.view(self._params[i].shape)
        present = [g for g in mean if g is not None]
        self._mean_grads = mean
        return _sumsq(present), (not present or all_finite(present))

    def _apply(self, coef: float) -> None:
        """Clip the mean gradients by ``coef``, step the owned matrices, all-gather every matrix."""
        mean, self._mean_grads = self._mean_grads, None
        _scale_([g for g in mean if g is not None], coef)
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
            muon(params, grads, [self.state[p]["momentum_buffer"] for p in params], **_hyper(group))
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
            _all_gather(recv, send, group=self.process_group)
            self.comm_bytes["all_gather"] += _nbytes(recv.numel(), dtype)
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
            ValueError, TypeError: an invalid hyperparameter or gradient on any rank, or a non-finite mean
                gradient: on every rank, before anything is written (parameters, state and ``.grad`` are
                bitwise unchanged).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sumsq, finite = self._reduce()
        if not finite:
            self._mean_grads = None
            raise ValueError("LayerWiseMuon.step: the mean gradient holds inf or NaN (on every rank); skip this "
                             "step (see the loss scaler); nothing was changed")
        norm = math.sqrt(sumsq)
        self.last_grad_norm = torch.tensor(norm, dtype=torch.float64)
        self._apply(_clip_coefficient(norm, self.max_grad_norm))
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
        gathered = _consolidate(self, local, to)
        if gathered is None:
            self._consolidated = None
            return
        state = {}
        for part in gathered:
            state.update(part)
        plain = super().state_dict()  # param_groups with indices in param-group order
        self._consolidated = {"state": {i: state[i] for i in sorted(state)}, "param_groups": plain["param_groups"]}

    def state_dict(self) -> dict:
        """The consolidated state on the rank :meth:`consolidate_state_dict` sent it to: the plain
        ``optbook.optim.Muon`` layout (``{"state": {index: {"momentum_buffer": tensor}}, "param_groups":
        [...]}``, parameters numbered in param-group order, tensors on the CPU). It loads into a single-process
        :class:`optbook.optim.Muon` over the same parameters and into a LayerWiseMuon at any world size.

        Raises:
            RuntimeError: not consolidated on this rank since the last step.
        """
        return _consolidated_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a plain Muon state dict (from :meth:`state_dict` at any world size, or from
        :meth:`optbook.optim.Muon.state_dict`); each rank keeps the momentum of the matrices it owns. Not a
        collective: call it on every rank with the same dict.

        Raises:
            ValueError: as :meth:`torch.optim.Optimizer.load_state_dict` (group or parameter counts differ), or
                a momentum buffer whose shape is not its parameter's; before anything is loaded.
        """
        _check_muon_state_dict(state_dict, self._params)
        super().load_state_dict(state_dict)
        for i, p in enumerate(self._params):
            if self.owners[i] != self.rank:
                self.state.pop(p, None)
        self._consolidated = None


def _check_muon_state_dict(state_dict, params) -> None:
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


def _consolidated_state(opt) -> dict:
    """``opt._consolidated``, or a RuntimeError saying how to get it."""
    if opt._consolidated is None:
        raise RuntimeError(f"{type(opt).__name__}.state_dict: nothing consolidated on rank {opt.rank}; call "
                           "consolidate_state_dict(to=rank) on every rank first, then state_dict() on that rank")
    return opt._consolidated


def _consolidate(opt, local, to: int):
    """Gather ``local`` (picklable, per rank) on group rank ``to``; the list of every rank's, or None elsewhere."""
    to = _check_int("to", to, 0)
    if to >= opt.world_size:
        raise ValueError(f"Invalid to: expected a rank in 0 .. {opt.world_size - 1}, got {to}")
    gathered = [None] * opt.world_size if opt.rank == to else None
    dist.gather_object(local, gathered, dst=global_rank(opt.process_group, to), group=opt.process_group)
    return gathered


# --- Moonlight: ZeRO-1 shards, gather the full matrix -------------------------------------------------------
class DistributedMuon(Muon):
    """Moonlight's distributed Muon (Liu et al. 2025, Algorithm 1): ZeRO-1 element shards, each matrix
    gathered whole for Newton–Schulz (module docstring).

    Args:
        params: 2-D float32 or float64 tensors (or param-group dicts), as :class:`optbook.optim.Muon`; the
            same on every rank (broadcast from the group's rank 0 at construction). float16/bfloat16
            parameters are refused (their float32 masters are not implemented here; keep float32 weights).
        process_group: the data-parallel group (``None``: WORLD).
        gather_dtype: dtype of the momentum gather (``torch.bfloat16`` as Moonlight; ``torch.float64`` or the
            parameters' dtype for an exact comparison with single-process Muon).
        max_grad_norm: clip the mean gradient by its global norm before the momentum (``None``: no clip).
        bucket_size, param_alignment, bucket_alignment: the ZeRO-1 layout, :func:`optbook.distributed.shard_layout`.
        **muon_defaults: as :class:`optbook.optim.Muon`.

    One step, per bucket of the layout (a collective)::

        all_reduce([failing rank + 1, has_grad...], MAX)       every rank raises together on bad input
        g_r = reduce_scatter(flat gradients, SUM) / d            this rank's element shard of the mean
        all_reduce([sum of squares of g_r, non-finite], SUM)     one global norm; every rank skips together
        M_r <- lerp(M_r, c g_r, 1 - mu); D_r (Nesterov)          momentum on the shard only (c: the clip)
        D = all_gather(D_r in gather_dtype)                      the full momentum-updated matrices
        O = scale * NS(D) per matrix with a piece on this rank   optbook.optim.muon's arithmetic
        W_r <- W_r (1 - lr wd) - lr O_r                          keep the local part of the update
        W = all_gather(W_r)                                      as ZeRO-1

    A teaching implementation: the flat parameter and gradient buffers are copies (the parameters are not
    views of them, as in ``DistributedOptimizer``), and every rank orthogonalises each matrix it holds a piece
    of (a matrix cut by a shard boundary is orthogonalised on every rank that holds a piece of it).

    Attributes:
        layout: the :class:`optbook.distributed.zero1.Layout`; ``pieces``: this rank's pieces.
        state: ``state[p]["momentum_shard"]``, the 1-D momentum of this rank's piece of ``p`` (only for the
            parameters with a piece here) -- ``1/d`` of Muon's state; ``momentum_shard`` the same by index.
        comm_bytes: ``{"reduce_scatter", "gather", "all_gather", "control"}`` bytes since construction;
            :func:`zero1_comm_bytes` ``(layout, gather_dtype)`` predicts one step's.
        last_grad_norm: the global norm of the mean gradient at the last step (0-dim float64 tensor).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError, TypeError: what :class:`optbook.optim.Muon` raises; float16/bfloat16 parameters; bad
            ``gather_dtype`` or ``max_grad_norm``; parameters that differ between ranks. :meth:`step`: an
            invalid input or non-finite mean gradient on any rank raises on every rank, nothing written.
    """

    def __init__(self, params, process_group=None, *, gather_dtype: torch.dtype = torch.bfloat16,
                 max_grad_norm=None, bucket_size: int | None = None, param_alignment: int = 64,
                 bucket_alignment: int = 128, **muon_defaults):
        group, rank, world_size = group_info(process_group)
        if gather_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise TypeError(f"Invalid gather_dtype: expected a floating dtype, got {gather_dtype!r}")
        max_grad_norm = _check_max_grad_norm(max_grad_norm)
        super().__init__(params, **muon_defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(all_params):
            if p.dtype in _LOW_PRECISION:
                raise ValueError(f"Invalid params: parameter {i} is {p.dtype}; DistributedMuon steps float32 or "
                                 "float64 parameters (keep float32 weights and compute in low precision)")
        devices = {p.device for p in all_params}
        if len(devices) > 1:
            raise ValueError(f"Invalid params: they are on several devices {sorted(map(str, devices))}")
        layout = shard_layout(all_params, world_size, bucket_size=bucket_size, param_alignment=param_alignment,
                              bucket_alignment=bucket_alignment)
        check_same_params(all_params, group, world_size, "DistributedMuon")
        self.process_group, self.rank, self.world_size = group, rank, world_size
        self.gather_dtype, self.max_grad_norm = gather_dtype, max_grad_norm
        self.layout, self.pieces = layout, layout.pieces(rank)
        self._params = all_params
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self.comm_bytes = {"reduce_scatter": 0, "gather": 0, "all_gather": 0, "control": 0}
        self.last_grad_norm: torch.Tensor | None = None
        self._consolidated: dict | None = None
        with torch.no_grad():
            self.param_buffers = {d: torch.zeros(n, dtype=d, device=self.device)
                                  for d, n in layout.buffer_numel.items()}
            self.grad_buffers = {d: torch.zeros(n, dtype=d, device=self.device)
                                 for d, n in layout.buffer_numel.items()}
            src = global_rank(group, 0)
            for p in all_params:
                if p.numel():
                    dist.broadcast(p.data, src=src, group=group)
            self._params_to_buffers()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "layout", None) is not None:
            raise NotImplementedError("DistributedMuon.add_param_group: the layout is fixed at construction")
        super().add_param_group(param_group)

    @property
    def momentum_shard(self) -> dict[int, torch.Tensor]:
        """``{param index: this rank's 1-D momentum piece}`` (the same tensors as ``state[p]["momentum_shard"]``)."""
        return {i: self.state[p]["momentum_shard"] for i, p in enumerate(self._params)
                if p in self.state and "momentum_shard" in self.state[p]}

    def _params_to_buffers(self) -> None:
        for r, p in zip(self.layout.params, self._params):
            self.param_buffers[r.dtype][r.start:r.end].copy_(p.detach().reshape(-1))

    def _shard(self, buffers: dict, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        lo, hi = bucket.shard(self.rank)
        return buffers[bucket.dtype][lo:hi]

    @torch.no_grad()
    def step(self, closure=None):
        """One distributed Muon step (a collective; the class docstring's sequence).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError, TypeError: an invalid hyperparameter or gradient on any rank, or a non-finite mean
                gradient: on every rank, before anything is written.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        has_grad = validate_on_every_rank(self, "DistributedMuon")
        self._consolidated = None
        # 1. reduce-scatter the flat gradients, mean
        for buf in self.grad_buffers.values():
            buf.zero_()
        for r, p in zip(self.layout.params, self._params):
            if p.grad is not None and r.numel:
                self.grad_buffers[r.dtype][r.start:r.end].copy_(p.grad.reshape(-1))
        shards = []
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.numel:
                shard = self._shard(self.grad_buffers, b)
                _reduce_scatter(shard, self.grad_buffers[bucket.dtype][bucket.start:bucket.end],
                                group=self.process_group)
                self.comm_bytes["reduce_scatter"] += _nbytes(bucket.numel, bucket.dtype)
                shard.div_(self.world_size)
                shards.append(shard)
        # 2. one global norm and one non-finite flag
        stats = torch.tensor([_sumsq(shards), 0.0 if not shards or all_finite(shards) else 1.0],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(stats, group=self.process_group)
        self.comm_bytes["control"] += 16
        if stats[1] > 0:
            raise ValueError("DistributedMuon.step: the mean gradient holds inf or NaN (on every rank); skip this "
                             "step; nothing was changed")
        norm = math.sqrt(float(stats[0]))
        self.last_grad_norm = torch.tensor(norm, dtype=torch.float64)
        coef = _clip_coefficient(norm, self.max_grad_norm)
        _scale_(shards, coef)
        # 3. momentum on this rank's pieces; the directions into a gather buffer
        groups = [self._read_floats(g) for g in self.param_groups]
        directions = {d: torch.zeros(n, dtype=self.gather_dtype, device=self.device)
                      for d, n in self.layout.buffer_numel.items()}
        for piece in self.pieces:
            if not has_grad[piece.index]:
                continue
            r = self.layout.params[piece.index]
            g = groups[self._group_of[piece.index]]
            grad = self.grad_buffers[r.dtype][piece.buffer_start:piece.buffer_start + piece.numel]
            state = self.state[self._params[piece.index]]
            if "momentum_shard" not in state:
                state["momentum_shard"] = torch.zeros_like(grad)
            m = state["momentum_shard"]
            (d,) = momentum_directions([m], [grad], g["momentum"], g["nesterov"])
            directions[r.dtype][piece.buffer_start:piece.buffer_start + piece.numel].copy_(d)
        # 4. gather the full matrices
        for bucket in self.layout.buckets:
            if bucket.numel:
                lo, hi = bucket.shard(self.rank)
                _all_gather(directions[bucket.dtype][bucket.start:bucket.end], directions[bucket.dtype][lo:hi],
                            group=self.process_group)
                self.comm_bytes["gather"] += _nbytes(bucket.numel, self.gather_dtype)
        # 5. orthogonalise every matrix with a piece here (Muon's own arithmetic), keep the local part
        for gi, g in enumerate(groups):
            mine = [p for p in self.pieces if self._group_of[p.index] == gi and has_grad[p.index]]
            if not mine:
                continue
            full = []
            for piece in mine:
                r = self.layout.params[piece.index]
                full.append(directions[r.dtype][r.start:r.end].view(r.shape).to(r.dtype))
            updates = _scaled_orthogonal(full, g)
            for piece, upd in zip(mine, updates):
                r = self.layout.params[piece.index]
                w = self.param_buffers[r.dtype][piece.buffer_start:piece.buffer_start + piece.numel]
                w.mul_(1 - g["lr"] * g["weight_decay"])
                w.sub_(upd.reshape(-1)[piece.param_start:piece.param_end], alpha=g["lr"])
        # 6. all-gather the parameters, back into the model
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.numel:
                _all_gather(self.param_buffers[bucket.dtype][bucket.start:bucket.end],
                            self._shard(self.param_buffers, b), group=self.process_group)
                self.comm_bytes["all_gather"] += _nbytes(bucket.numel, bucket.dtype)
        for r, p in zip(self.layout.params, self._params):
            if r.numel:
                p.data.copy_(self.param_buffers[r.dtype][r.start:r.end].view(r.shape))
        return loss

    # --- checkpoints ------------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's momentum pieces on group rank ``to`` and assemble whole momentum matrices (a
        collective), for :meth:`state_dict`. The result is dropped at the next :meth:`step`.

        Raises:
            TypeError, ValueError: ``to`` is not a rank of the group (on every rank, before communicating).
        """
        local = [(piece.index, piece.param_start, piece.param_end,
                  self.state[self._params[piece.index]]["momentum_shard"].detach().cpu().clone())
                 for piece in self.pieces if "momentum_shard" in self.state.get(self._params[piece.index], {})]
        gathered = _consolidate(self, local, to)
        if gathered is None:
            self._consolidated = None
            return
        buffers: dict[int, torch.Tensor] = {}
        for part in gathered:
            for index, start, end, m in part:
                buffers.setdefault(index, torch.zeros(self.layout.params[index].numel, dtype=m.dtype))[start:end] = m
        plain = super().state_dict()  # param_groups with indices in param-group order
        self._consolidated = {"state": {i: {"momentum_buffer": buffers[i].view(self.layout.params[i].shape)}
                                        for i in sorted(buffers)},
                              "param_groups": plain["param_groups"]}

    def state_dict(self) -> dict:
        """The consolidated state on the rank :meth:`consolidate_state_dict` sent it to, in the plain
        ``optbook.optim.Muon`` layout (``{"state": {index: {"momentum_buffer": tensor}}, "param_groups": [...]}``,
        parameters numbered in param-group order, tensors on the CPU). It loads into a single-process
        :class:`optbook.optim.Muon` over the same parameters, into a :class:`LayerWiseMuon` and into a
        DistributedMuon at any world size.

        Raises:
            RuntimeError: not consolidated on this rank since the last step.
        """
        return _consolidated_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a plain Muon state dict (from :meth:`state_dict` at any world size, from
        :meth:`LayerWiseMuon.state_dict` or from :meth:`optbook.optim.Muon.state_dict`); each rank keeps its
        pieces of the momentum. Not a collective: call it on every rank with the same dict.

        Raises:
            TypeError, ValueError: as :meth:`torch.optim.Optimizer.load_state_dict` (group or parameter counts
                differ), or a momentum buffer whose shape is not its parameter's; before anything is loaded.
        """
        _check_muon_state_dict(state_dict, self._params)
        super().load_state_dict(state_dict)
        full = {i: self.state.pop(p)["momentum_buffer"] for i, p in enumerate(self._params)
                if "momentum_buffer" in self.state.get(p, {})}
        self.state.clear()
        for piece in self.pieces:
            if piece.index in full:
                flat = full[piece.index].reshape(-1)[piece.param_start:piece.param_end]
                self.state[self._params[piece.index]]["momentum_shard"] = flat.to(self.device).clone()
        self._consolidated = None


def _scaled_orthogonal(directions: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """``scale * NS(D)`` for each full matrix ``D``, computed by the functional core
    :func:`optbook.optim.muon` itself (on a zero parameter, ``lr = 1``, no momentum, no decay), so the
    rescaling, head split, Newton–Schulz schedule and scale are Muon's and nothing is re-implemented.
    Exact: the zero parameter minus ``1 * U`` is ``-U`` bit for bit, and ``lerp(M, D, 1)`` is ``D``."""
    out = [torch.zeros_like(d) for d in directions]
    bufs = [torch.zeros_like(d) for d in directions]
    hyper = {**_hyper(group), "lr": 1.0, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0}
    muon(out, directions, bufs, **hyper)
    return [o.neg_() for o in out]


def zero1_comm_bytes(layout, gather_dtype: torch.dtype | None = None, grad_dtype=None) -> dict:
    """Bytes one ZeRO-1 step moves for ``layout`` (:func:`optbook.distributed.shard_layout`), by the
    module docstring's convention: a reduce-scatter of every bucket in its gradient dtype (``grad_dtype``,
    default: float32 for float16/bfloat16 buckets, else the bucket's dtype, as ``DistributedOptimizer``) and
    an all-gather of every bucket in its parameter dtype. With ``gather_dtype``, also Moonlight's gather of
    the momentum-updated buckets in that dtype (:class:`DistributedMuon`).

    Returns:
        ``{"reduce_scatter": int, "all_gather": int, "gather": int (0 without gather_dtype), "total": int}``.
    """
    out = {"reduce_scatter": 0, "all_gather": 0, "gather": 0}
    for b in layout.buckets:
        gd = grad_dtype or (torch.float32 if b.dtype in _LOW_PRECISION else b.dtype)
        out["reduce_scatter"] += _nbytes(b.numel, gd)
        out["all_gather"] += _nbytes(b.numel, b.dtype)
        if gather_dtype is not None:
            out["gather"] += _nbytes(b.numel, gather_dtype)
    out["total"] = out["reduce_scatter"] + out["all_gather"] + out["gather"]
    return out


# --- one global norm for a Muon member and a ZeRO-1 AdamW member ---------------------------------------------
class DistributedChain(torch.optim.Optimizer):
    """A :class:`LayerWiseMuon` (matrices) and a ZeRO-1 ``DistributedOptimizer`` (AdamW for the rest) as one
    optimizer whose clip uses **one** global norm of the mean raw gradients of both.

    The norm is ``sqrt(S_muon + S_adamw)``: ``S_muon`` is the sum of squares of the all-reduced (replicated)
    Muon gradients, computed once on every rank with no further communication; ``S_adamw`` sums the
    squares of each rank's ZeRO-1 shard over the group (``DistributedOptimizer.step(extra_grad_sumsq=
    S_muon)``). Both members are then scaled by the same ``min(1, max_norm / (norm + 1e-6))``. The norm is
    that of the gradients, not of the orthogonalised updates (whose norm is fixed by Newton–Schulz and would
    make clipping meaningless). Without ``max_grad_norm`` the norm is still computed (``last_grad_norm``).

    Args:
        muon: a :class:`LayerWiseMuon` with ``max_grad_norm=None``.
        adamw: an ``optbook.distributed.DistributedOptimizer`` on the same process group, with
            ``max_grad_norm=None`` and no loss scaler.
        max_grad_norm: ``None`` or a number ``> 0``.

    ``param_groups`` is the members' groups (Muon's first), so one learning-rate scheduler drives both.
    Checkpoint each member (``consolidate_state_dict`` then ``state_dict`` on each).

    Step order (a collective): Muon validates and all-reduces (nothing written; on bad input every rank
    raises), AdamW reduce-scatters, clips by the shared norm and steps its shards, then Muon clips by the
    same coefficient, steps the owned matrices and all-gathers. If AdamW raises, Muon has written nothing.

    Raises:
        TypeError: a member of the wrong type.
        ValueError: a member with its own ``max_grad_norm`` or a loss scaler, different process groups, or a
            bad ``max_grad_norm``.
    """

    def __init__(self, muon: LayerWiseMuon, adamw, max_grad_norm=None):
        from .zero1 import DistributedOptimizer

        if not isinstance(muon, LayerWiseMuon):
            raise TypeError(f"Invalid muon: expected a LayerWiseMuon, got {type(muon).__name__}")
        if not isinstance(adamw, DistributedOptimizer):
            raise TypeError(f"Invalid adamw: expected an optbook.distributed.DistributedOptimizer, got "
                            f"{type(adamw).__name__}")
        if muon.max_grad_norm is not None or adamw.max_grad_norm is not None:
            raise ValueError("Invalid members: build both with max_grad_norm=None; the chain clips by the one "
                             "global norm (pass max_grad_norm to DistributedChain)")
        if adamw.loss_scaler is not None:
            raise ValueError("Invalid adamw: a loss scaler is not supported in a DistributedChain")
        if muon.process_group is not adamw.process_group:
            raise ValueError("Invalid members: they must use the same process group object")
        self.muon, self.adamw = muon, adamw
        self.optimizers = [muon, adamw]
        self.max_grad_norm = _check_max_grad_norm(max_grad_norm)
        self.last_grad_norm: torch.Tensor | None = None
        self.defaults = {**adamw.defaults, **muon.defaults}
        self.state = {}  # the members keep their own (sharded) state
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise AttributeError("DistributedChain.param_groups is the members' groups")

    @torch.no_grad()
    def step(self, closure=None):
        """One chained step (a collective; class docstring).

        Returns:
            ``True`` when applied (``DistributedOptimizer.step``'s return: ``False`` never happens without a
            loss scaler).

        Raises:
            ValueError, TypeError: invalid input on any rank, or a non-finite Muon gradient: every rank
                raises, nothing written by either member.
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        sumsq, finite = self.muon._reduce()
        if not finite:
            self.muon._mean_grads = None
            raise ValueError("DistributedChain.step: a Muon parameter's mean gradient holds inf or NaN (on every "
                             "rank); nothing was changed")
        saved = self.adamw.max_grad_norm
        self.adamw.max_grad_norm = self.max_grad_norm
        try:
            applied = self.adamw.step(extra_grad_sumsq=sumsq)
        except BaseException:
            self.muon._mean_grads = None
            raise
        finally:
            self.adamw.max_grad_norm = saved
        self.last_grad_norm = self.adamw.last_grad_norm
        if not applied:
            self.muon._mean_grads = None
            return False
        self.muon.last_grad_norm = self.last_grad_norm
        self.muon._apply(_clip_coefficient(float(self.last_grad_norm), self.max_grad_norm))
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise NotImplementedError("DistributedChain: checkpoint each member (consolidate_state_dict, state_dict)")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("DistributedChain: load each member's state dict")
