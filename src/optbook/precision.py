"""Mixed precision: fp32 master weights, loss scaling and skipped steps. Explained in chapter 11.

Sources: Micikevicius et al. (2018), "Mixed Precision Training", arXiv:1710.03740 (Sec. 3.1 master
weights, Sec. 3.2 loss scaling); Megatron-LM core_r0.13.0 ``megatron/core/optimizer/optimizer.py``
(``MixedPrecisionOptimizer``, ``Float16OptimizerWithFloat16Params``); PyTorch v2.13.0
``torch/amp/grad_scaler.py``. The code here is our own; it keeps Megatron's order of operations.

The model keeps its float16/bfloat16 parameters (they are what the forward and backward passes use).
The optimizer updates float32 *master* copies of them and rounds the result into the model once per
step. One iteration::

    loss = model(batch)                              (low precision forward)
    opt.scale_loss(loss).backward()                  (grads of loss * S, S = the loss scale)
    opt.step()                                       (see MixedPrecisionOptimizer)
    if not opt.found_inf: scheduler.step()           (a skipped step does not advance the schedule)
    opt.zero_grad()

Why the two halves exist (chapter 11):

* **Master weights.** A bfloat16 number has 8 significant bits: next to ``1.0`` the spacing is
  ``2**-7`` above and ``2**-8`` below, so any update smaller than half of that (``lr * 1e-3``, or a
  decay factor ``1 - lr * wd = 1 - 1e-4``) rounds back to the old weight and training stalls. The
  float32 master accumulates those small updates; the model sees them once they add up to a bfloat16
  step.
* **Loss scaling** (:mod:`optbook.loss_scaling`, whose names are importable from here too:
  :class:`ConstantLossScaler`, :class:`DynamicLossScaler`, :func:`loss_scale_of`, :func:`check_loss_scaler`,
  :func:`check_float16_scaled`, :func:`scaled_loss`, :func:`unscale_grads_`). A float16 gradient below
  ``2**-24`` flushes to zero; the loss is multiplied by ``S`` and the gradients divided by ``S`` in float32.

The wrapper is an :class:`~optbook.masters.MastersWrapper` (one checkpoint layout for every owner of a copy of
the weights; :func:`take_up_` is the rule for writes it did not make) on the base of :mod:`optbook.wrapper`.

``import optbook.precision`` needs torch only.
"""

from __future__ import annotations

import weakref

import torch

from .contract import NonFiniteGradientError, owner_of
from .loss_scaling import (FLOAT32_MAX, ConstantLossScaler, DynamicLossScaler, _check_scale, _unscale_unfused_,
                           check_float16_scaled, check_loss_scaler, loss_scale_of, scaled_loss, unscale_grads_)
from .masters import MASTER_KEY, MastersWrapper, check_optimizer_state_dict, take_up_
from ._sharded import is_dtensor
from ._checks import LOW_PRECISION, check_bool, check_grad, check_number, check_params
from .optim.chained import ChainedOptimizer
from .optim.optimizer import all_finite
from .wrapper import OptimizerWrapper

__all__ = ["ConstantLossScaler", "DynamicLossScaler", "FLOAT32_MAX", "MASTER_KEY", "MixedPrecisionOptimizer",
           "check_float16_scaled", "check_loss_scaler", "check_optimizer_state_dict", "loss_scale_of",
           "scaled_loss", "take_up_", "unscale_grads_"]

# Old private names, kept while other modules still import them.
_scaler_scale = loss_scale_of
_check_loss_scaler = check_loss_scaler
_ = (_check_scale, _unscale_unfused_)

def check_inner_steps_its_groups(optimizer) -> None:
    """Refuse an inner optimizer whose step would not update the float32 masters put into its groups.

    :class:`MixedPrecisionOptimizer` replaces each low-precision parameter in the inner optimizer's
    ``param_groups`` by a master and, after the inner step, writes the masters back into the model. An
    inner optimizer that steps tensors of its own instead -- a wrapper holding its own copy of the weights
    (:class:`~optbook.memory.OffloadOptimizer`, ZeRO-1's ``DistributedOptimizer``, ``DistributedMuon``),
    a distributed optimizer of :mod:`optbook.distributed` (which steps and exchanges the model's tensors
    across ranks), or FSDP2's sharded parameters -- would leave the masters as they were, and the wrapper
    would silently undo its update. Checked for every member of a chain.

    Raises:
        TypeError: names the member and what to use instead.
    """
    for opt in {id(m): m for m in _members(optimizer)}.values():
        name = type(opt).__name__
        # a wrapper registers itself as the owner of the parameters it keeps a copy of (optbook.contract);
        # another, earlier MixedPrecisionOptimizer over the same model is no reason to refuse
        held = any(owner_of(p) is opt for g in opt.param_groups for p in g["params"])
        if type(opt).__module__.startswith("optbook.distributed") or held:
            raise TypeError(
                f"Invalid optimizer: {name} {'keeps its own copy of the weights' if held else 'steps the model'} "
                "instead of the tensors in its param_groups, so MixedPrecisionOptimizer's float32 masters would "
                "never be stepped and its update would be undone. Use the wrapper's own mixed precision where it has one (DistributedOptimizer "
                "and OffloadOptimizer keep float32 masters of bfloat16 parameters themselves; under FSDP2, "
                "fully_shard's MixedPrecisionPolicy), or wrap a single-process optimizer")
        if any(is_dtensor(p) for g in opt.param_groups for p in g["params"]):
            raise TypeError(f"Invalid optimizer: {name} steps FSDP2-sharded (DTensor) parameters; use "
                            "fully_shard's MixedPrecisionPolicy for bfloat16 compute over float32 shards")


def _members(optimizer) -> list:
    """The optimizer stepping each parameter of ``optimizer``, in flat group order (a chain's members)."""
    if isinstance(optimizer, ChainedOptimizer):
        return [m for opt in optimizer.optimizers for m in _members(opt)]
    return [optimizer for g in optimizer.param_groups for _ in g["params"]]


#: The inner optimizers some MixedPrecisionOptimizer wraps (their groups hold its float32 masters).
_WRAPPED: weakref.WeakSet = weakref.WeakSet()


class MixedPrecisionOptimizer(MastersWrapper):
    """Step a float16/bfloat16 model with an optimizer that updates float32 master weights.

    Megatron-LM's ``Float16OptimizerWithFloat16Params`` and ``MixedPrecisionOptimizer.step``
    (core_r0.13.0, ``megatron/core/optimizer/optimizer.py``), after Micikevicius et al. (2018), without
    the distributed parts; the skip-and-report rule of ``torch.amp.GradScaler`` (PyTorch v2.13.0).

    Args:
        optimizer: an already-built ``torch.optim.Optimizer`` (optbook's or PyTorch's, or a
            :class:`~optbook.optim.ChainedOptimizer`) constructed on the model's parameters, with no state
            yet. For every float16/bfloat16 parameter of its groups that requires grad, a float32 master
            copy (same shape, a new leaf tensor) replaces it in the inner optimizer's ``param_groups`` (the
            model keeps its own tensor); float32 and float64 parameters are used as they are. The inner
            optimizer then owns and updates only float32 tensors, and its state (Adam's moments, ...) is
            float32.
        loss_scaler: ``None`` (scale 1; allowed without float16 parameters), a
            :class:`ConstantLossScaler`, a :class:`DynamicLossScaler`, or any object with ``scale`` (a
            float in ``(0, FLOAT32_MAX]``), ``update(found_inf)``, ``state_dict()`` and ``load_state_dict()``.
        max_grad_norm: if set (``> 0``), clip the unscaled float32 gradients of all parameters by
            their global L2 norm before the inner step (``optbook.clipping.clip_grad_norm_``, imported
            on first use); the norm is kept in :attr:`last_grad_norm`.
        check_for_nonfinite: without a loss scaler, look for ``inf``/``NaN`` gradients before anything is
            written and raise :class:`~optbook.contract.NonFiniteGradientError` naming the parameter
            (default ``True``). ``False`` skips the check: a non-finite gradient then reaches the masters,
            the state and the weights, as in ``torch.optim``. (Megatron-LM core_v0.16.0's optimizer step
            looks only with a grad scaler, which bfloat16 runs usually lack; its training loop checks each
            gradient bucket for ``NaN``/``inf`` before the data-parallel reduction instead, under
            ``--check-for-nan-in-loss-and-grad``, on by default, and stops the run.) With a loss scaler
            the check is part of unscaling and always runs, so ``False`` is refused there.
        state_dtype: ``None`` (the inner optimizer's state keeps its own dtype: float32 for masters), or
            ``torch.bfloat16``/``torch.float16``/``torch.float32``: between steps every floating-point
            state tensor except ``step`` (Adam's moments, momentum buffers, ...) is *stored* in this
            dtype; each applied step casts it back to its parameter's dtype, steps, and rounds it down
            again (as Megatron's precision-aware optimizer stores bf16 moments). This halves the state
            memory between steps, not the peak during the step, and rounds the state once per step.
            A ``state_dict`` holds the stored dtype and loads back bit for bit.

    Attributes:
        loss_scaler: the scaler (or ``None``).
        found_inf: whether the last :meth:`step` found a non-finite gradient (``False`` before any).
        skipped_steps: how many steps were skipped for non-finite gradients (an int; saved).
        last_grad_norm: the global norm (a Python float) of the unscaled gradients before clipping, of the
            last applied step with ``max_grad_norm``; else ``None``.
        param_groups: the wrapper's own groups over the *model's* parameters (what a learning-rate scheduler
            and ``torch.distributed.checkpoint`` see); the inner optimizer's groups hold the float32 masters,
            and the hyperparameters go from one to the other at each step (:class:`~optbook.masters.MastersWrapper`).
        state: ``{model parameter: the inner optimizer's state of its master}`` (a view); ``defaults``: the
            inner optimizer's.

    Who owns the weights (:mod:`optbook.contract`): the wrapper registers itself as the owner of every
    float16/bfloat16 parameter it keeps a master for. After every applied step (and after
    :meth:`load_state_dict`) each such parameter equals its master rounded to the model's dtype.

    * A write the wrapper did not make (a weights-only ``model.load_state_dict``, an in-place edit) bumps
      the parameter's version counter; at the start of the next :meth:`step` it is taken up into the
      master (:func:`take_up_`: elements whose rounded value did not change keep the master's low bits), so
      it is never undone. Version counters are host integers: no device synchronisation.
    * :func:`optbook.contract.scale_weights_` (which :func:`optbook.qk_clip_` uses) scales the float32
      master and writes the parameter from it (:meth:`_scale_weights_`), so a clip keeps the master's bits.

    Gradients: :meth:`step` reads the model's ``.grad`` (of the *scaled* loss, the model's dtype) and
    leaves it as it is for float16/bfloat16 parameters; a float32 parameter's ``.grad`` is its own
    main gradient and is unscaled in place. :meth:`zero_grad` clears model and master gradients.

    The step is the template of :class:`~optbook.wrapper.OptimizerWrapper` (Megatron's order): validate,
    prepare the gradients (copy each float16/bfloat16 model gradient into its master's ``.grad``, divide
    every main gradient by ``S`` and look for ``inf``/``NaN`` in the same pass: :func:`unscale_grads_`), the
    inner optimizer's own checks once, ``loss_scaler.update(found_inf)``, then either skip (``found_inf``:
    masters, state and model bitwise unchanged, ``skipped_steps += 1``) or clip, step the inner optimizer on
    the masters and round each master into its model parameter. A step in which no parameter has a gradient
    does nothing after validation (the scaler is not updated). Everything an inner optimizer offers is
    forwarded (:mod:`optbook.wrapper`): ``train()``/``eval()`` of Schedule-Free (the masters move to the
    average and the model is written from them), hooks, ``add_param_group``, ``zero_grad``, pickling with
    hooks dropped (``torch.save`` of the object works with a ``lambda`` hook registered), DCP's priming.

    Checkpoints: the layout of :mod:`optbook.masters` (each master in its parameter's state under
    ``"master_param"``), plus ``"loss_scaler"`` (the scaler's state dict or ``None``) and ``"skipped_steps"``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or steps tensors other than those in its
            groups (a wrapper with its own copy of the weights, a distributed optimizer, FSDP2 shards:
            :func:`check_inner_steps_its_groups`); ``loss_scaler`` lacks ``scale``,
            ``update``, ``state_dict`` or ``load_state_dict``; ``check_for_nonfinite`` is not a bool;
            ``state_dtype`` is not ``None`` or a float32/bfloat16/float16 dtype.
        ValueError: the inner optimizer already has state or another wrapper wraps it; a float16 parameter
            without a loss scaler (float16 needs scaling); a scale outside ``(0, FLOAT32_MAX]``; ``max_grad_norm <= 0``;
            ``check_for_nonfinite=False`` with a loss scaler. Each is raised before anything is changed.
    """

    chain_member = False   # its masters' gradients exist only inside its own step: wrap the chain instead

    def __init__(self, optimizer: torch.optim.Optimizer, loss_scaler=None, *, max_grad_norm: float | None = None,
                 check_for_nonfinite: bool = True, state_dtype: torch.dtype | None = None):
        # Everything is checked before the inner optimizer's groups are touched.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Invalid optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError("Invalid optimizer: it is already a MixedPrecisionOptimizer; wrap the inner one once")
        if optimizer in _WRAPPED:   # its groups already hold another wrapper's masters: this one would own none
            raise ValueError("Invalid optimizer: another MixedPrecisionOptimizer already wraps it; wrap an "
                             "optimizer once")
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("Invalid optimizer: it already has state (it has stepped, or a state dict was "
                             "loaded); wrap a freshly built optimizer, then load the wrapper's state dict")
        check_inner_steps_its_groups(optimizer)
        for gi, group in enumerate(optimizer.param_groups):   # torch.optim only warns about a repeated parameter
            try:
                check_params(group["params"])
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} (optimizer param_groups[{gi}])") from None
        check_loss_scaler(loss_scaler)
        if max_grad_norm is not None:
            max_grad_norm = check_number("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
        check_bool("check_for_nonfinite", check_for_nonfinite)
        if state_dtype is not None and state_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"Invalid state_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, "
                            f"got {state_dtype!r}")
        if loss_scaler is not None and not check_for_nonfinite:
            raise ValueError("Invalid check_for_nonfinite: False is only allowed without a loss scaler (unscaling "
                             "always checks, and the scaler's update needs the result)")
        check_float16_scaled([(f"optimizer param_groups[{gi}]['params'][{pi}]", p)
                              for gi, g in enumerate(optimizer.param_groups)
                              for pi, p in enumerate(g["params"])], loss_scaler)

        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.max_grad_norm = max_grad_norm
        self.check_for_nonfinite = check_for_nonfinite
        self.state_dtype = state_dtype
        self.defaults = optimizer.defaults
        self.param_groups: list[dict] = []
        self._inner_groups: list[dict] = []   # the inner group of each of the wrapper's groups
        for group in optimizer.param_groups:
            self._adopt(group)
        self._init_masters(self._leaf_spec())
        self._no_grads = False
        _WRAPPED.add(optimizer)

    def _adopt(self, group: dict) -> None:
        """Make ``group`` (an inner group over model parameters) one of the wrapper's: the wrapper's group keeps
        the model's parameters, the inner group gets a float32 master for each low-precision one."""
        self.param_groups.append({**group, "params": list(group["params"])})
        masters = []
        for p in group["params"]:
            if p.dtype in LOW_PRECISION and p.requires_grad:
                master = p.detach().to(torch.float32, copy=True).requires_grad_(True)
                self._add_copy(p, master)
                masters.append(master)
            else:
                masters.append(p)
        group["params"] = masters
        self._inner_groups.append(group)

    def _leaf_spec(self) -> list:
        """For :meth:`~optbook.masters.MastersWrapper._init_masters`: each leaf's groups as the wrapper's."""
        where = {id(g): gi for gi, g in enumerate(self._inner_groups)}
        return [[(where[id(g)], list(range(len(g["params"])))) for g in leaf.param_groups] for leaf in self.leaves()]

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    @property
    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, float32 master) for every float16/bfloat16 parameter, in group order."""
        return [(p, self._copies[p]) for p in self.model_params() if p in self._copies]

    @property
    def loss_scale(self) -> float:
        """The current loss scale ``S`` (``1.0`` without a scaler)."""
        return loss_scale_of(self.loss_scaler)

    def add_param_group(self, param_group: dict, optimizer=None) -> None:
        """Add a group of *model* parameters: low-precision ones get masters, then the inner optimizer adds it.

        Args:
            param_group: a dict with ``params`` (model parameters) and optional hyperparameters.
            optimizer: only when the inner optimizer is a :class:`~optbook.optim.ChainedOptimizer`: the
                member (index or object) that gets the group, passed on to its ``add_param_group`` (which
                may leave it out when the chain has one member).

        Raises:
            ValueError: a float16 parameter without a loss scaler; a parameter this wrapper already steps;
                ``optimizer`` given when the inner optimizer is not a chain; whatever the inner
                ``add_param_group`` raises (then nothing has been recorded here).
        """
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_float16_scaled([(f"the new group's param_groups[0]['params'][{pi}]", p)
                              for pi, p in enumerate(params)], self.loss_scaler)
        chain = isinstance(self.optimizer, ChainedOptimizer)
        if optimizer is not None and not chain:
            raise ValueError(f"Invalid optimizer: it names the member of a ChainedOptimizer that gets the group; "
                             f"this wrapper's inner optimizer is a {type(self.optimizer).__name__}")
        held = {id(p) for p in self.model_params()}
        for pi, p in enumerate(params):
            if id(p) in held:   # a second master of one weight: the last group's would win at every step
                raise ValueError(f"Invalid param_group: params[{pi}] (shape {tuple(p.shape)}) is already stepped "
                                 "by this wrapper; some parameters appear in more than one parameter group")
        before = [g for g in self.optimizer.param_groups]
        if chain:
            self.optimizer.add_param_group({**param_group, "params": params}, optimizer=optimizer)
        else:
            self.optimizer.add_param_group({**param_group, "params": params})
        new = [g for g in self.optimizer.param_groups if not any(g is b for b in before)]
        for group in new:
            self._adopt(group)
        self._leaf_groups = self._leaf_spec()
        self._own()

    def reload_model_params(self) -> None:
        """Copy every low-precision model parameter into its master, exactly (the master's low bits are lost).

        Not needed after an outside write (the next :meth:`step` takes it up, keeping the low bits of
        unchanged elements); it discards what the masters hold beyond the model's precision.
        """
        with torch.no_grad():
            for p, master in self._copies.items():
                master.copy_(p)
        self._tracker.record(list(self._copies))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` for ``backward()`` (``S = 1`` without a scaler); see :func:`scaled_loss`.

        A float16/bfloat16 ``loss`` is cast to float32 first (a float16 loss of 1 times ``2**16``
        overflows by itself). Compute the loss in float32 where possible: the gradient flowing back
        into the first float16 tensor is ``S`` times its true value and overflows when that exceeds
        65504 -- which is the overflow the scaler is there to detect.

        Raises:
            TypeError: ``loss`` is not a floating-point tensor.
        """
        return scaled_loss(loss, self.loss_scale)

    # --- the phases of the step (optbook.wrapper) ---------------------------------------------------------
    def validate(self) -> None:
        """The loss scale and every model gradient's shape, dtype and device, before anything is written."""
        self.loss_scale
        for i, p in enumerate(self.model_params()):   # every one (a float32 parameter's sparse gradient too)
            if p.grad is not None:
                check_grad(p, f"model parameter {i} ({str(p.dtype).removeprefix('torch.')})")
        super().validate()

    def _copy_model_grads_to_main_grads(self) -> None:
        for p, master in self._copies.items():
            if p.grad is None:
                master.grad = None  # no stale gradient from an earlier step
            elif master.grad is None:
                master.grad = p.grad.detach().to(torch.float32)
            else:
                master.grad.copy_(p.grad)

    def prepare_grads(self) -> bool:
        """Take up outside writes; copy each low-precision model gradient into its master's ``.grad``; with a
        loss scaler divide every main gradient by ``S`` and look for ``inf``/``NaN`` in the same pass
        (:func:`unscale_grads_`); without one (and ``check_for_nonfinite``) one check that raises
        :class:`~optbook.contract.NonFiniteGradientError` naming the parameter."""
        self.take_up_outside_writes()
        self._no_grads = not any(p.grad is not None for p in self.model_params())
        if self._no_grads:
            return False
        if self.loss_scaler is not None:
            self._copy_model_grads_to_main_grads()
            return unscale_grads_([p.grad for p in self.params_for_norm() if p.numel()], self.loss_scale)
        if self.check_for_nonfinite:   # on the model's gradients, before the masters' are written
            named = [(f"param_groups[{gi}]['params'][{pi}]", p) for gi, g in enumerate(self.param_groups)
                     for pi, p in enumerate(g["params"]) if p.grad is not None and p.grad.numel()]
            if named and not all_finite([p.grad for _, p in named]):
                for where, p in named:
                    if not bool(torch.isfinite(p.grad).all()):
                        raise NonFiniteGradientError(
                            f"Non-finite gradient of {where} (shape {tuple(p.shape)}, the model's "
                            f"{p.dtype}): nothing was written; pass a loss scaler to skip such steps")
        self._copy_model_grads_to_main_grads()
        return False

    def update_loss_scale(self, found_inf: bool) -> None:
        """The scaler's update, except in a step without any gradient (a clean step would count toward growth)."""
        if not self._no_grads:
            super().update_loss_scale(found_inf)

    def _cast_state(self, dtype: torch.dtype | None) -> None:
        """Cast every floating-point state tensor except ``step`` to ``dtype`` (``None``: its parameter's dtype)."""
        for leaf in self.leaves():
            for p, state in leaf.state.items():
                target = p.dtype if dtype is None else dtype
                for key, value in state.items():
                    if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() \
                            and value.dtype != target:
                        state[key] = value.to(target)

    def step_with_ready_grads(self) -> None:
        """The inner step on the masters (state cast to the parameters' dtype and back with ``state_dtype``)."""
        if self.state_dtype is not None:
            self._cast_state(None)  # compute in the parameters' dtype
        super().step_with_ready_grads()
        if self.state_dtype is not None:
            self._cast_state(self.state_dtype)  # store in state_dtype

    def prime(self) -> None:
        self._copy_model_grads_to_main_grads()
        super().prime()

    # --- checkpoints (the layout of optbook.masters, plus the scaler) --------------------------------------
    def _extra_state(self) -> dict:
        return {"loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def _check_extra_state(self, state_dict: dict) -> None:
        super()._check_extra_state(state_dict)
        if "loss_scaler" not in state_dict:   # torch.distributed.checkpoint keeps state and param_groups only
            return
        if (state_dict["loss_scaler"] is None) != (self.loss_scaler is None):
            raise ValueError("Invalid state_dict: " + ("it holds no loss scaler state, but this optimizer has a "
                             "loss scaler" if self.loss_scaler is not None else
                             "it holds a loss scaler state, but this optimizer has no loss scaler"))
        if self.loss_scaler is not None:  # a scaler state that does not load fails here, before any write
            import copy
            copy.deepcopy(self.loss_scaler).load_state_dict(state_dict["loss_scaler"])

    def _load_extra_state(self, state_dict: dict) -> None:
        super()._load_extra_state(state_dict)
        if self.loss_scaler is not None and state_dict.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    def _leaf_parts(self, state_dict: dict) -> list[dict]:
        """With ``state_dtype``, the saved state goes back to each master's dtype before its optimizer checks it."""
        parts = super()._leaf_parts(state_dict)
        if self.state_dtype is None:
            return parts
        out = []
        for leaf, part in zip(self.leaves(), parts):
            flat = [p for g in leaf.param_groups for p in g["params"]]
            state = {i: {k: v.to(flat[i].dtype) if k != "step" and isinstance(v, torch.Tensor)
                         and v.is_floating_point() else v for k, v in s.items()} for i, s in part["state"].items()}
            out.append({**part, "state": state})
        return out

    def _load_state_dict(self, state_dict: dict) -> None:
        super()._load_state_dict(state_dict)
        if self.state_dtype is not None:
            self._cast_state(self.state_dtype)

    def _repr_options(self) -> str:
        return f"loss_scaler={self.loss_scaler!r}, max_grad_norm={self.max_grad_norm!r}, masters={len(self._copies)}"
