"""ZeRO-1: each data-parallel rank keeps the optimizer state of one shard of the parameters. Explained in
chapter 13.

Sources: Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC20, arXiv:1910.02054), stage 1 ("P_os", optimizer-state partitioning; bib key
``rajbhandari2020zero``); the layout and the order of the collectives follow Megatron-LM's distributed
optimizer (``megatron/core/distributed/param_and_grad_buffer.py`` and
``megatron/core/optimizer/distrib_optimizer.py``; bib key ``megatron2024distopt``). The code here is our
own.

The layout (:func:`shard_layout`). The parameters of each dtype live in one contiguous flat buffer, in
param-group order; each parameter starts at a multiple of ``param_alignment`` elements (Megatron: 64).
The buffer is cut into buckets (one per dtype unless ``bucket_size`` is given); each bucket is padded to a
multiple of ``lcm(world_size, bucket_alignment)`` elements (Megatron: 128) and split into ``world_size``
equal, contiguous shards **ignoring parameter boundaries**: a parameter may be split across two or more
ranks, and a rank may hold only padding. Rank ``r`` owns shard ``r`` of every bucket; the part of a
parameter inside it is a :class:`Piece`.

One step (:meth:`DistributedOptimizer.step`) as collective calls, per bucket::

    flat_grad[param] = p.grad                      every rank, its own micro-batch's gradient
    reduce_scatter(flat_grad[shard r], flat_grad)   SUM; rank r receives the summed shard r (gloo: an
                                                    all-reduce of the bucket, of which rank r reads shard r) ...
    flat_grad[shard r] /= world_size                 ... and takes the mean
    flat_grad[shard r] /= S; found_inf             (with a loss scaler S)
    all_reduce([found_inf, has_grad...], MAX)       every rank skips together, one scale update
    clip by sqrt(all_reduce(sum of squares, SUM))   (max_grad_norm) each element counted once
    inner optimizer step on the pieces of shard r   float32 masters and m, v for shard r only
    flat_param[shard r] = master[shard r]           (float16/bfloat16: one rounding)
    all_gather(flat_param, flat_param[shard r])     every rank has every updated parameter (gloo: a
                                                    broadcast of shard q from rank q, for each q)

Memory per parameter (bytes, ``d`` = world size, AdamW): bfloat16/float16 parameters with float32
gradient reduction: 2 (parameter) + 4 (gradient buffer) + 12/d (float32 master, m, v); float32
parameters: 4 + 4 + 8/d (the parameter is its own master). Without ZeRO the same is 18 and 16
(Megatron-LM's ``docs/source/api-guide/dist_optimizer.md``). :meth:`DistributedOptimizer.memory_bytes`
measures it.

Checkpoints come in two kinds. Consolidated (:meth:`DistributedOptimizer.consolidate_state_dict`, then
``state_dict()`` on one rank): the plain ``torch.optim`` layout, loadable at any world size and into a
single-process optimizer. Sharded (:meth:`DistributedOptimizer.sharded_state_dict`, one file per rank,
no communication): each rank's pieces of m, v and the masters, with the piece boundaries as layout
metadata; :meth:`DistributedOptimizer.load_sharded_state_dict` takes the rank's own file (same world size)
or the list of all files of a save at any world size (each rank keeps the elements its pieces cover).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import contract
from ..clipping import clip_coefficient, clip_grad_norm_, get_grad_norm, scale_grads_
from ..optim import AdamW
from ..optim._validation import check_grad, check_number
from ..optim.optimizer import BookOptimizer, all_finite
from ..precision import check_loss_scaler, loss_scale_of, scaled_loss, take_up_, unscale_grads_
from ._collectives import LOW_PRECISION, all_gather, check_int, reduce_scatter
from ._ranks import check_same_params

__all__ = ["SHARDED_FORMAT", "Bucket", "DistributedOptimizer", "Layout", "ParamRange", "Piece", "shard_layout"]

#: The ``"format"`` entry of :meth:`DistributedOptimizer.sharded_state_dict`.
SHARDED_FORMAT = "optbook.DistributedOptimizer.sharded/1"

# Old private names, kept as aliases while optbook.distributed.layerwise_muon still imports them from here;
# new code imports the public names from optbook.distributed._collectives.
_LOW_PRECISION, _all_gather, _reduce_scatter, _check_int = LOW_PRECISION, all_gather, reduce_scatter, check_int


# --- the layout ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamRange:
    """Where one parameter lives: elements ``start .. start + numel - 1`` of its dtype's flat buffer."""

    index: int          #: position of the parameter in param-group order (the state-dict index)
    dtype: torch.dtype
    bucket: int         #: index into :attr:`Layout.buckets`
    start: int
    numel: int
    shape: tuple

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """Elements ``start .. start + numel - 1`` of the ``dtype`` buffer, split into equal shards."""

    dtype: torch.dtype
    start: int
    numel: int          #: padded: a multiple of lcm(world_size, bucket_alignment) (0 for an empty bucket)
    world_size: int

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    def shard(self, rank: int) -> tuple[int, int]:
        """``(start, end)`` of rank ``rank``'s shard in the dtype's buffer."""
        s = self.start + rank * self.shard_numel
        return s, s + self.shard_numel


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` that rank ``rank`` owns: elements ``param_start .. param_end - 1``
    of the flattened parameter, which are elements ``buffer_start ..`` of its dtype's buffer."""

    index: int
    rank: int
    bucket: int
    param_start: int
    param_end: int
    buffer_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class Layout:
    """The flat buffers, buckets and shards of :func:`shard_layout`."""

    world_size: int
    params: tuple       #: one :class:`ParamRange` per parameter, in param-group order
    buckets: tuple      #: :class:`Bucket` s, grouped by dtype in order of first appearance
    buffer_numel: dict  #: dtype -> elements of its flat buffer (padding included)

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces of parameters rank ``rank`` owns, bucket by bucket, in buffer order (zero-element
        parameters and padding have none)."""
        out = []
        for b, bucket in enumerate(self.buckets):
            lo, hi = bucket.shard(rank)
            for r in self.params:
                if r.bucket != b:
                    continue
                s, e = max(r.start, lo), min(r.end, hi)
                if s < e:
                    out.append(Piece(r.index, rank, b, s - r.start, e - r.start, s))
        return out

    def padding(self, rank: int) -> int:
        """Elements of rank ``rank``'s shards that belong to no parameter."""
        return sum(b.shard_numel for b in self.buckets) - sum(p.numel for p in self.pieces(rank))


def _is_power_of_two(x) -> bool:
    """Whether ``x`` (an int or a finite float > 0) is ``2 ** k`` for an integer ``k``."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shard_layout(params, world_size: int, *, bucket_size: int | None = None, param_alignment: int = 64,
                 bucket_alignment: int = 128) -> Layout:
    """Place ``params`` in flat per-dtype buffers, cut into buckets and equal shards (Megatron-LM's layout).

    Args:
        params: tensors (any shapes, including zero elements; only ``shape``, ``numel`` and ``dtype`` are
            read), in param-group order.
        world_size: number of data-parallel ranks, an int ``>= 1``.
        bucket_size: ``None`` (one bucket per dtype) or an int ``>= 1``: a bucket is closed as soon as it
            holds at least this many elements (padding included), as Megatron's ``bucket_size``.
        param_alignment: each parameter starts at a multiple of this many elements (Megatron: 64).
        bucket_alignment: each bucket is padded to a multiple of ``lcm(world_size, bucket_alignment)``
            elements (Megatron: 128), so it splits into ``world_size`` equal shards.

    Returns:
        A :class:`Layout`. A zero-element parameter gets a range of length 0 (and keeps its shape).

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range, named in the message.
    """
    world_size = check_int("world_size", world_size, 1)
    if bucket_size is not None:
        bucket_size = check_int("bucket_size", bucket_size, 1)
    param_alignment = check_int("param_alignment", param_alignment, 1)
    bucket_alignment = check_int("bucket_alignment", bucket_alignment, 1)
    params = list(params)
    multiple = math.lcm(world_size, bucket_alignment)
    ranges: dict[int, ParamRange] = {}
    buckets: list[Bucket] = []
    buffer_numel: dict = {}
    for dtype in dict.fromkeys(p.dtype for p in params):  # dtypes in order of first appearance
        offset = bucket_start = 0
        open_bucket = False

        def close(offset: int, bucket_start: int, dtype: torch.dtype = dtype) -> int:
            numel = _round_up(offset - bucket_start, multiple)
            buckets.append(Bucket(dtype, bucket_start, numel, world_size))
            return bucket_start + numel

        for i, p in enumerate(params):
            if p.dtype != dtype:
                continue
            offset = _round_up(offset, param_alignment)
            ranges[i] = ParamRange(i, dtype, len(buckets), offset, p.numel(), tuple(p.shape))
            offset += p.numel()
            open_bucket = True
            if bucket_size is not None and offset - bucket_start >= bucket_size:
                offset = bucket_start = close(offset, bucket_start)
                open_bucket = False
        if open_bucket:
            offset = close(offset, bucket_start)
        buffer_numel[dtype] = offset
    return Layout(world_size, tuple(ranges[i] for i in range(len(params))), tuple(buckets), buffer_numel)


def _clip_with_extra(params, max_norm, group, extra_sumsq: float) -> torch.Tensor:
    """``norm = sqrt(group sum of squares of params' grads + extra_sumsq)``; scale the grads by
    ``min(1, max_norm / (norm + 1e-6))`` (as :func:`optbook.clipping.clip_grad_norm_`; no scaling when
    ``max_norm`` is ``None`` or the norm is not finite). Returns the norm (0-dim float64)."""
    own = get_grad_norm(params, group=group)
    norm = torch.sqrt(own.square() + extra_sumsq)
    scale_grads_([p.grad for p in params if p.grad is not None], clip_coefficient(norm.item(), max_norm))
    return norm


# --- the optimizer ------------------------------------------------------------------------------------------
class DistributedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 around an element-wise optimizer: reduce-scatter, shard step, all-gather (module docstring).

    Used like ``torch.distributed.optim.ZeroRedundancyOptimizer``: build it on every rank of
    ``process_group`` with the same parameters (each rank a replica of the model), run the backward pass on
    each rank's micro-batch, call :meth:`step` on every rank (it averages the gradients itself), and
    :meth:`zero_grad`. Every method documented as collective must be called by every rank.

    Args:
        params: an iterable of tensors or of param-group dicts, as for ``optimizer_class``; all on one
            device (the CPU for gloo, the rank's CUDA device for NCCL); float16, bfloat16, float32 or
            float64. At construction each parameter is copied into its dtype's flat buffer and its
            ``.data`` becomes a view of that buffer (same shape; contiguous); then every buffer is
            broadcast from the group's rank 0, so every rank starts from rank 0's parameters (as
            ``DistributedDataParallel``). Do not replace ``p.data`` afterwards (``model.to(...)``,
            ``load_state_dict(assign=True)``): :meth:`step` refuses a parameter that left its buffer.
        optimizer_class: an element-wise ``torch.optim.Optimizer`` class (default
            :class:`optbook.optim.AdamW`; also ``SGD``, ``Adam``, ``Lion`` or ``torch.optim``'s). Muon,
            Shampoo, SOAP and Adafactor are refused: their update of a matrix is not the concatenation of
            the updates of its pieces.
        process_group: the data-parallel group (``None``: ``torch.distributed.group.WORLD``).
        loss_scaler: ``None`` or a loss scaler of :mod:`optbook.precision` (``scale``, ``update``,
            ``state_dict``, ``load_state_dict``); required with float16 parameters. Use
            :meth:`scale_loss` for the backward pass.
        max_grad_norm: if set (``> 0``), clip the mean, unscaled gradient by its global L2 norm over the
            group (:func:`optbook.clipping.clip_grad_norm_` on the shards; padding is not counted, a
            parameter split across ranks is counted once); the norm is kept in :attr:`last_grad_norm`.
        bucket_size, param_alignment, bucket_alignment: the layout, see :func:`shard_layout`.
        **defaults: hyperparameters for ``optimizer_class`` (``lr``, ``betas``, ``weight_decay``, ...).

    Dtypes: a float16/bfloat16 parameter is reduced in a float32 gradient buffer and stepped on a float32
    master of this rank's pieces (the state is float32); a float32/float64 parameter is reduced in its own
    dtype and stepped in place (its buffer is its own master, the state has its dtype).

    Attributes:
        optimizer: the ``optimizer_class`` instance over this rank's pieces (1-D views); its groups mirror
            :attr:`param_groups` (hyperparameters are copied over before each step, so a learning-rate
            scheduler built on this object works). Its ``state`` is this rank's shard of the state.
        layout: the :class:`Layout`; ``pieces``: this rank's :class:`Piece` s.
        found_inf, skipped_steps, last_grad_norm: as :class:`optbook.precision.MixedPrecisionOptimizer`.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass; a bad ``loss_scaler``;
            an argument of the wrong type, named in the message.
        ValueError: a non-element-wise ``optimizer_class``; parameters on several devices; float16
            parameters without a loss scaler; ``max_grad_norm <= 0``; what ``optimizer_class`` raises for
            its hyperparameters. All before any parameter is touched.
    """

    def __init__(self, params, optimizer_class=AdamW, process_group=None, *, loss_scaler=None,
                 max_grad_norm: float | None = None, bucket_size: int | None = None,
                 param_alignment: int = 64, bucket_alignment: int = 128, **defaults):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedOptimizer needs an initialised torch.distributed process group "
                               "(optbook.distributed.launch, or init_from_env under torchrun)")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"Invalid optimizer_class: expected a torch.optim.Optimizer subclass, got "
                            f"{optimizer_class!r}")
        if not contract.elementwise(optimizer_class):
            raise ValueError(f"Invalid optimizer_class: {optimizer_class.__module__}.{optimizer_class.__qualname__} "
                             "is not element-wise (optbook.contract.elementwise: its class attribute "
                             "'elementwise', or torch.optim's element-wise classes), so it cannot step a shard "
                             "that cuts through a matrix; use AdamW, Adam, SGD or Lion (whole-matrix optimizers "
                             "need ownership of whole matrices, chapter 14)")
        check_loss_scaler(loss_scaler)
        if max_grad_norm is not None:
            max_grad_norm = check_number("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
        group = dist.group.WORLD if process_group is None else process_group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        # The class checks its own hyperparameters and parameters and fills every group's defaults.
        template = optimizer_class(params, **defaults)
        groups = template.param_groups
        all_params = [p for g in groups for p in g["params"]]
        devices = {p.device for p in all_params}
        if len(devices) > 1:
            raise ValueError(f"Invalid params: they are on several devices {sorted(map(str, devices))}; put "
                             "the whole model on this rank's device")
        for i, p in enumerate(all_params):
            if p.dtype == torch.float16 and loss_scaler is None and p.requires_grad:
                raise ValueError(f"Invalid loss_scaler: parameter {i} (shape {tuple(p.shape)}) is float16, "
                                 "whose small gradients flush to zero without loss scaling; pass loss_scaler="
                                 "optbook.precision.DynamicLossScaler()")
        layout = shard_layout(all_params, world_size, bucket_size=bucket_size,
                              param_alignment=param_alignment, bucket_alignment=bucket_alignment)
        check_same_params(all_params, group, world_size, "DistributedOptimizer")  # one collective

        # Nothing was changed up to here.
        self._layout = None  # add_param_group is allowed while the base class builds the groups
        super().__init__(groups, template.defaults)
        del template
        self.layout = layout
        self._layout = layout
        self.process_group = group
        self.rank, self.world_size = rank, world_size
        self.loss_scaler = loss_scaler
        self.max_grad_norm = max_grad_norm
        self.found_inf = False
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._consolidated: dict | None = None
        self._params = all_params
        self._index_of = {id(p): i for i, p in enumerate(all_params)}
        self.device = next(iter(devices))
        self._global_ranks = [q if group is dist.group.WORLD else dist.get_global_rank(group, q)
                              for q in range(world_size)]
        # gloo's reduce_scatter / all_gather_into_tensor are several times slower than its (pipelined)
        # all_reduce and its broadcast on the same bytes, and one reduce per shard is slower than the
        # all_reduce (measured: benchmarks/bench_zero1.py); NCCL's reduce-scatter/all-gather are the fast path.
        self._gloo_collectives = dist.get_backend(group) == "gloo" and world_size > 1

        with torch.no_grad():
            self.param_buffers: dict = {}
            self.grad_buffers: dict = {}
            for dtype, numel in layout.buffer_numel.items():
                self.param_buffers[dtype] = torch.zeros(numel, dtype=dtype, device=self.device)
                grad_dtype = torch.float32 if dtype in LOW_PRECISION else dtype
                self.grad_buffers[dtype] = torch.zeros(numel, dtype=grad_dtype, device=self.device)
            for r, p in zip(layout.params, all_params):
                view = self.param_buffers[r.dtype][r.start:r.end]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(r.shape)
            src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
            for buf in self.param_buffers.values():
                if buf.numel():
                    dist.broadcast(buf, src=src, group=group)
            # float32 masters of this rank's shards of low-precision buckets (padding included, never stepped)
            self.master_shards: dict[int, torch.Tensor] = {}
            for b, bucket in enumerate(layout.buckets):
                if bucket.dtype in LOW_PRECISION:
                    lo, hi = bucket.shard(rank)
                    self.master_shards[b] = self.param_buffers[bucket.dtype][lo:hi].float()

        self.pieces = layout.pieces(rank)
        self._piece_params: list[torch.Tensor] = []  # the tensor the inner optimizer steps, per piece
        self._piece_grads: list[torch.Tensor] = []   # its gradient: a view of the flat gradient buffer
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
        for piece in self.pieces:
            dtype = layout.params[piece.index].dtype
            lo, hi = piece.buffer_start, piece.buffer_start + piece.numel
            if piece.bucket in self.master_shards:
                offset = lo - layout.buckets[piece.bucket].shard(rank)[0]
                target = self.master_shards[piece.bucket][offset:offset + piece.numel]
            else:
                target = self.param_buffers[dtype][lo:hi]
            self._piece_params.append(target)
            self._piece_grads.append(self.grad_buffers[dtype][lo:hi])
            inner_groups[group_of[piece.index]]["params"].append(target)
        self.optimizer = optimizer_class(inner_groups, **defaults)
        self._class_kwargs = dict(defaults)  # how optimizer_class was called (the probe of _state_kinds)
        # The owner of the model's parameters (optbook.contract): writes through the flat buffers do not move a
        # parameter's own version counter, so only writes made through the parameter show up here.
        self._versions = contract.VersionTracker()
        self._versions.record(all_params)
        contract.register_owner(all_params, self)

    # --- small helpers ----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing: the flat buffers cannot grow.

        Raises:
            NotImplementedError: after construction (build a new optimizer with every group instead).
        """
        if getattr(self, "_layout", None) is not None:
            raise NotImplementedError("DistributedOptimizer.add_param_group: the flat buffers are laid out "
                                      "at construction; build a new DistributedOptimizer with every group")
        super().add_param_group(param_group)

    @property
    def loss_scale(self) -> float:
        """The current loss scale ``S`` (``1.0`` without a scaler)."""
        return 1.0 if self.loss_scaler is None else loss_scale_of(self.loss_scaler)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` for ``backward()`` (a float16/bfloat16 loss is cast to float32 first).

        Raises:
            TypeError: ``loss`` is not a floating-point tensor.
        """
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(f"Invalid loss: expected a floating-point tensor, got {loss!r}")
        return scaled_loss(loss, self.loss_scale)

    def _param_view(self, index: int) -> torch.Tensor:
        r = self.layout.params[index]
        return self.param_buffers[r.dtype][r.start:r.end]

    def _grad_view(self, index: int) -> torch.Tensor:
        r = self.layout.params[index]
        return self.grad_buffers[r.dtype][r.start:r.end]

    def _shard(self, buffers: dict, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        lo, hi = bucket.shard(self.rank)
        return buffers[bucket.dtype][lo:hi]

    def use_grad_buffer(self) -> int:
        """Make the ``.grad`` of every float32/float64 parameter a view of the flat gradient buffer, so that
        ``backward()`` accumulates straight into it and :meth:`step` skips copying it there (as
        ``DistributedDataParallel(gradient_as_bucket_view=True)``). Not a collective.

        :meth:`step` reduces the buffer in place, so afterwards these ``.grad`` tensors hold no meaningful
        values: call ``zero_grad(set_to_none=False)`` before the next backward pass to keep the views
        (``set_to_none=True``, the default, drops them; the next gradients are then copied as usual).
        float16/bfloat16 parameters keep their own gradients (the buffer is float32).

        Returns:
            The number of parameters whose ``.grad`` is now a view (their current gradients are copied in;
            ``None`` becomes zeros).
        """
        n = 0
        with torch.no_grad():
            for i, (p, r) in enumerate(zip(self._params, self.layout.params)):
                if r.dtype in LOW_PRECISION or not r.numel:
                    continue
                view = self._grad_view(i).view(r.shape)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
                n += 1
        return n

    def reload_model_params(self) -> None:
        """Copy this rank's pieces of the low-precision model parameters into their float32 masters (after
        editing the model's weights in place, identically on every rank). Not a collective.

        :meth:`step` does this by itself for every parameter written in place since the optimizer's last
        write (its version counter moved, :class:`optbook.contract.VersionTracker`); this method also takes
        up writes that bypassed the parameter (e.g. through ``param_buffers``)."""
        with torch.no_grad():
            for b, master in self.master_shards.items():
                master.copy_(self._shard(self.param_buffers, b))
        self._versions.record(self._params)

    @torch.no_grad()
    def _take_up_outside_writes(self) -> None:
        """The step contract's take-up (:mod:`optbook.contract`): for each low-precision parameter written in
        place by someone else since this optimizer's last write (its ``_version`` moved; host integers, no
        device synchronisation), copy this rank's pieces of it into the float32 masters. An element whose
        model value still equals its rounded master keeps the master (with its low bits): a weights-only
        reload of the same checkpoint changes nothing. float32/float64 parameters are their own masters (the
        flat buffer is their storage), so their writes need no copy. Not a collective: an outside write must
        be made identically on every rank."""
        changed = self._versions.changed(self._params)
        if not changed:
            return
        changed_set = set(changed)
        for piece, target in zip(self.pieces, self._piece_params):
            if piece.index in changed_set and piece.bucket in self.master_shards:
                take_up_(target, self._param_view(piece.index)[piece.param_start:piece.param_end])
        self._versions.record(self._params[i] for i in changed)

    @torch.no_grad()
    def _scale_weights_(self, param: torch.Tensor, factor) -> None:
        """Multiply ``param``'s weights by ``factor`` in this optimizer's copy and rewrite the model's
        ``param`` from it, as the next :meth:`step` would (:func:`optbook.contract.scale_weights_` calls this).

        A collective: every rank of the group calls it with the same ``param`` (its replica) and ``factor``.
        Each rank multiplies the part of its shard that belongs to ``param`` -- ``factor`` expanded to
        ``param.shape``, flattened and sliced to the piece's range -- in the shard's dtype (the float32
        master of a float16/bfloat16 parameter; the parameter itself for float32/float64), then the
        parameter's bucket is gathered again, so every rank's ``param`` holds the scaled (rounded) master.

        Args:
            param: one of this optimizer's parameters (the model's tensor).
            factor: a Python number or a real tensor broadcastable to ``param.shape`` (a row scaling of a
                matrix: shape ``(rows, 1)``), the same on every rank.

        Raises:
            ValueError: ``param`` is not one of this optimizer's parameters, or ``factor`` does not broadcast
                to its shape. Raised on the rank where it happens, before any write or communication.
        """
        index = self._index_of.get(id(param))
        if index is None or self._params[index] is not param:
            raise ValueError(f"Invalid param: a tensor of shape {tuple(param.shape)} that this "
                             "DistributedOptimizer does not hold")
        r = self.layout.params[index]
        try:
            flat = torch.as_tensor(factor).to(param.device).expand(r.shape).reshape(-1)
        except RuntimeError as e:
            raise ValueError(f"Invalid factor: shape {tuple(torch.as_tensor(factor).shape)} does not broadcast "
                             f"to the parameter's shape {r.shape}") from e
        self._take_up_outside_writes()
        for piece, target in zip(self.pieces, self._piece_params):
            if piece.index == index:
                target.mul_(flat[piece.param_start:piece.param_end].to(target.dtype))
        if r.bucket in self.master_shards:
            self._shard(self.param_buffers, r.bucket).copy_(self.master_shards[r.bucket])
        self._gather(r.bucket)

    def _gather(self, b: int) -> None:
        """All-gather bucket ``b`` of the parameter buffer from each rank's shard (gloo: each owner
        broadcasts its shard)."""
        bucket = self.layout.buckets[b]
        if not bucket.numel:
            return
        if self._gloo_collectives:
            flat = self.param_buffers[bucket.dtype]
            for q, src in enumerate(self._global_ranks):
                lo, hi = bucket.shard(q)
                dist.broadcast(flat[lo:hi], src=src, group=self.process_group)
        else:
            all_gather(self.param_buffers[bucket.dtype][bucket.start:bucket.end],
                       self._shard(self.param_buffers, b), group=self.process_group)

    def memory_bytes(self) -> dict:
        """Bytes this rank holds, measured from the real tensors.

        Returns:
            ``{"params": flat parameter buffers, "grads": flat gradient buffers, "master_params": float32
            master shards, "optimizer_state": every tensor in the inner optimizer's state, "padding_elements":
            padding elements in the parameter buffers, "numel": real parameter elements}`` (ints). The
            model's own ``.grad`` tensors (freed by :meth:`zero_grad`) are not counted.
        """
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts)

        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        numel = sum(r.numel for r in self.layout.params)
        return {"params": nbytes(self.param_buffers.values()), "grads": nbytes(self.grad_buffers.values()),
                "master_params": nbytes(self.master_shards.values()), "optimizer_state": nbytes(state),
                "padding_elements": sum(self.layout.buffer_numel.values()) - numel, "numel": numel}

    # --- the step ---------------------------------------------------------------------------------------
    def _validate(self) -> None:
        """Everything :meth:`step` checks before writing: the loss scale, the hyperparameters (an optbook
        ``optimizer_class``), each gradient (shape, dtype, device), each parameter still in its buffer."""
        self.loss_scale  # noqa: B018 -- raises on a bad scale
        if isinstance(self.optimizer, BookOptimizer):
            for group in self.param_groups:
                self.optimizer._check_hyperparameters(group)
        i = 0
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                where = f"param_groups[{gi}]['params'][{pi}]"
                if p.numel() and p.data_ptr() != self._param_view(i).data_ptr():
                    raise RuntimeError(f"{where} (shape {tuple(p.shape)}) no longer lives in the optimizer's "
                                       "flat buffer (its .data was replaced, e.g. by model.to() or "
                                       "load_state_dict(assign=True)); copy new values in place instead, "
                                       "then build a new optimizer")
                if p.grad is not None:
                    check_grad(p, where)
                i += 1

    def _unscale_and_check(self, shard_grads: list[torch.Tensor]) -> bool:
        """Mean over ranks, then ``/ S``; whether this rank's shards hold an ``inf``/``NaN``.

        When the world size and ``S`` are powers of two, ``g * (1 / (d S))`` is exactly ``(g / d) / S``, so
        one fused pass (:func:`optbook.precision.unscale_grads_` by ``d S``) divides and checks; otherwise
        the division by ``d`` is its own pass."""
        if not shard_grads:
            return False
        scale = self.loss_scale
        if _is_power_of_two(self.world_size) and _is_power_of_two(scale):
            return unscale_grads_(shard_grads, self.world_size * scale)
        for g in shard_grads:
            g.div_(self.world_size)
        if self.loss_scaler is None:
            return not all_finite(shard_grads)
        return unscale_grads_(shard_grads, scale)

    def _raise_non_finite(self) -> None:
        """Every rank agreed that some mean gradient holds ``inf``/``NaN`` and there is no loss scaler: find
        the first such parameter over the group (one all-reduce, MIN) and raise on every rank."""
        first = len(self._params)
        for piece, grad in zip(self.pieces, self._piece_grads):
            if piece.index < first and not bool(torch.isfinite(grad).all()):  # the error path: syncs are fine
                first = piece.index
        index = torch.tensor([first], dtype=torch.float64, device=self.device)
        dist.all_reduce(index, op=dist.ReduceOp.MIN, group=self.process_group)
        index = int(index.item())
        gi, pi = self._group_position(index)
        raise contract.NonFiniteGradientError(
            f"DistributedOptimizer.step: the mean gradient of parameter {index} (param_groups[{gi}]['params']"
            f"[{pi}], shape {self.layout.params[index].shape}) holds inf or NaN and there is no loss_scaler to "
            "skip the step; nothing was written on any rank. Find the source of the non-finite value, or pass "
            "loss_scaler= to skip such steps")

    def _group_position(self, index: int) -> tuple[int, int]:
        """``(group, position in the group)`` of parameter ``index`` (param-group order)."""
        for gi, g in enumerate(self.param_groups):
            if index < len(g["params"]):
                return gi, index
            index -= len(g["params"])
        raise IndexError(index)

    @torch.no_grad()  # torch.optim.Optimizer.__init__ wraps step once more, to run the step hooks
    def step(self, closure=None, *, extra_grad_sumsq: float | None = None):
        """One ZeRO-1 step (a collective): the module docstring's sequence of calls.

        Args:
            closure: optional callable that recomputes the loss and calls ``backward`` (on
                :meth:`scale_loss` of it with a loss scaler); run with gradients enabled.
            extra_grad_sumsq: for a chain that clips by one global norm (chapter 14,
                :class:`optbook.distributed.DistributedChain`): the float64 sum of squares of the other
                members' mean gradients, the same number ``>= 0`` on every rank. It is added to this
                optimizer's sum of squares before the square root; :attr:`last_grad_norm` is then the
                global norm, and with ``max_grad_norm`` the shards are clipped by it.

        Returns:
            What ``closure`` returned, or ``None`` (as ``torch.optim.Optimizer.step``). The outcome is in the
            attributes (:mod:`optbook.contract`): ``found_inf`` -- with a loss scaler, ``True`` when some rank's
            mean gradient held ``inf``/``NaN`` and every rank skipped (parameters, masters and state unchanged,
            the loss scaler updated once, ``skipped_steps += 1``; advance a learning-rate scheduler only when
            it is ``False``); ``last_grad_norm`` -- the global norm of the mean, unscaled gradient before
            clipping (a float) when ``max_grad_norm`` or ``extra_grad_sumsq`` is given, else ``None``.

        Before anything else, parameters written in place since the optimizer's last write (a weights-only
        ``model.load_state_dict``, an in-place edit made identically on every rank) are taken up into the
        float32 masters (:mod:`optbook.contract`), so the step starts from them.

        A parameter whose ``grad`` is ``None`` on some ranks contributes zeros from those ranks (the mean
        still divides by the world size, as ``DistributedDataParallel``); one whose ``grad`` is ``None`` on
        every rank is not stepped (no decay, no step count), as in ``optimizer_class``.

        Raises:
            ValueError, TypeError: a hyperparameter, the loss scale or a gradient (shape, dtype, device) is
                invalid -- on **every** rank, even when only one rank's input is bad (the others raise a
                ``ValueError`` naming that rank). Nothing has been written then: parameters, masters, state
                and the ``.grad`` tensors are bitwise unchanged, and the ranks stay in step.
            RuntimeError: a parameter no longer lives in the flat buffer (its ``.data`` was replaced).
            optbook.contract.NonFiniteGradientError: without a loss scaler, some rank's mean gradient holds
                ``inf``/``NaN``: raised on every rank, naming the first such parameter; nothing was written on
                any rank (a ``ValueError``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated = None
        try:
            self._validate()
            if extra_grad_sumsq is not None:
                check_number("extra_grad_sumsq", extra_grad_sumsq, low=0.0)
            error = None
        except (TypeError, ValueError, RuntimeError) as e:
            error = e
        has_grad = [p.grad is not None for p in self._params]
        # 1. the flat gradient of this rank (the model's .grad is only read). Padding is never written (the
        #    reduce-scatter of zeros gives zeros), so only the ranges without a gradient are zeroed.
        for i, (p, r) in enumerate(zip(self._params, self.layout.params)):
            if r.numel:
                if p.grad is None or error is not None:
                    self._grad_view(i).zero_()
                elif p.grad.data_ptr() != self._grad_view(i).data_ptr():  # else: already there (in place)
                    self._grad_view(i).view(r.shape).copy_(p.grad)
        # 2. reduce-scatter (SUM) bucket by bucket: rank r receives its shard, in place
        shard_grads = []
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.numel:
                shard = self._shard(self.grad_buffers, b)
                if self._gloo_collectives:  # gloo: an all-reduce of the bucket; each rank reads its shard
                    dist.all_reduce(self.grad_buffers[bucket.dtype][bucket.start:bucket.end],
                                    group=self.process_group)
                else:
                    reduce_scatter(shard, self.grad_buffers[bucket.dtype][bucket.start:bucket.end],
                                   group=self.process_group)
                shard_grads.append(shard)
        # 3. mean, unscale, look for inf/NaN on this rank's shards
        found_inf = self._unscale_and_check(shard_grads) if error is None else False
        # 4. one small all-reduce (MAX): [failing rank + 1, found_inf, has_grad of every parameter]
        status = torch.tensor([self.rank + 1 if error is not None else 0, float(found_inf), *has_grad],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.process_group)
        status = status.tolist()
        if error is not None:
            raise error
        if status[0]:
            raise ValueError(f"DistributedOptimizer.step: rank {int(status[0]) - 1} of the group found an "
                             "invalid input (see its error); nothing was changed on any rank")
        found_inf = bool(status[1])
        if found_inf and self.loss_scaler is None:
            self._raise_non_finite()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        self.found_inf = found_inf
        self.last_grad_norm = None
        if found_inf:
            self.skipped_steps += 1
            return loss
        self._take_up_outside_writes()
        # 5. the pieces' gradients; a parameter without a gradient on every rank is not stepped
        stepped = []
        for piece, target, grad in zip(self.pieces, self._piece_params, self._piece_grads):
            target.grad = grad if status[2 + piece.index] else None
            if target.grad is not None:
                stepped.append(target)
        # 6. clip by the norm over the group: each rank's pieces are its own (counted once)
        if extra_grad_sumsq is not None:  # a chain's one global norm: this group's squares plus the others'
            self.last_grad_norm = _clip_with_extra(stepped, self.max_grad_norm, self.process_group,
                                                   float(extra_grad_sumsq)).item()
        elif self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(stepped, self.max_grad_norm, group=self.process_group).item()
        # 7. the inner step on this rank's shard, with the hyperparameters of param_groups
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optimizer.step()
        for target in self._piece_params:
            target.grad = None
        # 8. masters -> low-precision parameter shard; 9. all-gather the parameters
        for b, master in self.master_shards.items():
            self._shard(self.param_buffers, b).copy_(master)
        for b in range(len(self.layout.buckets)):
            self._gather(b)
        return loss

    # --- checkpoints ------------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on group rank ``to`` (a collective), for :meth:`state_dict`.

        Every rank sends its pieces' state (moved to the CPU) with ``torch.distributed.gather_object``; rank
        ``to`` assembles it. The result is dropped at the next :meth:`step`.

        Raises:
            TypeError, ValueError: ``to`` is not an int in ``0 .. world_size - 1`` (on every rank, before any
                communication).
        """
        to = check_int("to", to, 0)
        if to >= self.world_size:
            raise ValueError(f"Invalid to: expected a rank in 0 .. {self.world_size - 1}, got {to}")
        local = self._local_pieces()
        gathered = [None] * self.world_size if self.rank == to else None
        world = self.process_group is dist.group.WORLD
        dst = to if world else dist.get_global_rank(self.process_group, to)
        dist.gather_object(local, gathered, dst=dst, group=self.process_group)
        self._consolidated = self._assemble(gathered) if self.rank == to else None

    def _local_pieces(self) -> list[tuple]:
        """``(index, param_start, param_end, state, master or None)`` per piece of this rank, on the CPU."""
        local = []
        for piece, target in zip(self.pieces, self._piece_params):
            state = self.optimizer.state.get(target, {})
            state = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                     for k, v in state.items()}
            master = target.detach().cpu().clone() if piece.bucket in self.master_shards else None
            local.append((piece.index, piece.param_start, piece.param_end, state, master))
        return local

    def _assemble(self, gathered: list) -> dict:
        flat_state: dict[int, dict] = {}
        masters: dict[int, torch.Tensor] = {}
        for pieces in gathered:
            for index, s, e, state, master in pieces:
                r = self.layout.params[index]
                entry = flat_state.setdefault(index, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.shape == (e - s,):  # element-wise state
                        entry.setdefault(key, torch.zeros(r.numel, dtype=value.dtype))[s:e] = value
                    else:
                        entry[key] = value  # the same on every piece (a step count)
                if master is not None:
                    masters.setdefault(index, torch.zeros(r.numel, dtype=master.dtype))[s:e] = master
        for r in self.layout.params:  # every low-precision parameter has a master (zero elements included)
            if r.dtype in LOW_PRECISION:
                masters.setdefault(r.index, torch.zeros(r.numel, dtype=torch.float32))
        state = {}
        for index in sorted(flat_state):
            if flat_state[index]:
                shape = self.layout.params[index].shape
                state[index] = {k: (v.view(shape) if isinstance(v, torch.Tensor) and v.dim() == 1
                                    and v.numel() == self.layout.params[index].numel else v)
                                for k, v in flat_state[index].items()}
        param_groups, i = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            param_groups.append({**copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
                                 "params": list(range(i, i + n))})
            i += n
        return {"state": state, "param_groups": param_groups,
                "master_params": {k: v.view(self.layout.params[k].shape) for k, v in sorted(masters.items())},
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        """The consolidated state on the rank that :meth:`consolidate_state_dict` sent it to.

        Returns:
            The plain ``torch.optim`` layout -- ``{"state": {index: {"step": ..., "exp_avg": tensor of the
            parameter's shape, ...}}, "param_groups": [{hyperparameters..., "params": [indices]}]}`` with
            parameters numbered in param-group order (as ``torch.optim``, also when groups interleave
            relative to ``model.parameters()``), state tensors on the CPU in the masters' dtype -- plus
            ``"master_params"`` (``{index: float32 tensor}`` for float16/bfloat16 parameters),
            ``"loss_scaler"`` (its state or ``None``) and ``"skipped_steps"``, which ``torch.optim`` ignores.
            It loads into the single-process ``optimizer_class`` (e.g. ``torch.optim.AdamW``) over the same
            parameters, and into a DistributedOptimizer at any world size.

        Raises:
            RuntimeError: not consolidated on this rank since the last step.
        """
        if self._consolidated is None:
            raise RuntimeError(f"DistributedOptimizer.state_dict: nothing consolidated on rank {self.rank}; "
                               "call consolidate_state_dict(to=rank) on every rank first, then state_dict() "
                               "on that rank")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict (from :meth:`state_dict` at any world size, or from the
        single-process ``optimizer_class`` over the same parameters). Not a collective: call it on every
        rank with the same dict; each rank keeps its own pieces.

        Hyperparameters of ``param_groups`` are taken from the dict (as ``torch.optim``); ``master_params``,
        when present, become the masters and are rounded into the model parameters; ``loss_scaler`` and
        ``skipped_steps``, when present, are restored.

        Raises:
            TypeError, ValueError: not a dict with ``state`` and ``param_groups``; another number of groups or
                of parameters per group; a state tensor or master whose shape differs from its parameter's; a
                loss-scaler state without a scaler, or one the scaler refuses. All found before anything is
                loaded.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise TypeError("Invalid state_dict: expected a dict with 'state' and 'param_groups' (from "
                            "DistributedOptimizer.state_dict() or a torch.optim optimizer's state_dict())")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"Invalid state_dict: it has {len(saved_groups)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        index_of, i = {}, 0
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"Invalid state_dict: param group {gi} has {len(saved['params'])} "
                                 f"parameters, this optimizer's has {len(group['params'])}")
            for saved_id in saved["params"]:
                index_of[saved_id] = i
                i += 1
        owner_group = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        kinds = [self._state_kinds({k: v for k, v in g.items() if k != "params"}) for g in saved_groups]
        state: dict[int, dict] = {}
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in index_of:
                raise ValueError(f"Invalid state_dict: state for parameter {saved_id!r}, which no group "
                                 "lists")
            index = index_of[saved_id]
            self._check_state_entry(f"state[{saved_id!r}]", entry, kinds[owner_group[index]], index)
            state[index] = entry
        masters = {}
        for saved_id, value in (state_dict.get("master_params") or {}).items():
            index = index_of.get(saved_id)
            if (index is None or not isinstance(value, torch.Tensor)
                    or value.shape != self.layout.params[index].shape):
                raise ValueError(f"Invalid state_dict: master_params[{saved_id!r}] does not match a "
                                 "parameter's shape")
            masters[index] = value
        scaler_state = state_dict.get("loss_scaler")
        if scaler_state is not None:
            if self.loss_scaler is None:
                raise ValueError("Invalid state_dict: it holds a loss scaler state, but this optimizer has "
                                 "no loss_scaler")
            copy.deepcopy(self.loss_scaler).load_state_dict(scaler_state)  # refuses before any write
        skipped = state_dict.get("skipped_steps", self.skipped_steps)
        skipped = check_int("state_dict['skipped_steps']", skipped, 0)

        # The inner optimizer's own state dict: this rank's pieces, numbered in its group order.
        inner_state, inner_groups, k = {}, [], 0
        pieces_of_group: list[list[int]] = [[] for _ in self.param_groups]
        for n, piece in enumerate(self.pieces):
            pieces_of_group[owner_group[piece.index]].append(n)
        order = [n for ns in pieces_of_group for n in ns]
        for gi, ns in enumerate(pieces_of_group):
            hyper = {key: v for key, v in saved_groups[gi].items() if key != "params"}
            inner_groups.append({**hyper, "params": list(range(k, k + len(ns)))})
            k += len(ns)
        for k, n in enumerate(order):
            piece = self.pieces[n]
            if piece.index in state:
                elementwise = kinds[owner_group[piece.index]]
                inner_state[k] = {key: (v.reshape(-1)[piece.param_start:piece.param_end].clone()
                                        if elementwise[key] else copy.deepcopy(v))
                                  for key, v in state[piece.index].items()}
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for gi, group in enumerate(self.param_groups):
            group.update(copy.deepcopy({key: v for key, v in saved_groups[gi].items() if key != "params"}))
        if scaler_state is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        self.skipped_steps = skipped
        with torch.no_grad():
            for index, value in masters.items():
                self._param_view(index).copy_(value.reshape(-1))  # every rank rounds the whole master
            for piece, target in zip(self.pieces, self._piece_params):
                if piece.index in masters:
                    target.copy_(masters[piece.index].reshape(-1)[piece.param_start:piece.param_end])
        self._consolidated = None
        # The model's parameters now agree with the loaded masters (or are the masters' own storage); a
        # weights-only reload made before this load is superseded by it.
        self._versions.record(self._params)

    def _state_kinds(self, hyper: dict) -> dict:
        """``{state key: element-wise?}`` of the inner optimizer's per-parameter state under the group
        hyperparameters ``hyper``: read from one step of ``optimizer_class`` on a 2-element tensor with a zero
        gradient (element-wise entries are tensors of that tensor's shape; a step count is not). A 0-dim
        parameter's state cannot tell the two apart by shape, so the class is asked."""
        probe = torch.zeros(2, dtype=torch.float32, requires_grad=True)
        probe.grad = torch.zeros(2, dtype=torch.float32)
        try:
            opt = type(self.optimizer)([{**hyper, "params": [probe]}], **self._class_kwargs)
            opt.step()
        except (TypeError, ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"Invalid state_dict: its param_groups hyperparameters are refused by "
                             f"{type(self.optimizer).__name__}: {e}") from e
        return {k: isinstance(v, torch.Tensor) and v.shape == probe.shape for k, v in opt.state[probe].items()}

    def _check_state_entry(self, where: str, entry, kinds: dict, index: int) -> None:
        """``entry`` must hold exactly the inner optimizer's state keys, element-wise ones as floating-point
        tensors of parameter ``index``'s shape, the others as numbers or one-element tensors."""
        shape = self.layout.params[index].shape
        if not isinstance(entry, dict):
            raise TypeError(f"Invalid state_dict: {where} is a {type(entry).__name__}, expected a dict")
        if set(entry) != set(kinds):
            raise ValueError(f"Invalid state_dict: {where} has the keys {sorted(entry)}, "
                             f"{type(self.optimizer).__name__} keeps {sorted(kinds)} (a state dict of another "
                             "optimizer or of another model)")
        for key, value in entry.items():
            if kinds[key]:
                if (not isinstance(value, torch.Tensor) or not value.is_floating_point()
                        or tuple(value.shape) != shape):
                    what = (f"shape {tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                            else type(value).__name__)
                    raise ValueError(f"Invalid state_dict: {where}[{key!r}] is {what}, expected a "
                                     f"floating-point tensor of its parameter's shape {shape} (a state dict "
                                     "of another model?)")
            elif isinstance(value, torch.Tensor) and value.numel() > 1:
                raise ValueError(f"Invalid state_dict: {where}[{key!r}] has shape {tuple(value.shape)}, "
                                 "expected a number (a state dict of another optimizer?)")

    # --- sharded checkpoints: one file per rank --------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's part of the optimizer state, for one checkpoint file per rank. Not a collective.

        Returns:
            ``{"format": SHARDED_FORMAT, "rank", "world_size", "params": [(shape, dtype name)] in
            param-group order, "pieces": [(index, param_start, param_end, state, master)], "param_groups",
            "loss_scaler", "skipped_steps"}``: for each piece this rank owns, elements ``param_start ..
            param_end - 1`` of the flattened parameter ``index``, its inner-optimizer state (element-wise
            tensors such as ``exp_avg``, ``exp_avg_sq`` of the piece's length; the step count) and its
            float32 master (``None`` for a float32/float64 parameter, which is its own master). Tensors are
            CPU copies; only plain types, so ``torch.save`` / ``torch.load(weights_only=True)`` round-trip
            it. Padding is not stored. The model's parameters are not included: save them separately (they
            are the same on every rank, e.g. ``model.state_dict()`` on rank 0).
        """
        groups, i = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
                           "params": list(range(i, i + n))})
            i += n
        return {"format": SHARDED_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "params": [(tuple(r.shape), str(r.dtype)) for r in self.layout.params],
                "pieces": self._local_pieces(), "param_groups": groups,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def load_sharded_state_dict(self, shards) -> None:
        """Load sharded checkpoints from :meth:`sharded_state_dict`. Not a collective.

        Args:
            shards: either **this rank's own** dict (saved by the rank of the same number at the same world
                size and layout: the fast path, each rank reads one file), or a list of **every** rank's
                dict of one save, at any world size (each rank reads all files and keeps the elements its
                own pieces cover: resharding). Either way the run continues exactly as the uninterrupted
                one (bitwise: the state is copied, not recomputed).

        With the list, float16/bfloat16 masters are also rounded into the model parameters (as
        :meth:`load_state_dict`); with one dict only this rank's masters are restored and the model
        parameters must come from the model checkpoint (they are the rounded masters).

        Raises:
            TypeError: ``shards`` is neither a dict nor a list/tuple of dicts of this format.
            ValueError: one dict saved at another world size, or by another rank, or with other pieces
                (another ``bucket_size`` or alignment) -- the message names both sides and says to pass all
                files to reshard; a list that is not exactly ranks ``0 .. W - 1`` of one save at world size
                ``W``; parameters of other shapes or dtypes (naming the first); what
                :meth:`load_state_dict` raises. All before anything is loaded.
        """
        if isinstance(shards, dict):
            self._check_sharded(shards, "shards")
            own = [(p.index, p.param_start, p.param_end) for p in self.pieces]
            saved = [tuple(p[:3]) for p in shards["pieces"]]
            if shards["world_size"] != self.world_size or shards["rank"] != self.rank or saved != own:
                what = (f"world size {shards['world_size']}, this group has {self.world_size}"
                        if shards["world_size"] != self.world_size else
                        f"rank {shards['rank']}, this is rank {self.rank}" if shards["rank"] != self.rank
                        else "other pieces (another bucket_size or alignment)")
                raise ValueError(f"Invalid shards: this file was saved by rank {shards['rank']} of "
                                 f"{shards['world_size']}: {what}; to reshard, pass the list of all "
                                 f"{shards['world_size']} files of that save")
            consolidated = self._assemble([shards["pieces"]])
            whole = False
            meta = shards
        elif isinstance(shards, (list, tuple)) and shards:
            for k, sd in enumerate(shards):
                self._check_sharded(sd, f"shards[{k}]")
            sizes = sorted({sd["world_size"] for sd in shards})
            ranks = sorted(sd["rank"] for sd in shards)
            if len(sizes) != 1 or ranks != list(range(sizes[0])):
                raise ValueError(f"Invalid shards: expected the files of ranks 0 .. W - 1 of one save at "
                                 f"world size W, got ranks {ranks} saved at world sizes {sizes}")
            ordered = sorted(shards, key=lambda sd: sd["rank"])
            consolidated = self._assemble([sd["pieces"] for sd in ordered])
            whole = True
            meta = ordered[0]
        else:
            raise TypeError(f"Invalid shards: expected this rank's dict from sharded_state_dict() or a list of "
                            f"every rank's, got {type(shards).__name__}")
        consolidated.update(param_groups=meta["param_groups"], loss_scaler=meta.get("loss_scaler"),
                            skipped_steps=meta.get("skipped_steps", self.skipped_steps))
        if whole:
            self.load_state_dict(consolidated)
            return
        consolidated["master_params"] = {}  # other ranks' parts are absent: restore only this rank's below
        self.load_state_dict(consolidated)
        with torch.no_grad():  # the pieces equal the saved ones (checked above)
            for target, (_, _, _, _, master) in zip(self._piece_params, meta["pieces"]):
                if master is not None:
                    target.copy_(master)

    def _check_sharded(self, sd, name: str) -> None:
        if not isinstance(sd, dict) or sd.get("format") != SHARDED_FORMAT:
            raise TypeError(f"Invalid {name}: expected a dict from DistributedOptimizer.sharded_state_dict() "
                            f"(format {SHARDED_FORMAT!r}), got {type(sd).__name__}")
        mine = [(tuple(r.shape), str(r.dtype)) for r in self.layout.params]
        theirs = [(tuple(shape), dtype) for shape, dtype in sd["params"]]
        if len(theirs) != len(mine):
            raise ValueError(f"Invalid {name}: it holds {len(theirs)} parameters, this optimizer has {len(mine)}")
        for i, (a, b) in enumerate(zip(theirs, mine)):
            if a != b:
                raise ValueError(f"Invalid {name}: parameter {i} was saved with shape and dtype {a}, this "
                                 f"optimizer's is {b}")
