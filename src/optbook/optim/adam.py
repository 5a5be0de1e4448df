"""Adam and AdamW. Explained in chapter 2 (Adam) and chapter 3 (AdamW).

Source: Kingma & Ba (2015), arXiv:1412.6980, Algorithm 1 (Adam); Loshchilov & Hutter (2019),
arXiv:1711.05101, Algorithm 2 (AdamW); PyTorch's ``torch/optim/adam.py`` and ``adamw.py`` for the parity tests.

For one parameter ``p`` with gradient ``g`` at step ``t = 1, 2, ...`` (elementwise; every tensor has
``p``'s shape and dtype)::

    g  <- -g                                    (maximize=True: ascend the objective)
    g  <- g + weight_decay * p                  (Adam: coupled L2)
    p  <- p * (1 - lr * weight_decay)           (AdamW: decoupled decay, multiplied by the current lr)
    m  <- lerp(m, g, 1 - beta1)
    v  <- beta2 * v + (1 - beta2) * g * g
    v  <- v_max <- max(v_max, v)                (amsgrad=True: the denominator never shrinks; v_max from 0)
    p  <- p - lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)

``eps`` sits *outside* the square root, as in Algorithm 1. For a float16/bfloat16 parameter every line
is computed in float32 and ``p``, ``m``, ``v`` are rounded back once (the state keeps the parameter's
dtype, as in ``torch.optim``): in float16 ``eps * sqrt(1 - beta2**t)`` would underflow to 0 and give
NaN for a zero gradient; the loop and foreach paths then agree bitwise. The last line is evaluated as
``p - (lr * c2 / c1) * m / (sqrt(v) + eps * c2)`` with ``c1 = 1 - beta1**t`` and
``c2 = sqrt(1 - beta2**t)``: the same number in exact arithmetic, one pass over memory fewer.
AMSGrad is Reddi, Kale & Kumar (2018), arXiv:1904.09237, Algorithm 2, in ``torch.optim.Adam``'s form
(the maximum of the raw ``v``, bias-corrected afterwards). The step count ``t`` is a Python ``int`` per parameter (exact at any length; a low-precision
float count would stall at 256 in bf16).
"""

from __future__ import annotations

import math

import torch

from ._functional import LOW_PRECISION, check_fused, in_float32, use_foreach, write_back
from .._sharded import local
from .._checks import check_betas, check_bool, check_eps, check_foreach, check_lr, check_weight_decay
from .optimizer import BookOptimizer

__all__ = ["Adam", "AdamW", "adam"]


@torch.no_grad()
def adam(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
         exp_avg_sqs: list[torch.Tensor], steps: list[int], *, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, decoupled_weight_decay: bool, foreach: bool = False,
         amsgrad: bool = False, maximize: bool = False, max_exp_avg_sqs: list[torch.Tensor] | None = None,
         fused: bool = False) -> None:
    """Apply one Adam (``decoupled_weight_decay=False``) or AdamW step in place.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: lists of equal-shape tensors, one entry per parameter;
            ``exp_avgs`` (m) and ``exp_avg_sqs`` (v) are updated in place.
        steps: the step number ``t >= 1`` of each parameter, *after* counting this step.
        lr, beta1, beta2, eps, weight_decay: hyperparameters (not re-validated here).
        decoupled_weight_decay: AdamW's ``p *= 1 - lr * weight_decay`` instead of L2 in the gradient.
        foreach: one ``torch._foreach_*`` call per line of the update for the whole list; otherwise one
            parameter at a time, whole tensors. The two compute every element with the same kernels, so
            they agree bitwise.
        amsgrad: divide by the running maximum of ``v``, kept in ``max_exp_avg_sqs`` (one tensor per
            parameter, updated in place; required when ``amsgrad``).
        maximize: step along ``+g`` (gradient ascent).
        fused: hand the whole step to torch's fused kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``,
            one pass over memory per tensor, the kernel of ``torch.optim.Adam(fused=True)``), called per
            device and dtype with the step counts as float32 tensors, as ``torch.optim``'s ``_fused_adam``
            calls it: bitwise ``torch.optim.Adam/AdamW(fused=True)``. The same algorithm as the other
            paths, with the arithmetic in another order, so it rounds differently (float64 over 10 steps:
            within 1e-14 relative, ``tests/test_fused.py``).
            A float16/bfloat16 parameter goes as it is (the kernel computes in float32 and rounds once).

    Raises:
        ValueError: ``amsgrad`` without one ``max_exp_avg_sqs`` tensor per parameter.
    """
    if not params:
        return
    if amsgrad and (max_exp_avg_sqs is None or len(max_exp_avg_sqs) != len(params)):
        raise ValueError("Invalid max_exp_avg_sqs: amsgrad=True needs one tensor per parameter")
    if fused:
        _fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps, lr=lr,
                    beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                    maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
        return
    if any(p.dtype in LOW_PRECISION for p in params):  # the same step in float32, rounded back once
        work = [in_float32(x) for x in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or [])]
        adam(*work[:4], steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
             decoupled_weight_decay=decoupled_weight_decay, foreach=foreach, amsgrad=amsgrad, maximize=maximize,
             max_exp_avg_sqs=work[4] if amsgrad else None)
        for target, result in zip((params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or []), work[:1] + work[2:]):
            write_back(target, result)
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    c1 = [1 - beta1 ** t for t in steps]
    c2 = [math.sqrt(1 - beta2 ** t) for t in steps]
    if weight_decay and not decoupled_weight_decay:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    decay = 1 - lr * weight_decay if decoupled_weight_decay else 1.0
    if foreach:   # one call per line for the whole list
        if decay != 1.0:
            torch._foreach_mul_(params, decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        if amsgrad:
            torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denoms = torch._foreach_sqrt(max_exp_avg_sqs if amsgrad else exp_avg_sqs)
        torch._foreach_add_(denoms, [eps * b for b in c2])
        torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr * b / a for a, b in zip(c1, c2)])
        return
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):   # the same lines, a tensor at a time
        if decay != 1.0:
            p.mul_(decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if amsgrad:
            v = torch.maximum(max_exp_avg_sqs[i], v, out=max_exp_avg_sqs[i])
        denom = v.sqrt().add_(eps * c2[i])
        p.addcdiv_(m, denom, value=-lr * c2[i] / c1[i])


def _fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                weight_decay, amsgrad, maximize, decoupled_weight_decay) -> None:
    """torch's fused Adam/AdamW kernel, once per (device, dtype); ``steps`` already count this step."""
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), indices in groups.items():
        def pick(xs):
            return [xs[i] for i in indices]
        # torch.optim keeps the count as a float32 tensor for its fused kernels (_get_scalar_dtype(is_fused))
        counts = [torch.tensor(float(steps[i]), dtype=torch.float32, device=device) for i in indices]
        kernel(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
               pick(max_exp_avg_sqs) if amsgrad else [], counts, amsgrad=amsgrad, lr=lr, beta1=beta1,
               beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=maximize, grad_scale=None, found_inf=None)


class _AdamBase(BookOptimizer):
    _decoupled: bool
    elementwise = True
    state_tensors = 2  #: parameter-sized state tensors (exp_avg, exp_avg_sq), for optbook.memory
    state_scalars = {"step": "count"}
    nonnegative_state = ("exp_avg_sq", "max_exp_avg_sq")   # second moments: refused negative at load
    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 amsgrad: bool, maximize: bool, foreach: bool | None, fused: bool | None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, fused=fused)
        super().__init__(params, defaults)

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])
        check_bool("amsgrad", group["amsgrad"])
        check_bool("maximize", group["maximize"])
        check_foreach(group["foreach"])
        check_fused(group)
        if group["fused"] and self.compiled is not None:
            raise ValueError("Invalid fused=True: this optimizer's arithmetic runs through compiled_step's "
                             "torch.compile-d kernel, and fused=True hands it to torch's fused kernel; choose one")

    def _expected_state(self, p, group):
        like = (tuple(p.shape), p.dtype)
        return {"exp_avg": (*like, True), "exp_avg_sq": (*like, True), "max_exp_avg_sq": (*like, False)}

    def _prepare_group(self, group: dict) -> tuple[list, list, list, list, list]:
        """Create missing state and advance the step count of every parameter of ``group`` with a gradient
        (``step()`` has removed those with no element). Returns ``(params, exp_avgs, exp_avg_sqs, steps,
        max_exp_avg_sqs)``, the last empty unless ``amsgrad``."""
        params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs = [], [], [], [], []
        amsgrad = group["amsgrad"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:   # one dict.update: an interrupt (Ctrl-C) cannot leave half a state behind
                state.update(step=0, exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            if amsgrad and "max_exp_avg_sq" not in state:  # also when amsgrad is switched on mid-run
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            params.append(p)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            if amsgrad:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        return params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs

    #: ``None`` (the eager step), or the :class:`optbook.optim.compiled.CompiledStep` whose compiled kernel
    #: runs this optimizer's arithmetic inside its own ``step()`` (set by :func:`optbook.optim.compiled_step`).
    compiled = None

    def _step_group(self, group: dict) -> None:
        params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs = self._prepare_group(group)
        amsgrad = group["amsgrad"]
        if self.compiled is not None:
            self.compiled.run_group(params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, group,
                                    decoupled_weight_decay=self._decoupled)
            return
        foreach = use_foreach(group["foreach"], params)
        beta1, beta2 = group["betas"]
        # a DTensor (FSDP2 shard) is stepped through its local shard: element-wise, the same arithmetic
        adam(local(params), local([p.grad for p in params]), local(exp_avgs), local(exp_avg_sqs), steps,
             lr=group["lr"],
             beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
             decoupled_weight_decay=self._decoupled, foreach=foreach, amsgrad=amsgrad,
             maximize=group["maximize"], max_exp_avg_sqs=local(max_exp_avg_sqs) if amsgrad else None,
             fused=bool(group["fused"]))


_ARGS_DOC = """
    Args:
        params: iterable of real floating-point tensors, of ``(name, tensor)`` pairs
            (``model.named_parameters()``: the names go to each group's ``param_names``), or of param-group dicts.
        lr: learning rate ``alpha`` (parameter units per step at unit normalised gradient), ``>= 0``.
        betas: EMA coefficients ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)`` (outside the root), ``> 0``.
        weight_decay: ``lambda >= 0``; {wd}
        amsgrad: divide by the running maximum of ``v`` (AMSGrad, Reddi et al. 2018), as
            ``torch.optim.{name}(amsgrad=True)``.
        maximize: maximise the objective (step along ``+g``), as ``torch.optim.{name}(maximize=True)``.
        foreach: force (``True``) or forbid (``False``) the ``torch._foreach_*`` path; ``None``
            picks it (on the CPU and on devices with foreach kernels; the per-tensor loop gives the same bits).
        fused: ``True`` hands the step to torch's fused kernel (``torch._fused_{kernel}_``, one pass over
            memory per tensor): bitwise ``torch.optim.{name}(fused=True)``, the same algorithm as the
            default path rounded otherwise (:func:`adam`'s ``fused``). ``None``/``False``: not fused.
            Refused with ``foreach=True`` and for a parameter on a device torch has no fused kernel for.

    torch's ``differentiable`` and ``capturable`` are refused unless ``False`` (``BookOptimizer``).

    State per parameter: ``step`` (``int``), ``exp_avg`` and ``exp_avg_sq`` (the parameter's shape
    and dtype), and ``max_exp_avg_sq`` (same) when ``amsgrad``. A parameter whose ``grad`` is ``None`` is skipped entirely (no decay, no count).

    Raises:
        ValueError: ``lr < 0``, a beta outside ``[0, 1)``, ``eps <= 0``, ``weight_decay < 0``,
            non-finite values; a gradient of another shape or device; a gradient holding ``inf``/``NaN``
            (:class:`~optbook.contract.NonFiniteGradientError`, nothing written: ``torch.optim`` writes
            the NaN into the weights instead).
        TypeError: integer, bool or complex parameters; sparse gradients or gradients of another dtype;
            ``amsgrad`` or ``maximize`` not a bool, ``foreach``/``fused`` not ``None``/``True``/``False``.
"""

class Adam(_AdamBase):
    __doc__ = ("Adam (Kingma & Ba 2015, Algorithm 1) with optional coupled L2 weight decay.\n"
               + _ARGS_DOC.format(name="Adam", kernel="adam", wd="coupled L2: ``lambda * p`` is added to the gradient, so it is "
                                     "rescaled by the adaptive denominator (chapter 3, Prop. 2).")
               + "\n    ``decoupled_weight_decay``: only ``False``; torch 2.13's ``Adam(decoupled_weight_decay=True)``"
                 " is AdamW,\n    which is :class:`AdamW` here (``ValueError`` otherwise).\n")
    _decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False,
                 *, foreach: bool | None = None, fused: bool | None = None, decoupled_weight_decay: bool = False):
        if decoupled_weight_decay is not False:
            raise ValueError(f"Invalid decoupled_weight_decay={decoupled_weight_decay!r}: torch's "
                             "Adam(decoupled_weight_decay=True) is AdamW; use optbook.optim.AdamW. Accepted here: False")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused)


class AdamW(_AdamBase):
    __doc__ = ("AdamW (Loshchilov & Hutter 2019, Algorithm 2) in PyTorch's parametrisation.\n"
               + _ARGS_DOC.format(name="AdamW", kernel="adamw", wd="decoupled: ``p *= 1 - lr * lambda`` before the Adam update, "
                                     "so the decay follows the (scheduled) lr; equals "
                                     "``torch.optim.AdamW``'s ``weight_decay``."))
    _decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                 *, foreach: bool | None = None, fused: bool | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused)
