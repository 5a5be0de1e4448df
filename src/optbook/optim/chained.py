"""Several optimizers acting as one: one ``step()``, one ``state_dict``, one global gradient norm.

Explained in chapter 7 (Muon + AdamW) and chapter 10 (anatomy of a step). Source: Megatron-LM,
``megatron/core/optimizer/optimizer.py`` (``ChainedOptimizer``).

``param_groups`` is the concatenation of the children's groups (the same dict objects), so a
``torch.optim.lr_scheduler`` scheduler built on the chain updates every child.
"""

from __future__ import annotations

import torch

__all__ = ["ChainedOptimizer"]


class ChainedOptimizer(torch.optim.Optimizer):
    """Chain ``optimizers`` (e.g. ``[Muon(...), AdamW(...)]``) into one optimizer.

    Args:
        optimizers: non-empty sequence of ``torch.optim.Optimizer`` with disjoint parameters.
        max_grad_norm: if set (``> 0``), ``step()`` first clips all gradients of all children by
            their *global* L2 norm (one norm over every parameter, not one per child).

    Attributes:
        last_grad_norm: the global gradient norm of the last ``step()`` (a float tensor), or ``None``.

    Raises:
        TypeError: an element is not a ``torch.optim.Optimizer``.
        ValueError: no optimizers, a parameter owned by two children, or ``max_grad_norm <= 0``.
    """

    def __init__(self, optimizers, max_grad_norm: float | None = None):
        # The children own parameters and state; Optimizer.__init__ (which would copy groups) is not called.
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("Invalid optimizers: expected at least one optimizer")
        seen: set[int] = set()
        for i, opt in enumerate(self.optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"Invalid optimizers: element {i} is a {type(opt).__name__}, not a torch.optim.Optimizer")
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"Invalid optimizers: a parameter of shape {tuple(p.shape)} is in two "
                                         "optimizers")
                    seen.add(id(p))
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"Invalid max_grad_norm: expected > 0 or None, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self.defaults = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def parameters(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        """Clip by the global norm (if configured), then step every child in order.

        Returns the closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            self.last_grad_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(self.parameters(), self.max_grad_norm, self.last_grad_norm)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by :meth:`state_dict` of a chain of the same structure.

        Raises:
            ValueError: the number of children differs.
        """
        states = state_dict.get("optimizers")
        if states is None or len(states) != len(self.optimizers):
            raise ValueError(f"Invalid state_dict: expected {len(self.optimizers)} optimizer states, got "
                             f"{None if states is None else len(states)}")
        for opt, s in zip(self.optimizers, states):
            opt.load_state_dict(s)

    def __repr__(self) -> str:
        inner = ",\n  ".join(repr(o).replace("\n", "\n  ") for o in self.optimizers)
        return f"ChainedOptimizer(\n  {inner}\n)"
