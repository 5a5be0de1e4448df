"""SGD with EMA (lerp) momentum and Nesterov. Explained in chapter 1 (SGD and momentum).

Source: Polyak (1964) for heavy ball, Nesterov (1983) and Sutskever et al. (2013,
eq. 3-4) for the look-ahead form.

The update for one parameter ``p`` with gradient ``g`` (all tensors of ``p``'s shape and dtype)::

    g       <- -g                                         (maximize=True: ascend the objective)
    g       <- g + weight_decay * p                       (coupled L2, as torch.optim.SGD)
    m       <- lerp(m, g, 1 - momentum)                    (m starts at zero)
    d       <- lerp(g, m, momentum)  if nesterov  else  m
    p       <- p - lr * d

For a float16/bfloat16 parameter the step is computed in float32 and ``p`` and ``m`` are rounded back
once, so the loop and foreach paths agree bitwise.

Relation to ``torch.optim.SGD`` (heavy ball ``b <- momentum * b + g``, first ``b = g``): since
``m_t = (1 - momentum) * b_t`` in exact arithmetic, ``SGD(lr=a, momentum=mu)`` here equals
``torch.optim.SGD(lr=a * (1 - mu), momentum=mu, dampening=0)``, with or without Nesterov, up to
rounding (float64 over 5 steps: within 1.1e-16, not bit for bit).
"""

from __future__ import annotations

import torch

from ._functional import LOW_PRECISION, check_fused, in_float32, momentum_directions, use_foreach, write_back
from .._sharded import local
from .._checks import check_bool, check_foreach, check_lr, check_momentum, check_nesterov, check_weight_decay
from .optimizer import BookOptimizer

__all__ = ["SGD", "sgd"]


@torch.no_grad()
def sgd(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor | None],
        *, lr: float, momentum: float, nesterov: bool, weight_decay: float, foreach: bool = False,
        maximize: bool = False, fused: bool = False) -> None:
    """Apply one SGD step in place (the pure function behind :class:`SGD`).

    Args:
        params, grads: lists of tensors of equal shapes and dtype, one per parameter.
        momentum_buffers: one EMA buffer per parameter (same shape), updated in place; ignored when
            ``momentum == 0``.
        lr, momentum, nesterov, weight_decay, maximize: as in :class:`SGD`; not re-validated here.
        foreach: use the ``torch._foreach_*`` kernels (one call per line for the whole list; bitwise the
            per-tensor loop).
        fused: hand the step to torch's fused kernel ``torch._fused_sgd_`` (one pass over memory per
            tensor), once per device and dtype, as heavy-ball momentum ``b <- momentum * b + (1 - dampening) * g``
            with ``dampening = momentum`` and the zero-started buffer: that *is* the EMA
            ``m <- lerp(m, g, 1 - momentum)``, rounded otherwise (``torch.optim.SGD`` copies ``g`` into ``b`` at
            its first step instead; with a zero buffer already in its state it does not). Not with
            ``nesterov`` (the kernel's look-ahead is ``g + momentum * b``, not ``lerp(g, m, momentum)``).
    """
    if not params:
        return
    if fused:
        groups: dict = {}
        for i, p in enumerate(params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        for indices in groups.values():
            torch._fused_sgd_([params[i] for i in indices], [grads[i] for i in indices],
                              [momentum_buffers[i] for i in indices] if momentum else [],
                              weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=momentum,
                              nesterov=False, maximize=maximize, is_first_step=False, grad_scale=None,
                              found_inf=None)
        return
    if any(p.dtype in LOW_PRECISION for p in params):  # the same step in float32, rounded back once
        work = [in_float32(x) for x in (params, grads, momentum_buffers)]
        sgd(*work, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, foreach=foreach,
            maximize=maximize)
        write_back(params, work[0])
        write_back(momentum_buffers, work[2])
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay:
        if foreach:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        else:
            grads = [g.add(p, alpha=weight_decay) for p, g in zip(params, grads)]
    directions = momentum_directions(momentum_buffers, grads, momentum, nesterov, foreach=foreach) if momentum else grads
    if foreach:
        torch._foreach_add_(params, directions, alpha=-lr)
    else:
        for p, d in zip(params, directions):
            p.add_(d, alpha=-lr)


class SGD(BookOptimizer):
    """Stochastic gradient descent with EMA momentum (lerp form) and optional Nesterov look-ahead.

    Args:
        params: iterable of real floating-point tensors, of ``(name, tensor)`` pairs
            (``model.named_parameters()``: the names go to each group's ``param_names``), or of param-group dicts.
        lr: learning rate (units of the parameter per unit of the EMA'd gradient), ``>= 0``.
        momentum: EMA coefficient ``mu`` in ``[0, 1)``; 0 gives plain SGD and allocates no state.
        nesterov: use ``lerp(g, m, mu)`` as the direction instead of ``m``; needs ``momentum > 0``
            (as ``torch.optim.SGD``).
        weight_decay: coupled L2 coefficient ``>= 0`` added to the gradient.
        dampening: only ``0``. This class's EMA ``m`` is ``(1 - mu)`` times ``torch.optim.SGD``'s
            ``dampening=0`` buffer, so ``SGD(lr, mu)`` here is ``torch.optim.SGD(lr * (1 - mu), mu,
            dampening=0)`` (module docstring); another ``dampening`` has no counterpart and is refused.
        maximize: step along ``+g`` (ascend the objective), as ``torch.optim.SGD(maximize=True)``.
        foreach: force (``True``) or forbid (``False``) the ``torch._foreach_*`` path; ``None``
            picks it (on the CPU and on devices with foreach kernels; the loop gives the same bits).
        fused: ``True`` steps with torch's fused kernel (:func:`sgd`'s ``fused``: the same update,
            rounded otherwise; bitwise ``torch.optim.SGD(fused=True, momentum=mu, dampening=mu)`` with a
            zero buffer in its state). ``None``/``False``: not fused. Refused with ``foreach=True``, with
            ``nesterov``, for a parameter on a device torch has no fused kernel for, and for a
            float16/bfloat16 parameter on the CPU (torch 2.13's kernel writes wrong values there:
            pytorch/pytorch#191763).

    torch's ``differentiable`` and ``capturable`` are refused unless ``False`` (``BookOptimizer``).

    State per parameter: ``momentum_buffer`` (same shape and dtype as the parameter), only when
    ``momentum > 0``; with ``momentum == 0`` ``state`` stays empty, as in ``torch.optim.SGD``.

    Raises:
        ValueError: ``lr < 0``, ``momentum`` outside ``[0, 1)``, ``weight_decay < 0``, non-finite
            values, ``nesterov=True`` with ``momentum=0``, ``dampening != 0``, ``fused=True`` where it
            cannot apply; a gradient of another shape or device; a gradient holding ``inf``/``NaN``
            (:class:`~optbook.contract.NonFiniteGradientError`, nothing written).
        TypeError: integer, bool or complex parameters; sparse gradients or gradients of another dtype;
            ``nesterov``/``maximize`` not a bool, ``foreach``/``fused`` not ``None``/``True``/``False``.
    """

    elementwise = True
    state_tensors = 1  #: parameter-sized state tensors (the momentum buffer), for optbook.memory

    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "momentum", "weight_decay")

    def __init__(self, params, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, *, dampening: float = 0, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None):
        if isinstance(dampening, bool) or not isinstance(dampening, (int, float)) or dampening != 0:
            raise ValueError(f"Invalid dampening={dampening!r}: optbook's SGD keeps the EMA m = (1 - momentum) * b "
                             "of torch.optim.SGD's dampening=0 buffer b (SGD(lr, momentum) here is torch's "
                             "SGD(lr * (1 - momentum), momentum, dampening=0)); another dampening has no "
                             "counterpart in this form. Accepted: 0")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        maximize=maximize, foreach=foreach, fused=fused)
        super().__init__(params, defaults)

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        momentum = check_momentum(group["momentum"])
        check_weight_decay(group["weight_decay"])
        check_nesterov(group["nesterov"], momentum)
        check_bool("maximize", group["maximize"])
        check_foreach(group["foreach"])
        check_fused(group, nesterov=group["nesterov"], sgd=True)
        if group["fused"] and self.compiled is not None:
            raise ValueError("Invalid fused=True: this optimizer's arithmetic runs through compiled_step's "
                             "torch.compile-d kernel, and fused=True hands it to torch's fused kernel; choose one")

    #: ``None`` (the eager step), or the :class:`optbook.optim.compiled.CompiledStep` whose compiled kernel
    #: runs this optimizer's arithmetic inside its own ``step()`` (set by :func:`optbook.optim.compiled_step`).
    compiled = None

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        momentum = group["momentum"]
        buffers = []
        for p in params:
            if momentum:   # (with momentum 0 state is left empty, as torch.optim.SGD leaves it)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buffers.append(state["momentum_buffer"])
            else:
                buffers.append(None)
        if self.compiled is not None:
            self.compiled.run_sgd(params, buffers, group)
            return
        sgd(local(params), local([p.grad for p in params]), local(buffers), lr=group["lr"], momentum=momentum,
            nesterov=group["nesterov"], weight_decay=group["weight_decay"], maximize=group["maximize"],
            foreach=use_foreach(group["foreach"], params), fused=bool(group["fused"]))
