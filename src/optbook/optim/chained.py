"""Several optimizers acting as one: one atomic ``step()``, one ``state_dict``, one global gradient norm.

Explained in chapter 7 (Muon + AdamW) and chapter 10 (anatomy of a step). Source: Megatron-LM,
``megatron/core/optimizer/optimizer.py`` (``ChainedOptimizer``).

The chain is a full :class:`torch.optim.Optimizer`: step and state-dict hooks, ``add_param_group``
(to a chosen member), ``torch.optim.lr_scheduler`` schedulers (including momentum cycling), and a
``state_dict`` in PyTorch's usual layout. ``param_groups`` is the concatenation of the members' groups
(the same dict objects), so a scheduler built on the chain updates every member; ``state`` is a view
that reads and writes the owning member's state.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, MutableMapping

import torch

from .optimizer import BookOptimizer, check_state_layout
from ..wrapper import OptimizerWrapper, pack_state_dict

__all__ = ["ChainedOptimizer"]


class _ChainedState(MutableMapping):
    """``chain.state``: ``state[p]`` is the state of ``p`` in the member that owns ``p``."""

    def __init__(self, chain: ChainedOptimizer):
        self._chain = chain

    def _owner(self, p) -> torch.optim.Optimizer:
        for opt in self._chain.optimizers:
            if any(q is p for group in opt.param_groups for q in group["params"]):
                return opt
        raise KeyError("this tensor is not a parameter of any optimizer in the chain")

    def __getitem__(self, p):
        return self._owner(p).state[p]  # a member's state is a defaultdict: {} for a new parameter

    def __setitem__(self, p, value) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p) -> None:
        del self._owner(p).state[p]

    def __iter__(self):
        return (p for opt in self._chain.optimizers for p in list(opt.state))

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._chain.optimizers)

    def __repr__(self) -> str:
        return f"ChainedState({len(self)} parameters)"


def _check_like_current(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """Each state tensor in ``state_dict`` has the shape and dtype of the one ``opt`` holds under that key
    (for a ``torch.optim`` member, whose state layout optbook does not know otherwise)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for index, p in zip(ids, params):
        for key, value in (state_dict["state"].get(index) or {}).items():
            held = opt.state[p].get(key) if p in opt.state else None
            if isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and value.ndim and (
                    value.shape != held.shape or value.dtype != held.dtype):
                raise ValueError(f"Invalid state_dict: state[{index!r}][{key!r}] has shape {tuple(value.shape)}, "
                                 f"dtype {value.dtype}; the optimizer holds {tuple(held.shape)}, {held.dtype}")


def _own_format(opt) -> bool:
    """Whether a member saves its own state-dict format (a wrapper such as ``MixedPrecisionOptimizer`` or
    ``OffloadOptimizer``, whose masters or host copies are not in ``torch.optim``'s layout)."""
    return not isinstance(opt, BookOptimizer) and type(opt).state_dict is not torch.optim.Optimizer.state_dict


def _check_member(i: int, opt) -> None:
    """Refuse a member whose gradients the chain's one check and global clip cannot see before it steps.

    A ``MixedPrecisionOptimizer``'s groups hold float32 masters whose gradients exist only inside its own
    step (and its loss scaler could skip its part of a step that the others apply); a distributed optimizer
    holds each rank's local gradients, whose norm is not the global one, and a rank raising alone would
    leave the others waiting in a collective.
    """
    if type(opt).__name__ == "FSDP2Muon":
        raise TypeError(f"Invalid optimizers: element {i} is an FSDP2Muon, whose gradients are this rank's shards: "
                        "the chain's one global norm and inf/NaN check would see only them; clip every parameter "
                        "by one norm with optbook.clipping.clip_grad_norm_(params, max_norm, group=mesh.get_group()), "
                        "then step FSDP2Muon and the optimizer of the other parameters in turn")
    if type(opt).__module__.startswith("optbook.distributed"):
        raise TypeError(f"Invalid optimizers: element {i} is a {type(opt).__name__}, a distributed optimizer; "
                        "chain it with optbook.distributed.DistributedChain, which clips by the norm of the "
                        "averaged gradients across ranks")
    if isinstance(opt, OptimizerWrapper) and not opt.chain_member:
        name = type(opt).__name__
        raise TypeError(f"Invalid optimizers: element {i} is a {name}, whose masters' gradients "
                        f"the chain cannot check or clip before it steps; wrap the chain instead: "
                        f"{name}(ChainedOptimizer([...]), loss_scaler)")


def _chain_groups(message: str, first: int) -> str:
    """A member's message with its ``param_groups[g]`` renumbered as the chain's (its first group is the
    chain's group ``first``)."""
    return re.sub(r"\bparam_groups\[(\d+)\]", lambda m: f"param_groups[{int(m[1]) + first}]", message)


def _member_error(error: Exception, k: int, opt, message: str) -> Exception:
    """``error``'s type with ``message`` and the member that raised it."""
    return type(error)(f"{message} (member {k}, {type(opt).__name__}, of the chain)")


class ChainedOptimizer(OptimizerWrapper):
    """Chain ``optimizers`` (e.g. ``[Muon(...), AdamW(...)]``) into one optimizer.

    Args:
        optimizers: non-empty sequence of ``torch.optim.Optimizer`` with disjoint parameters.
        max_grad_norm: if set (``> 0``), ``step()`` clips all gradients of all members by their
            *global* L2 norm (one norm over every parameter, :func:`optbook.clipping.clip_grad_norm_`),
            not one norm per member.

    ``step()`` is the template of :class:`optbook.wrapper.OptimizerWrapper` (Megatron-LM's
    ``ChainedOptimizer``: the members' gradients prepared, one global clip, then each member's
    ``step_with_ready_grads``), and it is atomic:

    1. one check over every gradient of every member, the global gradient norm (float64 sums of squares,
       finite exactly when every element is): if any gradient holds ``inf`` or ``NaN``,
       :class:`~optbook.contract.NonFiniteGradientError` is raised naming it and nothing is written (the step
       contract of :mod:`optbook.contract`: the chain has no loss scaler; wrap it in
       :class:`optbook.precision.MixedPrecisionOptimizer` with one to skip such steps). A member that is a
       wrapper (:class:`~optbook.memory.OffloadOptimizer`) prepares its own gradients first;
    2. every optbook member validates its hyperparameters and gradients, once (a bad value raises before
       *any* member writes; the message names the chain's group and the member);
    3. the gradients are clipped to ``max_grad_norm`` by that same norm, if set;
    4. each member steps in order, without validating again.

    Members from ``torch.optim`` validate inside their own ``step()``, after the members before them
    have stepped; use optbook's classes where the step must be atomic.

    Momentum cycling (``OneCycleLR``, ``CyclicLR`` with ``cycle_momentum=True``): when every member
    uses the same key (all ``momentum`` or all ``betas``), ``defaults`` holds it and schedulers write it
    as usual. When members mix them (Muon's ``momentum``, AdamW's ``betas``), ``defaults`` offers
    ``momentum`` only; the scheduler writes ``momentum`` into every group, and before each step the chain
    copies it into ``betas[0]`` for the members that use ``betas``.

    Attributes:
        optimizers: the members, in step order.
        last_grad_norm: the global gradient norm before clipping of the last ``step()`` (a Python float,
            units of the gradient), or ``None`` before the first step with a gradient.
        found_inf: always ``False``, and ``skipped_steps`` always ``0``: a chain never skips a step (it
            raises); the attributes are there because every wrapper of the step contract has them.

    Raises:
        TypeError: a member that is not a ``torch.optim.Optimizer``, is a ``MixedPrecisionOptimizer`` (wrap
            the chain in one instead) or a distributed optimizer of :mod:`optbook.distributed` (use
            ``DistributedChain``); ``max_grad_norm`` not a number.
        ValueError: no optimizers, a parameter owned by two members, or ``max_grad_norm <= 0`` (or NaN).
    """

    def __init__(self, optimizers, max_grad_norm: float | None = None):
        # The members own parameters and state, so Optimizer.__init__ (which would copy the groups)
        # is not called; what it sets up for hooks is set up here.
        members = list(optimizers)
        if not members:
            raise ValueError("Invalid optimizers: expected at least one optimizer")
        for i, opt in enumerate(members):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"Invalid optimizers: element {i} is a {type(opt).__name__}, not a "
                                "torch.optim.Optimizer")
        for i, opt in enumerate(members):
            _check_member(i, opt)
        seen: set[int] = set()
        for opt in members:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"Invalid optimizers: a parameter of shape {tuple(p.shape)} is in two "
                                         "optimizers")
                    seen.add(id(p))
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool)
                                          or not isinstance(max_grad_norm, (int, float))):
            raise TypeError(f"Invalid max_grad_norm: expected a number > 0 or None, got {max_grad_norm!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"Invalid max_grad_norm: expected > 0 or None, got {max_grad_norm!r}")
        self.optimizers = members
        self.max_grad_norm = max_grad_norm
        self.defaults = self._merged_defaults()
        self._init_wrapper()

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The members, in step order."""
        return self.optimizers

    def _merged_defaults(self) -> dict:
        """The members' defaults, first member first; ``momentum`` only when members mix the keys."""
        merged: dict = {}
        for opt in self.optimizers:
            for key, value in opt.defaults.items():
                merged.setdefault(key, value)
        if self._mixed_momentum_keys():
            merged.pop("betas", None)
        return merged

    def _mixed_momentum_keys(self) -> bool:
        keys = [("betas" in opt.defaults, "momentum" in opt.defaults) for opt in self.optimizers]
        return any(b and not m for b, m in keys) and any(m and not b for b, m in keys)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise AttributeError("ChainedOptimizer.param_groups is the members' groups; use add_param_group")

    @property
    def state(self) -> _ChainedState:
        return _ChainedState(self)

    def parameters(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict, optimizer: int | torch.optim.Optimizer | None = None) -> None:
        """Add ``param_group`` to one member (``optimizer``: its index or the member itself).

        ``optimizer`` may be left out when the chain has a single member.

        Raises:
            ValueError: ``optimizer`` missing with several members, not a member, or a parameter
                already in the chain (and whatever the member's own ``add_param_group`` raises).
        """
        if optimizer is None:
            if len(self.optimizers) != 1:
                raise ValueError(f"Invalid optimizer: this chain has {len(self.optimizers)} members; pass "
                                 "optimizer=<index or member> to say which one gets the group")
            member = self.optimizers[0]
        elif isinstance(optimizer, int) and not isinstance(optimizer, bool):
            if not 0 <= optimizer < len(self.optimizers):
                raise ValueError(f"Invalid optimizer: expected an index in [0, {len(self.optimizers)}), "
                                 f"got {optimizer}")
            member = self.optimizers[optimizer]
        elif any(optimizer is opt for opt in self.optimizers):
            member = optimizer
        else:
            raise ValueError("Invalid optimizer: expected an index or one of the chain's members")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owned = {id(p) for p in self.parameters()}
        for p in params:
            if id(p) in owned:
                raise ValueError(f"Invalid param_group: a parameter of shape {tuple(p.shape)} is already in the "
                                 "chain")
        member.add_param_group({**param_group, "params": params})
        for key, value in member.defaults.items():
            self.defaults.setdefault(key, value)

    def _sync_momentum(self) -> None:
        """Copy a scheduler's ``momentum`` into ``betas[0]`` for members that use ``betas``."""
        if not self._mixed_momentum_keys():
            return
        for opt in self.optimizers:
            if "betas" in opt.defaults and "momentum" not in opt.defaults:
                for group in opt.param_groups:
                    if "momentum" in group:
                        group["betas"] = (group["momentum"], *group["betas"][1:])

    # --- the phases of the step (optbook.wrapper); the template step() is the base class's ------------------
    def validate_leaves(self) -> None:
        """Copy a scheduler's ``momentum`` into ``betas[0]`` where members mix the keys, then every member's
        own checks (a skipped step, under a wrapper with a loss scaler, leaves the members untouched)."""
        self._sync_momentum()
        super().validate_leaves()

    def _leaf_error(self, error: Exception, k: int, optimizer) -> Exception:
        """A member's error with its ``param_groups[g]`` renumbered as the chain's and the member named."""
        first = sum(len(o.param_groups) for o in self.optimizers[:k])
        return _member_error(error, k, optimizer, _chain_groups(str(error), first))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def _layout(self) -> list[int]:
        """Number of groups of each member (to split a chain state dict)."""
        return [len(opt.param_groups) for opt in self.optimizers]

    def _split_state_dict(self, state_dict: dict) -> list[dict]:
        """One state dict per member (parameter indices renumbered from 0), from a checked chain dict."""
        return [part for part, _ in self._member_parts(state_dict)]

    def _member_parts(self, state_dict: dict) -> list[tuple[dict, Callable[[str], str]]]:
        """For each member: its part of a layout-checked chain dict (parameter indices renumbered from 0)
        and a function that rewrites a message about the part (``state[i]``, ``param_groups[g]``) into the
        chain dict's own indices, so that an error names what the caller passed."""
        groups, state, start, parts = state_dict["param_groups"], state_dict["state"], 0, []
        for n in self._layout():
            mine, first = groups[start:start + n], start
            start += n
            renumber = {old: new for new, old in enumerate(i for g in mine for i in g["params"])}
            back = {new: old for old, new in renumber.items()}

            def in_chain_terms(message: str, back=back, first=first) -> str:
                message = re.sub(r"\bstate\[(\d+)\]", lambda m: f"state[{back.get(int(m[1]), m[1])}]", message)
                return _chain_groups(message, first)

            parts.append(({"state": {renumber[i]: s for i, s in state.items() if i in renumber},
                           "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]} for g in mine]},
                          in_chain_terms))
        return parts

    def check_state_dict(self, state_dict) -> None:
        """Check that ``state_dict`` fits the whole chain, writing nothing (:meth:`load_state_dict` calls it).

        The chain's layout (groups, parameter counts and indices, ``state`` and ``param_groups`` present),
        then each member's part: an :class:`~optbook.optim.BookOptimizer` member checks its
        hyperparameters and state shapes and dtypes (:meth:`~optbook.optim.BookOptimizer.check_state_dict`);
        for a ``torch.optim`` member a state tensor must have the shape and dtype of the one the member
        holds under that key, if it holds one.

        Raises:
            ValueError, TypeError: naming the member and what does not fit.
        """
        check_state_layout(self.param_groups, state_dict)
        own = state_dict.get("members", {})
        for k, (opt, (part, in_chain_terms)) in enumerate(zip(self.optimizers, self._member_parts(state_dict))):
            try:
                if _own_format(opt):  # a wrapper member: its own dict, saved whole under "members"
                    if k not in own:
                        raise ValueError(f"Invalid state_dict: missing state_dict['members'][{k}], the own state "
                                         f"dict of this {type(opt).__name__}")
                    check = getattr(opt, "check_state_dict", None)
                    if check is not None:
                        check(own[k])
                elif isinstance(opt, BookOptimizer):
                    opt.check_state_dict(part)
                else:
                    check_state_layout(opt.param_groups, part)
                    _check_like_current(opt, part)
            except (TypeError, ValueError) as e:
                # a wrapper member's own dict keeps its own indices; a part's indices are the chain dict's
                raise _member_error(e, k, opt, str(e) if _own_format(opt) else in_chain_terms(str(e))) from e

    def _state_dict(self) -> dict:
        """PyTorch's layout over every member's groups (``state`` keyed by parameter index over all groups,
        ``param_groups`` concatenated); a member with a state-dict format of its own (a wrapper keeping
        masters or host copies) is also saved whole under ``"members"`` (``{member index: its dict}``)."""
        sd = pack_state_dict(self.param_groups, self.state)
        own = {k: opt.state_dict() for k, opt in enumerate(self.optimizers) if _own_format(opt)}
        if own:
            sd["members"] = own
        return sd

    def _load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by :meth:`state_dict` of a chain with the same members and groups; all or
        nothing (the base's ``load_state_dict`` runs the hooks and :meth:`check_state_dict` first).

        The state dict is in PyTorch's layout (``state`` keyed by parameter index over all groups,
        ``param_groups`` concatenated). It is checked whole first (:meth:`check_state_dict`: every member's
        part), then split and loaded into each member (which copies it). On an error no member has been
        written.

        Raises:
            ValueError, TypeError: as :meth:`check_state_dict` (a missing ``state``, a different number of
                groups or parameters, a state tensor of another shape or dtype, a bad hyperparameter).
        """
        for k, (opt, part) in enumerate(zip(self.optimizers, self._split_state_dict(state_dict))):
            if _own_format(opt):
                opt.load_state_dict(state_dict["members"][k])
            else:
                opt.load_state_dict(copy.deepcopy(part) if not isinstance(opt, BookOptimizer) else part)
