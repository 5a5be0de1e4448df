"""Moonlight's distributed Muon: ZeRO-1 element shards, each matrix gathered whole. Chapter 14.

Liu et al. 2025, "Muon is Scalable for LLM Training" (arXiv:2502.16982, section 2.3 and Algorithm 1): the
ZeRO-1 layout of :func:`optbook.distributed.shard_layout`; gradients reduce-scattered; the momentum kept for
the local element shard only; each step the momentum-updated shards are all-gathered (in bfloat16 by
default) into full matrices, each matrix is orthogonalised, and each rank keeps the part of the update that
falls in its shard; parameters all-gathered as in ZeRO-1. It communicates one gather more than ZeRO-1 AdamW:
:attr:`DistributedMuon.comm_bytes` counts it, :func:`zero1_comm_bytes` gives the formula (the byte-counting
convention is :mod:`optbook.distributed.layerwise_muon`'s), and :func:`received_bytes` gives what each rank
receives (what :class:`optbook.distributed.wire.CommCounter` counts at the dispatcher).

Two gathers (``gather=``): ``"touched"`` is the paper's (section 2.3, "DP Gather": the rank gathers the full
matrices of its own partition): each rank receives, with one ``all_to_all_single`` per bucket, only the
elements of the matrices that have a piece in its shard, so a rank receives little more than the matrices cut
by its shard's two ends; ``"all"`` all-gathers every bucket, so every rank receives every matrix -- the upper
end of the paper's 1 to 1.25 times ZeRO-1 AdamW's bytes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..clipping import clip_coefficient, grad_sumsq, scale_grads_
from ..contract import VersionTracker, register_owner
from ..optim import Muon
from ..optim._functional import momentum_directions
from ..optim.optimizer import all_finite
from . import _muon_common as common
from ._comm import LOW_PRECISION, all_gather, first_nonfinite, group_info, raise_nonfinite_across, reduce_scatter
from ._comm import validate_on_every_rank
from .wire import all_reduce_received
from .zero1 import shard_layout

__all__ = ["DistributedMuon", "GATHERS", "received_bytes", "touched_ranges", "zero1_comm_bytes"]

#: The ``gather=`` modes of :class:`DistributedMuon`.
GATHERS = ("all", "touched")


class DistributedMuon(common.ConsolidatingMuon, Muon):
    """Moonlight's distributed Muon (Liu et al. 2025, Algorithm 1): ZeRO-1 element shards, each matrix
    gathered whole for Newton–Schulz (module docstring).

    Args:
        params: 2-D float32 or float64 tensors (or param-group dicts), as :class:`optbook.optim.Muon`; the
            same on every rank (broadcast from the group's rank 0 at construction). float16/bfloat16
            parameters are refused (their float32 masters are not implemented here; keep float32 weights).
        process_group: the data-parallel group (``None``: WORLD).
        gather_dtype: dtype of the momentum gather (``torch.bfloat16`` as Moonlight; ``torch.float64`` or the
            parameters' dtype for an exact comparison with single-process Muon).
        gather: ``"all"`` (default): every bucket all-gathered, every rank receives every matrix;
            ``"touched"``: the paper's gather, each rank receives only the matrices with a piece in its shard
            (one ``all_to_all_single`` per bucket; :func:`touched_ranges`). The same update bit for bit.
        max_grad_norm: clip the mean gradient by its global norm before the momentum (``None``: no clip).
        bucket_size, param_alignment, bucket_alignment: the ZeRO-1 layout, :func:`optbook.distributed.shard_layout`.
        **muon_defaults: as :class:`optbook.optim.Muon`.

    One step, per bucket of the layout (a collective; ``2 + 3 B`` calls for ``B`` non-empty buckets, whatever
    the number of matrices: :meth:`step_comm`)::

        all_reduce([failing rank + 1, has_grad...], MAX)       every rank raises together on bad input
        g_r = reduce_scatter(flat gradients, SUM) / d            this rank's element shard of the mean
        all_reduce([sum of squares of g_r, non-finite], SUM)     one global norm; every rank skips together
        M_r <- lerp(M_r, c g_r, 1 - mu); D_r (Nesterov)          momentum on the shard only (c: the clip)
        D = gather(D_r in gather_dtype)                          the full matrices with a piece here
                                                                  ("all": every matrix, an all-gather)
        O = scale * NS(D) per matrix with a piece on this rank   optbook.optim.functional.muon's arithmetic
        W_r <- W_r (1 - lr wd) - lr O_r                          keep the local part of the update
        W = all_gather(W_r)                                      as ZeRO-1

    A teaching implementation: the flat parameter and gradient buffers are copies (the parameters are not
    views of them, as in ``DistributedOptimizer``), and every rank orthogonalises each matrix it holds a piece
    of (a matrix cut by a shard boundary is orthogonalised on every rank that holds a piece of it).

    Attributes:
        layout: the :class:`optbook.distributed.zero1.Layout`; ``pieces``: this rank's pieces.
        state: ``state[p]["momentum_shard"]``, the 1-D momentum of this rank's piece of ``p`` (only for the
            parameters with a piece here) -- ``1/d`` of Muon's state; ``momentum_shard`` the same by index.
        comm_bytes: ``{"reduce_scatter", "gather", "all_gather", "control"}`` bytes since construction, the
            buffers this optimizer hands to its collectives (``"gather"`` with ``"touched"``: the touched
            interval of :func:`touched_ranges`); :func:`zero1_comm_bytes` ``(layout, gather_dtype, gather=,
            rank=)`` predicts one step's. What the rank receives: :func:`received_bytes`, counted by
            :class:`optbook.distributed.wire.CommCounter`.
        last_grad_norm: the global norm of the mean gradient at the last step, before clipping (float;
            ``None`` before the first step).
        found_inf: always ``False``: a non-finite mean gradient raises, it is never skipped (``found_inf``
            reports a skipped step, as in every wrapper; :mod:`optbook.contract`).
        skipped_steps: always 0 (no loss scaler to skip with); kept in the state dict.
        report: the last step's :class:`optbook.wrapper.StepReport` (``found_inf``, ``grad_norm``,
            ``skipped_steps``).

    It is an :class:`optbook.wrapper.OptimizerWrapper` (``MuonWrapper`` of ``optbook.distributed._muon_common``):
    :meth:`step` is the base's template over the phases ``prepare_grads`` (outside writes taken up, validate
    and agree, reduce-scatter, the norm and the non-finite flag), ``clip_grads``, ``step_with_ready_grads``
    (momentum, gather, Newton–Schulz, the local update) and ``publish_weights`` (the all-gather); the base gives
    ``train()``/``eval()`` (no-ops: Muon has no modes), hooks, ``zero_grad(set_to_none=...)``, pickling and
    ``repr``; ``add_param_group`` after construction raises ``NotImplementedError`` (the layout is fixed).

    Who owns the weights (:mod:`optbook.contract`): the flat parameter buffer is this optimizer's copy of the
    weights, and this rank's shard of it is the truth its next step starts from, so the optimizer registers
    as the owner of its parameters. At the start of :meth:`step` a parameter written from outside (a
    weights-only ``model.load_state_dict``, an in-place edit under ``torch.no_grad()``) is copied into the
    buffer first; :func:`optbook.contract.scale_weights_` (what :func:`optbook.qk_clip_` calls) scales the
    buffer and rewrites the parameter from it (:meth:`_scale_weights_`). A write through ``p.data`` does not
    move ``p._version`` and is not seen.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError, TypeError: what :class:`optbook.optim.Muon` raises; float16/bfloat16 parameters; bad
            ``gather_dtype``, ``gather`` or ``max_grad_norm``; parameters that differ between ranks (naming the first and
            the ranks). :meth:`step`: an invalid input on any rank raises on every rank, nothing written.
        optbook.contract.NonFiniteGradientError: :meth:`step`, when a mean gradient holds ``inf`` or ``NaN``
            (on every rank, naming the parameter, nothing written).
    """

    def __init__(self, params, process_group=None, *, gather_dtype: torch.dtype = torch.bfloat16,
                 gather: str = "all", max_grad_norm=None, bucket_size: int | None = None, param_alignment: int = 64,
                 bucket_alignment: int = 128, **muon_defaults):
        group, rank, world_size = group_info(process_group)
        if gather_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise TypeError(f"Invalid gather_dtype: expected a floating dtype, got {gather_dtype!r}")
        if not isinstance(gather, str) or gather not in GATHERS:
            raise ValueError(f"Invalid gather: expected one of {GATHERS}, got {gather!r}")
        max_grad_norm = common.check_max_grad_norm(max_grad_norm)
        Muon.__init__(self, params, **muon_defaults)
        all_params, device = common.replicated(
            self, group, world_size, "DistributedMuon", LOW_PRECISION,
            "DistributedMuon steps float32 or float64 parameters and keeps no float32 masters (keep float32 "
            "weights and compute in low precision, or use LayerWiseMuon, which keeps float32 masters of bfloat16 "
            "matrices)")
        layout = shard_layout(all_params, world_size, bucket_size=bucket_size, param_alignment=param_alignment,
                              bucket_alignment=bucket_alignment)
        self.process_group, self.rank, self.world_size = group, rank, world_size
        self.gather_dtype, self.gather, self.max_grad_norm = gather_dtype, gather, max_grad_norm
        self._touched = [touched_ranges(layout, b, rank) for b in range(len(layout.buckets))]
        self.layout, self.pieces = layout, layout.pieces(rank)
        self._params = all_params
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self.device = device if device is not None else torch.device("cpu")
        self.comm_bytes = {"reduce_scatter": 0, "gather": 0, "all_gather": 0, "control": 0}
        self.last_grad_norm: float | None = None
        self.found_inf, self.skipped_steps = False, 0
        self._consolidated = None
        self._index = {id(p): i for i, p in enumerate(all_params)}
        self._versions = VersionTracker()
        self._ready: tuple | None = None   # (has_grad, shards, norm) from prepare_grads, for the next phases
        self.param_buffers = {d: torch.zeros(n, dtype=d, device=self.device) for d, n in layout.buffer_numel.items()}
        self.grad_buffers = {d: torch.zeros(n, dtype=d, device=self.device) for d, n in layout.buffer_numel.items()}
        common.broadcast_from_first(all_params, group)
        with torch.no_grad():
            self._params_to_buffers()
        self._versions.record(all_params)
        register_owner(all_params, self)

    _fixed_at_construction = "the layout is fixed"

    def owned_params(self) -> list[torch.Tensor]:
        """Every parameter (the flat buffer is this optimizer's copy of the weights)."""
        return list(self._params)

    def _repr_options(self) -> str:
        return (f"rank {self.rank} of {self.world_size}, gather={self.gather!r}, gather_dtype={self.gather_dtype}, "
                f"max_grad_norm={self.max_grad_norm}")

    @property
    def momentum_shard(self) -> dict[int, torch.Tensor]:
        """``{param index: this rank's 1-D momentum piece}`` (the same tensors as ``state[p]["momentum_shard"]``)."""
        return {i: self.state[p]["momentum_shard"] for i, p in enumerate(self._params)
                if p in self.state and "momentum_shard" in self.state[p]}

    def _params_to_buffers(self, indices=None) -> None:
        for i in range(len(self._params)) if indices is None else indices:
            r = self.layout.params[i]
            self.param_buffers[r.dtype][r.start:r.end].copy_(self._params[i].detach().reshape(-1))

    def take_up_outside_writes(self) -> None:
        """Copy every parameter written since this optimizer's last write into the flat buffer (the step
        contract's outside writes; host integers only, no device synchronisation)."""
        changed = self._versions.changed(self._params)
        if changed:
            self._params_to_buffers(changed)
            self._versions.record(self._params)

    @torch.no_grad()
    def _scale_weights_(self, param: torch.Tensor, factor) -> None:
        """Multiply ``param``'s weights by ``factor`` in the buffer the next step starts from and rewrite
        ``param`` from it (called by :func:`optbook.contract.scale_weights_`). Collective in the contract's
        sense: every rank must call it with the same factor (each rank scales its whole copy, so no message
        is sent). The product is ``param``'s dtype times ``factor`` as ``param.mul_(factor)``, bit for bit.

        Raises:
            ValueError: ``param`` is not one of this optimizer's parameters, or ``factor`` is a tensor that
                does not broadcast to ``param.shape`` (or sits on another device); nothing written.
        """
        i = self._index.get(id(param))
        if i is None or self._params[i] is not param:
            raise ValueError("Invalid param: not a parameter of this DistributedMuon")
        if isinstance(factor, torch.Tensor) and not _broadcasts_to(factor, param):
            raise ValueError(f"Invalid factor: shape {tuple(factor.shape)} on {factor.device} does not "
                                 f"broadcast to parameter {i}'s shape {tuple(param.shape)} on {param.device}")
        self.take_up_outside_writes()
        r = self.layout.params[i]
        weights = self.param_buffers[r.dtype][r.start:r.end].view(r.shape)
        weights.mul_(factor)
        param.copy_(weights)
        self._versions.record([param])

    def step_comm(self, has_grad=None) -> dict:
        """One :meth:`step`'s collectives, in order, and the bytes this rank receives in them, as a formula
        (:func:`received_bytes` plus the two float64 control all-reduces), what
        :class:`optbook.distributed.wire.CommCounter` counts around a step. With ``B`` non-empty buckets the
        step issues ``2 + 3 B`` calls: the status all-reduce, ``B`` reduce-scatters, the norm/non-finite
        all-reduce, ``B`` gathers (all-gathers, or all-to-alls with ``gather="touched"``: none on one rank)
        and ``B`` parameter all-gathers. ``B`` grows with the bytes (``bucket_size``) and the number of dtypes,
        not with the number of matrices (one bucket per dtype with ``bucket_size=None``).

        Args:
            has_grad: unused (the buckets travel whole); accepted as :meth:`LayerWiseMuon.step_comm`.

        Returns:
            ``{"calls": [(collective, dtype)], "received": {collective: bytes}}`` (an all-reduce's share
            may be a :class:`fractions.Fraction`).
        """
        buckets = [b for b in self.layout.buckets if b.numel]
        touched = self.gather == "touched"
        gathers = [] if touched and self.world_size == 1 else [
            ("all_to_all" if touched else "all_gather", self.gather_dtype)] * len(buckets)
        calls = ([("all_reduce", torch.float64)] + [("reduce_scatter", b.dtype) for b in buckets]
                 + [("all_reduce", torch.float64)] + gathers + [("all_gather", b.dtype) for b in buckets])
        wire = received_bytes(self.layout, self.rank, self.gather_dtype, gather=self.gather)
        received = {"all_reduce": all_reduce_received(8 * (1 + len(self._params)) + 16, self.world_size)}
        if buckets:
            received["reduce_scatter"] = wire["reduce_scatter"]
            received["all_gather"] = wire["all_gather"] + (0 if touched else wire["gather"])
            if gathers and touched:
                received["all_to_all"] = wire["gather"]
        return {"calls": calls, "received": received}

    def _shard(self, buffers: dict, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        lo, hi = bucket.shard(self.rank)
        return buffers[bucket.dtype][lo:hi]

    # --- the step in public phases (optbook.wrapper's template runs them) -------------------------------------
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Phase 1 (a collective): outside writes taken up, validate on every rank and agree, reduce-scatter the
        mean gradient into this rank's shards, one all-reduce of their sum of squares and non-finite flag.

        Returns:
            ``False`` (no loss scaler: a non-finite mean gradient raises, it is never skipped).

        Raises:
            ValueError, TypeError: an invalid hyperparameter or gradient on any rank: on every rank, before
                anything is written.
            optbook.contract.NonFiniteGradientError: a mean gradient holds ``inf`` or ``NaN``: on every rank,
                naming the parameter, before anything is written.
        """
        self._ready = None
        self.take_up_outside_writes()
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
                reduce_scatter(shard, self.grad_buffers[bucket.dtype][bucket.start:bucket.end],
                                group=self.process_group)
                self.comm_bytes["reduce_scatter"] += common.nbytes(bucket.numel, bucket.dtype)
                shard.div_(self.world_size)
                shards.append(shard)
        # 2. one global norm and one non-finite flag
        stats = torch.tensor([float(grad_sumsq(shards)), 0.0 if not shards or all_finite(shards) else 1.0],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(stats, group=self.process_group)
        self.comm_bytes["control"] += 16
        if stats[1] > 0:  # every rank is here: agree on the first parameter (one more all-reduce, MIN)
            bad = first_nonfinite([self.grad_buffers[self.layout.params[p.index].dtype][
                p.buffer_start:p.buffer_start + p.numel] for p in self.pieces])
            raise_nonfinite_across("DistributedMuon", None if bad is None else self.pieces[bad].index,
                                   self.param_groups, self.process_group, self.device)
        self._ready = (has_grad, shards, math.sqrt(float(stats[0])))
        return False

    def _prepared(self) -> tuple:
        if self._ready is None:
            raise RuntimeError("DistributedMuon: call prepare_grads() first (nothing written)")
        return self._ready

    @torch.no_grad()
    def clip_grads(self) -> float:
        """Phase 2 (local): the global norm of the mean gradient (from :meth:`prepare_grads`'s all-reduce; kept
        in :attr:`last_grad_norm` and returned), and the shards clipped by ``max_grad_norm`` when set."""
        _, shards, norm = self._prepared()
        self.last_grad_norm = norm
        scale_grads_(shards, clip_coefficient(norm, self.max_grad_norm))
        return norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Phase 3 (a collective): momentum on this rank's pieces, the gather of the full matrices, Newton–Schulz,
        this rank's part of the update into the flat parameter buffer; :meth:`publish_weights` follows."""
        has_grad = self._prepared()[0]
        self._ready = None
        self._has_state = self._has_state or any(has_grad)   # has_grad is agreed: alike on every rank
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
        # 4. gather the full matrices (all of them, or those with a piece here)
        for b, bucket in enumerate(self.layout.buckets):
            if not bucket.numel or (self.gather == "touched" and self.world_size == 1):
                continue
            buf = directions[bucket.dtype]
            if self.gather == "all":
                lo, hi = bucket.shard(self.rank)
                all_gather(buf[bucket.start:bucket.end], buf[lo:hi], group=self.process_group)
                self.comm_bytes["gather"] += common.nbytes(bucket.numel, self.gather_dtype)
                continue
            send_ranges, recv_ranges, (t_lo, t_hi) = self._touched[b]
            send = torch.cat([buf[s:e] for s, e in send_ranges])
            recv = torch.empty(sum(e - s for s, e in recv_ranges), dtype=buf.dtype, device=buf.device)
            dist.all_to_all_single(recv, send, output_split_sizes=[e - s for s, e in recv_ranges],
                                   input_split_sizes=[e - s for s, e in send_ranges], group=self.process_group)
            offset = 0
            for s, e in recv_ranges:
                buf[s:e].copy_(recv[offset:offset + e - s])
                offset += e - s
            self.comm_bytes["gather"] += common.nbytes(t_hi - t_lo, self.gather_dtype)
        # 5. orthogonalise every matrix with a piece here (Muon's own arithmetic), keep the local part
        for gi, g in enumerate(groups):
            mine = [p for p in self.pieces if self._group_of[p.index] == gi and has_grad[p.index]]
            if not mine:
                continue
            full = []
            for piece in mine:
                r = self.layout.params[piece.index]
                full.append(directions[r.dtype][r.start:r.end].view(r.shape).to(r.dtype))
            updates = common.scaled_orthogonal(full, g)
            for piece, upd in zip(mine, updates):
                r = self.layout.params[piece.index]
                w = self.param_buffers[r.dtype][piece.buffer_start:piece.buffer_start + piece.numel]
                w.mul_(1 - g["lr"] * g["weight_decay"])
                w.sub_(upd.reshape(-1)[piece.param_start:piece.param_end], alpha=g["lr"])

    @torch.no_grad()
    def publish_weights(self) -> None:
        """Phase 4 (a collective): all-gather the parameter shards, back into the model."""
        # 6. all-gather the parameters, back into the model
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.numel:
                all_gather(self.param_buffers[bucket.dtype][bucket.start:bucket.end],
                            self._shard(self.param_buffers, b), group=self.process_group)
                self.comm_bytes["all_gather"] += common.nbytes(bucket.numel, bucket.dtype)
        for r, p in zip(self.layout.params, self._params):
            if r.numel:
                p.data.copy_(self.param_buffers[r.dtype][r.start:r.end].view(r.shape))
        self._versions.record(self._params)

    # --- checkpoints ------------------------------------------------------------------------------------
    def _local_checkpoint(self) -> list[tuple]:
        """``(index, param_start, param_end, momentum piece on the CPU)`` for each piece with momentum here."""
        return [(piece.index, piece.param_start, piece.param_end,
                 self.state[self._params[piece.index]]["momentum_shard"].detach().cpu().clone())
                for piece in self.pieces if "momentum_shard" in self.state.get(self._params[piece.index], {})]

    def _assemble(self, parts) -> dict:
        """The plain Muon dict whose momentum matrices are put together from the ranks' ``parts`` (lists of
        :meth:`_local_pieces` tuples; elements no part covers are zero)."""
        buffers: dict[int, torch.Tensor] = {}
        for part in parts:
            for index, start, end, m in part:
                buffers.setdefault(index, torch.zeros(self.layout.params[index].numel, dtype=m.dtype))[start:end] = m
        plain = common.plain_state_dict(self)  # param_groups with indices in param-group order
        return {"state": {i: {"momentum_buffer": buffers[i].view(self.layout.params[i].shape)} for i in sorted(buffers)},
                "param_groups": plain["param_groups"], "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        """The consolidated state (``ConsolidatingMuon`` of ``optbook.distributed._muon_common``): on the rank
        :meth:`consolidate_state_dict` sent it to, or, when nothing was consolidated since the last step or
        load, on **every** rank (a collective: every rank calls it, as ``torch.distributed.checkpoint``'s
        ``get_``/``set_optimizer_state_dict`` do). The plain ``optbook.optim.Muon`` layout (``{"state":
        {index: {"momentum_buffer": tensor}}, "param_groups": [...]}``, parameters numbered in param-group
        order, tensors on the CPU) plus ``"skipped_steps"``. It loads into a single-process
        :class:`optbook.optim.Muon` over the same parameters, into a :class:`LayerWiseMuon` and into a
        DistributedMuon at any world size.

        Raises:
            RuntimeError: consolidated on another rank since the last step (call it on that rank).
        """
        return super().state_dict()

    def check_state_dict(self, state_dict) -> None:
        """Check a dict for ``load_state_dict`` without writing anything (group and parameter counts,
        hyperparameters, state keys, momentum shapes and dtypes, ``skipped_steps``: ``check_muon_state_dict``
        of ``optbook.distributed._muon_common``).

        Raises:
            TypeError, ValueError: the first problem found (a checkpoint of another model or optimizer).
        """
        common.check_muon_state_dict(state_dict, self)

    def _load_state_dict(self, state_dict: dict) -> None:
        """``load_state_dict(state_dict)`` (the base runs the hooks and :meth:`check_state_dict` first): a plain
        Muon state dict (from :meth:`state_dict` at any world size, from :meth:`LayerWiseMuon.state_dict` or
        from :meth:`optbook.optim.Muon.state_dict`); each rank keeps its pieces of the momentum. Not a
        collective: call it on every rank with the same dict. Nothing is loaded when the check fails.
        """
        skipped = state_dict.get("skipped_steps", self.skipped_steps)   # checked
        common.load_plain(self, {"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        full = {i: self.state.pop(p)["momentum_buffer"] for i, p in enumerate(self._params)
                if "momentum_buffer" in self.state.get(p, {})}
        self.state.clear()
        for piece in self.pieces:
            if piece.index in full:
                flat = full[piece.index].reshape(-1)[piece.param_start:piece.param_end]
                self.state[self._params[piece.index]]["momentum_shard"] = flat.to(self.device).clone()
        self.skipped_steps = skipped
        self._consolidated = None
        self._has_state = bool(full)   # the same dict on every rank

    # --- sharded checkpoints: one file per rank --------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's momentum pieces, for one checkpoint file per rank. Not a collective.

        Returns:
            ``{"format": SHARDED_FORMAT, "rank", "world_size", "params": [(shape, dtype name)] in param-group
            order, "pieces": [(index, param_start, param_end)] of this rank, "momentum": [(index, param_start,
            param_end, 1-D CPU tensor)] for the pieces with momentum, "param_groups", "skipped_steps",
            "layout": :meth:`checkpoint_layout`}``.
        """
        plain = common.plain_state_dict(self)
        return {"format": SHARDED_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "layout": self.checkpoint_layout(),
                "params": [(tuple(p.shape), str(p.dtype)) for p in self._params],
                "pieces": [(p.index, p.param_start, p.param_end) for p in self.pieces],
                "momentum": self._local_checkpoint(), "param_groups": plain["param_groups"],
                "skipped_steps": self.skipped_steps}

    def load_sharded_state_dict(self, shards) -> None:
        """Load :meth:`sharded_state_dict` files. Not a collective.

        Args:
            shards: **this rank's own** dict (saved by the same rank at the same world size and layout), or
                the list of **every** rank's dicts of one save at any world size (resharding).

        Raises:
            TypeError, ValueError: not dicts of this format; a file of another class, rank, world size or
                layout (naming both layouts; the message says to pass the list); files of two saves; files
                for other parameter shapes or dtypes; what :meth:`load_state_dict` raises. Before any load.
        """
        parts = common.shard_parts(shards, self, SHARDED_FORMAT, "pieces",
                            [(p.index, p.param_start, p.param_end) for p in self.pieces])
        plain = self._assemble([sd["momentum"] for sd in parts])
        plain.update(param_groups=parts[0]["param_groups"], skipped_steps=parts[0]["skipped_steps"])
        self.load_state_dict(plain)


#: The ``"format"`` entry of :meth:`DistributedMuon.sharded_state_dict`.
SHARDED_FORMAT = "optbook.DistributedMuon.sharded/1"


def _broadcasts_to(factor: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``param.mul_(factor)`` keeps ``param``'s shape (and both are on one device)."""
    try:
        return factor.device == param.device and torch.broadcast_shapes(factor.shape, param.shape) == param.shape
    except RuntimeError:
        return False


def touched_ranges(layout, bucket: int, rank: int) -> tuple[list, list, tuple]:
    """The ``"touched"`` gather of one bucket for ``rank`` (:class:`DistributedMuon`).

    The matrices with a piece in ``rank``'s shard occupy one contiguous interval ``[t_lo, t_hi)`` of the flat
    buffer (the shard is contiguous, and so is each matrix), which contains the shard's parameter elements
    (not the padding at a bucket's end). Rank ``q`` sends rank
    ``r`` the part of ``q``'s shard that lies in ``r``'s interval (nothing to itself).

    Args:
        layout: a :class:`optbook.distributed.zero1.Layout`; ``bucket``: an index into ``layout.buckets``;
            ``rank``: a rank of ``0 .. layout.world_size - 1``.

    Returns:
        ``(send, recv, (t_lo, t_hi))``: ``send[r]``: the ``(start, end)`` buffer range of this rank's shard
        that goes to rank ``r``; ``recv[q]``: the range that comes from rank ``q`` (both empty for ``q = r =
        rank``); the interval in buffer elements (``t_lo = t_hi`` = the shard's start when no matrix has a
        piece in the shard).
    """
    b = layout.buckets[bucket]
    d = layout.world_size

    def interval(r):
        idx = [p.index for p in layout.pieces(r) if p.bucket == bucket]
        lo, _ = b.shard(r)
        if not idx:
            return lo, lo
        return min(layout.params[i].start for i in idx), max(layout.params[i].end for i in idx)

    def overlap(q, r):
        if q == r:
            return (0, 0)
        (lo, hi), (t_lo, t_hi) = b.shard(q), interval(r)
        s, e = max(lo, t_lo), min(hi, t_hi)
        return (s, e) if s < e else (0, 0)

    return [overlap(rank, r) for r in range(d)], [overlap(q, rank) for q in range(d)], interval(rank)


def zero1_comm_bytes(layout, gather_dtype: torch.dtype | None = None, grad_dtype=None, *, gather: str = "all",
                     rank: int | None = None) -> dict:
    """Bytes one ZeRO-1 step moves for ``layout`` (:func:`optbook.distributed.shard_layout`), by the
    module docstring's convention: a reduce-scatter of every bucket in its gradient dtype (``grad_dtype``,
    default: float32 for float16/bfloat16 buckets, else the bucket's dtype, as ``DistributedOptimizer``) and
    an all-gather of every bucket in its parameter dtype. With ``gather_dtype``, also Moonlight's gather of
    the momentum-updated buckets in that dtype (:class:`DistributedMuon`): every bucket (``gather="all"``),
    or the touched interval of ``rank`` (``gather="touched"``, :func:`touched_ranges`; ``rank`` required).

    Returns:
        ``{"reduce_scatter": int, "all_gather": int, "gather": int (0 without gather_dtype), "total": int}``.

    Raises:
        ValueError: ``gather`` not in :data:`GATHERS`, or ``"touched"`` without a ``rank``.
    """
    if gather not in GATHERS:
        raise ValueError(f"Invalid gather: expected one of {GATHERS}, got {gather!r}")
    if gather == "touched" and gather_dtype is not None and rank is None:
        raise ValueError("Invalid rank: gather='touched' counts one rank's gather; pass rank=")
    out = {"reduce_scatter": 0, "all_gather": 0, "gather": 0}
    for i, b in enumerate(layout.buckets):
        gd = grad_dtype or (torch.float32 if b.dtype in LOW_PRECISION else b.dtype)
        out["reduce_scatter"] += common.nbytes(b.numel, gd)
        out["all_gather"] += common.nbytes(b.numel, b.dtype)
        if gather_dtype is not None and b.numel:
            if gather == "all":
                out["gather"] += common.nbytes(b.numel, gather_dtype)
            elif layout.world_size > 1:
                t_lo, t_hi = touched_ranges(layout, i, rank)[2]
                out["gather"] += common.nbytes(t_hi - t_lo, gather_dtype)
    out["total"] = out["reduce_scatter"] + out["all_gather"] + out["gather"]
    return out


def received_bytes(layout, rank: int, gather_dtype: torch.dtype | None = None, grad_dtype=None, *,
                   gather: str = "all") -> dict:
    """Bytes ``rank`` receives in one step's bucket collectives, by
    :class:`optbook.distributed.wire.CommCounter`'s rules, for ZeRO-1 (``gather_dtype=None``: the reduce-scatter
    and the all-gather of :class:`optbook.distributed.DistributedOptimizer` on its NCCL path) or
    :class:`DistributedMuon` (with its gather). With ``d`` ranks and a bucket of ``n`` elements (shard
    ``n / d``): the reduce-scatter ``(d - 1) n / d`` gradient elements, the all-gather ``(d - 1) n / d``
    parameter elements, the gather ``(d - 1) n / d`` elements (``"all"``) or the touched interval less the
    own shard's part of it (``"touched"``), in ``gather_dtype``. The control all-reduces are not included.

    Returns:
        ``{"reduce_scatter": int, "all_gather": int, "gather": int}`` (``"gather"`` 0 without
        ``gather_dtype``); key names are the collectives' (the ``"touched"`` gather is an all-to-all).

    Raises:
        ValueError: ``gather`` not in :data:`GATHERS`.
    """
    if gather not in GATHERS:
        raise ValueError(f"Invalid gather: expected one of {GATHERS}, got {gather!r}")
    d = layout.world_size
    out = {"reduce_scatter": 0, "all_gather": 0, "gather": 0}
    for i, b in enumerate(layout.buckets):
        if not b.numel or d == 1:
            continue
        gd = grad_dtype or (torch.float32 if b.dtype in LOW_PRECISION else b.dtype)
        out["reduce_scatter"] += common.nbytes((d - 1) * b.shard_numel, gd)
        out["all_gather"] += common.nbytes((d - 1) * b.shard_numel, b.dtype)
        if gather_dtype is not None:
            if gather == "all":
                out["gather"] += common.nbytes((d - 1) * b.shard_numel, gather_dtype)
            else:
                _, recv, _ = touched_ranges(layout, i, rank)
                out["gather"] += common.nbytes(sum(e - s for s, e in recv), gather_dtype)
    return out
