"""ZeRO-1: each data-parallel rank keeps the optimizer state of one shard of the parameters. Explained in
chapter 13.

Sources: Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC20, arXiv:1910.02054), stage 1 ("P_os", optimizer-state partitioning; bib key
``rajbhandari2020zero``); the layout and the order of the collectives follow Megatron-LM's distributed
optimizer (``megatron/core/distributed/param_and_grad_buffer.py`` and
``megatron/core/optimizer/distrib_optimizer.py``; bib key ``megatron2024distopt``). The code here is our
own.

The code is in four modules: the layout (:func:`shard_layout`, in ``_zero1_layout``: per-dtype flat buffers
cut into buckets and equal shards that ignore parameter boundaries; rank ``r``'s part of a parameter is a
:class:`Piece`), the optimizer (:class:`DistributedOptimizer`, here: the step below, in three public phases
``prepare_grads``, ``clip_grads``, ``step_with_ready_grads``, ``publish_weights``, as ``optbook.wrapper``
names them), its ownership of the weights under
:mod:`optbook.contract` (``_zero1_weights``: outside writes taken up, weights scaled in the masters), and its
checkpoints (``_zero1_checkpoints``). Every public name is importable
from here and from :mod:`optbook.distributed`.

One step (:meth:`DistributedOptimizer.step`) as collective calls, per bucket::

    all_reduce([bad input, check needed, has_grad...], MAX)   every rank raises together on bad input,
                                                    before the flat gradient (the .grad views) is touched
    flat_grad[param] = p.grad                      every rank, its own micro-batch's gradient
    reduce_scatter(flat_grad[shard r], flat_grad)   SUM; rank r receives the summed shard r (gloo: an
                                                    all-reduce of the bucket, of which rank r reads shard r) ...
    flat_grad[shard r] /= world_size                 ... and takes the mean
    flat_grad[shard r] /= S; found_inf             (with a loss scaler S, or gradients that could overflow)
    all_reduce([found_inf], MAX)                   every rank skips (or raises) together, one scale update
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

Checkpoints come in two kinds: consolidated (the plain ``torch.optim`` layout with each float32 master in its
parameter's state, as :mod:`optbook.masters` writes it; any world size; also what
``torch.distributed.checkpoint`` reads and writes) and sharded (one file per rank), described in
``_zero1_checkpoints``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import contract
from ..clipping import clip_coefficient, get_grad_norm, scale_grads_
from ..optim import AdamW
from .._checks import check_grad, check_number
from ..optim.optimizer import BookOptimizer, all_finite, check_hyperparameters, nonfinite_checked_by_caller
from ..loss_scaling import check_loss_scaler, loss_scale_of, scaled_loss, unscale_grads_
from ..wrapper import OptimizerWrapper
from ._comm import (
    LOW_PRECISION,
    agree,
    all_gather,
    check_same_params,
    first_nonfinite,
    global_rank,
    raise_nonfinite_across,
    reduce_scatter,
)
from ._zero1_checkpoints import SHARDED_FORMAT, Zero1Checkpoints
from ._zero1_weights import Zero1Weights
from ._zero1_layout import Bucket, Layout, ParamRange, Piece, is_power_of_two, shard_layout

__all__ = ["SHARDED_FORMAT", "Bucket", "DistributedOptimizer", "Layout", "ParamRange", "Piece", "shard_layout"]

def _clip_by_group_norm(params, max_norm, group, extra_sumsq: float | None) -> float:
    """``norm`` = :func:`optbook.clipping.get_grad_norm` of the ``params``' grads over ``group`` (with
    ``extra_sumsq``: ``sqrt(norm ** 2 + extra_sumsq)``); scale the grads by :func:`optbook.clipping.
    clip_coefficient` ``(norm, max_norm)`` (no scaling when ``max_norm`` is ``None`` or the norm is not
    finite), as :func:`optbook.clipping.clip_grad_norm_`. Returns the norm as a float (one device
    synchronisation, the one clip_grad_norm_ makes too)."""
    norm = get_grad_norm(params, group=group)
    if extra_sumsq is not None:
        norm = torch.sqrt(norm.square() + extra_sumsq)
    norm = norm.item()
    scale_grads_([p.grad for p in params if p.grad is not None], clip_coefficient(norm, max_norm))
    return norm


# --- the optimizer ------------------------------------------------------------------------------------------
class DistributedOptimizer(Zero1Checkpoints, Zero1Weights, OptimizerWrapper):
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
            :class:`optbook.optim.AdamW`; also ``SGD``, ``Adam``, ``Lion`` or ``torch.optim``'s): one for
            which :func:`optbook.contract.elementwise` is true. Any other (Muon, Shampoo, SOAP, Adafactor,
            ``torch.optim.Muon``, ...) is refused: its update of a matrix is not the concatenation of the
            updates of its pieces.
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
        found_inf, skipped_steps, last_grad_norm: the step contract's report (:mod:`optbook.contract`);
            ``skipped_steps`` is saved in both kinds of checkpoint.

    The owner of its parameters (:mod:`optbook.contract`): it registers itself, so
    :func:`optbook.contract.scale_weights_` (e.g. :func:`optbook.qk_clip_`) scales the float32 master shards
    -- a collective, every rank calls it; ``qk_clip_`` hands it all of a step's scalings at once, so each
    bucket is gathered once -- and an in-place write to a parameter made identically on every
    rank (a weights-only ``model.load_state_dict``) is taken up into the masters at the next :meth:`step`.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass; a bad ``loss_scaler``;
            an argument of the wrong type, named in the message.
        ValueError: a non-element-wise ``optimizer_class`` (naming it); parameters on several devices;
            float16 parameters without a loss scaler; ``max_grad_norm <= 0``; what ``optimizer_class`` raises
            for its hyperparameters; ranks whose parameters differ in number, shape or dtype (one collective;
            on every rank, naming the first differing parameter, each side's shape and dtype and its ranks).
            All before any parameter is touched.
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
        groups, filled = contract.checked_param_groups(optimizer_class, params, defaults)
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
        super().__init__(groups, filled)
        self.layout = layout
        self._layout = layout
        self.process_group = group
        self.rank, self.world_size = rank, world_size
        self.loss_scaler = loss_scaler
        self.max_grad_norm = max_grad_norm
        self.found_inf = False
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._consolidated: tuple | None = None   # (rank or "every rank", the dict there or None)
        self._params = all_params
        self._index_of = {id(p): i for i, p in enumerate(all_params)}
        self.device = next(iter(devices))
        self._global_ranks = [global_rank(group, q) for q in range(world_size)]
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
            src = global_rank(group, 0)
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
        torch.optim.Optimizer.add_param_group(self, param_group)   # its own groups (not the wrapper's forwarding)

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

        :meth:`step` reduces the buffer in place, so after a completed (or skipped) step these ``.grad``
        tensors hold no meaningful values: call ``zero_grad(set_to_none=False)`` before the next backward
        pass to keep the views (``set_to_none=True``, the default, drops them; the next gradients are then
        copied as usual). float16/bfloat16 parameters keep their own gradients (the buffer is float32). A
        step that raises
        leaves the views bitwise unchanged, so the step can be retried after fixing its input: input errors
        are agreed over the ranks before the buffer is touched, and when some rank's gradients could give a
        non-finite mean (without a loss scaler: a gradient whose 2-norm is non-finite or above
        ``max / (2 d)`` of its dtype) every rank copies its buffer first and puts it back before raising.

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
        for gi, group in enumerate(self.param_groups):
            if group.get("train_mode") is False:   # an inner Schedule-Free put in eval mode by eval()
                raise RuntimeError(f"Invalid call: step() with param_groups[{gi}] in eval mode; call train() first")
        if isinstance(self.optimizer, BookOptimizer):
            for group in self.param_groups:
                check_hyperparameters(self.optimizer, group)
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
        if is_power_of_two(self.world_size) and is_power_of_two(scale):
            return unscale_grads_(shard_grads, self.world_size * scale)
        self._mean_(shard_grads)
        if self.loss_scaler is None:
            return not all_finite(shard_grads)
        return unscale_grads_(shard_grads, scale)

    def _mean_(self, shard_grads: list[torch.Tensor]) -> None:
        """Divide the summed shards by the world size in place (by ``1 / d`` when ``d`` is a power of two:
        exactly the same bits, one multiply)."""
        if not shard_grads:
            return
        if is_power_of_two(self.world_size):
            torch._foreach_mul_(shard_grads, 1.0 / self.world_size)
        else:
            torch._foreach_div_(shard_grads, float(self.world_size))

    def _needs_check(self) -> bool:
        """Whether the mean gradient must be checked for ``inf``/``NaN`` after the reduction: always with a
        loss scaler (a non-finite mean is a skipped step); without one, only when this rank's gradients
        could make a mean non-finite. Each gradient's 2-norm (one ``torch._foreach_norm`` pass, one
        synchronisation) bounds its elements: below ``max / (2 d)`` of the buffer's dtype no sum over ``d``
        ranks can overflow, and a non-finite element makes its norm non-finite (as does a huge finite
        tensor: then the check runs needlessly, which is only slower). When no rank needs the check, the
        mean is finite and the check and its all-reduce are skipped; when one does (and there is no loss
        scaler), every rank copies its flat gradient buffer before the reduction, to put back the
        ``.grad`` views of :meth:`use_grad_buffer` before raising."""
        if self.loss_scaler is not None:
            return True
        grads = [p.grad for p, r in zip(self._params, self.layout.params) if p.grad is not None and r.numel]
        if not grads:
            return False
        limit = min(torch.finfo(b.dtype).max for b in self.grad_buffers.values()) / (2 * self.world_size)
        largest = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(grads)]).max()
        return not bool(largest <= limit)  # a NaN norm compares false: checked

    @torch.no_grad()  # torch.optim.Optimizer.__init__ wraps step once more, to run the step hooks
    def step(self, closure=None, *, extra_grad_sumsq: float | None = None):
        """One ZeRO-1 step (a collective): prepare_grads, clip_grads, step_with_ready_grads, publish_weights.

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
        if extra_grad_sumsq is not None:
            check_number("extra_grad_sumsq", extra_grad_sumsq, low=0.0)
        self._extra_sumsq = extra_grad_sumsq
        try:
            return OptimizerWrapper.step(self, closure)   # the template: validate ... publish_weights
        finally:
            self._extra_sumsq = None

    # --- the step's public phases (DistributedChain composes them) ----------------------------------------
    _extra_sumsq: float | None = None   # step(extra_grad_sumsq=): a chain's other members' squares

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Phase 1 of :meth:`step` (a collective): validate and agree over the ranks, reduce-scatter the mean
        gradient, unscale and look for ``inf``/``NaN`` (steps 0 to 5 of the module docstring), take up outside
        writes, and hand each piece its gradient for :meth:`step_with_ready_grads`.

        Returns:
            ``found_inf``: with a loss scaler, ``True`` when every rank skips this step (nothing written; the
            template step then updates the scaler and counts the step); then do not call the next phases.

        Raises:
            As :meth:`step`: bad input on any rank, or a non-finite mean gradient without a loss scaler, on
            every rank, nothing written (the ``.grad`` views of :meth:`use_grad_buffer` put back).
        """
        self._consolidated = None
        try:
            self._validate()
            error = None
        except (TypeError, ValueError, RuntimeError) as e:
            error = e
        has_grad = [p.grad is not None for p in self._params]
        # 0. one small all-reduce (MAX) before the flat gradient buffer is touched, since the .grad of
        #    use_grad_buffer() are views of it: [error code, the mean must be checked, has_grad...]
        _, check, *has_grad = agree(error, self.rank, self.process_group, self.device, "DistributedOptimizer",
                                    [float(error is None and self._needs_check()), *has_grad])
        # Without a loss scaler, a mean gradient with inf/NaN is an error, after which the .grad views must
        # hold what they held: when some rank's gradients could give one, every rank keeps a copy to restore.
        saved = ({dtype: buf.clone() for dtype, buf in self.grad_buffers.items()}
                 if check and self.loss_scaler is None else None)
        # 1. the flat gradient of this rank (the model's .grad is only read). Padding is never written (the
        #    reduce-scatter of zeros gives zeros), so only the ranges without a gradient are zeroed.
        for i, (p, r) in enumerate(zip(self._params, self.layout.params)):
            if r.numel:
                if p.grad is None:
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
        # 3. mean, unscale, look for inf/NaN on this rank's shards (4: agreed by one all-reduce, MAX)
        #    (no rank's gradients can make a mean non-finite, and no loss scaler: the mean alone)
        found_inf = False
        if check:
            found_inf = agree(None, self.rank, self.process_group, self.device, "DistributedOptimizer",
                              verdict=self._unscale_and_check(shard_grads))[0]
        else:
            self._mean_(shard_grads)
        if found_inf and self.loss_scaler is None:
            self._raise_non_finite(saved)
        self.last_grad_norm = None
        if found_inf:   # the template updates the loss scaler and counts the skipped step
            return True
        self.take_up_outside_writes()
        # 5. the pieces' gradients; a parameter without a gradient on every rank is not stepped
        for piece, target, grad in zip(self.pieces, self._piece_params, self._piece_grads):
            target.grad = grad if has_grad[piece.index] else None
        return False

    def _raise_non_finite(self, saved: dict | None) -> None:
        """Put back the flat gradient buffers from ``saved`` (their copies from before the reduction: the
        ``.grad`` views are then unchanged) and raise on every rank, naming the first non-finite parameter
        over the group (:func:`~optbook.distributed._comm.raise_nonfinite_across`)."""
        bad = first_nonfinite(self._piece_grads)   # the error path: synchronisations are fine
        if saved is not None:
            for dtype, buf in self.grad_buffers.items():
                buf.copy_(saved[dtype])
        raise_nonfinite_across("DistributedOptimizer", None if bad is None else self.pieces[bad].index,
                               self.param_groups, self.process_group, self.device,
                               advice="There is no loss_scaler to skip the step: find the source of the "
                                      "non-finite value, or pass loss_scaler= to skip such steps")

    def _stepped(self) -> list[torch.Tensor]:
        return [t for t in self._piece_params if t.grad is not None]

    def grad_sumsq(self) -> float:
        """The sum of squares of the prepared mean gradients over the group (a collective: one all-reduce;
        each element counted once), for a chain's one global norm."""
        return float(get_grad_norm(self._stepped(), group=self.process_group).square())

    def scale_grads(self, coefficient: float) -> None:
        """Multiply this rank's prepared gradient pieces by ``coefficient`` (a chain's clip)."""
        scale_grads_([t.grad for t in self._stepped()], coefficient)

    @torch.no_grad()
    def clip_grads(self) -> float | None:
        """Phase 2 of :meth:`step` (a collective when ``max_grad_norm`` is set): the global L2 norm of the
        prepared mean gradients over the group (each element counted once), kept in :attr:`last_grad_norm`
        and returned, and the pieces scaled by :func:`optbook.clipping.clip_coefficient`; ``None`` (nothing
        computed) without ``max_grad_norm``."""
        if self.max_grad_norm is None and self._extra_sumsq is None:
            return None
        self.last_grad_norm = _clip_by_group_norm(self._stepped(), self.max_grad_norm, self.process_group,
                                                  None if self._extra_sumsq is None else float(self._extra_sumsq))
        return self.last_grad_norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Phase 3 of :meth:`step` (local, after :meth:`prepare_grads` returned ``False``): the inner
        optimizer's step on this rank's pieces; :meth:`publish_weights` follows."""
        # 7. the inner step on this rank's shard, with the hyperparameters of param_groups. Its own look
        #    for inf/NaN would be a second pass: the mean is known finite here (checked in 3, or bounded
        #    by every rank's norms in 0), and clipping scales it by at most 1
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        with nonfinite_checked_by_caller([self.optimizer]):
            self.optimizer.step()
        self._has_state = True   # on every rank alike (the state view's truth value)
        for target in self._piece_params:
            target.grad = None
