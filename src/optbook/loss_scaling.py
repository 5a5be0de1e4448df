"""Loss scaling: the scale ``S`` a float16 loss is multiplied by, its update after each step, and unscaling.
Explained in chapter 11.

Sources: Micikevicius et al. (2018), "Mixed Precision Training", arXiv:1710.03740, Sec. 3.2 (loss scaling);
Megatron-LM core_r0.13.0 ``megatron/core/optimizer/grad_scaler.py`` (``ConstantGradScaler``,
``DynamicGradScaler``: the counters and their order, followed here) and ``megatron/core/optimizer/optimizer.py``
(``_unscale_main_grads_and_check_for_nan``); PyTorch v2.13.0 ``torch/amp/grad_scaler.py`` and
``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp`` (``_amp_update_scale_``). The code here is our own.

A float16 gradient below ``2**-24`` (about ``6e-8``) flushes to zero. Multiplying the loss by ``S``
multiplies every gradient by ``S`` (the chain rule is linear), which lifts them into float16's range; the
optimizer divides by ``S`` in float32 before using them. Too large an ``S`` overflows to ``inf``: that step
is skipped and a dynamic scaler lowers ``S``. bfloat16 has float32's exponent range and usually needs no
scaling.

Every optimizer with a loss scaler shares these pieces (:class:`~optbook.precision.MixedPrecisionOptimizer`,
ZeRO-1's ``DistributedOptimizer``): the scalers :class:`ConstantLossScaler` and :class:`DynamicLossScaler`,
and :func:`loss_scale_of`, :func:`check_loss_scaler`, :func:`check_float16_scaled`, :func:`scaled_loss`,
:func:`unscale_grads_`. The names are also importable from :mod:`optbook.precision`.
"""

from __future__ import annotations

import torch

from ._checks import LOW_PRECISION, check_bool, check_number
from ._checks import check_int as _check_int

__all__ = ["FLOAT32_MAX", "ConstantLossScaler", "DynamicLossScaler", "check_float16_scaled", "check_loss_scaler",
           "loss_scale_of", "scaled_loss", "unscale_grads_"]

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

    A step whose gradients overflow is still skipped by :class:`~optbook.precision.MixedPrecisionOptimizer`; the scale
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
    them is still detected and its step skipped by :class:`~optbook.precision.MixedPrecisionOptimizer`. A run that
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
