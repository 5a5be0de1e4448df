"""ZeRO-1's ownership of the weights (:mod:`optbook.contract`): outside writes taken up into the float32
masters, weights scaled in the copy the next step starts from, the weights published (masters rounded into the
shards, all-gathered), and the phases of :class:`optbook.wrapper.OptimizerWrapper` that the step itself does
not need (modes, DCP's priming, the checks done inside ``prepare_grads``). Explained in chapter 13.

:class:`Zero1Weights` holds these methods for :class:`~optbook.distributed.DistributedOptimizer` (its only
user): they read the optimizer's ``layout``, ``pieces``, ``master_shards``, ``param_buffers``, its parameter
views and its version tracker.
"""

from __future__ import annotations

import torch

from ..masters import take_up_

__all__ = ["Zero1Weights"]


class Zero1Weights:
    """The weight-ownership methods of :class:`~optbook.distributed.DistributedOptimizer` (a mixin)."""

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
    def take_up_outside_writes(self) -> None:
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
        ``param`` from it, as the next :meth:`step` would (:func:`optbook.contract.scale_weights_` calls
        this): :meth:`_scale_weights_many_` with one pair. A collective (see there)."""
        self._scale_weights_many_([(param, factor)])

    @torch.no_grad()
    def _scale_weights_many_(self, pairs) -> None:
        """Multiply each ``param`` of ``pairs`` (``[(param, factor)]``) by its ``factor`` in this optimizer's
        copy, then rewrite the model's parameters from it once: each bucket holding one of them is gathered
        once, however many of its parameters were scaled (:func:`optbook.qk_clip_` scales every clipped query
        and key weight of a step in one call: one gather per bucket, not one per weight).

        A collective: every rank of the group calls it with the same ``pairs`` (its replicas, in the same
        order). Each rank multiplies the part of its shard that belongs to each ``param`` -- ``factor``
        expanded to ``param.shape``, flattened and sliced to the piece's range -- in the shard's dtype (the
        float32 master of a float16/bfloat16 parameter; the parameter itself for float32/float64), then the
        buckets are gathered again, so every rank's parameters hold the scaled (rounded) masters. Writes
        made to the parameters before (identically on every rank) are taken up first.

        Args:
            pairs: ``(param, factor)`` pairs: ``param`` one of this optimizer's parameters (the model's
                tensor), at most once; ``factor`` a Python number or a real tensor broadcastable to ``param.shape`` (a
                row scaling of a matrix: shape ``(rows, 1)``), the same on every rank.

        Raises:
            ValueError: a ``param`` that is not one of this optimizer's parameters or is named twice, or a
                ``factor`` that does not broadcast to its shape. Raised on the rank where it happens, before
                any write or communication.
        """
        flats = {}
        for param, factor in pairs:   # every pair checked before any write
            index = self._index_of.get(id(param))
            if index is None or self._params[index] is not param:
                raise ValueError(f"Invalid param: a tensor of shape {tuple(param.shape)} that this "
                                 "DistributedOptimizer does not hold")
            if index in flats:
                raise ValueError(f"Invalid pairs: parameter {index} (shape {tuple(param.shape)}) is named "
                                 "twice")
            shape = self.layout.params[index].shape
            try:
                flats[index] = torch.as_tensor(factor).to(param.device).expand(shape).reshape(-1)
            except RuntimeError as e:
                raise ValueError(f"Invalid factor: shape {tuple(torch.as_tensor(factor).shape)} does not "
                                 f"broadcast to the parameter's shape {shape}") from e
        if not flats:
            return
        self.take_up_outside_writes()
        for piece, target in zip(self.pieces, self._piece_params):
            flat = flats.get(piece.index)
            if flat is not None:
                target.mul_(flat[piece.param_start:piece.param_end].to(target.dtype))
        for b in sorted({self.layout.params[index].bucket for index in flats}):
            if b in self.master_shards:
                self._shard(self.param_buffers, b).copy_(self.master_shards[b])
            self._gather(b)

    # --- the wrapper base's phases that ZeRO-1 fills in (optbook.wrapper.OptimizerWrapper), publishing included
    def inner_optimizers(self) -> list:
        return [self.optimizer]

    def validate(self) -> None:
        """Nothing here: :meth:`prepare_grads` validates and agrees over the ranks before any write."""

    def validate_leaves(self) -> None:
        """Nothing here: the inner optimizer's hyperparameters are checked, agreed, in :meth:`prepare_grads`."""

    @torch.no_grad()
    def publish_weights(self) -> None:
        """The step's last phase (a collective): round the float32 masters into the parameter shards (8), then
        all-gather every bucket (9); every rank's parameters are then the optimizer's weights."""
        for b, master in self.master_shards.items():
            self._shard(self.param_buffers, b).copy_(master)
        for b in range(len(self.layout.buckets)):
            self._gather(b)

    def prime(self) -> None:
        """A step like any other: DCP's priming cannot be told apart on one rank (each sees its own gradients)."""
        if not self.prepare_grads():
            self.step_with_ready_grads()
            self.publish_weights()

    def set_mode(self, name: str) -> None:
        """The template's forwarding (outside writes taken up, the inner optimizer's mode, the weights
        published: a collective), then each group's ``train_mode`` read back from the inner optimizer's."""
        super().set_mode(name)
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            if "train_mode" in inner:
                outer["train_mode"] = inner["train_mode"]
