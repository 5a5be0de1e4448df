"""Wrappers that keep their own copy of the weights: one base, one checkpoint layout. Explained in chapter 11.

:class:`MastersWrapper` is the part of :class:`~optbook.wrapper.OptimizerWrapper` that every wrapper holding a
copy of the model's parameters shares -- the float32 masters of
:class:`~optbook.precision.MixedPrecisionOptimizer`, the host copies of :class:`~optbook.memory.OffloadOptimizer`:

* its ``param_groups`` are its own and hold the *model's* parameters (what a learning-rate scheduler,
  ``torch.distributed.checkpoint`` and the user see); its inner optimizers' groups hold the copies. The
  hyperparameters go to the inner groups before each step and mode switch and come back after
  (:meth:`MastersWrapper.sync_hyperparameters`) -- a scheduler writes the wrapper's groups;
* ``state`` is a view: ``state[p]`` is the inner optimizer's state of ``p``'s copy;
* it is the owner of the parameters it copies (:mod:`optbook.contract`): a write it did not make is taken up
  into the copy at the next step (:func:`take_up_`), :func:`optbook.contract.scale_weights_` scales the copy;
* one checkpoint layout, ``torch.optim``'s over the model's parameters, with each copy in its parameter's
  state under :data:`MASTER_KEY`::

      {"state": {i: {<the inner optimizer's state of parameter i>, "master_param": <its copy>}},
       "param_groups": [{<hyperparameters>, "params": [i, ...]}], <the subclass's own entries>}

  ``torch.distributed.checkpoint``'s ``get_``/``set_optimizer_state_dict`` read and write it (they keep
  ``state`` and ``param_groups`` only: the subclass's own entries, such as a loss scaler's state, travel
  with ``torch.save`` of :meth:`state_dict`). Loading checks every part through its inner optimizer's own
  ``check_state_dict`` (shapes, dtypes, finite values) and every copy (shape, dtype, finite) before it
  writes anything.

A subclass builds the copies (:meth:`_add_copy`) and the inner optimizers, then calls :meth:`_init_masters`
with, for each inner optimizer, which of its own groups and parameters each inner group holds.
"""

from __future__ import annotations

import copy as _copy

import torch

from .contract import VersionTracker, register_owner
from .optim.optimizer import BookOptimizer, check_state_layout
from .wrapper import OptimizerWrapper, pack_state_dict

__all__ = ["MASTER_KEY", "MastersWrapper", "check_optimizer_state_dict", "take_up_"]

#: The key of a parameter's copy (float32 master, host copy) in its state, in every wrapper's state dict.
MASTER_KEY = "master_param"


@torch.no_grad()
def take_up_(copy: torch.Tensor, param: torch.Tensor) -> None:
    """Copy an outside write of the model parameter ``param`` into the optimizer's ``copy`` of it.

    ``copy`` is the tensor the optimizer steps (a float32 master, a host copy), ``param`` the model's
    parameter (same shape, any device). With the same dtype the copy becomes ``param`` exactly. For a
    float16/bfloat16 ``param`` and a wider ``copy``, element by element: an element whose value still equals
    the copy rounded to ``param``'s dtype keeps the copy (its low bits: the write did not change it); every
    other element takes ``param``'s value. So reloading the weights the model already has (a weights-only
    checkpoint loaded after the optimizer's) loses nothing, and any real edit is kept. No synchronisation.
    """
    src = param.detach().to(copy.device)
    if src.dtype == copy.dtype:
        copy.copy_(src)
    else:
        copy.copy_(torch.where(src == copy.to(src.dtype), copy, src.to(copy.dtype)))


def check_optimizer_state_dict(state_dict, params: list[list[torch.Tensor]], elementwise: list[bool],
                               live_state=None, where: str = "state_dict") -> None:
    """Check a ``torch.optim``-layout state dict of an optimizer that is not optbook's against the tensors it
    steps; write nothing.

    Args:
        state_dict: ``{"state": {index: {name: value}}, "param_groups": [{"params": [index, ...], ...}]}``.
        params: per group, the tensors the optimizer steps (masters, host copies), in group order.
        elementwise: per parameter (flat group order), whether its optimizer is element-wise
            (:func:`optbook.contract.elementwise`): then every floating state tensor but ``step`` must have the
            parameter's shape (Adam's moments, momentum buffers).
        live_state: optional, per parameter (flat order), the optimizer's current state of it: a saved tensor
            under a key it already has must have that tensor's shape.
        where: how messages name the dict.

    Raises:
        ValueError: another number of groups or of parameters in a group; a state index that names no
            parameter; a state tensor (other than ``step``) that is not floating point, has another shape than
            required, or holds ``inf``/``NaN``.
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"Invalid {where}: expected a dict with 'state' and 'param_groups'")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(params):
        n = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
        raise ValueError(f"Invalid {where}: it has {n} param_groups, this optimizer has {len(params)}")
    index = {}
    for gi, (saved, mine) in enumerate(zip(groups, params)):
        ids = saved.get("params") if isinstance(saved, dict) else None
        if ids is None or len(ids) != len(mine):
            raise ValueError(f"Invalid {where}: param_groups[{gi}] has "
                             f"{'no' if ids is None else len(ids)} parameters, this optimizer's has {len(mine)}")
        for pi, i in enumerate(ids):
            index[i] = (gi, pi, len(index))
    if not isinstance(state, dict):
        raise ValueError(f"Invalid {where}['state']: expected a dict, got {type(state).__name__}")
    for i, entry in state.items():
        if i not in index:
            raise ValueError(f"Invalid {where}['state']: key {i!r} names no parameter of param_groups")
        gi, pi, flat = index[i]
        p = params[gi][pi]
        live = live_state[flat] if live_state is not None else {}
        for key, value in entry.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            name = f"{where}['state'][{i!r}][{key!r}] (param_groups[{gi}]['params'][{pi}])"
            if not value.is_floating_point():
                raise ValueError(f"Invalid {name}: dtype {value.dtype}, expected a floating-point tensor")
            expected = p.shape if elementwise[flat] else getattr(live.get(key), "shape", None)
            if expected is not None and value.shape != expected:
                raise ValueError(f"Invalid {name}: shape {tuple(value.shape)}, expected {tuple(expected)}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"Invalid {name}: holds inf or NaN (the next step would write it into the "
                                 "weights); nothing was loaded")


class _StateView(dict):
    """``wrapper.state``: ``{model parameter: the inner optimizer's state of its copy}`` (a snapshot of the
    mapping; each value is the live per-parameter dict). Indexing it by the copy itself (a master, as the
    inner optimizer's own ``state`` is keyed) gives the same dict."""

    def __init__(self, resolve):
        super().__init__()
        self._resolve = resolve

    def __missing__(self, key):   # as torch.optim's defaultdict: a parameter without state has an empty dict
        return self._resolve(key)


class MastersWrapper(OptimizerWrapper):
    """The base of a wrapper that keeps a copy of (some of) the model's parameters (module docstring).

    Subclass contract: set ``self.param_groups`` (the model's parameters), ``self.defaults``; for each copied
    parameter call :meth:`_add_copy`; build the inner optimizers on the copies; then :meth:`_init_masters`.
    """

    # --- construction -----------------------------------------------------------------------------------------
    def _add_copy(self, param: torch.Tensor, copy: torch.Tensor) -> None:
        """Record ``copy`` as the tensor the inner optimizers step for model parameter ``param``."""
        if not hasattr(self, "_copies"):
            self._copies = {}
        self._copies[param] = copy

    def _init_masters(self, leaf_groups: list) -> None:
        """Finish construction.

        Args:
            leaf_groups: for each inner (leaf) optimizer, for each of its groups, ``(gi, [pi, ...])``: the index
                of the wrapper's group it belongs to and the positions in that group of its parameters.
        """
        if not hasattr(self, "_copies"):
            self._copies = {}
        self._leaf_groups = list(leaf_groups)
        self._init_wrapper()
        self._tracker = VersionTracker()
        self._own()

    def _own(self) -> None:
        register_owner(list(self._copies), self)
        self._tracker.record(list(self._copies))

    def copy_of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizers step for model parameter ``param`` (``param`` itself if none)."""
        return self._copies.get(param, param)

    def master_params(self) -> list[torch.Tensor]:
        """The copies, one per copied model parameter, in group order."""
        return [self._copies[p] for p in self.model_params() if p in self._copies]

    def params_for_norm(self) -> list[torch.Tensor]:
        """The tensors the inner optimizers step, in the model's parameter order, those with a gradient."""
        return [q for q in map(self.copy_of, self.model_params()) if q.grad is not None]

    @property
    def state(self) -> dict:
        """``{model parameter: its inner optimizer's state}`` for every parameter with state (a view)."""
        view = _StateView(self._state_of)
        for leaf in self.leaves():
            for p in self.model_params():
                q = self.copy_of(p)
                if q in leaf.state and leaf.state[q]:
                    view[p] = leaf.state[q]
        return view

    def _state_of(self, key) -> dict:
        """The live state dict of a model parameter or of its copy, in the inner optimizer that steps it."""
        q = self.copy_of(key)
        for leaf in self.leaves():
            if any(q is x for g in leaf.param_groups for x in g["params"]):
                return leaf.state[q]
        raise KeyError("this tensor is not a parameter of this wrapper")

    # --- hyperparameters --------------------------------------------------------------------------------------
    def _leaf_group_pairs(self):
        for leaf, spec in zip(self.leaves(), self._leaf_groups):
            for group, (gi, _) in zip(leaf.param_groups, spec):
                yield group, self.param_groups[gi]

    def sync_hyperparameters(self, back: bool = False) -> None:
        """Copy every hyperparameter of the wrapper's groups into the inner groups (``back``: the other way,
        after the inner optimizers may have changed one, such as Schedule-Free's ``train_mode``; only after a
        copy forward, so that a skipped step, which leaves the inner optimizers untouched, changes nothing)."""
        if back and not self.__dict__.pop("_synced", False):
            return
        self._synced = not back
        for inner, own in self._leaf_group_pairs():
            src, dst = (inner, own) if back else (own, inner)
            for k, v in src.items():
                if k != "params" and dst.get(k, _MISSING) is not v:
                    dst[k] = v

    def validate_leaves(self) -> None:
        self.sync_hyperparameters()   # only now: a skipped step leaves the inner optimizers bitwise untouched
        super().validate_leaves()

    def step(self, closure=None):
        try:
            return super().step(closure)
        finally:
            self.sync_hyperparameters(back=True)

    def set_mode(self, name: str) -> None:
        self.sync_hyperparameters()
        super().set_mode(name)
        self.sync_hyperparameters(back=True)

    def prime(self) -> None:
        self.sync_hyperparameters()
        super().prime()

    # --- the copies (optbook.contract) ------------------------------------------------------------------------
    def take_up_outside_writes(self) -> None:
        """Copy writes the wrapper did not make from each model parameter into its copy (:func:`take_up_`)."""
        params = list(self._copies)
        changed = [params[i] for i in self._tracker.changed(params)]
        for p in changed:
            take_up_(self._copies[p], p)
        self._tracker.record(changed)
        super().take_up_outside_writes()

    def _write_model(self, param: torch.Tensor, copy: torch.Tensor) -> None:
        """Write model parameter ``param`` from its copy (one rounding to its dtype)."""
        param.copy_(copy)

    def publish_weights(self) -> None:
        """Write every copied model parameter from its copy, then record their versions."""
        super().publish_weights()
        for p, q in self._copies.items():
            self._write_model(p, q)
        self._tracker.record(list(self._copies))

    @torch.no_grad()
    def _scale_weights_(self, param: torch.Tensor, factor) -> None:
        """``copy *= factor`` (float32 or wider), then the parameter from the copy
        (:func:`optbook.contract.scale_weights_`); an outside write not yet taken up is taken up first."""
        q = self._copies.get(param)
        if q is None:   # stepped in place: an ordinary scaling
            param.mul_(factor)
            return
        if self._tracker.changed([param]):
            take_up_(q, param)
        q.mul_(factor.to(q.device) if isinstance(factor, torch.Tensor) else factor)
        self._write_model(param, q)
        self._tracker.record([param])

    # --- checkpoints ------------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        """The subclass's own top-level entries of the state dict (default: ``skipped_steps``)."""
        return {"skipped_steps": self.skipped_steps}

    def _state_dict(self) -> dict:
        state = {}
        for p in self.model_params():
            entry = dict(self.state.get(p, {}))
            if p in self._copies:
                entry[MASTER_KEY] = self._copies[p].detach()
            state[p] = entry
        return {**pack_state_dict(self.param_groups, state), **self._extra_state()}

    def _leaf_parts(self, state_dict: dict) -> list[dict]:
        """Each inner optimizer's part of a layout-checked wrapper dict, in its own indices."""
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        parts = []
        for leaf, spec in zip(self.leaves(), self._leaf_groups):
            groups, state, n = [], {}, 0
            for gi, positions in spec:
                ids = []
                for pi in positions:
                    entry = saved_state.get(saved_groups[gi]["params"][pi])
                    if entry:
                        state[n] = {k: v for k, v in entry.items() if k != MASTER_KEY}
                    ids.append(n)
                    n += 1
                groups.append({**{k: v for k, v in saved_groups[gi].items() if k != "params"}, "params": ids})
            parts.append({"state": {k: v for k, v in state.items() if v}, "param_groups": groups})
        return parts

    def _check_leaf_part(self, leaf, part: dict, where: str) -> None:
        if isinstance(leaf, BookOptimizer):
            leaf.check_state_dict(part)
            return
        from .contract import elementwise
        params = [list(g["params"]) for g in leaf.param_groups]
        check_optimizer_state_dict(part, params, [elementwise(type(leaf))] * sum(map(len, params)),
                                   [leaf.state.get(p, {}) for ps in params for p in ps], where)

    def _check_extra_state(self, state_dict: dict) -> None:
        """Check the subclass's own entries (default: ``skipped_steps``, an int ``>= 0`` if present)."""
        skipped = state_dict.get("skipped_steps", 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"Invalid state_dict['skipped_steps']: expected an int >= 0, got {skipped!r}")

    def check_state_dict(self, state_dict) -> None:
        """Everything :meth:`load_state_dict` checks, writing nothing.

        The layout (``torch.optim``'s over the model's parameters); each inner optimizer's part through its own
        ``check_state_dict`` (hyperparameters, state shapes and dtypes, finite values); each copy under
        :data:`MASTER_KEY` (the copy's shape and dtype, finite; a parameter without one keeps its current copy,
        as a dict saved before the first step has none); the subclass's own entries.

        Raises:
            ValueError, TypeError: naming the part, the parameter and what does not fit.
        """
        check_state_layout(self.param_groups, state_dict)
        for k, (leaf, part) in enumerate(zip(self.leaves(), self._leaf_parts(state_dict))):
            try:
                self._check_leaf_part(leaf, part, f"state_dict (inner optimizer {k})")
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} (inner optimizer {k}, {type(leaf).__name__}, of the "
                              f"{type(self).__name__})") from e
        for gi, (group, saved) in enumerate(zip(self.param_groups, state_dict["param_groups"])):
            for pi, (p, i) in enumerate(zip(group["params"], saved["params"])):
                value = (state_dict["state"].get(i) or {}).get(MASTER_KEY)
                if value is None:
                    continue
                q = self.copy_of(p)
                where = f"state_dict['state'][{i!r}][{MASTER_KEY!r}] (param_groups[{gi}]['params'][{pi}])"
                if p not in self._copies:
                    raise ValueError(f"Invalid {where}: this parameter has no copy here (a state dict of "
                                     "another configuration?)")
                if not isinstance(value, torch.Tensor) or value.shape != q.shape or value.dtype != q.dtype:
                    raise ValueError(f"Invalid {where}: expected a {q.dtype} tensor of shape {tuple(q.shape)}, "
                                     f"got {getattr(value, 'dtype', type(value).__name__)} of shape "
                                     f"{tuple(getattr(value, 'shape', ()))}")
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(f"Invalid {where}: holds inf or NaN; nothing was loaded")
        self._check_extra_state(state_dict)

    def _load_extra_state(self, state_dict: dict) -> None:
        self.skipped_steps = state_dict.get("skipped_steps", self.skipped_steps)

    @torch.no_grad()
    def _load_state_dict(self, state_dict: dict) -> None:
        """Load a checked dict: each inner optimizer its part (it copies), each copy, the model from the copies."""
        for leaf, part in zip(self.leaves(), self._leaf_parts(state_dict)):
            leaf.load_state_dict(part if isinstance(leaf, BookOptimizer) else _copy.deepcopy(part))
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for p, i in zip(group["params"], saved["params"]):
                value = (state_dict["state"].get(i) or {}).get(MASTER_KEY)
                if value is not None:
                    self._copies[p].copy_(value)
        self.sync_hyperparameters()
        for p, q in self._copies.items():
            self._write_model(p, q)
        self._tracker.record(list(self._copies))
        self._load_extra_state(state_dict)

    # --- pickling ---------------------------------------------------------------------------------------------
    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._tracker = VersionTracker()   # keyed by tensor identity: the unpickled tensors are new objects
        self._own()


_MISSING = object()
