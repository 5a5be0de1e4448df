"""A compiled optimizer step: the update captured once by ``torch.compile``. Explained in chapter 15.

Why a separate path. :func:`optbook.optim.functional.adam` takes the step count ``t`` as a Python ``int`` and
``lr`` as a Python ``float`` and folds them into Python scalars (``lr * c2 / c1``). Under
``torch.compile`` a Python number is at first a constant of the captured graph, guarded by value: a
graph compiled at ``t = 1`` fails its guard at ``t = 2``. PyTorch 2.13's defaults then compile once more
with the number as an input (``torch/_dynamo/config.py``: ``specialize_float=False``,
``automatic_dynamic_shapes=True``; an int becomes a symbolic integer, a float a float64 scalar tensor),
and later values reuse that graph. Under CUDA graphs (``mode="reduce-overhead"``) floats stay constants
(``torch/_dynamo/variables/builder.py``): every new learning rate of a schedule compiles again, until
Dynamo's ``recompile_limit`` (8) makes it give up and run eagerly, without an error. Passing the numbers
that change from step to step as tensors avoids both, as ``torch.optim``'s ``capturable=True`` does: here
one float64 tensor per parameter group holding ``lr``, the betas, the decay factors and each parameter's
bias corrections, computed eagerly from the step counts (``<name>_scalars``). Their *values* are data,
not constants, so one graph serves every step from the first.

What is compiled: for each parameter group, the element-wise lines of the update (``<name>_elementwise``):
Adam/AdamW here (:func:`adam_elementwise`; Adam's L2 or AdamW's decoupled decay, AMSGrad, maximize), SGD
(momentum, Nesterov, weight decay), Lion, Adafactor (with its row/column means and RMS reductions) and
Schedule-Free AdamW in :mod:`optbook.optim.compiled_elementwise` (sources and guards there). A
float16/bfloat16 parameter is computed in float32 and rounded back once, as on the eager path.
:func:`compiled_step` makes such an optimizer (also as a member of a chain, or inside a mixed-precision
wrapper) run its arithmetic through these kernels, one ``torch.compile`` per algorithm, inside its own
``step()``: the usual validation, hooks, scheduler bookkeeping and state (``state["step"]`` stays an
``int``, Schedule-Free's ``lr_max`` and ``weight_sum`` stay floats, so state dicts are the eager optimizer's)
are unchanged. Inductor fuses each parameter's lines into one loop over memory, which is what
``torch.optim.AdamW(fused=True)`` does by hand in C++/CUDA.

What still recompiles (guards): for Adam/AdamW a change of the group's ``amsgrad`` or ``maximize`` (Python
constants of the graph), Adam's (L2) ``weight_decay`` switched between zero and non-zero; for SGD
``nesterov``, ``maximize`` and ``momentum`` switched between zero and non-zero; Adafactor's ``maximize``;
for every algorithm a change of the set of parameters that have a gradient, or of their shapes and dtypes.
``lr`` (float or one-element tensor, as a scheduler sets it), the step count and the other real-valued
hyperparameters do not: they reach the graph as rows of the float64 tensor, as ``torch.optim``'s compiled
optimizers take tensor hyperparameters. Each distinct group (another set of shapes) is another graph of the
same kernel function: Dynamo keeps at most ``recompile_limit`` (8) of them, then runs that kernel eagerly.

Cost: the first call compiles (tens of seconds on a small CPU for a hundred tensors); measured speed in
``benchmarks/bench_compiled_step.py``, ``benchmarks/bench_limits.py`` and their README.
"""

from __future__ import annotations

import torch

from ._functional import LOW_PRECISION
from .._sharded import local
from .adafactor import Adafactor
from .adam import Adam, AdamW
from ..wrapper import OptimizerWrapper
from .chained import ChainedOptimizer
from .compiled_elementwise import (adafactor_elementwise, adafactor_scalars, lion_elementwise, lion_scalars,
                                   parameter_norms, schedule_free_elementwise, schedule_free_scalars, sgd_elementwise,
                                   sgd_scalars)
from .lion import Lion
from .muon import Muon, muon
from .schedule_free import ScheduleFreeAdamW
from .sgd import SGD

__all__ = ["CompiledMuonStep", "CompiledStep", "adam_elementwise", "adam_scalars", "adam_tensor", "compiled_muon_step",
           "compiled_step"]


def adam_scalars(steps: torch.Tensor, lr: torch.Tensor, *, beta1, beta2, eps, weight_decay,
                 decoupled_weight_decay: bool = True) -> torch.Tensor:
    """The per-parameter numbers of one Adam step, from the step counts, ``lr`` and the other
    hyperparameters as tensors.

    Args:
        steps: float64 tensor ``(n,)``, the step number ``t >= 1`` of each parameter after counting this
            step (float64 holds every integer below 2**53 exactly).
        lr: 0-d (or one-element) float64 tensor.
        beta1, beta2, eps, weight_decay: Python floats or 0-d tensors (read in float64).
        decoupled_weight_decay: ``True`` (AdamW): row 2 is ``1 - lr * weight_decay``; ``False`` (Adam's L2):
            row 2 is 1 and row 6 is ``weight_decay``.

    Returns:
        float64 tensor ``(7, n)``: rows ``-lr * c2 / c1`` (the step size), ``eps * c2``, AdamW's decay factor,
        ``1 - beta1``, ``beta2``, ``1 - beta2`` and the L2 coefficient, with ``c1 = 1 - beta1**t``,
        ``c2 = sqrt(1 - beta2**t)``. ``1 - beta`` is formed here in float64 and rounded once into the
        parameter's dtype, as a Python float ``1 - beta`` is when the eager step passes it to a kernel.
    """
    f64 = dict(dtype=torch.float64, device=steps.device)
    lr = lr.reshape(()).to(**f64)
    beta1, beta2, eps, weight_decay = (torch.as_tensor(x, **f64).reshape(())
                                       for x in (beta1, beta2, eps, weight_decay))
    c1 = 1 - torch.pow(beta1, steps)
    c2 = torch.sqrt(1 - torch.pow(beta2, steps))
    one = torch.ones_like(c2)
    decay = (1 - lr * weight_decay) * one if decoupled_weight_decay else one
    l2 = one * (0.0 if decoupled_weight_decay else weight_decay)
    return torch.stack([-lr * c2 / c1, eps * c2, decay, (1 - beta1) * one, beta2 * one, (1 - beta2) * one, l2])


def adam_elementwise(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], scalars: torch.Tensor, *, decoupled_weight_decay: bool,
                     l2: bool = False, amsgrad: bool = False, maximize: bool = False,
                     max_exp_avg_sqs: list[torch.Tensor] | None = None) -> None:
    """The element-wise lines of one Adam/AdamW step, in place; ``scalars`` from :func:`adam_scalars`.

    Only element-wise work: what :class:`CompiledStep` compiles, into one fused loop per parameter.
    (Left inside the graph, ``beta1**t`` and its square root would be recomputed by Inductor's CPU code
    for every vector of 8 floats, in float64: slower than the eager step.) Every number that a schedule may
    change (``lr``, the betas, the decay) is a row of ``scalars``: data, not a constant of the graph.
    AdamW's decay is always applied (a factor of exactly 1 without decay); Adam's L2 term only when ``l2``
    (a Python bool: switching Adam's ``weight_decay`` between zero and non-zero compiles once more).
    """
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        low = p.dtype in LOW_PRECISION      # the same step in float32, rounded back once
        w = p.float() if low else p
        g = g.float() if low else g
        m_w = m.float() if low else m
        v_w = v.float() if low else v
        step_size, eps_hat, decay, one_minus_beta1, beta2, one_minus_beta2, l2_coefficient = (
            scalars[k, i].to(w.dtype) for k in range(7))
        if maximize:
            g = -g
        if decoupled_weight_decay:
            w = w * decay
        elif l2:
            g = g + l2_coefficient * w
        m_new = torch.lerp(m_w, g, one_minus_beta1)
        v_new = v_w * beta2 + one_minus_beta2 * g * g
        denominator = v_new
        if amsgrad:
            vmax = torch.maximum(max_exp_avg_sqs[i].float() if low else max_exp_avg_sqs[i], v_new)
            max_exp_avg_sqs[i].copy_(vmax)
            denominator = vmax
        w = w + step_size * m_new / (torch.sqrt(denominator) + eps_hat)
        p.copy_(w)
        m.copy_(m_new)
        v.copy_(v_new)


def adam_tensor(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: torch.Tensor, lr: torch.Tensor, *, beta1,
                beta2, eps, weight_decay, decoupled_weight_decay: bool,
                amsgrad: bool = False, maximize: bool = False,
                max_exp_avg_sqs: list[torch.Tensor] | None = None) -> None:
    """One Adam/AdamW step in place with the step counts and ``lr`` as tensors (capturable).

    The lines of :func:`optbook.optim.functional.adam` (module docstring of :mod:`optbook.optim.adam`):
    :func:`adam_scalars` then :func:`adam_elementwise`. Call it under ``torch.no_grad()`` (it writes into
    parameters); ``torch.compile(adam_tensor)`` captures it once for every step count and ``lr``.

    Args:
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs: as in :func:`optbook.optim.functional.adam`.
        steps: float64 tensor of shape ``(len(params),)``: each parameter's step number ``t >= 1``.
        lr: 0-d (or one-element) float64 tensor, the learning rate.
        beta1, beta2, eps, weight_decay: as in :func:`optbook.optim.functional.adam`, Python floats or 0-d tensors.
        decoupled_weight_decay, amsgrad, maximize: as in :func:`optbook.optim.functional.adam` (Python bools:
            constants of a compiled graph).

    The result equals :func:`optbook.optim.functional.adam`'s to float rounding, not bitwise: a compiler may
    reassociate, and ``beta**t`` is ``torch.pow`` here, Python's ``**`` there.
    """
    scalars = adam_scalars(steps, lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                           decoupled_weight_decay=decoupled_weight_decay)
    adam_elementwise(params, grads, exp_avgs, exp_avg_sqs, scalars, decoupled_weight_decay=decoupled_weight_decay,
                     l2=bool(float(weight_decay)) and not decoupled_weight_decay, amsgrad=amsgrad,
                     maximize=maximize, max_exp_avg_sqs=max_exp_avg_sqs)


class CompiledStep:
    """The compiled arithmetic of one or more element-wise optimizers, run inside their own ``step()``.

    Made by :func:`compiled_step`; see the module docstring. Calling it is calling ``optimizer.step``:
    ``step(closure=None)`` returns what that returns. Each ``run_*`` method is called by an optimizer's
    ``step()`` for one group, with the state that ``step()`` prepared (created, step counts advanced); the
    numbers of the step are formed eagerly (``<name>_scalars``), the element-wise lines run in ``kernels``.

    Attributes:
        optimizer: what :func:`compiled_step` was given (an optimizer, a chain, a mixed-precision wrapper).
        optimizers: the optimizers whose ``step()`` runs a compiled kernel (their attribute ``compiled`` is
            this object).
        kernels: ``{"adam" | "sgd" | "lion" | "adafactor" | "schedule_free": the torch.compile-d element-wise
            function}``; nothing is compiled before the first call of each.
    """

    def __init__(self, optimizer, optimizers: list, **compile_options):
        self.optimizer = optimizer
        self.optimizers = optimizers
        self.kernels = {name: torch.compile(fn, fullgraph=True, **compile_options) for name, fn in _KERNELS.items()}

    def __call__(self, closure=None):
        return self.optimizer.step(closure)

    def run_group(self, params, exp_avgs, exp_avg_sqs, steps: list[int], max_exp_avg_sqs, group: dict, *,
                  decoupled_weight_decay: bool) -> None:
        """One Adam/AdamW group's arithmetic through the compiled kernel, from the state an Adam/AdamW's
        ``step()`` prepared (``steps``: each parameter's step count after this step); ``group``'s numbers as floats."""
        if not params:
            return
        amsgrad = group["amsgrad"]
        beta1, beta2 = (float(b) for b in group["betas"])
        weight_decay = float(group["weight_decay"])
        # a few float64 numbers per parameter, eagerly: the compiled graph sees them (lr, betas, decay) as data
        scalars = adam_scalars(torch.tensor(steps, dtype=torch.float64),
                               torch.tensor(float(group["lr"]), dtype=torch.float64), beta1=beta1, beta2=beta2,
                               eps=float(group["eps"]), weight_decay=weight_decay,
                               decoupled_weight_decay=decoupled_weight_decay)
        if params[0].device != scalars.device:
            scalars = scalars.to(params[0].device)
        self.kernels["adam"](params, [p.grad for p in params], exp_avgs, exp_avg_sqs, scalars,
                             decoupled_weight_decay=decoupled_weight_decay,
                             l2=bool(weight_decay) and not decoupled_weight_decay, amsgrad=amsgrad,
                             maximize=group["maximize"], max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else None)

    def run_sgd(self, params, momentum_buffers, group: dict) -> None:
        """One :class:`~optbook.optim.SGD` group (``momentum_buffers``: ``None`` entries without momentum)."""
        if not params:
            return
        momentum = float(group["momentum"])
        scalars = sgd_scalars(lr=float(group["lr"]), momentum=momentum, weight_decay=float(group["weight_decay"]),
                              device=params[0].device)
        self.kernels["sgd"](local(params), local([p.grad for p in params]), local(momentum_buffers), scalars,
                            momentum=bool(momentum), nesterov=group["nesterov"], maximize=group["maximize"])

    def run_lion(self, params, exp_avgs, group: dict) -> None:
        """One :class:`~optbook.optim.Lion` group."""
        if not params:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        scalars = lion_scalars(lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                               weight_decay=float(group["weight_decay"]), device=params[0].device)
        self.kernels["lion"](local(params), local([p.grad for p in params]), local(exp_avgs), scalars)

    def run_adafactor(self, params, row_vars, col_vars, variances, steps: list[int], group: dict) -> None:
        """One :class:`~optbook.optim.Adafactor` group (``steps`` counted after this step)."""
        if not params:
            return
        eps1, eps2 = group["eps"]
        scalars = adafactor_scalars(steps, [p.dtype for p in params], lr=float(group["lr"]),
                                    beta2_decay=float(group["beta2_decay"]),
                                    eps1=None if eps1 is None else float(eps1), eps2=float(eps2),
                                    d=float(group["d"]), weight_decay=float(group["weight_decay"]),
                                    device=params[0].device)
        self.kernels["adafactor"](params, [p.grad for p in params], row_vars, col_vars, variances, scalars,
                                  parameter_norms(params), maximize=group["maximize"])

    def run_schedule_free(self, params, zs, exp_avg_sqs, steps: list[int], lrs: list[float], ckps: list[float],
                          group: dict) -> None:
        """One :class:`~optbook.optim.ScheduleFreeAdamW` group (``lrs``, ``ckps``: each parameter's ``lr_t`` and
        averaging weight, from :func:`~optbook.optim.schedule_free.schedule_free_weight`)."""
        if not params:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        scalars = schedule_free_scalars(steps, lrs, ckps, beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                                        weight_decay=float(group["weight_decay"]), device=params[0].device)
        self.kernels["schedule_free"](local(params), local([p.grad for p in params]), local(zs), local(exp_avg_sqs),
                                      scalars)


_KERNELS = {"adam": adam_elementwise, "sgd": sgd_elementwise, "lion": lion_elementwise,
            "adafactor": adafactor_elementwise, "schedule_free": schedule_free_elementwise}
#: The optimizers whose ``step()`` runs a :class:`CompiledStep`'s kernel when their attribute ``compiled`` is set.
SUPPORTED = (Adam, AdamW, SGD, Lion, Adafactor, ScheduleFreeAdamW)


def _members(optimizer) -> list:
    """The supported optimizers whose ``step()`` runs when ``optimizer.step()`` does (every wrapper of
    :mod:`optbook.wrapper` looked into: a chain's members, a mixed-precision wrapper's inner optimizer; a chain's
    other members are left eager); ``TypeError`` for an optimizer :func:`compiled_step` does not know."""
    if type(optimizer) in SUPPORTED:
        return [optimizer]
    if isinstance(optimizer, ChainedOptimizer):
        return [a for member in optimizer.optimizers
                if type(member) in SUPPORTED or isinstance(member, OptimizerWrapper) for a in _members(member)]
    if isinstance(optimizer, OptimizerWrapper):
        return [a for inner in optimizer.inner_optimizers() for a in _members(inner)]
    names = ", ".join(c.__name__ for c in SUPPORTED)
    raise TypeError(f"Invalid optimizer: compiled_step supports optbook.optim.{names} "
                    f"(not subclasses: their own step would bypass the kernel), a ChainedOptimizer with such "
                    f"members, and a MixedPrecisionOptimizer around one of these; got {type(optimizer).__name__}")


def compiled_step(optimizer, **compile_options) -> CompiledStep:
    """Run the arithmetic of ``optimizer``'s element-wise steps (Adam, AdamW, SGD, Lion, Adafactor,
    Schedule-Free AdamW) through ``torch.compile``-d kernels, not compiled again when ``lr`` or the step
    count change; returns ``optimizer.step``'s stand-in.

    Use it in place of ``optimizer.step`` (or keep calling ``optimizer.step()``: it is the same)::

        opt = optbook.optim.AdamW(model.parameters(), lr=3e-4)
        step = optbook.optim.compiled_step(opt)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
        for batch in data:
            loss(model, batch).backward()
            step()                  # first call compiles; later calls reuse the graph
            sched.step()
            opt.zero_grad()

    The compiled arithmetic runs *inside* the optimizer's own ``step()`` (each supported optimizer gets the
    attribute ``compiled``), so everything ``step()`` does still happens: the validation (a bad
    hyperparameter or gradient, or an ``inf``/``NaN`` gradient, raises before anything is written), the
    step pre- and post-hooks, and the ``torch.optim.lr_scheduler`` bookkeeping (a scheduler wraps
    ``optimizer.step`` to see that the optimizer stepped; calling :class:`CompiledStep` calls that
    wrapped method, so a correctly ordered loop gets no "lr_scheduler.step() before optimizer.step()"
    warning). The state stays the eager optimizer's (same ``state_dict``); Schedule-Free's ``train()`` and
    ``eval()`` stay eager.

    Where it works, and why these: each kernel is one algorithm's update, so it replaces the arithmetic of
    instances of that class only. ``optimizer`` may be

    * an :class:`~optbook.optim.Adam`, :class:`~optbook.optim.AdamW`, :class:`~optbook.optim.SGD`,
      :class:`~optbook.optim.Lion`, :class:`~optbook.optim.Adafactor` or
      :class:`~optbook.optim.ScheduleFreeAdamW` (the class itself, not a subclass);
    * a :class:`~optbook.optim.ChainedOptimizer`: its supported members (also inside nested chains or
      mixed-precision members) run compiled, the others (Muon, ...) eagerly, and the chain's one check
      and global clip come first as always;
    * an :class:`optbook.precision.MixedPrecisionOptimizer` around one of these: the inner optimizer
      steps the float32 masters with the compiled kernel, after the wrapper's unscale, check and clip.

    Anything else (``torch.optim``'s classes, other wrappers, whose steps do not go through an optbook
    optimizer's ``step()``) is refused with a ``TypeError``: there is nothing the kernel could replace.

    Args:
        optimizer: as above (the ``foreach`` option is ignored: the compiler fuses the loop; ``fused=True``
            of SGD/Adam/AdamW is refused at the next step, naming ``fused``).
        compile_options: passed to ``torch.compile`` (e.g. ``mode="max-autotune-no-cudagraphs"``, or
            ``backend="eager"`` to trace without generating code).

    Returns:
        A :class:`CompiledStep`, callable as ``step(closure=None)``: it calls ``optimizer.step(closure)``.

    Raises:
        TypeError: ``optimizer`` is none of the above, or a chain without a supported member.
    """
    targets = _members(optimizer)
    if not targets:
        raise TypeError(f"Invalid optimizer: compiled_step found no optbook.optim."
                        f"{', '.join(c.__name__ for c in SUPPORTED)} in this {type(optimizer).__name__}: nothing "
                        "to compile")
    step = CompiledStep(optimizer, targets, **compile_options)
    for opt in targets:
        opt.compiled = step
    return step


# ---------------------------------------------------------------- a compiled Muon step

class CompiledMuonStep:
    """``step(closure=None)`` of a :class:`~optbook.optim.Muon` whose arithmetic runs through a compiled
    :func:`optbook.optim.functional.muon` (momentum, the batched Newton–Schulz calls, the scaled update).

    Made by :func:`compiled_muon_step`, which installs the compiled kernel on the optimizer
    (``optimizer.compiled_kernel``): calling this object is calling ``optimizer.step``, so the optimizer's
    validation, step hooks (``register_step_pre_hook``/``register_step_post_hook``, and torch's global ones)
    and state handling run as in the eager step, and ``optimizer.step()`` itself runs the compiled kernel
    too. Attributes: ``optimizer`` (the wrapped Muon) and ``kernel`` (the ``torch.compile``-d ``muon``).
    """

    def __init__(self, optimizer, **compile_options):
        self.optimizer = optimizer
        self.kernel = torch.compile(muon, fullgraph=True, **compile_options)
        optimizer.compiled_kernel = self.kernel

    def __call__(self, closure=None):
        return self.optimizer.step(closure)


def compiled_muon_step(optimizer, **compile_options) -> CompiledMuonStep:
    """A ``step`` for an :class:`~optbook.optim.Muon` compiled once by ``torch.compile``, not again when
    ``lr``, ``momentum`` or ``weight_decay`` changes (a schedule).

    Use it in place of ``optimizer.step`` (as :func:`compiled_step` for Adam/AdamW)::

        opt = optbook.optim.Muon(muon_params, lr=0.02, ns_algorithm="auto")
        step = optbook.optim.compiled_muon_step(opt)
        for batch in data:
            loss(model, batch).backward()
            step()                  # first call compiles; later calls reuse the graph
            opt.zero_grad()

    What is compiled is :func:`optbook.optim.functional.muon` itself: the momentum lerps, the stacking of equal
    shapes, each batched :func:`optbook.newton_schulz` call and the scaled update, with ``lr`` passed as
    a 0-d float32 tensor and ``momentum`` and ``weight_decay`` as 0-d float64 tensors, as ``torch.optim``'s
    compiled optimizers take theirs: any schedule of the three (an LR schedule, a momentum warm-up, a
    weight-decay schedule) runs in the one graph compiled at the first step. (A Python float would be a
    constant of the graph at first, guarded by its value: Dynamo compiles once more when it first changes,
    with the float as an input from then on, and under CUDA graphs once per value; see the module's
    docstring.) What still recompiles: a change of the other hyperparameters (``nesterov``, ``ns_steps``,
    ``coefficients``, ``scale_mode``, ``extra_scale_factor``, ``eps``, ``ns_dtype``, ...: Python
    constants of the graph), of the set of parameters that have a gradient, or of their shapes and
    dtypes. Validation and state initialisation are the optimizer's own, eager, before anything is
    written. ``gram="symmetric"`` (Triton kernels) is not supported here.

    Args:
        optimizer: an ``optbook.optim.Muon``.
        compile_options: passed to ``torch.compile``.

    Returns:
        A :class:`CompiledMuonStep`, callable as ``step(closure=None)``.

    Raises:
        TypeError: ``optimizer`` is not an ``optbook.optim.Muon`` (a subclass is refused: its own ``step``
            would bypass the kernel).
        ValueError: a group uses ``gram="symmetric"``.
    """
    if type(optimizer) is not Muon:
        raise TypeError(f"Invalid optimizer: compiled_muon_step supports optbook.optim.Muon itself, got "
                        f"{type(optimizer).__name__} (a subclass with a step of its own, such as the distributed "
                        "Muons, would not run the compiled kernel)")
    if any(g["gram"] != "plain" for g in optimizer.param_groups):
        raise ValueError("Invalid gram: compiled_muon_step needs gram='plain' in every group (the symmetric "
                         "Triton kernels are not traced)")
    return CompiledMuonStep(optimizer, **compile_options)
