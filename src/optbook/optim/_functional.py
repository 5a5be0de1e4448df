"""Pieces of math that several optimizers of :mod:`optbook.optim` share, written once.

``momentum_directions`` is the EMA (lerp) momentum with the optional Nesterov look-ahead of chapter 1,
used by :func:`optbook.optim.functional.sgd` and :func:`optbook.optim.functional.muon`; ``use_foreach`` is the rule that picks
the ``torch._foreach_*`` path (the default on the CPU and on accelerators), used by :class:`~optbook.optim.SGD` and
:class:`~optbook.optim.Adam`;
``in_float32``/``write_back`` compute the update of a float16/bfloat16 parameter in float32 and round
it into the parameter (and its state) once, as mixed-precision training keeps master weights in
float32 (Micikevicius et al. 2018, arXiv:1710.03740): a quantity such as Adam's
``eps * sqrt(1 - beta2**t)`` (3e-10 at t = 1) underflows to zero in float16.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices

from .._checks import LOW_PRECISION

__all__ = ["LOW_PRECISION", "check_fused", "in_float32", "momentum_directions", "steps_in_float32", "use_foreach",
           "write_back"]


def momentum_directions(momentum_buffers: list[torch.Tensor], grads: list[torch.Tensor], momentum: float,
                        nesterov: bool, *, foreach: bool = False) -> list[torch.Tensor]:
    """Update each EMA buffer in place and return the step directions (chapter 1)::

        m <- lerp(m, g, 1 - momentum)                       (m starts at zero)
        d  = lerp(g, m, momentum)  if nesterov  else  m

    Source: Polyak (1964) for the heavy ball, Sutskever et al. (2013, eq. 3-4) for the look-ahead;
    ``m`` is ``(1 - momentum)`` times ``torch.optim.SGD``'s buffer, so the two agree in exact arithmetic
    (to rounding in floating point) with ``lr`` rescaled by ``1 - momentum``.

    Args:
        momentum_buffers, grads: lists of equal-shape, equal-dtype tensors, one entry per parameter;
            the buffers are updated in place.
        momentum: the EMA coefficient in ``[0, 1)`` (not re-validated here).
        nesterov: return the look-ahead ``lerp(g, m, momentum)`` (a new tensor) instead of ``m``.
        foreach: use the ``torch._foreach_*`` kernels (one launch per operation for the whole list).

    Returns:
        One direction per parameter: the buffer itself without Nesterov, a new tensor with it.
    """
    if foreach:
        torch._foreach_lerp_(momentum_buffers, grads, 1 - momentum)
        return torch._foreach_lerp(grads, momentum_buffers, momentum) if nesterov else list(momentum_buffers)
    directions = []
    for g, m in zip(grads, momentum_buffers):
        m.lerp_(g, 1 - momentum)
        directions.append(g.lerp(m, momentum) if nesterov else m)
    return directions


def use_foreach(foreach: bool | None, params: list[torch.Tensor]) -> bool:
    """The ``foreach`` option resolved for one group's ``params``.

    ``True``/``False`` are kept; ``None`` picks the ``torch._foreach_*`` path (whole tensors, one call per
    line of the update for the whole list) when there is at least one parameter and every parameter is on
    the CPU or on a device with torch's foreach kernels (CUDA, XPU, ...): on an accelerator it saves kernel
    launches, on the CPU it runs each tensor's kernels in turn in C++, bitwise the per-tensor loop. (torch
    itself picks its for-loop on the CPU; the two give the same bits for these element-wise updates.)
    """
    if foreach is None:
        devices = {"cpu", *_get_foreach_kernels_supported_devices()}
        return bool(params) and all(p.device.type in devices for p in params)
    return foreach



def in_float32(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``tensors`` with every float16/bfloat16 entry replaced by a float32 copy (others kept as they are)."""
    return [t.float() if t is not None and t.dtype in LOW_PRECISION else t for t in tensors]


def write_back(targets: list[torch.Tensor | None], results: list[torch.Tensor | None]) -> None:
    """Copy each float32 working copy made by :func:`in_float32` into its original (one rounding)."""
    for t, r in zip(targets, results):
        if t is not None and r is not t:
            t.copy_(r)


def steps_in_float32(n_lists: int):
    """Decorator for a functional twin ``fn(params, grads, *state_lists, *rest, **hyperparameters)``.

    When any of ``params`` is float16/bfloat16, ``fn`` runs once on float32 copies of its first ``n_lists``
    positional arguments (lists of tensors: the parameters, the gradients, then the state the step updates)
    and every copy but the gradients' is rounded back into its original once (:func:`write_back`); the other
    arguments pass through. Otherwise ``fn`` runs on the tensors themselves; with no parameters it does not
    run. Each functional twin's own low-precision branch and empty-list check, written once.
    """
    def wrap(fn):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            lists, rest = args[:n_lists], args[n_lists:]
            if not lists[0]:
                return None
            if not any(p.dtype in LOW_PRECISION for p in lists[0]):
                return fn(*args, **kwargs)
            work = [in_float32(x) for x in lists]
            fn(*work, *rest, **kwargs)
            for i, (target, result) in enumerate(zip(lists, work)):
                if i != 1:   # the gradients are read, never written
                    write_back(target, result)
        return step
    return wrap


def check_fused(group: dict, *, nesterov: bool = False, sgd: bool = False) -> None:
    """Check a group's ``fused`` option (SGD, Adam, AdamW), and that torch's fused kernel can take the group.

    ``None``/``False`` ask for nothing. ``True`` needs ``foreach`` not ``True`` (``torch.optim`` refuses both
    too), no Nesterov look-ahead (SGD: torch's kernel computes another one), and every parameter floating
    point on a device torch has fused optimizer kernels for (``torch.utils._foreach_utils.
    _get_fused_kernels_supported_devices``, torch 2.13: CPU, CUDA, MPS, XPU, HPU, MTIA). For SGD
    (``sgd=True``) also no float16/bfloat16 parameter on the CPU: torch 2.13's CPU ``_fused_sgd_`` writes wrong
    values there (pytorch/pytorch#191763, a fix proposed in pytorch/pytorch#192545: full SIMD blocks of a
    float16/bfloat16 tensor skipped, and stale values written into the momentum buffer; observed with
    torch 2.13.0+cpu as momentum-buffer entries that differ from run to run).

    Raises:
        TypeError: ``fused`` not ``None``/``True``/``False``.
        ValueError: ``fused=True`` where it cannot apply, naming ``fused`` and the reason.
    """
    fused = group["fused"]
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"Invalid fused: expected None, True or False, got {fused!r} ({type(fused).__name__})")
    if not fused:
        return
    if group.get("foreach"):
        raise ValueError("Invalid fused=True with foreach=True: the fused kernel and the foreach path are two "
                         "ways to run the step; choose one (torch.optim refuses both at once too)")
    if nesterov:
        raise ValueError("Invalid fused=True with nesterov=True: torch's fused SGD kernel's look-ahead is "
                         "g + momentum * b, not this class's lerp(g, m, momentum) for its EMA buffer m; "
                         "use fused=False (or None) for Nesterov")
    devices = _get_fused_kernels_supported_devices()
    for i, p in enumerate(group.get("params", ())):
        if isinstance(p, torch.Tensor) and (p.device.type not in devices or not p.is_floating_point()):
            raise ValueError(f"Invalid fused=True: parameter {i} is {p.dtype} on {p.device.type}, and torch has "
                             f"fused optimizer kernels only for floating-point tensors on {devices}")
        if sgd and isinstance(p, torch.Tensor) and p.device.type == "cpu" and p.dtype in LOW_PRECISION:
            raise ValueError(f"Invalid fused=True: parameter {i} is {p.dtype} on the CPU, where torch's fused SGD "
                             "kernel writes wrong values (pytorch/pytorch#191763); use fused=False (or None) for "
                             "float16/bfloat16 parameters on the CPU")
