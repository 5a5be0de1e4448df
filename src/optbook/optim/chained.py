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
from collections import OrderedDict
from collections.abc import MutableMapping

import torch

from .optimizer import BookOptimizer, all_finite

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


class ChainedOptimizer(torch.optim.Optimizer):
    """Chain ``optimizers`` (e.g. ``[Muon(...), AdamW(...)]``) into one optimizer.

    Args:
        optimizers: non-empty sequence of ``torch.optim.Optimizer`` with disjoint parameters.
        max_grad_norm: if set (``> 0``), ``step()`` clips all gradients of all members by their
            *global* L2 norm (one norm over every parameter, :func:`optbook.clipping.clip_grad_norm_`),
            not one norm per member.

    ``step()`` is atomic:

    1. every member that is an :class:`optbook.optim.BookOptimizer` validates its hyperparameters and
       gradients (a bad value raises before *any* member writes);
    2. one check over every gradient of every member: if any is non-finite, the whole step is skipped
       for all members (nothing is written; ``found_inf`` is set and ``skipped_steps`` counts it);
    3. the global clip (if ``max_grad_norm``), then each member's ``step()`` in order.

    Members from ``torch.optim`` validate inside their own ``step()``, after the members before them
    have stepped; use optbook's classes where the step must be atomic.

    Momentum cycling (``OneCycleLR``, ``CyclicLR`` with ``cycle_momentum=True``): when every member
    uses the same key (all ``momentum`` or all ``betas``), ``defaults`` holds it and schedulers write it
    as usual. When members mix them (Muon's ``momentum``, AdamW's ``betas``), ``defaults`` offers
    ``momentum`` only; the scheduler writes ``momentum`` into every group, and before each step the chain
    copies it into ``betas[0]`` for the members that use ``betas``.

    Attributes:
        optimizers: the members, in step order.
        last_grad_norm: the global gradient norm of the last ``step()`` (a 0-dim tensor), or ``None``.
        found_inf: whether the last ``step()`` was skipped for a non-finite gradient.
        skipped_steps: how many steps were skipped that way (counted per process, not saved in the
            state dict; :class:`optbook.precision.MixedPrecisionOptimizer` saves its own counter).

    Raises:
        TypeError: an element is not a ``torch.optim.Optimizer``.
        ValueError: no optimizers, a parameter owned by two members, or ``max_grad_norm <= 0``.
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
        seen: set[int] = set()
        for opt in members:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"Invalid optimizers: a parameter of shape {tuple(p.shape)} is in two "
                                         "optimizers")
                    seen.add(id(p))
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: expected > 0 or None, got {max_grad_norm!r}")
        self.optimizers = members
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self.found_inf = False
        self.skipped_steps = 0
        self.defaults = self._merged_defaults()
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

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

    @torch.no_grad()
    def step(self, closure=None):
        """Validate every member, skip the whole step on a non-finite gradient, clip, step each member.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss (run once,
                with gradients enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError, TypeError: a member's hyperparameter or gradient is invalid; no member has
                written anything when this happens.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_momentum()
        books = [opt for opt in self.optimizers if isinstance(opt, BookOptimizer)]
        for opt in books:  # every optbook member validates before any member writes
            saved, opt.refuse_nonfinite_grads = opt.refuse_nonfinite_grads, False  # checked below, for all
            try:
                opt._validate()
            finally:
                opt.refuse_nonfinite_grads = saved
        grads = [p.grad for p in self.parameters() if p.grad is not None and p.grad.numel()]
        self.found_inf = bool(grads) and not all_finite(grads)
        if self.found_inf:  # skip the whole step for all members: nothing is written
            self.skipped_steps += 1
            return loss
        if grads:
            from optbook.clipping import clip_grad_norm_, get_grad_norm
            if self.max_grad_norm is not None:
                self.last_grad_norm = clip_grad_norm_(self.parameters(), self.max_grad_norm)
            else:
                self.last_grad_norm = get_grad_norm(self.parameters())
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def _layout(self) -> list[int]:
        """Number of groups of each member (to split a chain state dict)."""
        return [len(opt.param_groups) for opt in self.optimizers]

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by :meth:`state_dict` of a chain with the same members and groups.

        The state dict is in PyTorch's layout (``state`` keyed by parameter index over all groups,
        ``param_groups`` concatenated); it is split and loaded into each member (which copies it).

        Raises:
            ValueError: the number of groups, or of parameters in a group, differs.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or len(groups) != len(self.param_groups):
            raise ValueError(f"Invalid state_dict: expected {len(self.param_groups)} param_groups, got "
                             f"{None if groups is None else len(groups)}")
        state = state_dict.get("state", {})
        start = 0
        for opt, n in zip(self.optimizers, self._layout()):
            mine = groups[start:start + n]
            start += n
            ids = [i for g in mine for i in g["params"]]
            renumber = {old: new for new, old in enumerate(ids)}
            member = {"state": {renumber[i]: copy.deepcopy(s) for i, s in state.items() if i in renumber},
                      "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]} for g in mine]}
            opt.load_state_dict(member)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        inner = ",\n  ".join(repr(o).replace("\n", "\n  ") for o in self.optimizers)
        return f"ChainedOptimizer(\n  {inner}\n)"
