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
the assignment functions and re-exports :class:`DistributedMuon` and :func:`zero1_comm_bytes` (the chain,
which steps a :class:`LayerWiseMuon`, imports this module, not the other way round).

Communication volume convention (:attr:`LayerWiseMuon.comm_bytes`, :attr:`DistributedMuon.comm_bytes`,
:func:`zero1_comm_bytes`): a collective counts the bytes of the full buffer it reduces or gathers
(``numel * element_size``); an all-reduce counts twice that (it is a reduce-scatter followed by an
all-gather). A ring implementation sends ``(d - 1) / d`` of the counted bytes from each rank, the same factor
for every collective, so ratios are unchanged.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from ..clipping import _reduce_device, clip_coefficient, grad_sumsq, scale_grads_
from ..contract import VersionTracker, register_owner
from ..optim import Muon
from ..optim.functional import muon
from ..masters import MASTER_KEY, take_up_
from . import _comm
from ._muon_common import (
    ConsolidatingMuon,
    broadcast_from_first,
    check_max_grad_norm,
    check_muon_state_dict,
    hyper,
    load_plain,
    nbytes,
    plain_state_dict,
    replicated,
    shard_parts,
)
from .assignment import lpt_assign, ns_cost, owned_pack, owner_step_comm, rank_loads, round_robin_assign
from .distributed_muon import DistributedMuon, zero1_comm_bytes

__all__ = ["DistributedMuon", "LayerWiseMuon", "lpt_assign", "ns_cost", "rank_loads",
           "round_robin_assign", "zero1_comm_bytes"]


# --- layer-wise: whole matrices per rank --------------------------------------------------------------------
class LayerWiseMuon(ConsolidatingMuon, Muon):
    """Muon with whole-matrix ownership across the ranks of a process group (module docstring).

    Build it on every rank with the same parameters (each rank a replica of the model), run the backward
    pass on each rank's micro-batch, call :meth:`step` on every rank (it averages the gradients itself; do
    not also wrap the model in ``DistributedDataParallel``), then ``zero_grad``.

    Args:
        params: 2-D real floating tensors ``(fan_out, fan_in)`` or param-group dicts, as
            :class:`optbook.optim.Muon`: bfloat16, float32 or float64 (float16 is refused: its small
            gradients flush to zero without a loss scaler, which this class does not take); the same
            shapes, dtypes and order on every rank (checked: a collective at construction). All on one
            device (CPU for gloo, the rank's GPU for NCCL). At construction every parameter is broadcast
            from the group's rank 0.
        process_group: the data-parallel group (``None``: ``torch.distributed.group.WORLD``).
        assignment: ``"lpt"`` (:func:`lpt_assign` on :func:`ns_cost`, the default) or ``"round_robin"``.
        max_grad_norm: if set (``> 0``), clip the averaged gradients of these parameters by their global
            L2 norm before the momentum (in a :class:`~optbook.distributed.DistributedChain`, leave it
            ``None``: the chain clips).
        **muon_defaults: ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``,
            ``coefficients``, ``scale_mode``, ``extra_scale_factor``, ``eps``, ``ns_dtype``, ``head_split``
            (as :class:`optbook.optim.Muon`).

    Attributes:
        owners: the owner rank of each parameter, in param-group order; ``costs``: their :func:`ns_cost`;
            ``loads``: the total cost per rank.
        state: momentum buffers of the parameters this rank owns only (``1/d`` of Muon's state); float32
            for a bfloat16 parameter. Its truth value is whether any rank holds state (the same on every
            rank, so that ``torch.distributed.checkpoint`` primes on every rank or none).
        master_params: ``{index: float32 master}`` of the bfloat16 matrices this rank owns (``1/d`` of the
            masters; empty for float32/float64 parameters, which are their own masters).
        comm_bytes: ``{"all_reduce": ..., "all_gather": ..., "control": ...}`` bytes counted since
            construction (module docstring's convention); :meth:`predicted_comm_bytes` per step.
        last_grad_norm: the L2 norm of the averaged gradients at the last step, before clipping (float;
            ``None`` before the first step).
        found_inf: always ``False``: a non-finite mean gradient raises, it is never skipped (``found_inf``
            reports a skipped step, as in every wrapper; :mod:`optbook.contract`).
        skipped_steps: steps skipped for non-finite gradients: always 0, as there is no loss scaler to skip
            with (kept in the state dict, as every optbook wrapper's).
        report: the last step's :class:`optbook.wrapper.StepReport` (``found_inf``, ``grad_norm``,
            ``skipped_steps``).

    It is an :class:`optbook.wrapper.OptimizerWrapper` (through ``MuonWrapper`` of
    ``optbook.distributed._muon_common``): :meth:`step` is the base's template over the phases below; the
    base gives ``train()``/``eval()`` (no-ops: Muon has no modes), the step and state-dict hooks,
    ``zero_grad(set_to_none=...)``, pickling (hooks dropped) and ``repr``; ``add_param_group`` after
    construction raises ``NotImplementedError`` (the owners are fixed).

    The step (a collective), in public phases (Megatron-LM's names, also ``optbook.wrapper``'s) that
    :class:`~optbook.distributed.DistributedChain` composes (after Megatron-LM's ``prepare_grads`` /
    ``clip_grad_norm`` / ``step_with_ready_grads``, ``megatron/core/optimizer/optimizer.py`` at core_v0.16.0)::

        prepare_grads():
          all_reduce([failing rank code, has_grad...], MAX)    every rank raises together on bad input
          g = all_reduce(flat local gradients, SUM) / d         per reduce dtype (float32 for bfloat16)
          inf/NaN in g: every rank raises, naming the parameter
        clip_grads():
          g <- c g  (c: the clip coefficient of ||g||)          replicated: no further communication
        step_with_ready_grads():
          owner of W:  M, W32 <- Muon(W32, M, g_W)             optbook.optim.functional.muon on the owned masters
          W <- W32 rounded (bfloat16 only)
        publish_weights():
          all_gather(owned matrices' bytes, every dtype)       one uint8 chunk per rank: every W

    So a step issues at most **4** collective calls whatever the number of matrices and the mix of
    bfloat16/float32/float64 (one status all-reduce, one or two gradient all-reduces, one all-gather;
    3 with one reduce dtype), as Megatron-LM's layer-sharded Muon (NVIDIA/Megatron-LM issue #6676: 76/276
    NCCL calls per step down to 4); :meth:`step_comm` gives the calls and the bytes each rank receives
    (:func:`~optbook.distributed.assignment.owner_step_comm`), which
    :class:`~optbook.distributed.wire.CommCounter` counts at the dispatcher.

    The owners' arithmetic is the single-process Muon's, on the same mean gradient: with an exact mean
    (float64, dyadic gradients) the result equals ``optbook.optim.Muon`` to rounding of the batched
    Newton–Schulz products (bit for bit in the tests here). For bfloat16 parameters it is
    :class:`optbook.precision.MixedPrecisionOptimizer` around ``Muon``: the owner steps a float32 master
    and the model gets it rounded once per step (bit for bit in ``tests/test_distributed_ownership.py``).

    Who owns the weights (:mod:`optbook.contract`): for bfloat16 parameters this optimizer keeps the
    float32 masters and registers as their owner: an in-place write to a parameter made identically on every
    rank (a weights-only ``model.load_state_dict``) is taken up into the owner's master at the next step
    (:func:`optbook.masters.take_up_`), and :func:`optbook.contract.scale_weights_` (what
    :func:`optbook.qk_clip_` calls; every rank calls it) scales the master and rewrites the parameter.
    float32/float64 parameters are stepped in place: outside writes to them need no care.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError, TypeError: what :class:`optbook.optim.Muon` raises; a float16 parameter (named);
            parameters that differ between ranks or sit on several devices; a bad ``assignment`` or
            ``max_grad_norm``. Before anything is written. :meth:`step` raises on **every** rank when one
            rank's input is invalid (hyperparameter, gradient shape/dtype), with nothing written on any rank.
        optbook.contract.NonFiniteGradientError: :meth:`step`, when a mean gradient holds ``inf`` or ``NaN``
            (on every rank, naming the parameter, nothing written; the step contract of
            :mod:`optbook.contract`).
    """

    def __init__(self, params, process_group=None, *, assignment: str = "lpt", max_grad_norm=None,
                 **muon_defaults):
        group, rank, world_size = _comm.group_info(process_group)
        if assignment not in ("lpt", "round_robin"):
            raise ValueError(f"Invalid assignment: expected 'lpt' or 'round_robin', got {assignment!r}")
        max_grad_norm = check_max_grad_norm(max_grad_norm)
        Muon.__init__(self, params, **muon_defaults)  # validates parameters and hyperparameters
        all_params, device = replicated(
            self, group, world_size, "LayerWiseMuon", (torch.float16,),
            "its small gradients flush to zero without a loss scaler, which LayerWiseMuon does not take; use "
            "bfloat16 (float32 masters are kept) or float32 parameters")
        self.process_group, self.rank, self.world_size = group, rank, world_size
        self.max_grad_norm = max_grad_norm
        self.assignment = assignment
        self._params = all_params
        # no parameter: the CPU, or the current GPU for NCCL (its status all-reduce takes no CPU tensor)
        self.device = device if device is not None else _reduce_device([], group)
        self.costs = [ns_cost(p.shape, g["head_split"]) for g in self.param_groups for p in g["params"]]
        self.owners = (lpt_assign(self.costs, world_size) if assignment == "lpt"
                       else round_robin_assign(len(self.costs), world_size))
        self.loads = rank_loads(self.costs, self.owners, world_size)
        self._pack = owned_pack([p.numel() for p in all_params], [p.dtype for p in all_params], self.owners,
                                world_size)
        self.comm_bytes = {"all_reduce": 0, "all_gather": 0, "control": 0}
        self.last_grad_norm: float | None = None
        self.found_inf, self.skipped_steps = False, 0
        self._consolidated = None
        self._mean_grads: list | None = None
        broadcast_from_first(all_params, group)
        self.master_params: dict[int, torch.Tensor] = {
            i: p.detach().to(torch.float32, copy=True) for i, p in enumerate(all_params)
            if p.dtype in _comm.LOW_PRECISION and self.owners[i] == rank}
        self._versions = VersionTracker()
        self._versions.record(self.owned_params())
        register_owner(self.owned_params(), self)

    def owned_params(self) -> list[torch.Tensor]:
        """The bfloat16 parameters (this optimizer keeps their float32 masters)."""
        return [p for p in self._params if p.dtype in _comm.LOW_PRECISION]

    def _repr_options(self) -> str:
        return (f"rank {self.rank} of {self.world_size}, assignment={self.assignment!r}, "
                f"max_grad_norm={self.max_grad_norm}")

    def _expected_state(self, p: torch.Tensor, group: dict) -> dict:
        """The momentum of a bfloat16 parameter is float32 (it updates the float32 master)."""
        dtype = torch.float32 if p.dtype in _comm.LOW_PRECISION else p.dtype
        return {"momentum_buffer": (tuple(p.shape), dtype, False)}

    def predicted_comm_bytes(self, has_grad=None) -> dict:
        """Bytes one :meth:`step` communicates (module docstring's convention): the all-reduce of every
        gradient (counted twice; a parameter without a gradient on every rank is left out), the one
        all-gather of ``d`` byte-packed chunks (:func:`~optbook.distributed.assignment.owned_pack`) and the
        status all-reduce of ``1 + n_params`` float64 values: ``{"all_reduce", "all_gather", "control"}``.

        Args:
            has_grad: one bool per parameter (param-group order), whether some rank has its gradient
                (``None``: all)."""
        return self.step_comm(has_grad)["buffers"]

    def step_comm(self, has_grad=None) -> dict:
        """One :meth:`step`'s collectives and the bytes this rank receives in them, as a formula
        (:func:`~optbook.distributed.assignment.owner_step_comm` of this optimizer's parameters and owners):
        ``{"calls": [(collective, dtype)] in order (at most 4), "received": {collective: bytes}, "buffers":
        :meth:`predicted_comm_bytes`}``; :class:`optbook.distributed.wire.CommCounter` around the step counts
        the same calls and bytes.

        Args:
            has_grad: as :meth:`predicted_comm_bytes`."""
        return owner_step_comm([p.numel() for p in self._params], [p.dtype for p in self._params], self.owners,
                               self.world_size, has_grad)

    @staticmethod
    def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    # --- the step in public phases (optbook.wrapper's names; DistributedChain composes them) ------------
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Phase 1 of :meth:`step` (a collective): validate on every rank and agree, average the gradients
        (one all-reduce per reduce dtype), check them for ``inf``/``NaN``. Writes nothing but this optimizer's
        buffer of mean gradients, which the next phases read (or :meth:`discard_grads` drops).

        Returns:
            ``False`` (found_inf: without a loss scaler a non-finite mean gradient raises, it is never
            skipped).

        Raises:
            ValueError, TypeError: an invalid input on any rank: on every rank, nothing kept.
            optbook.contract.NonFiniteGradientError: a mean gradient holds ``inf``/``NaN``: on every rank,
                naming the first such parameter, nothing kept.
        """
        self._consolidated = None
        self._mean_grads = None
        has_grad = _comm.validate_on_every_rank(self, type(self).__name__)
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
        bad = _comm.first_nonfinite(mean)   # the same on every rank: the mean is replicated
        if bad is not None:
            _comm.raise_nonfinite_across(type(self).__name__, bad, self.param_groups, self.process_group, self.device)
        self._mean_grads = mean
        return False

    def _prepared(self) -> list:
        if self._mean_grads is None:
            raise RuntimeError(f"{type(self).__name__}: call prepare_grads() first (nothing written)")
        return self._mean_grads

    def grad_sumsq(self) -> float:
        """The float64 sum of squares of the prepared mean gradients (the same on every rank; no
        communication: the mean is replicated)."""
        return float(grad_sumsq([g for g in self._prepared() if g is not None]))

    def scale_grads(self, coefficient: float) -> None:
        """Multiply the prepared mean gradients by ``coefficient`` (a chain's clip; :func:`optbook.clipping.scale_grads_`)."""
        scale_grads_([g for g in self._prepared() if g is not None], coefficient)

    def clip_grads(self) -> float:
        """Phase 2: the L2 norm of the prepared mean gradients (kept in :attr:`last_grad_norm`, returned),
        and the clip by ``max_grad_norm`` when set."""
        norm = math.sqrt(self.grad_sumsq())
        self.last_grad_norm = norm
        self.scale_grads(clip_coefficient(norm, self.max_grad_norm))
        return norm

    def discard_grads(self) -> None:
        """Drop the mean gradients of :meth:`prepare_grads` (a chain whose other member failed)."""
        self._mean_grads = None

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Phase 3 (local): step the owned matrices on the prepared mean gradients (the float32 masters of
        bfloat16 ones, which are then rounded into the parameters); :meth:`publish_weights` follows.

        Raises:
            RuntimeError: :meth:`prepare_grads` was not called since the last step (nothing written).
        """
        mean = self._prepared()
        self._mean_grads = None
        self.take_up_outside_writes()
        self._has_state = self._has_state or any(g is not None for g in mean)   # alike on every rank
        i = 0
        for group in self.param_groups:
            group = self._read_floats(group)
            params, grads, bufs, written = [], [], [], []
            for p in group["params"]:
                if self.owners[i] == self.rank and mean[i] is not None:
                    target = self.master_params.get(i, p)   # a bfloat16 matrix: its float32 master
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(target,
                                                                            memory_format=torch.preserve_format)
                    params.append(target)
                    grads.append(mean[i].to(target.dtype))
                    bufs.append(self.state[p]["momentum_buffer"])
                    if target is not p:
                        written.append((p, target))
                i += 1
            muon(params, grads, bufs, **hyper(group))
            for p, master in written:
                p.copy_(master)   # one rounding to the model's dtype

    @torch.no_grad()
    def publish_weights(self) -> None:
        """Phase 4 (a collective): every rank packs the bytes of its owned matrices, every dtype together, into
        one ``uint8`` chunk (:func:`~optbook.distributed.assignment.owned_pack`); **one** all-gather; every
        rank copies the others' matrices out of the received bytes (a copy of bits: bitwise)."""
        chunk, plan = self._pack
        if chunk:
            send = torch.zeros(chunk, dtype=torch.uint8, device=self.device)
            for i, offset in plan[self.rank]:
                p = self._params[i]
                send[offset:offset + p.numel() * p.element_size()].view(p.dtype).copy_(p.detach().reshape(-1))
            recv = torch.empty(self.world_size * chunk, dtype=torch.uint8, device=self.device)
            _comm.all_gather(recv, send, group=self.process_group)
            self.comm_bytes["all_gather"] += recv.numel()
            for r, items in enumerate(plan):
                for i, offset in items if r != self.rank else ():
                    p, start = self._params[i], r * chunk + offset
                    p.data.copy_(recv[start:start + p.numel() * p.element_size()].view(p.dtype).view(p.shape))
        self._versions.record(self._params)

    def take_up_outside_writes(self) -> None:
        """Copy into the owner's float32 master every bfloat16 parameter written since this optimizer's last
        write (the step contract's outside writes; host integers only)."""
        for i in self._versions.changed(self._params):
            if i in self.master_params:
                take_up_(self.master_params[i], self._params[i])
        self._versions.record(self._params)

    @torch.no_grad()
    def _scale_weights_(self, param: torch.Tensor, factor) -> None:
        """``master *= factor`` in float32 on the owner and ``param <- master`` rounded, then the owner
        broadcasts ``param`` (a collective: every rank calls it with the same ``param`` and ``factor``,
        :func:`optbook.contract.scale_weights_`).

        Raises:
            ValueError: ``param`` is not one of this optimizer's bfloat16 parameters; nothing written.
        """
        i = next((k for k, p in enumerate(self._params) if p is param), None)
        if i is None or param.dtype not in _comm.LOW_PRECISION:
            raise ValueError("Invalid param: not a bfloat16 parameter of this LayerWiseMuon")
        self.take_up_outside_writes()
        if i in self.master_params:
            master = self.master_params[i]
            master.mul_(factor.to(master.device) if isinstance(factor, torch.Tensor) else factor)
            param.copy_(master)
        dist.broadcast(param.data, src=_comm.global_rank(self.process_group, self.owners[i]),
                       group=self.process_group)
        self._versions.record([param])

    # --- checkpoints ------------------------------------------------------------------------------------
    def _low_indices(self) -> list[int]:
        """The indices (param-group order) of the bfloat16 parameters (those with a float32 master)."""
        return [i for i, p in enumerate(self._params) if p.dtype in _comm.LOW_PRECISION]

    def _local_checkpoint(self) -> tuple[dict, dict]:
        """``({index: state}, {index: master})`` of the matrices this rank owns, on the CPU."""
        state = {i: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                     for k, v in self.state[p].items()}
                 for i, p in enumerate(self._params) if self.owners[i] == self.rank and p in self.state}
        return state, {i: m.detach().cpu().clone() for i, m in self.master_params.items()}

    def _plain(self, state: dict, masters: dict, param_groups: list, skipped: int) -> dict:
        """The plain layout, each float32 master in its parameter's state under ``"master_param"``."""
        entries = {i: dict(state.get(i, {})) for i in sorted(set(state) | set(masters))}
        for i, m in masters.items():
            entries[i][MASTER_KEY] = m
        return {"state": entries, "param_groups": param_groups, "skipped_steps": skipped}

    def _assemble(self, gathered: list) -> dict:
        state, masters = {}, {}
        for part_state, part_masters in gathered:
            state.update(part_state)
            masters.update(part_masters)
        return self._plain(state, masters, plain_state_dict(self)["param_groups"], self.skipped_steps)

    def state_dict(self) -> dict:
        """The consolidated state (``ConsolidatingMuon`` of ``optbook.distributed._muon_common``): on the rank
        :meth:`consolidate_state_dict` sent it to, or, when nothing was consolidated since the last step or
        load, on **every** rank (a collective: every rank calls it, as ``torch.distributed.checkpoint``'s
        ``get_``/``set_optimizer_state_dict`` do).

        Returns:
            The plain ``optbook.optim.Muon`` layout -- ``{"state": {index: {"momentum_buffer": tensor}},
            "param_groups": [...]}``, parameters numbered in param-group order, tensors on the CPU -- plus
            ``"skipped_steps"`` (which ``torch.optim`` ignores); the float32 master of each bfloat16 parameter
            is in its state under ``"master_param"`` (:data:`optbook.masters.MASTER_KEY`, the layout of
            :class:`optbook.precision.MixedPrecisionOptimizer`, which DCP keeps; the momentum of a bfloat16
            parameter is float32). It loads into a single-process :class:`optbook.optim.Muon` over the same
            float32/float64 parameters, into ``MixedPrecisionOptimizer(Muon(...))`` over bfloat16 ones, and
            into a LayerWiseMuon at any world size.

        Raises:
            RuntimeError: consolidated on another rank since the last step (call it on that rank).
        """
        return super().state_dict()

    def _checked(self, state_dict) -> tuple[dict, int, dict]:
        """Everything :meth:`load_state_dict` checks, writing nothing: ``(the plain Muon dict without the
        masters and with the momentum of each bfloat16 parameter as float32, skipped_steps, {index: float32
        master})``. Parameters are matched by position in the groups (the keys may be any: DCP writes names)."""
        masters: dict[int, torch.Tensor] = {}
        low = self._low_indices()
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict) and isinstance(
                state_dict.get("param_groups"), (list, tuple)):
            ids = [i for g in state_dict["param_groups"] if isinstance(g, dict)
                   for i in (g.get("params") or [])]
            index_of = {saved: k for k, saved in enumerate(ids)}
            entries = {}
            for saved, entry in state_dict["state"].items():
                i = index_of.get(saved)
                if isinstance(entry, dict) and MASTER_KEY in entry:
                    if i is None or i not in low:
                        raise ValueError(f"Invalid state_dict: state[{saved!r}] holds a {MASTER_KEY!r} for a "
                                         "parameter that is not bfloat16 (it is its own master)")
                    masters[i] = entry[MASTER_KEY]
                    entry = {k: v for k, v in entry.items() if k != MASTER_KEY}
                    if not entry:   # a master saved before the first step: no momentum yet
                        continue
                if i in low and isinstance(entry, dict):   # a bfloat16 momentum (a single-process Muon's)
                    entry = {k: v.to(torch.float32) if k == "momentum_buffer" and isinstance(v, torch.Tensor)
                             and v.dtype in _comm.LOW_PRECISION else v for k, v in entry.items()}
                entries[saved] = entry
            old = state_dict.get("master_params")   # the older layout: a list in the order of low
            if old is not None:
                if not isinstance(old, (list, tuple)) or len(old) != len(low):
                    raise ValueError(f"Invalid state_dict: 'master_params' must be a list of {len(low)} float32 "
                                     "tensors (one per bfloat16 parameter, in param-group order)")
                masters.update({i: m for i, m in zip(low, old) if m is not None})
            state_dict = {**{k: v for k, v in state_dict.items() if k != "master_params"}, "state": entries}
        skipped = check_muon_state_dict(state_dict, self)
        for i, m in masters.items():
            if (not isinstance(m, torch.Tensor) or m.dtype != torch.float32
                    or tuple(m.shape) != tuple(self._params[i].shape)):
                what = f"shape {tuple(m.shape)}, {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
                raise ValueError(f"Invalid state_dict: the master of {_comm.param_name(self.param_groups, i)} "
                                 f"has {what}; expected a float32 tensor of the parameter's shape")
            if not bool(torch.isfinite(m).all()):
                raise ValueError(f"Invalid state_dict: the master of {_comm.param_name(self.param_groups, i)} "
                                 "holds inf or NaN; nothing was loaded")
        return state_dict, skipped, masters

    def check_state_dict(self, state_dict) -> None:
        """Check a dict for :meth:`load_state_dict` without writing anything (as :meth:`load_state_dict`).

        Raises:
            TypeError, ValueError: the first problem found.
        """
        self._checked(state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        """``load_state_dict(state_dict)`` (the base runs the hooks and :meth:`check_state_dict` first): a plain
        Muon state dict (from :meth:`state_dict` at any world size, from :meth:`optbook.optim.Muon.state_dict`
        or from ``MixedPrecisionOptimizer(Muon(...)).state_dict()``; parameters matched by position); each
        rank keeps the momentum (and the float32 masters) of the matrices it owns. Not a collective: call it
        on every rank with the same dict. A bfloat16 parameter without ``"master_param"`` in its state (a
        single-process Muon's dict) takes its master from the parameter as it is now, and a bfloat16 momentum
        is widened to float32. A dict of the older layout (masters in a top-level ``"master_params"`` list)
        loads the same.

        Raises:
            TypeError, ValueError: the whole dict is validated first (``check_muon_state_dict`` of
                :mod:`optbook.distributed._muon_common`: group and parameter counts, hyperparameters, state
                keys, momentum shapes -- a checkpoint of another model or optimizer is refused -- and the
                masters' shapes, dtype and values); nothing is loaded then.
        """
        state_dict, skipped, masters = self._checked(state_dict)
        load_plain(self, {"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        for i, p in enumerate(self._params):
            if self.owners[i] != self.rank:
                self.state.pop(p, None)
        with torch.no_grad():
            for i in self._low_indices():
                if i in self.master_params:
                    self.master_params[i].copy_(masters.get(i, self._params[i]).detach().to(torch.float32))
        self._versions.record(self._params)
        self.skipped_steps = skipped
        self._consolidated = None
        self._has_state = bool(state_dict["state"])   # the same dict on every rank

    # --- sharded checkpoints: one file per rank --------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's part of the state, for one checkpoint file per rank. Not a collective.

        Returns:
            ``{"format": SHARDED_FORMAT, "rank", "world_size", "owners", "params": [(shape, dtype name)] in
            param-group order, "state": {index: {"momentum_buffer": CPU tensor}} for the matrices this rank
            owns, "master_params": {index: float32 CPU master} of the bfloat16 ones it owns, "param_groups":
            as :meth:`state_dict`, "skipped_steps", "layout": :meth:`checkpoint_layout`}``.
        """
        state, masters = self._local_checkpoint()
        return {"format": SHARDED_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "layout": self.checkpoint_layout(),
                "owners": list(self.owners), "params": [(tuple(p.shape), str(p.dtype)) for p in self._params],
                "state": state, "master_params": masters, "param_groups": plain_state_dict(self)["param_groups"],
                "skipped_steps": self.skipped_steps}

    def _plain_from_shards(self, shards) -> dict:
        """The plain Muon dict that :meth:`load_sharded_state_dict` loads, after every check that does not
        need it loaded (format, ranks, owners, parameter shapes and dtypes). Writes nothing."""
        parts = shard_parts(shards, self, SHARDED_FORMAT, "owners", list(self.owners))
        state, masters = {}, {}
        for sd in parts:
            state.update(sd["state"])
            masters.update(sd.get("master_params", {}))
        plain = self._plain(state, masters, parts[0]["param_groups"], parts[0]["skipped_steps"])
        return plain

    def check_sharded_state_dict(self, shards) -> None:
        """Everything :meth:`load_sharded_state_dict` checks, writing nothing (a chain checks each member
        before it loads any).

        Raises:
            TypeError, ValueError: as :meth:`load_sharded_state_dict`.
        """
        self._checked(self._plain_from_shards(shards))

    def load_sharded_state_dict(self, shards) -> None:
        """Load :meth:`sharded_state_dict` files. Not a collective.

        Args:
            shards: **this rank's own** dict (saved by the same rank with the same layout,
                :meth:`checkpoint_layout`), or the list of **every** rank's dicts of one save at any world
                size and assignment (resharding).

        Raises:
            TypeError, ValueError: not dicts of this format; a file of another class, rank, world size or
                assignment (the message names both layouts and says to pass the list); files of two saves;
                files saved for other parameter shapes or dtypes (naming the first); a file holding matrices
                its rank does not own; what :meth:`load_state_dict` raises. All before anything is loaded.
        """
        self.load_state_dict(self._plain_from_shards(shards))


#: The ``"format"`` entry of :meth:`LayerWiseMuon.sharded_state_dict`.
SHARDED_FORMAT = "optbook.LayerWiseMuon.sharded/1"
