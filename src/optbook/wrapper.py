"""One base class for every optimizer wrapper: the step contract of :mod:`optbook.contract` in code.
Explained in chapter 10.

A *wrapper* holds optimizers (its *inner* optimizers: a chain's members, the optimizer a mixed-precision
wrapper steps on float32 masters, the host optimizers of an offload) and owns the step around them. The
step is written once, here, as a template with public phases; a wrapper overrides the phases it changes
and inherits the rest. The shape is Megatron-LM's ``MegatronOptimizer`` (NVIDIA/Megatron-LM at commit
001199898c4b, ``megatron/core/optimizer/optimizer.py``: ``prepare_grads`` returns whether a non-finite
gradient was found, then ``clip_grad_norm``, then ``step_with_ready_grads`` steps the inner optimizer and
copies the main parameters into the model; ``ChainedOptimizer`` calls its members' ``prepare_grads`` and
``step_with_ready_grads`` and clips once by the global norm in between).

The template, :meth:`OptimizerWrapper.step`::

    loss = closure()                  with gradients enabled (optbook.contract.closure_loss)
    DCP priming?                      prime() and return (is_priming_step, below)
    validate()                        the wrapper's own checks; nothing written on an error
    found_inf = prepare_grads()       take up outside writes; main gradients; unscale; reduce; ONE check for
                                      inf/NaN: raises NonFiniteGradientError without a loss scaler
    validate_leaves()                 (unless found_inf) every inner optimizer's own checks, ONCE, on the ready
                                      gradients, before any of them writes
    update_loss_scale(found_inf)      the loss scaler's one update (none: nothing)
    found_inf: skipped_steps += 1; return loss
    last_grad_norm = clip_grads()     one global norm; clip when max_grad_norm is set
    step_with_ready_grads()           each inner optimizer steps (without validating again)
    publish_weights()                 masters -> model parameters (an all-gather, for a sharded wrapper)
    return loss

Nesting goes through the same phases: ``MixedPrecisionOptimizer(ChainedOptimizer([Muon, AdamW]))`` calls
the chain's ``validate``, ``validate_leaves``, ``clip_grads`` (only if the chain clips by its own
``max_grad_norm``), ``step_with_ready_grads`` and ``publish_weights``, never its ``prepare_grads``: the outer
wrapper made and checked every gradient already. So hyperparameters are validated once per step and the
gradients checked for inf/NaN once, whatever the nesting.

A subclass implements :meth:`inner_optimizers` and the checkpoint methods (:meth:`check_state_dict`,
:meth:`_state_dict`, :meth:`_load_state_dict`) and overrides the phases it changes; where it keeps a copy of
the weights (float32 masters, host copies) also :meth:`take_up_outside_writes` and :meth:`publish_weights`.
Its ``param_groups``, ``state`` and ``defaults`` are its own (a property or attributes).

What the base forwards once, so that every wrapper offers what its inner optimizers offer:

* modes: :meth:`train`/:meth:`eval` (Schedule-Free evaluates at its average ``x``), or any other mode by
  name (:meth:`set_mode`): outside writes are taken up first, every inner optimizer that has the method is
  called, and the weights are published, so the model holds what the masters hold;
* the step and state-dict hooks of ``torch.optim.Optimizer`` (``register_step_pre_hook``,
  ``register_state_dict_post_hook``, ...), run by :meth:`step`, :meth:`state_dict` and
  :meth:`load_state_dict`; the learning-rate schedulers of ``torch.optim.lr_scheduler``;
* ``add_param_group`` (to the single inner optimizer, unless the subclass says otherwise),
  ``zero_grad(set_to_none=...)`` (the model's gradients and every inner optimizer's);
* pickling (``torch.save``/``copy.deepcopy`` of the object): hooks are dropped, as
  ``torch.optim.Optimizer.__getstate__`` drops them, so a wrapper with a ``lambda`` hook pickles; a
  distributed wrapper's WORLD process group is kept by reference (any other group is refused, naming it);
* ``repr``, and the per-step report: ``found_inf``, ``skipped_steps``, ``last_grad_norm``
  (:attr:`report`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .clipping import clip_coefficient, get_grad_norm, scale_grads_
from .contract import NonFiniteGradientError, closure_loss

__all__ = ["OptimizerWrapper", "StepReport", "is_priming_step", "leaf_step", "pack_state_dict", "record_priming",
           "undo_priming", "validated_by_caller"]

_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


# --- DCP's priming step ---------------------------------------------------------------------------------------
# torch.distributed.checkpoint.state_dict (torch 2.13, ``_init_optim_state``; pytorch/pytorch#164929) creates the
# state of an optimizer that has none by calling a real ``step()``: every parameter that requires grad gets a zero
# gradient and every group's ``lr`` is set to 0 for the call. It does so in ``get_optimizer_state_dict`` and
# ``set_optimizer_state_dict``, so that ``dcp.load`` finds state tensors to load into. A real step with a zero
# gradient is not free: counters advance (Adam's bias correction is then off by one), Shampoo's inverse roots
# come from eps*I, Dion's right factor becomes zero, SOAP keeps the eigenbasis of a zero matrix. So the priming
# step is recognised (empty state, every lr 0, every gradient of a parameter that requires grad present and
# zero) and stepped as usual -- DCP gets state tensors of the right shapes and dtypes -- and that state is
# remembered. At the next step, if nothing has loaded over it (no ``load_state_dict``, no in-place write by
# ``dcp.load``: the same tensor objects at the same version counters, the same non-tensor entries), it is
# dropped, so the optimizer starts from empty state exactly as without the read: bitwise the same steps.
# The one step taken for priming that is not: a first step with lr 0 and every gradient exactly zero (a
# warm-up from lr 0 on a dead model), whose state would also be dropped -- its only effect was that state.
def _lr_is_zero(lr) -> bool:
    if isinstance(lr, torch.Tensor):
        return lr.numel() == 1 and float(lr) == 0.0
    return isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr == 0


def is_priming_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` is being called as DCP's ``_init_optim_state`` calls it: no state, every
    group's ``lr`` 0, and every parameter that requires grad has a gradient, all zero (read last: one
    synchronisation, only when the first two hold)."""
    groups = optimizer.param_groups
    if not groups or not all("lr" in g and _lr_is_zero(g["lr"]) for g in groups):
        return False
    if any(len(s) for s in optimizer.state.values()):
        return False
    params = [p for g in groups for p in g["params"]]
    if any(p.requires_grad and p.grad is None for p in params):
        return False
    grads = [p.grad for p in params if p.grad is not None]   # a wrapper's host copy need not require grad
    if not grads:
        return False
    return not any(bool(g.any()) for g in grads if g.numel())


def _fingerprint(optimizer) -> list:
    return [(p, key, value, value._version if isinstance(value, torch.Tensor) else None)
            for p, s in optimizer.state.items() for key, value in s.items()]


def record_priming(optimizer: torch.optim.Optimizer) -> None:
    """Remember the state a priming step (:func:`is_priming_step`) made, for :func:`undo_priming`."""
    optimizer._dcp_priming = _fingerprint(optimizer)


def undo_priming(optimizer: torch.optim.Optimizer) -> None:
    """Drop the state a priming step made if nothing has loaded over it since (module comment above).

    Each parameter's state dict is emptied in place (a wrapper may share it); a state that was loaded over,
    written in place or extended is kept. Called at the start of every step; no-op without a priming record.
    """
    record = optimizer.__dict__.pop("_dcp_priming", None)
    if record is None:
        return
    now = _fingerprint(optimizer)
    same = len(now) == len(record) and all(
        p is q and k == k2 and (v is v2 if isinstance(v, torch.Tensor) else (type(v) is type(v2) and v == v2))
        and ver == ver2 for (p, k, v, ver), (q, k2, v2, ver2) in zip(now, record))
    if same:
        for s in optimizer.state.values():
            s.clear()


@dataclass(frozen=True)
class StepReport:
    """What the last ``step()`` did (:attr:`OptimizerWrapper.report`).

    Attributes:
        found_inf: the step was skipped for a non-finite gradient (only with a loss scaler; without one the
            step raises and this stays ``False``).
        grad_norm: the global gradient norm before clipping (a Python float, units of the gradient) where the
            wrapper computed one this step, else ``None``.
        skipped_steps: steps skipped since construction (kept in the state dict).
    """

    found_inf: bool
    grad_norm: float | None
    skipped_steps: int


def _is_book(optimizer) -> bool:
    """Whether ``optimizer`` is an :class:`optbook.optim.BookOptimizer` (read from what it has, so that this
    module, which :mod:`optbook.optim` imports, needs nothing from it)."""
    return hasattr(optimizer, "refuse_nonfinite_grads") and hasattr(optimizer, "_validate")


@contextlib.contextmanager
def _nonfinite_checked_by_caller(optimizer):
    """``optimizer``'s own inf/NaN check off for the block (``BookOptimizer.refuse_nonfinite_grads``)."""
    saved = optimizer.refuse_nonfinite_grads
    optimizer.refuse_nonfinite_grads = False
    try:
        yield
    finally:
        optimizer.refuse_nonfinite_grads = saved


def _raise_nonfinite(named: list) -> None:
    """Raise :class:`~optbook.contract.NonFiniteGradientError` naming the first ``(name, param)`` whose gradient
    holds ``inf``/``NaN``; called once one check over all of them has failed."""
    for where, p in named:
        if not bool(torch.isfinite(p.grad).all()):
            kind = "NaN" if bool(p.grad.isnan().any()) else "inf"
            raise NonFiniteGradientError(
                f"Non-finite gradient in {where} (shape {tuple(p.shape)}, holds {kind}): nothing was written. "
                "Without a loss scaler a step with an inf/NaN gradient is an error (the step contract, "
                "optbook.contract); to skip such steps instead, use a loss scaler "
                "(optbook.precision.MixedPrecisionOptimizer)")
    raise NonFiniteGradientError("Non-finite gradient: nothing was written")  # pragma: no cover - a race


@contextlib.contextmanager
def validated_by_caller(optimizers):
    """Within the block, ``step()`` of each :class:`~optbook.optim.BookOptimizer` in ``optimizers`` does not
    validate again: its caller ran its checks once this step (:meth:`OptimizerWrapper.validate_leaves`)."""
    books = [o for o in optimizers if _is_book(o)]
    for o in books:
        o._validated_by_caller = True
    try:
        yield
    finally:
        for o in books:
            o.__dict__.pop("_validated_by_caller", None)


def leaf_step(optimizer: torch.optim.Optimizer) -> None:
    """Step an inner optimizer whose checks :meth:`OptimizerWrapper.validate_leaves` has run this step.

    A ``torch.optim`` optimizer validates in its own ``step()`` (and never checks for inf/NaN).
    """
    with validated_by_caller([optimizer]):
        optimizer.step()


def pack_state_dict(param_groups: list[dict], state) -> dict:
    """``torch.optim``'s state-dict layout: ``{"state": {index: state}, "param_groups": [{..., "params":
    [index, ...]}]}``, parameters numbered over the groups in order; tensors are the live ones (as torch's)."""
    index: dict[int, int] = {}
    groups = []
    for g in param_groups:
        ids = [index.setdefault(id(p), len(index)) for p in g["params"]]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
    packed = {index[id(p)]: s for p, s in state.items() if id(p) in index}
    return {"state": dict(sorted(packed.items())), "param_groups": groups}


class OptimizerWrapper(torch.optim.Optimizer):
    """Base class of every optbook wrapper: the template ``step()`` and what is forwarded (module docstring).

    A subclass calls :meth:`_init_wrapper` in its ``__init__`` (or ``torch.optim.Optimizer.__init__``, which
    sets up the same hooks) and implements :meth:`inner_optimizers`. Attributes every wrapper has:

    Attributes:
        found_inf: whether the last step was skipped for a non-finite gradient (``False`` before any; a step
            that raises leaves it ``False``).
        skipped_steps: steps skipped since construction (an int; saved in the state dict).
        last_grad_norm: the global gradient norm before clipping of the last step that computed one (a Python
            float), else ``None``.
        loss_scaler: ``None`` (a non-finite gradient raises) or a loss scaler (it skips the step).
        max_grad_norm: ``None`` or the global norm to clip to (a wrapper that never clips has no such attribute).
    """

    loss_scaler = None
    _step_norm: float | None = None   # the global norm prepare_grads took this step, for clip_grads
    #: Whether a :class:`~optbook.optim.ChainedOptimizer` may hold this wrapper as a member. ``False`` for a
    #: wrapper whose inner optimizers step copies whose gradients exist only inside its own step (float32
    #: masters): the chain could not check or clip them first; wrap the chain in it instead.
    chain_member: bool = True

    def _init_wrapper(self) -> None:
        """What ``torch.optim.Optimizer.__init__`` sets up for hooks and the profiler, and the reports; for a
        wrapper whose groups and state are its inner optimizers' (it does not call that ``__init__``)."""
        for name in _HOOK_DICTS:
            if not hasattr(self, name):
                setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.found_inf = False
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None

    # --- what a subclass says -------------------------------------------------------------------------------
    def inner_optimizers(self) -> list[torch.optim.Optimizer]:  # pragma: no cover - abstract
        """The optimizers this wrapper holds, in step order (wrappers or plain optimizers)."""
        raise NotImplementedError

    def leaves(self) -> list[torch.optim.Optimizer]:
        """The plain (non-wrapper) optimizers under this wrapper, through any nesting, in step order."""
        out = []
        for o in self.inner_optimizers():
            out += o.leaves() if isinstance(o, OptimizerWrapper) else [o]
        return out

    def _inner_wrappers(self) -> list[OptimizerWrapper]:
        return [o for o in self.inner_optimizers() if isinstance(o, OptimizerWrapper)]

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters this wrapper steps (default: those of ``param_groups``)."""
        return [p for g in self.param_groups for p in g["params"]]

    # --- the template -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One step of the contract (module docstring: the phases).

        Args:
            closure: optional callable that re-evaluates the model and returns the loss; run once, with
                gradients enabled.

        Returns:
            The closure's loss, or ``None`` (as ``torch.optim.Optimizer.step``). Whether the update was
            applied is ``not self.found_inf``.

        Raises:
            optbook.contract.NonFiniteGradientError: a gradient holds ``inf``/``NaN`` and there is no loss
                scaler (named; nothing written).
            ValueError, TypeError: what a phase's checks raise (a hyperparameter, a gradient's layout);
                nothing has been written when they do.
        """
        loss = closure_loss(closure)
        for leaf in self.leaves():
            undo_priming(leaf)
        if is_priming_step(self):
            self.prime()
            return loss
        self.validate()
        found_inf = bool(self.prepare_grads())
        if not found_inf:
            self.validate_leaves()
        self.update_loss_scale(found_inf)
        self.found_inf = found_inf
        if found_inf:
            self.skipped_steps += 1
            return loss
        norm = self.clip_grads()
        if norm is not None:
            self.last_grad_norm = norm
        self.step_with_ready_grads()
        self.publish_weights()
        return loss

    # --- the phases -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """The wrapper's own checks, before anything is written (default: its inner wrappers' own checks).

        A subclass checks what only it knows (its loss scale, the model's gradients' shapes and dtypes) and
        calls ``super().validate()``. The inner optimizers' own checks run later, once, in
        :meth:`validate_leaves`, when their gradients are ready.
        """
        self._step_norm = None
        for o in self._inner_wrappers():
            o.validate()

    def prepare_grads(self) -> bool:
        """Make every gradient the inner optimizers read ready; return whether one holds ``inf``/``NaN``.

        The default (a wrapper whose inner optimizers step the model's own parameters, like a chain): its
        inner wrappers prepare theirs; then ONE global norm over the gradients of the other inner optimizers
        (float64 sums of squares: finite exactly when every element is), kept for :meth:`clip_grads`. A
        non-finite one raises :class:`~optbook.contract.NonFiniteGradientError` naming the parameter without
        a loss scaler, and is reported (``True``) with one.

        A wrapper with copies of the weights overrides it: take up outside writes, copy the model's gradients
        into main gradients, unscale, reduce across ranks, and check once.
        """
        found = False
        for o in self._inner_wrappers():
            found |= bool(o.prepare_grads())
        named = [(f"param_groups[{gi}]['params'][{pi}]", p) for gi, g in enumerate(self.param_groups)
                 for pi, p in enumerate(g["params"]) if p.grad is not None and p.numel()]
        own = {id(p) for o in self.inner_optimizers() if not isinstance(o, OptimizerWrapper)
               for g in o.param_groups for p in g["params"]}
        named = [(w, p) for w, p in named if id(p) in own]
        if named:
            norm = float(get_grad_norm([p for _, p in named]))
            if norm != norm or norm in (float("inf"), float("-inf")):
                if self.loss_scaler is None:
                    _raise_nonfinite(named)
                return True
            if not self._inner_wrappers():   # the norm of everything the wrapper steps: clip_grads reuses it
                self._step_norm = norm
        return found

    def validate_leaves(self) -> None:
        """Run every inner optimizer's own checks (hyperparameters, gradients, modes) once, on the ready
        gradients, before any of them writes; its inf/NaN check is off (:meth:`prepare_grads` did it once).

        A ``torch.optim`` optimizer is left to validate in its own ``step()``. A subclass may rewrite an
        error's message (:meth:`_leaf_error`) to name things as its caller sees them.
        """
        for k, o in enumerate(self.inner_optimizers()):
            if isinstance(o, OptimizerWrapper):
                o.validate_leaves()
            elif _is_book(o):
                with _nonfinite_checked_by_caller(o):
                    try:
                        o._validate()
                    except (TypeError, ValueError, RuntimeError) as e:
                        raise self._leaf_error(e, k, o) from e

    def _leaf_error(self, error: Exception, k: int, optimizer) -> Exception:
        """The error to raise for ``error`` from inner optimizer ``k`` (default: ``error`` itself)."""
        return error

    def update_loss_scale(self, found_inf: bool) -> None:
        """The loss scaler's one update of the step (``loss_scaler.update(found_inf)``); nothing without one."""
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)

    def params_for_norm(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` the global norm is taken over: every inner optimizer's parameters with a
        gradient (float32 masters and host copies, where the wrapper keeps them)."""
        out = []
        for o in self.inner_optimizers():
            out += (o.params_for_norm() if isinstance(o, OptimizerWrapper) else
                    [p for g in o.param_groups for p in g["params"] if p.grad is not None])
        return out

    def clip_grads(self) -> float | None:
        """Clip every gradient by the global norm when ``max_grad_norm`` is set; return the norm before
        clipping (a Python float) where one was computed this step, else ``None``.

        One norm (:func:`optbook.clipping.get_grad_norm`, float64) over :meth:`params_for_norm`, reused when
        :meth:`prepare_grads` took it; the coefficient is ``torch.nn.utils.clip_grad_norm_``'s
        (:func:`optbook.clipping.clip_coefficient`). An inner wrapper with a ``max_grad_norm`` of its own
        then clips by it.
        """
        norm = self._step_norm
        if getattr(self, "max_grad_norm", None) is not None:
            params = self.params_for_norm()
            if params:
                if norm is None:
                    norm = float(get_grad_norm(params))
                unique = {id(p): p.grad for p in params}
                scale_grads_(list(unique.values()), clip_coefficient(norm, self.max_grad_norm))
        for o in self._inner_wrappers():
            if getattr(o, "max_grad_norm", None) is not None:
                o._step_norm = None
                o.clip_grads()
        return norm

    def step_with_ready_grads(self) -> None:
        """Step every inner optimizer, in order, on its ready gradients (a plain one without validating again:
        :func:`leaf_step`)."""
        for o in self.inner_optimizers():
            if isinstance(o, OptimizerWrapper):
                o.step_with_ready_grads()
            else:
                leaf_step(o)

    def publish_weights(self) -> None:
        """Write the model's parameters from the copies the inner optimizers stepped (default: the inner
        wrappers publish theirs; nothing else, the inner optimizers stepped the model's own tensors)."""
        for o in self._inner_wrappers():
            o.publish_weights()

    def take_up_outside_writes(self) -> None:
        """Copy writes the wrapper did not make (a weights-only load, ``qk_clip_``) from the model into its
        copies (:mod:`optbook.contract`); default: the inner wrappers' copies."""
        for o in self._inner_wrappers():
            o.take_up_outside_writes()

    def prime(self) -> None:
        """DCP's priming step (:func:`is_priming_step`): make the inner optimizers'
        state as DCP expects and change nothing else -- no loss scale, no count, no weights published.

        Each plain optbook optimizer recognises the priming itself and drops that state at its next step unless
        it was loaded over (:func:`undo_priming`); a ``torch.optim`` one is recorded
        here. A wrapper whose inner optimizers read other gradients copies them first (then calls this).
        """
        for o in self.inner_optimizers():
            if isinstance(o, OptimizerWrapper):
                o.prime()
                continue
            primed = is_priming_step(o)
            o.step()
            if primed and not _is_book(o):
                record_priming(o)

    # --- reports ----------------------------------------------------------------------------------------------
    @property
    def report(self) -> StepReport:
        """The last step's report (:class:`StepReport`)."""
        return StepReport(self.found_inf, self.last_grad_norm, self.skipped_steps)

    # --- forwarded --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def set_mode(self, name: str) -> None:
        """Call the mode method ``name`` (``"train"``, ``"eval"``, ...) of every inner optimizer that has one.

        Outside writes are taken up first and the weights published after, so the model's parameters hold
        what the switched copies hold (Schedule-Free's ``eval()`` puts them at the average ``x``).

        Raises:
            AttributeError: no inner optimizer has a method ``name``.
        """
        targets = [o for o in self.leaves() if callable(getattr(o, name, None))]
        if not targets:
            raise AttributeError(f"{type(self).__name__}.{name}(): no inner optimizer has a {name}() method")
        self.take_up_outside_writes()
        for o in targets:
            getattr(o, name)()
        self.publish_weights()

    def train(self) -> None:
        """Forward ``train()`` (Schedule-Free: parameters back at ``y``); a no-op for optimizers without modes."""
        if any(callable(getattr(o, "train", None)) for o in self.leaves()):
            self.set_mode("train")

    def eval(self) -> None:
        """Forward ``eval()`` (Schedule-Free: parameters at the average ``x``); a no-op without modes."""
        if any(callable(getattr(o, "eval", None)) for o in self.leaves()):
            self.set_mode("eval")

    def add_param_group(self, param_group: dict) -> None:
        """Add ``param_group`` to the single inner optimizer (a subclass with several says which)."""
        inner = self.inner_optimizers()
        if len(inner) != 1:
            raise ValueError(f"Invalid call: {type(self).__name__} has {len(inner)} inner optimizers; "
                             "add_param_group needs to know which one gets the group")
        inner[0].add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's parameters and of every inner optimizer's (masters, copies)."""
        for p in self.model_params():
            _zero(p, set_to_none)
        for o in self.inner_optimizers():
            o.zero_grad(set_to_none=set_to_none)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def check_state_dict(self, state_dict) -> None:  # pragma: no cover - abstract
        """Check everything :meth:`load_state_dict` would load, writing nothing (ValueError/TypeError)."""
        raise NotImplementedError

    def _state_dict(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def _load_state_dict(self, state_dict: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch._disable_dynamo
    def state_dict(self) -> dict:
        """The wrapper's state dict (the subclass's layout), with the state-dict pre and post hooks run as in
        ``torch.optim``. Tensors are the live ones: ``torch.save`` or deep-copy it before stepping on."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            out = post_hook(self, sd)
            if out is not None:
                sd = out
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict``, all or nothing: the load pre hooks, :meth:`check_state_dict` (the whole dict,
        every inner optimizer's part through its own check), then the load, then the post hooks.

        Raises:
            ValueError, TypeError: what :meth:`check_state_dict` finds; nothing has been written then.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        self.check_state_dict(state_dict)
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # --- pickling and repr ------------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """Everything but the hooks (dropped, as ``torch.optim.Optimizer.__getstate__`` drops them: a ``lambda``
        does not pickle) and a scheduler's wrapper of the bound ``step``."""
        state = {k: v for k, v in self.__dict__.items() if k not in _HOOK_DICTS}
        state.pop("step", None)
        state.pop("_opt_called", None)
        for key, value in state.items():
            if _is_process_group(value):
                if value is not torch.distributed.group.WORLD:
                    raise TypeError(f"{type(self).__name__}.{key} is a process group other than WORLD: not pickled")
                state[key] = _WorldGroup()
        return state

    def __setstate__(self, state: dict) -> None:
        state = {k: torch.distributed.group.WORLD if isinstance(v, _WorldGroup) else v for k, v in state.items()}
        self.__dict__.update(state)
        for name in _HOOK_DICTS:
            if name not in self.__dict__:
                setattr(self, name, OrderedDict())
        self._patch_step_function()

    def _repr_options(self) -> str:
        """The wrapper's own options for :meth:`__repr__` (``"key=value, ..."``)."""
        return ""

    def __repr__(self) -> str:
        inner = ",\n  ".join(repr(o).replace("\n", "\n  ") for o in self.inner_optimizers())
        options = self._repr_options()
        return f"{type(self).__name__}(\n  {inner}" + (f",\n  {options}" if options else "") + "\n)"


class _WorldGroup:
    """Pickled for ``torch.distributed.group.WORLD`` (a group does not pickle); unpickled as that process's."""


def _is_process_group(value) -> bool:
    return isinstance(value, getattr(torch.distributed, "ProcessGroup", ()))


def _zero(p: torch.Tensor, set_to_none: bool) -> None:
    """``p.grad = None``, or zeroed in place as ``torch.optim.Optimizer.zero_grad`` does."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
        return
    if p.grad.grad_fn is not None:
        p.grad.detach_()
    else:
        p.grad.requires_grad_(False)
    p.grad.zero_()
