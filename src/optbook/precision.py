"""Mixed precision: fp32 master weights, loss scaling and skipped steps. Explained in chapter 11.

Sources: Micikevicius et al. (2018), "Mixed Precision Training", arXiv:1710.03740 (Sec. 3.1 master
weights, Sec. 3.2 loss scaling); Megatron-LM, ``megatron/core/optimizer/grad_scaler.py``
(``ConstantGradScaler``, ``DynamicGradScaler``) and ``megatron/core/optimizer/optimizer.py``
(``MixedPrecisionOptimizer``, ``Float16OptimizerWithFloat16Params``). The code here is our own; it
keeps Megatron's order of operations and its scaler's counter semantics.

The model keeps its float16/bfloat16 parameters (they are what the forward and backward passes use).
The optimizer updates float32 *master* copies of them and rounds the result into the model once per
step. One iteration::

    loss = model(batch)                              (low precision forward)
    opt.scale_loss(loss).backward()                  (grads of loss * S, S = the loss scale)
    opt.step()                                       (see MixedPrecisionOptimizer.step)
    if not opt.found_inf: scheduler.step()           (a skipped step does not advance the schedule)
    opt.zero_grad()

Why the two halves exist (chapter 11):

* **Master weights.** A bfloat16 number has 8 significant bits: next to ``1.0`` the spacing is
  ``2**-7`` above and ``2**-8`` below, so any update smaller than half of that (``lr * 1e-3``, or a
  decay factor ``1 - lr * wd = 1 - 1e-4``) rounds back to the old weight and training stalls. The
  float32 master accumulates those small updates; the model sees them once they add up to a bfloat16
  step.
* **Loss scaling.** A float16 gradient below ``2**-24`` (about ``6e-8``) flushes to zero. Multiplying
  the loss by ``S`` multiplies every gradient by ``S`` (the chain rule is linear), which lifts them
  into float16's range; the optimizer divides by ``S`` in float32 before using them. Too large an
  ``S`` overflows to ``inf``: that step is skipped and a dynamic scaler lowers ``S``. bfloat16 has
  float32's exponent range and usually needs no scaling.

The loss-scaling pieces are public functions, so that every optimizer with a loss scaler shares one copy:
:func:`loss_scale_of`, :func:`check_loss_scaler`, :func:`check_float16_scaled`, :func:`scaled_loss`,
:func:`unscale_grads_`; and two pieces every owner of a copy of the weights shares (:mod:`optbook.contract`):
:func:`take_up_` and :func:`check_optimizer_state_dict`.

Pinned sources: Megatron-LM core_r0.13.0 (``megatron/core/optimizer/optimizer.py``,
``megatron/core/optimizer/grad_scaler.py``); PyTorch v2.13.0 (``torch/amp/grad_scaler.py``,
``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``).

``import optbook.precision`` needs torch only.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict

import torch

from .contract import NonFiniteGradientError, VersionTracker, closure_loss, elementwise, owner_of, register_owner
from ._checks import LOW_PRECISION, check_bool, check_grad, check_number, check_params
from ._checks import check_int as _check_int
from .optim._sharded import is_dtensor
from .optim.optimizer import BookOptimizer, all_finite, check_hyperparameters

__all__ = ["ConstantLossScaler", "DynamicLossScaler", "MixedPrecisionOptimizer", "check_float16_scaled",
           "check_loss_scaler", "check_optimizer_state_dict", "loss_scale_of", "scaled_loss", "take_up_",
           "unscale_grads_"]

#: The largest finite float32, ``(2 - 2**-23) * 2**127``: the largest loss scale. The scaled loss and the
#: scale itself are float32 (``torch.amp.GradScaler`` keeps its scale in a float32 tensor; Megatron-LM too),
#: so a larger ``S`` is ``inf`` there and every step would overflow.
FLOAT32_MAX = torch.finfo(torch.float32).max


def _check_scale(name: str, value) -> float:
    """A loss scale: a real number in ``(0, FLOAT32_MAX]``, returned as a Python float."""
    return check_number(name, value, low=0.0, low_open=True, high=FLOAT32_MAX)


class ConstantLossScaler:
    """A loss scale that never changes (Megatron-LM's ``ConstantGradScaler``).

    Args:
        scale: the loss scale ``S``, a number in ``(0, FLOAT32_MAX]`` (e.g. ``2.0**16`` for float16; ``1.0``
            only detects overflows). Kept as a Python ``float``.

    A step whose gradients overflow is still skipped by :class:`MixedPrecisionOptimizer`; the scale
    stays. :meth:`state_dict` is empty, as Megatron's: the scale is configuration, not state.

    Raises:
        TypeError: ``scale`` is not a real number.
        ValueError: ``scale`` is not finite or not ``> 0`` (the message names ``scale``).
    """

    def __init__(self, scale: float):
        self._scale = _check_scale("scale", scale)

    @property
    def scale(self) -> float:
        """The loss scale ``S`` (a Python float)."""
        return self._scale

    def update(self, found_inf: bool) -> None:
        """Nothing to do: the scale is constant (``found_inf`` is still checked to be a bool)."""
        check_bool("found_inf", found_inf)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"Invalid state_dict: expected a dict, got {type(state_dict).__name__}")

    def __repr__(self) -> str:
        return f"ConstantLossScaler(scale={self._scale!r})"


class DynamicLossScaler:
    """A loss scale that backs off on overflows and grows after clean stretches (Megatron-LM's
    ``DynamicGradScaler`` in ``megatron/core/optimizer/grad_scaler.py``, same counters, same order).

    Args:
        initial_scale: the starting scale ``S``, ``> 0`` and at most :data:`FLOAT32_MAX`.
        growth_factor: ``S *= growth_factor`` after ``growth_interval`` clean steps in a row; ``> 1``.
        backoff_factor: ``S *= backoff_factor`` on an overflow once hysteresis is used up; in ``(0, 1)``.
        growth_interval: consecutive clean steps before growing, an int ``>= 1``.
        hysteresis: overflows tolerated (since the last growth) before the first back-off, an int ``>= 1``.
        min_scale: floor of ``S`` when backing off, finite, ``> 0`` and ``<= initial_scale``.

    Counters (both plain ``int``):

    * the *growth tracker* counts clean steps since the last overflow or the last growth;
    * the *hysteresis tracker* starts at ``hysteresis`` and is decremented by **every** overflow.

    ``update(found_inf)`` does exactly this (Megatron's ``DynamicGradScaler.update``)::

        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                S = max(S * backoff_factor, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                S = S * growth_factor

    Which overflows count toward hysteresis: all overflows since the start or since the last growth,
    **whether or not clean steps separate them**. A clean step resets only the growth tracker; the
    hysteresis tracker is reset to ``hysteresis`` only when the scale grows. (Megatron's docstring says
    "if `hysteresis` number of NaNs are seen in a row"; its code, followed here, does not require them
    to be in a row.) With ``hysteresis=2``: the first overflow after a growth (or the start) keeps
    ``S``; the second, and every further one until the next growth, multiplies ``S`` by
    ``backoff_factor`` (the tracker goes on decreasing below zero, so each of them backs off).
    ``hysteresis=1`` backs off on every overflow (PyTorch's ``GradScaler``).

    At ``min_scale`` the scale stays at ``min_scale``: further overflows do not lower it, and each of
    them is still detected and its step skipped by :class:`MixedPrecisionOptimizer`. A run that
    overflows at ``min_scale`` on every step makes no progress (watch ``skipped_steps``); nothing is
    raised.

    Growth stops at float32's range: a growth whose result exceeds :data:`FLOAT32_MAX` is not applied --
    ``S`` stays where it is and the trackers are reset as after a growth. This is ``torch.amp.GradScaler``'s
    rule (PyTorch v2.13.0, ``_amp_update_scale_``: ``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``
    and ``aten/src/ATen/native/cuda/AmpKernels.cu``, "Do not grow the scale past fp32 bounds to inf":
    ``new_scale = static_cast<float>(scale * growth_factor)``, kept only ``if isfinite(new_scale)``; its
    cast rounds a product less than half a float32 ulp above the maximum down to it, which only a factor
    that is not a power of two can produce). The scaled loss is float32, so a larger ``S`` would make
    every step overflow; Megatron-LM's float32 scale would become ``inf``. With the default factor 2 the
    largest scale reached is ``2**127``.

    The arithmetic is in Python floats (float64); Megatron computes in float32 tensors. The two agree
    bitwise when the factors and scales are powers of two (the defaults).

    :meth:`state_dict` holds ``scale``, ``growth_tracker`` and ``hysteresis_tracker``, so a resumed
    run backs off and grows at the same iterations as an uninterrupted one. The constructor arguments
    are configuration and are not saved (as in Megatron).

    Raises:
        TypeError: an argument of the wrong type (``growth_interval``/``hysteresis`` not an int, a
            factor not a real number).
        ValueError: an argument out of range, named in the message.
    """

    def __init__(self, initial_scale: float = 2.0**32, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, min_scale: float = 1.0):
        initial_scale = _check_scale("initial_scale", initial_scale)
        growth_factor = check_number("growth_factor", growth_factor, low=1.0, low_open=True)
        backoff_factor = check_number("backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True,
                                      high_open=True)
        growth_interval = _check_int("growth_interval", growth_interval, 1)
        hysteresis = _check_int("hysteresis", hysteresis, 1)
        min_scale = _check_scale("min_scale", min_scale)
        if min_scale > initial_scale:
            raise ValueError(f"Invalid min_scale: expected min_scale <= initial_scale = {initial_scale}, "
                             f"got {min_scale}")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        # The scaler's state (what state_dict saves): the scale and its two counters.
        self._scale, self._growth_tracker, self._hysteresis_tracker = initial_scale, 0, hysteresis

    @property
    def scale(self) -> float:
        """The current loss scale ``S`` (a Python float)."""
        return self._scale

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last overflow or growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """``hysteresis`` minus the overflows since the last growth (may be negative)."""
        return self._hysteresis_tracker

    def update(self, found_inf: bool) -> None:
        """Advance the counters after one iteration's overflow check (see the class docstring).

        Args:
            found_inf: whether this iteration's gradients held an ``inf`` or ``NaN``.

        Raises:
            TypeError: ``found_inf`` is not a ``bool`` (a tensor would hide a device synchronisation).
        """
        check_bool("found_inf", found_inf)
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                grown = self._scale * self.growth_factor
                if grown <= FLOAT32_MAX:  # finite in float32 (torch.amp.GradScaler's rule)
                    self._scale = grown

    def state_dict(self) -> dict:
        """``{"scale": float, "growth_tracker": int, "hysteresis_tracker": int}``."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the three counters saved by :meth:`state_dict`; all are checked before any is set.

        Raises:
            TypeError: ``state_dict`` is not a dict, or a counter is not an int.
            ValueError: a key is missing, the scale is not finite and ``> 0``, or the growth tracker is
                negative.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"Invalid state_dict: expected a dict, got {type(state_dict).__name__}")
        missing = [k for k in ("scale", "growth_tracker", "hysteresis_tracker") if k not in state_dict]
        if missing:
            raise ValueError(f"Invalid state_dict: expected keys scale, growth_tracker, hysteresis_tracker; "
                             f"missing {', '.join(missing)}")
        scale = state_dict["scale"]
        scale = _check_scale("state_dict['scale']", float(scale) if isinstance(scale, torch.Tensor) else scale)
        growth = _check_int("state_dict['growth_tracker']", state_dict["growth_tracker"], 0)
        hyst = _check_int("state_dict['hysteresis_tracker']", state_dict["hysteresis_tracker"], -(2**63))
        self._scale, self._growth_tracker, self._hysteresis_tracker = scale, growth, hyst

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self._scale!r}, growth_factor={self.growth_factor!r}, "
                f"backoff_factor={self.backoff_factor!r}, growth_interval={self.growth_interval}, "
                f"hysteresis={self.hysteresis}, min_scale={self.min_scale!r}, "
                f"growth_tracker={self._growth_tracker}, hysteresis_tracker={self._hysteresis_tracker})")


# --- the loss-scaling pieces every mixed-precision optimizer shares ------------------------------------------
# MixedPrecisionOptimizer uses them, and so can a sharded optimizer (ZeRO-1) that unscales only its shard.
def loss_scale_of(loss_scaler) -> float:
    """The current scale ``S`` of ``loss_scaler`` as a Python float (``1.0`` for ``None``).

    Args:
        loss_scaler: ``None`` or an object whose ``scale`` is a finite real number ``> 0`` (a Python float;
            a one-element tensor is read with ``float``, one device synchronisation).

    Raises:
        TypeError: the scale is not a real number (the message names ``loss_scaler.scale``).
        ValueError: the scale is not finite and ``> 0``.
    """
    if loss_scaler is None:
        return 1.0
    scale = loss_scaler.scale
    if isinstance(scale, torch.Tensor):
        scale = float(scale) if scale.numel() == 1 else scale
    try:
        return _check_scale("loss_scaler.scale", scale)
    except TypeError as e:
        raise TypeError(f"{e}; a loss scaler's scale must be a Python float") from None


def check_loss_scaler(loss_scaler) -> None:
    """``None``, or an object with ``scale`` (finite, ``> 0``), ``update``, ``state_dict``, ``load_state_dict``.

    Raises:
        TypeError: a method or attribute is missing (named in the message).
        ValueError: the scale is not finite and ``> 0``.
    """
    if loss_scaler is None:
        return
    lacking = [a for a in ("scale", "update", "state_dict", "load_state_dict") if not hasattr(loss_scaler, a)]
    if lacking:
        raise TypeError(f"Invalid loss_scaler: expected None or a loss scaler (scale, update, state_dict, "
                        f"load_state_dict), got a {type(loss_scaler).__name__} without {', '.join(lacking)}")
    loss_scale_of(loss_scaler)


def check_float16_scaled(params, loss_scaler, where: str = "params") -> None:
    """Refuse float16 parameters that require grad when there is no loss scaler.

    Args:
        params: an iterable of tensors, or of ``(name, tensor)`` pairs (the name is used in the message;
            without one the position in ``where`` is).
        loss_scaler: ``None`` or a loss scaler.
        where: how the message names the collection.

    Raises:
        ValueError: a float16 parameter without a loss scaler (float16 gradients below ``2**-24`` flush to
            zero; Micikevicius et al. 2018, Sec. 3.2).
    """
    if loss_scaler is not None:
        return
    for i, item in enumerate(params):
        name, p = item if isinstance(item, tuple) else (f"{where}[{i}]", item)
        if p.dtype == torch.float16 and p.requires_grad:
            raise ValueError(
                f"Invalid loss_scaler: {name} (shape {tuple(p.shape)}) is float16, and float16 gradients need "
                "loss scaling (small ones flush to zero); pass loss_scaler=DynamicLossScaler() or "
                "ConstantLossScaler(...)")


def scaled_loss(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``loss * scale`` for ``backward()``; a float16/bfloat16 ``loss`` is cast to float32 first.

    Args:
        loss: a floating-point tensor (usually 0-dim).
        scale: the loss scale ``S`` (a Python float).

    Returns:
        A tensor of ``loss``'s shape, float32 for a float16/bfloat16 loss, else ``loss``'s dtype.

    Raises:
        TypeError: ``loss`` is not a floating-point tensor.
    """
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise TypeError(f"Invalid loss: expected a floating-point tensor, got {loss!r}")
    if loss.dtype in LOW_PRECISION:
        loss = loss.float()
    return loss * scale


def unscale_grads_(grads: list[torch.Tensor], scale: float) -> bool:
    """Multiply every gradient by ``1 / scale`` in place and report whether any holds ``inf``/``NaN``.

    One fused pass per (device, dtype) list (``torch._amp_foreach_non_finite_check_and_unscale_``, as
    ``torch.amp.GradScaler.unscale_`` and Megatron-LM core_r0.13.0 ``MixedPrecisionOptimizer.
    _unscale_main_grads_and_check_for_nan``), one found-inf flag per device, so one device synchronisation
    per device.

    Args:
        grads: float32 (or float16/bfloat16/float64) tensors, any shapes and devices; empty ones are fine.
        scale: ``S``, a finite Python float ``> 0``; ``1 / S`` is rounded to float32 once (exact for a
            power of two). A sharded optimizer that also averages over ``d`` ranks passes ``d * S``.

    Returns:
        ``True`` when some element is ``inf`` or ``NaN`` (the gradients are then multiplied all the same:
        the step is to be skipped); ``False`` for an empty list.

    bfloat16 gradients on a GPU go through :func:`_unscale_unfused_` instead: torch's CUDA kernel has no
    bfloat16 version (pytorch/pytorch#127176, open as of torch 2.13); the result is the same.
    """
    by_key: dict = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    found: dict = {}
    inv: dict = {}
    for (device, dtype), gs in by_key.items():
        if device not in found:
            found[device] = torch.zeros(1, dtype=torch.float32, device=device)
            inv[device] = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device)
        if device.type == "cuda" and dtype == torch.bfloat16:
            _unscale_unfused_(gs, found[device], inv[device])
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found[device], inv[device])
    return any(bool(f.item()) for f in found.values())


def _unscale_unfused_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` in plain operations: ``found_inf`` (a 1-element
    float32 tensor) becomes 1 when an element of ``grads`` is ``inf``/``NaN`` before the multiplication, and
    every gradient is multiplied in place by ``inv_scale`` (1 element, float32; the product taken in float32
    and rounded once to the gradient's dtype, as the fused kernel does). Bitwise the fused kernel's result
    where both exist (a test compares them on the CPU)."""
    for g in grads:
        found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(g)).any().to(found_inf.dtype)))
    torch._foreach_mul_(grads, inv_scale[0])


# Old private names, kept while optbook.distributed.zero1 still imports them.
_scaler_scale = loss_scale_of
_check_loss_scaler = check_loss_scaler


# --- pieces every owner of a copy of the weights shares (MixedPrecisionOptimizer, OffloadOptimizer) ----------
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
    """Check a ``torch.optim``-layout state dict against the parameters it is to be loaded into; write nothing.

    Args:
        state_dict: ``{"state": {index: {name: value}}, "param_groups": [{"params": [index, ...], ...}]}``.
        params: per group, the tensors the optimizer steps (masters, host copies), in group order.
        elementwise: per parameter (flat group order), whether its optimizer is element-wise
            (:func:`optbook.contract.elementwise`): then every floating state tensor but ``step`` must have the
            parameter's shape (Adam's moments, momentum buffers).
        live_state: optional, per parameter (flat order), the optimizer's current state dict of it: a saved
            tensor under a key it already has must have that tensor's shape (any optimizer).
        where: how messages name the dict.

    Raises:
        ValueError: not a dict with ``state`` and ``param_groups``; another number of groups or of
            parameters in a group; a state index that names no parameter; a state tensor (other than
            ``step``) that is not floating point or has another shape than required.
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
    from .optim import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return [m for opt in optimizer.optimizers for m in _members(opt)]
    return [optimizer for g in optimizer.param_groups for _ in g["params"]]


_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


#: The inner optimizers some MixedPrecisionOptimizer wraps (their groups hold its float32 masters).
_WRAPPED: weakref.WeakSet = weakref.WeakSet()


class MixedPrecisionOptimizer(torch.optim.Optimizer):
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
        param_groups, state, defaults: the inner optimizer's (the same objects). The groups hold the
            float32 masters, so a ``torch.optim.lr_scheduler`` built on this wrapper sets the lr the
            inner optimizer uses, and ``state`` is keyed by the masters.

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

    It is a full ``torch.optim.Optimizer``: step hooks, state-dict and load-state-dict hooks
    (``register_state_dict_pre_hook`` and the others), ``copy.deepcopy`` and ``torch.save``/``torch.load``
    of the object (``weights_only=False``; the copy owns its own copies of the parameters).

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
        self.found_inf = False
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        #: (model parameter, float32 master) for every float16/bfloat16 parameter, in group order.
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Every model parameter the wrapper steps (low precision or not), in group order.
        self._model_params: list[torch.Tensor] = []
        #: Indices into _pairs of parameters to take up at the next step whatever their version says.
        self._pending: set[int] = set()
        self._tracker = VersionTracker()
        for group in optimizer.param_groups:
            group["params"] = self._with_masters(group["params"])
        # torch.optim.Optimizer.__init__ is not called: the inner optimizer owns groups and state.
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._own(self._pairs)
        _WRAPPED.add(optimizer)

    def _own(self, pairs) -> None:
        """Register as the owner of the model parameters of ``pairs`` and record their versions."""
        params = [p for p, _ in pairs]
        register_owner(params, self)
        self._tracker.record(params)

    def _with_masters(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` with each low-precision parameter replaced by a new float32 master (recorded in pairs)."""
        out = []
        for p in params:
            self._model_params.append(p)
            if p.dtype in LOW_PRECISION and p.requires_grad:
                master = p.detach().to(torch.float32, copy=True).requires_grad_(True)
                self._pairs.append((p, master))
                out.append(master)
            else:
                out.append(p)
        return out

    # --- the inner optimizer's view -------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        """The current loss scale ``S`` (``1.0`` without a scaler)."""
        return loss_scale_of(self.loss_scaler)

    def master_params(self) -> list[torch.Tensor]:
        """The float32 masters, one per float16/bfloat16 model parameter, in group order."""
        return [master for _, master in self._pairs]

    def model_params(self) -> list[torch.Tensor]:
        """Every model parameter the wrapper steps (low precision or not), in group order."""
        return list(self._model_params)

    def add_param_group(self, param_group: dict, optimizer=None) -> None:
        """Add a group of *model* parameters: low-precision ones get masters, then the inner optimizer adds it.

        Args:
            param_group: a dict with ``params`` (model parameters) and optional hyperparameters.
            optimizer: only when the inner optimizer is a :class:`~optbook.optim.ChainedOptimizer`: the
                member (index or object) that gets the group, passed on to its ``add_param_group`` (which
                may leave it out when the chain has one member).

        Raises:
            ValueError: a float16 parameter without a loss scaler; a parameter this wrapper already steps;
                ``optimizer`` given when the inner optimizer is not a chain; whatever the inner ``add_param_group`` raises (then nothing has
                been recorded here).
        """
        from .optim import ChainedOptimizer

        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_float16_scaled([(f"the new group's param_groups[0]['params'][{pi}]", p)
                              for pi, p in enumerate(params)], self.loss_scaler)
        chain = isinstance(self.optimizer, ChainedOptimizer)
        if optimizer is not None and not chain:
            raise ValueError(f"Invalid optimizer: it names the member of a ChainedOptimizer that gets the group; "
                             f"this wrapper's inner optimizer is a {type(self.optimizer).__name__}")
        held = {id(p) for p in self._model_params}
        for pi, p in enumerate(params):
            if id(p) in held:   # a second master of one weight: the last group's would win at every step
                raise ValueError(f"Invalid param_group: params[{pi}] (shape {tuple(p.shape)}) is already stepped "
                                 "by this wrapper; some parameters appear in more than one parameter group")
        n_pairs, n_params = len(self._pairs), len(self._model_params)
        group = {**param_group, "params": self._with_masters(params)}
        try:
            if chain:
                self.optimizer.add_param_group(group, optimizer=optimizer)
            else:
                self.optimizer.add_param_group(group)
        except Exception:
            del self._pairs[n_pairs:], self._model_params[n_params:]
            raise
        self._own(self._pairs[n_pairs:])

    def reload_model_params(self) -> None:
        """Copy every low-precision model parameter into its master, exactly (the master's low bits are lost).

        Not needed after an outside write (the next :meth:`step` takes it up, keeping the low bits of
        unchanged elements); it discards what the masters hold beyond the model's precision.
        """
        with torch.no_grad():
            for p, master in self._pairs:
                master.copy_(p)
        self._pending.clear()
        self._tracker.record([p for p, _ in self._pairs])

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every model parameter and every master."""
        for p in self._model_params + self.master_params():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:  # as torch.optim.Optimizer.zero_grad
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # --- owner of the low-precision parameters (optbook.contract) ----------------------------------------
    def _take_up(self, indices) -> None:
        """Take up the outside writes of the pairs at ``indices`` into their masters, then record."""
        for i in indices:
            take_up_(self._pairs[i][1], self._pairs[i][0])
        self._pending.difference_update(indices)
        self._tracker.record([self._pairs[i][0] for i in indices])

    def _take_up_outside_writes(self) -> None:
        params = [p for p, _ in self._pairs]
        changed = sorted(set(self._tracker.changed(params)) | self._pending)
        if changed:
            self._take_up(changed)

    @torch.no_grad()
    def _scale_weights_(self, param: torch.Tensor, factor) -> None:
        """``master *= factor`` in float32, then ``param <- master`` rounded (:func:`optbook.contract.scale_weights_`).

        Args:
            param: a float16/bfloat16 model parameter this wrapper keeps a master for.
            factor: a Python number or a real tensor broadcastable to ``param.shape`` (a row scaling:
                shape ``(rows, 1)``), applied in float32 or wider.

        An outside write of ``param`` not yet taken up is taken up first.
        """
        for i, (p, master) in enumerate(self._pairs):
            if p is param:
                break
        else:  # not one of ours (any more): an ordinary in-place scaling
            param.mul_(factor)
            return
        if i in self._pending or self._tracker.changed([p]):
            self._take_up([i])
        master.mul_(factor.to(master.device) if isinstance(factor, torch.Tensor) else factor)
        p.copy_(master)
        self._tracker.record([p])

    # --- the step ----------------------------------------------------------------------------------------
    def _validate(self) -> float:
        """Check the scale, an optbook inner optimizer's hyperparameters and every model gradient (shape,
        dtype, device; finite without a loss scaler) before anything is written; return the scale."""
        scale = self.loss_scale
        inner = {id(m): m for m in _members(self.optimizer)}.values()   # a chain's members, once each
        for opt in inner:   # their hyperparameters (a scheduler may have set them), before the scaler moves
            if isinstance(opt, BookOptimizer):
                for group in opt.param_groups:
                    check_hyperparameters(opt, group)
        for i, p in enumerate(self._model_params):   # every one (a float32 parameter's sparse gradient too)
            if p.grad is not None:
                check_grad(p, f"model parameter {i} ({str(p.dtype).removeprefix('torch.')})")
        if self.loss_scaler is None and self.check_for_nonfinite:
            named = [(f"param_groups[{gi}]['params'][{pi}]", p) for gi, g in enumerate(self.param_groups)
                     for pi, p in enumerate(g["params"])]
            model_of = {id(m): p for p, m in self._pairs}
            named = [(w, model_of.get(id(q), q)) for w, q in named]
            named = [(w, p) for w, p in named if p.grad is not None and p.grad.numel()]
            if named and not all_finite([p.grad for _, p in named]):
                for where, p in named:
                    if not bool(torch.isfinite(p.grad).all()):
                        raise NonFiniteGradientError(
                            f"Non-finite gradient of {where} (shape {tuple(p.shape)}, the model's "
                            f"{p.dtype}): nothing was written; pass a loss scaler to skip such steps")
        return scale

    def _copy_model_grads_to_main_grads(self) -> None:
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None  # no stale gradient from an earlier step
            elif master.grad is None:
                master.grad = p.grad.detach().to(torch.float32)
            else:
                master.grad.copy_(p.grad)

    def _cast_state(self, dtype: torch.dtype | None) -> None:
        """Cast every floating-point state tensor except ``step`` to ``dtype`` (``None``: its parameter's dtype)."""
        for p, state in self.optimizer.state.items():
            target = p.dtype if dtype is None else dtype
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() \
                        and value.dtype != target:
                    state[key] = value.to(target)

    def _copy_main_params_to_model_params(self) -> None:
        for p, master in self._pairs:
            p.copy_(master)  # one rounding to the model's dtype
        self._tracker.record([p for p, _ in self._pairs])

    @torch.optim.Optimizer.profile_hook_step  # runs hooks from register_step_pre_hook / post_hook
    @torch.no_grad()
    def step(self, closure=None):
        """One mixed-precision step, in Megatron's order (``MixedPrecisionOptimizer.step``).

        0. validate (nothing written on an error); take up outside writes of the model parameters;
        1. copy each float16/bfloat16 model gradient into its master's ``.grad`` (float32);
        2. with a loss scaler, divide every main gradient by ``S`` and look for ``inf``/``NaN`` in the same
           pass (:func:`unscale_grads_`);
        3. ``loss_scaler.update(found_inf)``;
        4. if ``found_inf``: skip -- no clipping, no inner step; model parameters, masters and the
           inner optimizer's state (step counts included) are bitwise unchanged; ``skipped_steps += 1``;
        5. otherwise clip by the global norm (if ``max_grad_norm``), step the inner optimizer on the
           masters, and round each master into its model parameter.

        A step in which no parameter has a gradient does nothing after step 0: the scaler is not updated
        (a clean step would count toward growth), ``found_inf`` is ``False`` and nothing is counted.
        ``torch.amp.GradScaler`` refuses such a step outright (``step`` asserts "No inf checks were
        recorded for this optimizer"); Megatron-LM would count it as clean. Here it is a no-op, as
        ``torch.optim``'s step without gradients.

        Args:
            closure: optional callable that recomputes the loss and calls ``backward`` on
                :meth:`scale_loss` of it; it runs with gradients enabled.

        Returns:
            The closure's loss, or ``None`` (as ``torch.optim``). Whether the update was applied is
            ``not self.found_inf``: advance a learning-rate scheduler only then, so a skipped iteration
            does not consume a step of the schedule.

        Raises:
            optbook.contract.NonFiniteGradientError: without a loss scaler (and ``check_for_nonfinite``),
                a gradient holds ``inf``/``NaN``; the message names the parameter.
            ValueError, TypeError: the loss scale is outside ``(0, FLOAT32_MAX]``, a hyperparameter of an
                optbook inner optimizer is invalid, or a model gradient has another shape, dtype or device.
                Nothing is written in these cases. Another inner optimizer's errors surface from its own
                ``step``, after the scaler's update.
        """
        loss = closure_loss(closure)
        scale = self._validate()
        self._take_up_outside_writes()
        if not any(p.grad is not None for p in self._model_params):
            self.found_inf = False
            return loss
        self._copy_model_grads_to_main_grads()
        found_inf = False
        if self.loss_scaler is not None:
            found_inf = unscale_grads_([p.grad for g in self.param_groups for p in g["params"]
                                        if p.grad is not None and p.numel()], scale)
            self.loss_scaler.update(found_inf)
        self.found_inf = found_inf
        if found_inf:
            self.skipped_steps += 1
            return loss
        if self.max_grad_norm is not None:
            from optbook.clipping import clip_grad_norm_  # written with chapter 12; needed only when clipping
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            self.last_grad_norm = float(clip_grad_norm_(params, self.max_grad_norm))
        if self.state_dtype is not None:
            self._cast_state(None)  # compute in the parameters' dtype
        self.optimizer.step()
        if self.state_dtype is not None:
            self._cast_state(self.state_dtype)  # store in state_dtype
        self._copy_main_params_to_model_params()
        return loss

    # --- checkpoints -------------------------------------------------------------------------------------
    @torch._disable_dynamo
    def state_dict(self) -> dict:
        """The inner optimizer's state dict, the masters, the scaler's state and ``skipped_steps``.

        Returns:
            ``{"optimizer": inner.state_dict(), "master_params": [float32 tensors, group order],
            "loss_scaler": scaler.state_dict() or None, "skipped_steps": int}``. As with
            ``torch.optim``, tensors are the live ones: ``torch.save`` the dict (or deep-copy it)
            before stepping on. The state-dict pre and post hooks run as in ``torch.optim``.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = {"optimizer": self.optimizer.state_dict(),
              "master_params": [master.detach() for master in self.master_params()],
              "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
              "skipped_steps": self.skipped_steps}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            out = post_hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def check_state_dict(self, state_dict) -> int:
        """Everything :meth:`load_state_dict` checks, writing nothing; returns the saved ``skipped_steps``."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"Invalid state_dict: expected a dict, got {type(state_dict).__name__}")
        missing = [k for k in ("optimizer", "master_params", "loss_scaler") if k not in state_dict]
        if missing:
            raise ValueError(f"Invalid state_dict: missing {', '.join(missing)} (expected a "
                             "MixedPrecisionOptimizer state dict)")
        masters = state_dict["master_params"]
        if len(masters) != len(self._pairs):
            raise ValueError(f"Invalid state_dict: it holds {len(masters)} master parameters, this optimizer has "
                             f"{len(self._pairs)}")
        for i, (saved, (_, master)) in enumerate(zip(masters, self._pairs)):
            if not isinstance(saved, torch.Tensor) or saved.shape != master.shape:
                raise ValueError(f"Invalid state_dict: master_params[{i}] has shape "
                                 f"{tuple(getattr(saved, 'shape', ()))}, expected {tuple(master.shape)}")
            if saved.dtype != torch.float32:   # a lower one would lose the masters' low bits, a higher one is
                raise ValueError(f"Invalid state_dict: master_params[{i}] has dtype {saved.dtype}, expected "
                                 "float32")   # not what this wrapper saves
            if not bool(torch.isfinite(saved).all()):
                raise ValueError(f"Invalid state_dict: master_params[{i}] holds inf or NaN")
        members = _members(self.optimizer)
        params = [list(g["params"]) for g in self.param_groups]
        flat = [p for ps in params for p in ps]
        check_optimizer_state_dict(state_dict["optimizer"], params,
                                   [elementwise(type(m)) for m in members],
                                   [self.state.get(p, {}) for p in flat], "state_dict['optimizer']")
        if (state_dict["loss_scaler"] is None) != (self.loss_scaler is None):
            raise ValueError("Invalid state_dict: " + ("it holds no loss scaler state, but this optimizer has a "
                             "loss scaler" if self.loss_scaler is not None else
                             "it holds a loss scaler state, but this optimizer has no loss scaler"))
        skipped = _check_int("state_dict['skipped_steps']", state_dict.get("skipped_steps", 0), 0)
        if self.loss_scaler is not None:  # a scaler state that does not load fails here, before any write
            copy.deepcopy(self.loss_scaler).load_state_dict(state_dict["loss_scaler"])
        return skipped

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a dict from :meth:`state_dict` of a wrapper over parameters of the same shapes.

        Copies the masters (then rounds them into the model parameters), loads the inner optimizer and
        the scaler, and restores ``skipped_steps`` (``0`` when the dict has none: saved before it existed).
        A resumed run then continues bit-identically -- also when the model's own weights-only state dict
        is loaded before or after this one (loading the rounded masters changes no element, so the
        masters keep their low bits: :func:`take_up_`). The load-state-dict pre and post hooks run as in
        ``torch.optim``.

        Raises:
            ValueError: not a dict or a key missing; another number of masters or of groups, parameters
                in a group, a master or state tensor of another shape, a state tensor that is not
                floating point (:func:`check_optimizer_state_dict`); a scaler state present without a
                scaler or missing with one, or refused by the scaler; what the inner ``load_state_dict``
                raises. Everything is checked first: on an error parameters, masters, state and scaler
                are bitwise unchanged.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        skipped = self.check_state_dict(state_dict)
        inner = state_dict["optimizer"]
        if self.state_dtype is not None:  # saved in state_dtype: back to each parameter's dtype (float32 for a
            # master, float64 for a float64 parameter), which the inner optimizer checks against
            flat = [p for g in self.optimizer.param_groups for p in g["params"]]

            def work(k, n, v):
                stored = n != "step" and isinstance(v, torch.Tensor) and v.is_floating_point()
                return v.to(flat[k].dtype) if stored and isinstance(k, int) and 0 <= k < len(flat) else v
            inner = {**inner, "state": {k: {n: work(k, n, v) for n, v in s.items()}
                                        for k, s in inner["state"].items()}}
        self.optimizer.load_state_dict(inner)
        if self.state_dtype is not None:  # torch.optim casts loaded state to the parameter's dtype
            self._cast_state(self.state_dtype)
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        with torch.no_grad():
            for saved, (p, master) in zip(state_dict["master_params"], self._pairs):
                master.copy_(saved)
                p.copy_(master)
        self._pending.clear()
        self._tracker.record([p for p, _ in self._pairs])
        self.skipped_steps = skipped
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # --- copy and pickle -----------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """Everything (the inner optimizer, pairs, scaler, hooks) but a scheduler's wrapper of :meth:`step`
        (bound to this object, as ``torch.optim.Optimizer.__getstate__`` leaves it out); outside writes not
        yet taken up are remembered by position, since the version tracker is keyed by tensor identity."""
        state = dict(self.__dict__)
        state.pop("step", None)  # a learning-rate scheduler's wrapper of the original's bound step
        state.pop("_opt_called", None)
        tracker = state.pop("_tracker")
        state["_pending"] = set(self._pending) | set(tracker.changed([p for p, _ in self._pairs]))
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in _HOOK_DICTS:
            if not hasattr(self, name):
                setattr(self, name, OrderedDict())
        self._tracker = VersionTracker()
        self._own(self._pairs)

    def __repr__(self) -> str:
        inner = repr(self.optimizer).replace("\n", "\n  ")
        return (f"MixedPrecisionOptimizer(\n  {inner},\n  loss_scaler={self.loss_scaler!r}, "
                f"max_grad_norm={self.max_grad_norm!r}, masters={len(self._pairs)}\n)")
