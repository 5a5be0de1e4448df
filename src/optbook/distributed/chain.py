"""One global gradient norm for a distributed Muon member and a ZeRO-1 AdamW member. Chapter 14.

The clip of a chained optimizer must use the norm of **all** the mean raw gradients (Pascanu et al. 2013,
section 3.2; Megatron-LM's ``ChainedOptimizer`` clips with one norm over every member,
``megatron/core/optimizer/optimizer.py`` at core_v0.16.0), not of the orthogonalised updates, whose norm Newton–Schulz fixes.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from ..clipping import clip_coefficient
from ..contract import NonFiniteGradientError
from ..wrapper import OptimizerWrapper
from ._comm import check_int, check_layout, check_one_save, layout_fingerprint
from ._muon_common import AgreedState, check_max_grad_norm
from .fsdp2 import FSDP2Muon
from .layerwise_muon import LayerWiseMuon
from .zero1 import DistributedOptimizer

__all__ = ["DistributedChain"]


class DistributedChain(OptimizerWrapper):
    """A :class:`LayerWiseMuon` (matrices) and a ZeRO-1 ``DistributedOptimizer`` (AdamW for the rest) as one
    optimizer whose clip uses **one** global norm of the mean raw gradients of both.

    The norm is ``sqrt(S_muon + S_adamw)``: ``S_muon`` is the sum of squares of the all-reduced (replicated)
    Muon gradients, computed once on every rank with no further communication; ``S_adamw`` sums the
    squares of each rank's ZeRO-1 shard over the group (``DistributedOptimizer.grad_sumsq()``, one all-reduce,
    the number ``DistributedOptimizer.step(extra_grad_sumsq=S_muon)`` adds ``S_muon`` to). Both members are then scaled by the same ``min(1, max_norm / (norm + 1e-6))``. The norm is
    that of the gradients, not of the orthogonalised updates (whose norm is fixed by Newton–Schulz and would
    make clipping meaningless). Without ``max_grad_norm`` the norm is still computed (``last_grad_norm``).

    Args:
        muon: a :class:`LayerWiseMuon` with ``max_grad_norm=None``.
        adamw: an ``optbook.distributed.DistributedOptimizer`` on the same process group, with
            ``max_grad_norm=None`` and no loss scaler.
        max_grad_norm: ``None`` or a number ``> 0``.

    ``param_groups`` is the members' groups (Muon's first), so one learning-rate scheduler drives both. The
    step and state-dict hooks of ``torch.optim.Optimizer`` (``register_step_pre_hook``, ...) run as there.
    Checkpoints: :meth:`state_dict` is ``torch.optim``'s layout over :attr:`param_groups` (both members' state
    by one index, float32 masters under ``"master_param"``), on the rank :meth:`consolidate_state_dict` (a
    collective) sent it to, or on every rank (a collective) when nothing was consolidated -- so
    ``torch.distributed.checkpoint``'s ``get_``/``set_optimizer_state_dict`` (full or sharded) work, and a
    read before the first step changes nothing (each member's priming is undone or harmless: zero momentum).
    :meth:`load_state_dict` validates both members' parts before either loads.

    Non-finite gradients (the step contract, :mod:`optbook.contract`): there is no loss scaler, so a mean
    gradient holding ``inf`` or ``NaN`` in either member makes :meth:`step` raise
    :class:`optbook.contract.NonFiniteGradientError` on every rank before either member writes anything.
    Attributes ``found_inf`` (always ``False``: it raises, never skips), ``skipped_steps`` (always 0 here; in the
    state dict)
    and ``last_grad_norm`` (the global norm before clipping, float).

    Step order (a collective), through the members' public phases only (Megatron-LM's names, also ``optbook.wrapper``'s,
    after Megatron-LM's ``ChainedOptimizer``: every member's ``prepare_grads``, one clip, every member's
    ``step_with_ready_grads``; ``megatron/core/optimizer/optimizer.py`` at core_v0.16.0): ``prepare_grads()`` of
    the Muon member (validate, all-reduce; on bad input or inf/NaN every rank raises, nothing written), then of
    the AdamW member (validate, reduce-scatter; if it raises, the Muon member drops its prepared gradients:
    nothing written); ``grad_sumsq()`` of both (the global norm above); ``scale_grads(c)`` of both;
    ``step_with_ready_grads()`` of both; ``publish_weights()`` of both (the all-gathers). No member's
    configuration (``max_grad_norm``, loss scaler) is changed; each one's ``last_grad_norm`` reports the chain's.
    Parameters of any shape, 0-dim ones included, go to the AdamW member (Muon refuses all but 2-D).

    Precision: bfloat16 parameters get float32 masters in both members (ZeRO-1 keeps them for its shard,
    LayerWiseMuon for the matrices a rank owns), so the chain on a bfloat16 model gives the numbers of
    :class:`optbook.precision.MixedPrecisionOptimizer` around a single-process ``ChainedOptimizer([Muon,
    AdamW])``.

    FSDP2: this chain steps replicated parameters (data parallelism). Under ``fully_shard`` every rank
    already holds its shard of the mean gradient: clip all of them by one norm with
    :func:`optbook.clipping.clip_grad_norm_` ``(params, max_norm, group=mesh.get_group())``, then step
    :class:`~optbook.distributed.FSDP2Muon` (matrices) and an element-wise optimizer (the rest) in turn;
    this class refuses an ``FSDP2Muon`` member, naming that recipe.

    Raises:
        TypeError: a member of the wrong type.
        ValueError: a member with its own ``max_grad_norm`` or a loss scaler, different process groups, or a
            bad ``max_grad_norm``.
    """

    def __init__(self, muon: LayerWiseMuon, adamw: DistributedOptimizer, max_grad_norm=None):
        if isinstance(muon, FSDP2Muon):
            raise TypeError("Invalid muon: DistributedChain takes a LayerWiseMuon (replicated parameters); under "
                            "FSDP2 each rank already holds its shard of the mean gradient: clip every parameter by "
                            "one norm with optbook.clipping.clip_grad_norm_(params, max_norm, "
                            "group=mesh.get_group()), then step the FSDP2Muon and the element-wise optimizer in turn")
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
        self.defaults = {**adamw.defaults, **muon.defaults}
        self._init_wrapper()   # hooks (the step's run by the template), found_inf, skipped_steps, last_grad_norm

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise AttributeError("DistributedChain.param_groups is the members' groups")

    @property
    def state(self) -> dict:
        """``{parameter: its state}``: a view of both members' ``state`` (this rank's entries, rebuilt at each
        access; the per-parameter dicts are the members' own). Its truth value is whether either member's
        is true -- whether any rank holds state, the same on every rank -- so that
        ``torch.distributed.checkpoint`` primes on every rank or none."""
        view = AgreedState(dict, {**self.muon.state, **self.adamw.state})
        view.any_rank = bool(self.muon.state) or bool(self.adamw.state)
        return view

    @state.setter
    def state(self, value) -> None:
        raise AttributeError("DistributedChain.state is a view of the members' state; load a state dict instead")

    def inner_optimizers(self) -> list:
        return [self.muon, self.adamw]

    # --- the phases of optbook.wrapper's template step (OptimizerWrapper.step) ---------------------------
    def validate(self) -> None:
        """Nothing here: each member validates in its :meth:`prepare_grads`, agreed over the ranks (a check on
        one rank alone would leave the others waiting in a collective)."""

    def validate_leaves(self) -> None:
        """Nothing here: done, once and agreed over the ranks, in the members' ``prepare_grads``."""

    def prepare_grads(self) -> bool:
        """The Muon member's ``prepare_grads`` (validate, all-reduce), then the AdamW member's (validate,
        reduce-scatter); if the second raises, the first drops its prepared gradients. A collective.

        Returns:
            ``False``: there is no loss scaler, a non-finite gradient raises.

        Raises:
            ValueError, TypeError: invalid input on any rank: every rank raises, nothing written by either
                member.
            optbook.contract.NonFiniteGradientError: a mean gradient of either member holds ``inf`` or
                ``NaN``: every rank raises (naming the member and the parameter), nothing written.
        """
        try:   # every rank raises together on bad input or inf/NaN, nothing kept
            self.muon.prepare_grads()
        except NonFiniteGradientError as e:
            raise NonFiniteGradientError(f"DistributedChain (Muon member): {e}") from e
        try:
            self.adamw.prepare_grads()   # no loss scaler: it raises, never skips
        except NonFiniteGradientError as e:
            self.muon.discard_grads()
            raise NonFiniteGradientError(f"DistributedChain (AdamW member): {e}") from e
        except BaseException:
            self.muon.discard_grads()
            raise
        return False

    def clip_grads(self) -> float:
        """One global norm over both members (one all-reduce: the AdamW member's shards; the Muon member's
        mean is replicated), both scaled by the same coefficient; the norm is every member's
        ``last_grad_norm`` too."""
        norm = math.sqrt(self.muon.grad_sumsq() + self.adamw.grad_sumsq())
        self.muon.last_grad_norm = self.adamw.last_grad_norm = norm
        coefficient = clip_coefficient(norm, self.max_grad_norm)
        for member in self.optimizers:
            member.scale_grads(coefficient)
        return norm

    def step_with_ready_grads(self) -> None:
        for member in self.optimizers:
            member.step_with_ready_grads()

    def publish_weights(self) -> None:
        """Both members' all-gathers."""
        for member in self.optimizers:
            member.publish_weights()

    # --- checkpoints ------------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Both members' ``consolidate_state_dict(to)`` (a collective), for :meth:`state_dict` on rank ``to``.

        Raises:
            TypeError, ValueError: ``to`` is not a rank of the group (on every rank, before communicating).
        """
        self.muon.consolidate_state_dict(to)
        self.adamw.consolidate_state_dict(to)

    def _state_dict(self) -> dict:
        """``state_dict()`` (the state-dict hooks run as in ``torch.optim``): ``torch.optim``'s layout over
        :attr:`param_groups` -- ``{"state": {index: state}, "param_groups": [the Muon member's groups, then
        the AdamW member's], "skipped_steps": int}``, parameters numbered in that order (the Muon member's
        first), each member's state (and float32 masters, under ``"master_param"``) as its own
        ``state_dict()`` gives it. This is what ``torch.distributed.checkpoint``'s
        ``get_``/``set_optimizer_state_dict`` read and write. On the rank :meth:`consolidate_state_dict`
        sent it to, or, when nothing was consolidated since the last step or load, on every rank (a
        collective: every rank calls it, as DCP does).

        Raises:
            RuntimeError: consolidated on another rank since the last step.
        """
        muon, adamw = self.muon.state_dict(), self.adamw.state_dict()
        n = sum(len(g["params"]) for g in self.muon.param_groups)
        state = {**{i: s for i, s in muon["state"].items()}, **{n + i: s for i, s in adamw["state"].items()}}
        groups = muon["param_groups"] + [{**g, "params": [n + i for i in g["params"]]} for g in adamw["param_groups"]]
        return {"state": dict(sorted(state.items())), "param_groups": groups, "skipped_steps": self.skipped_steps}

    def _split(self, state_dict) -> tuple[dict, dict]:
        """The members' dicts in ``state_dict`` (:meth:`_state_dict`'s layout; parameters matched by position
        in the groups, whatever their keys), or of the older ``{"muon": ..., "adamw": ...}`` layout."""
        if isinstance(state_dict, dict) and {"muon", "adamw"} <= set(state_dict):
            return state_dict["muon"], state_dict["adamw"]
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
                state_dict.get("param_groups"), (list, tuple)):
            raise TypeError("Invalid state_dict: expected a dict with 'state' and 'param_groups' (from "
                            "DistributedChain.state_dict())")
        groups, k = list(state_dict["param_groups"]), len(self.muon.param_groups)
        if len(groups) != len(self.param_groups):
            raise ValueError(f"Invalid state_dict: it has {len(groups)} param groups, this chain has "
                             f"{len(self.param_groups)} ({k} of the Muon member, then the AdamW member's)")
        parts = []
        for part in (groups[:k], groups[k:]):
            ids = {i for g in part if isinstance(g, dict) for i in (g.get("params") or [])}
            parts.append({"state": {i: s for i, s in state_dict["state"].items() if i in ids},
                          "param_groups": part})
        named = set().union(*(set(p["state"]) for p in parts))
        extra = [i for i in state_dict["state"] if i not in named]
        if extra:
            raise ValueError(f"Invalid state_dict: state for parameter {extra[0]!r}, which no group lists")
        return parts[0], parts[1]

    def check_state_dict(self, state_dict) -> None:
        """The chain's layout, ``skipped_steps`` and the Muon member's whole dict, writing nothing (the AdamW
        member checks its own whole dict before it writes anything, in ``load_state_dict``).

        Raises:
            TypeError, ValueError: the first problem found.
        """
        muon, _ = self._split(state_dict)
        check_int("state_dict['skipped_steps']", state_dict.get("skipped_steps", self.skipped_steps), 0)
        self.muon.check_state_dict(muon)

    def _load_state_dict(self, state_dict: dict) -> None:
        """``load_state_dict(state_dict)``: a dict from :meth:`state_dict` (any world size; also the older
        ``{"muon": ..., "adamw": ...}`` layout). Not a collective: call it on every rank with the same dict.
        All or nothing: :meth:`check_state_dict` first, then the ``DistributedOptimizer`` loads its part (it
        validates it whole before writing), and only then the Muon member; a dict without
        ``"skipped_steps"`` (saved before it existed) loads.
        """
        muon, adamw = self._split(state_dict)
        self.adamw.load_state_dict(adamw)
        self.muon.load_state_dict(muon)
        self.skipped_steps = state_dict.get("skipped_steps", self.skipped_steps)

    def sharded_state_dict(self) -> dict:
        """This rank's part of both members' state, for one checkpoint file per rank. Not a collective.

        Returns:
            ``{"muon": LayerWiseMuon.sharded_state_dict(), "adamw": DistributedOptimizer.sharded_state_dict(),
            "skipped_steps": int, "rank": int, "layout": :meth:`checkpoint_layout`}``.
        """
        return {"muon": self.muon.sharded_state_dict(), "adamw": self.adamw.sharded_state_dict(),
                "skipped_steps": self.skipped_steps, "rank": self.muon.rank, "layout": self.checkpoint_layout()}

    def checkpoint_layout(self) -> dict:
        """The layout fingerprint of this chain's sharded files (:func:`optbook.distributed._comm.
        layout_fingerprint`): both members' fingerprints under ``"parts"``, world size and parameters."""
        shape = SimpleNamespace(world_size=self.muon.world_size, _params=self.muon._params + self.adamw._params)
        return layout_fingerprint(shape, parts={"muon": self.muon.checkpoint_layout(),
                                                "adamw": self.adamw.checkpoint_layout()}, name="DistributedChain")

    def load_sharded_state_dict(self, shards) -> None:
        """Load :meth:`sharded_state_dict` files: this rank's own dict, or the list of every rank's dicts of
        one save (any world size). Not a collective. All or nothing, as :meth:`load_state_dict`: the Muon
        parts are checked (without loading), then the ``DistributedOptimizer`` loads its parts (it checks
        them all first), then the Muon member loads.

        The chain's layout fingerprint (:meth:`checkpoint_layout`) is judged first: a file of another class,
        files of two saves, or this rank's own file of another layout are refused naming both layouts; files
        of other parameters are left to the members, which name the parameter.

        Raises:
            TypeError, ValueError: not this format; another class, two saves, another layout (own file); what
                either member's sharded load raises (another rank, world size or model); nothing loaded.
        """
        parts = [shards] if isinstance(shards, dict) else list(shards) if isinstance(shards, (list, tuple)) else []
        mine, own = self.checkpoint_layout(), isinstance(shards, dict)
        for sd in parts:
            fp = sd.get("layout") if isinstance(sd, dict) else None
            if isinstance(fp, dict) and fp.get("class") != "DistributedChain":
                check_layout(fp, mine, "DistributedChain", own_file=False)
        if not parts or any(not isinstance(sd, dict) or not {"muon", "adamw"} <= set(sd) for sd in parts):
            raise TypeError("Invalid shards: expected this rank's dict from DistributedChain.sharded_state_dict() "
                            "or a list of every rank's")
        layouts = [sd.get("layout") for sd in parts]
        saved = (None if all(fp is None for fp in layouts) else layouts[0] if own
                 else check_one_save(parts, "DistributedChain"))
        if isinstance(saved, dict) and [(tuple(s), d) for s, d in saved.get("params", [])] == mine["params"]:
            check_layout(saved, mine, "DistributedChain", own_file=own, where="the file" if own else "the files")
        pick = (lambda key: parts[0][key]) if own else (lambda key: [sd[key] for sd in parts])
        skipped = check_int("shards['skipped_steps']", parts[0].get("skipped_steps", self.skipped_steps), 0)
        self.muon.check_sharded_state_dict(pick("muon"))
        self.adamw.check_sharded_state_dict(pick("adamw"))
        self.adamw.load_sharded_state_dict(pick("adamw"))
        self.muon.load_sharded_state_dict(pick("muon"))
        self.skipped_steps = skipped

