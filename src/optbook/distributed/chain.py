"""One global gradient norm for a distributed Muon member and a ZeRO-1 AdamW member. Chapter 14.

The clip of a chained optimizer must use the norm of **all** the mean raw gradients (Pascanu et al. 2013,
section 3.2; Megatron-LM's ``ChainedOptimizer`` clips with one norm over every member,
``megatron/core/optimizer/optimizer.py``), not of the orthogonalised updates, whose norm Newton–Schulz fixes.
"""

from __future__ import annotations

import torch

from ._muon_common import check_max_grad_norm, clip_coefficient
from .layerwise_muon import LayerWiseMuon

__all__ = ["DistributedChain"]


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
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
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
        self.muon._apply(clip_coefficient(float(self.last_grad_norm), self.max_grad_norm))
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise NotImplementedError("DistributedChain: checkpoint each member (consolidate_state_dict, state_dict)")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("DistributedChain: load each member's state dict")
