"""Schedule-Free AdamW: iterate averaging in place of a learning-rate schedule. Explained in chapter 18.

Source: Defazio, Yang, Mehta, Mishchenko, Khaled & Cutkosky (2024), "The Road Less Scheduled",
arXiv:2405.15682, Algorithm 1 (Schedule-Free AdamW) and eq. 1-3 (the three sequences); the reference code
facebookresearch/schedule_free, release 1.4.1 (PyPI ``schedulefree==1.4.1``),
``schedulefree/adamw_schedulefree.py`` (``AdamWScheduleFree``: warmup, the weights
``(t ** r) * lr_max ** weight_lr_power``, weight decay evaluated at ``y``, the update of ``y`` in place).

Derivation. A decaying schedule is what makes SGD's last iterate good; Polyak-Ruppert averaging of a
constant-step run is good too but lags. Schedule-Free keeps three sequences (eq. 1-3): the base iterate
``z`` takes the plain (Adam-normalised) gradient steps, ``x`` is the running weighted average of the
``z``'s, and the gradient is evaluated at the interpolation ``y`` between them::

    y_t = (1 - beta1) z_t + beta1 x_t                 gradient g_t evaluated here (train mode)
    v  <- beta2 v + (1 - beta2) g_t^2;  u = g_t / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * y_t
    z_{t+1} = z_t - lr_t u
    x_{t+1} = (1 - c_{t+1}) x_t + c_{t+1} z_{t+1},    c_{t+1} = w_t / sum_{i <= t} w_i

with ``lr_t = lr * min(1, t / warmup_steps)``, ``w_t = t**r * max_{i <= t}(lr_i)**weight_lr_power``. Only ``y``
and ``z`` are stored: the parameters hold ``y`` during training, updated in place as
``y <- lerp(y, z_t, c) + lr_t (beta1 (1 - c) - 1) u`` (the same ``y_{t+1}``, eq. 1 with eq. 2-3 substituted).
``x`` -- the point to evaluate and to save -- is recovered by :meth:`ScheduleFreeAdamW.eval`
(``x = (y - (1 - beta1) z) / beta1``, in place), and :meth:`ScheduleFreeAdamW.train` goes back to ``y``.
The mode is kept per param group (``train_mode``) and in the state dict, so it survives a save and load.
"""

from __future__ import annotations

import torch

from ._functional import in_float32, steps_in_float32, write_back
from .._sharded import local
from .._checks import (
    check_betas,
    check_bool,
    check_eps,
    check_int,
    check_lr,
    check_number,
    check_weight_decay,
)
from .optimizer import BookOptimizer

__all__ = ["ScheduleFreeAdamW", "schedule_free_adamw", "schedule_free_weight"]


def schedule_free_weight(t: int, lr: float, *, warmup_steps: int, r: float, weight_lr_power: float, lr_max: float,
                         weight_sum: float) -> tuple[float, float, float, float]:
    """The scalars of step ``t`` (``>= 1``): ``(lr_t, lr_max, weight_sum, c)``.

    ``lr_t = lr * min(1, t / warmup_steps)``; ``lr_max`` the largest ``lr_t`` so far (pass ``-1.0`` at the
    start); ``weight_sum`` the running sum of ``w_t = t**r * lr_max**weight_lr_power`` (start ``0.0``);
    ``c = w_t / weight_sum`` (0 while the sum is 0, e.g. ``lr = 0``).
    """
    lr_t = lr * (t / warmup_steps if t <= warmup_steps else 1.0)
    lr_max = max(lr_t, lr_max)
    weight = (t ** r) * (lr_max ** weight_lr_power)
    weight_sum = weight_sum + weight
    return lr_t, lr_max, weight_sum, (weight / weight_sum if weight_sum else 0.0)


@torch.no_grad()
@steps_in_float32(4)
def schedule_free_adamw(params: list[torch.Tensor], grads: list[torch.Tensor], zs: list[torch.Tensor],
                        exp_avg_sqs: list[torch.Tensor], steps: list[int], lrs: list[float], ckps: list[float], *,
                        beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """Apply one Schedule-Free AdamW step in place to parameters holding ``y`` (the pure function behind
    :class:`ScheduleFreeAdamW`).

    Args:
        params, grads, zs, exp_avg_sqs: lists of equal-shape tensors, one entry per parameter; ``zs`` (the
            base iterate) and ``exp_avg_sqs`` (``v``) are updated in place.
        steps: the step number ``t >= 1`` of each parameter; lrs: its ``lr_t`` (warmup applied); ckps: its
            averaging weight ``c`` (:func:`schedule_free_weight`).
        beta1, beta2, eps, weight_decay: as in :class:`ScheduleFreeAdamW`; not re-validated here.

    A float16/bfloat16 parameter is stepped in float32 and rounded back once (with ``z`` and ``v``).
    """
    for y, g, z, v, t, lr, c in zip(params, grads, zs, exp_avg_sqs, steps, lrs, ckps):
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = g / (v / (1 - beta2 ** t)).sqrt_().add_(eps)
        if weight_decay:
            u.add_(y, alpha=weight_decay)
        y.lerp_(z, c).add_(u, alpha=lr * (beta1 * (1 - c) - 1))
        z.sub_(u, alpha=lr)


class ScheduleFreeAdamW(BookOptimizer):
    """Schedule-Free AdamW (Defazio et al. 2024, arXiv:2405.15682, Algorithm 1): no schedule, an average.

    The derivation and the update are in the module docstring (:mod:`optbook.optim.schedule_free`). Call
    :meth:`eval` before evaluating or saving the model (the parameters then hold the average ``x``) and
    :meth:`train` before the next step (they hold ``y``); ``step()`` in eval mode raises. A new optimizer
    starts in train mode (at the start ``x = y = z``, so the first call of either is free).

    Args:
        params: real floating-point tensors or param-group dicts.
        lr: the constant learning rate ``>= 0`` reached after warmup (0.0025 in the reference code).
        betas: ``(beta1, beta2)``: ``beta1`` in ``(0, 1)`` is the interpolation weight of ``x`` in ``y``
            (0 would make ``x`` unrecoverable from ``y``), ``beta2`` in ``[0, 1)`` Adam's second moment.
        eps: added to ``sqrt(v_hat)`` (outside the root), ``> 0``.
        weight_decay: ``>= 0``; ``weight_decay * y`` is added to the normalised gradient (decay at ``y``).
        warmup_steps: an int ``>= 0``: ``lr_t = lr * t / warmup_steps`` for ``t <= warmup_steps``.
        r: the power of ``t`` in the averaging weights (``>= 0``, 0 in the reference).
        weight_lr_power: the power of ``lr_max`` in the averaging weights (``>= 0``, 2 in the reference).

    State per parameter: ``z`` and ``exp_avg_sq`` (the parameter's shape and dtype), ``step`` (``int``),
    ``lr_max`` and ``weight_sum`` (``float``); per group: ``train_mode`` (``bool``). A float16/bfloat16
    parameter is stepped in float32.

    The update of every element uses only that element's gradient and state and the group's scalars, so
    ``elementwise`` is ``True``; a wrapper that keeps its own copy of the weights (ZeRO-1, offload) does not
    forward :meth:`train`/:meth:`eval`.

    Raises:
        ValueError: a hyperparameter out of range (the message names it), a non-finite gradient
            (:class:`~optbook.contract.NonFiniteGradientError`); nothing is written.
        RuntimeError: ``step()`` in eval mode (nothing is written).
        TypeError: as for every optimizer of :mod:`optbook.optim`.
    """

    elementwise = True
    float_options = ("lr", "betas", "eps", "weight_decay", "r", "weight_lr_power")
    state_scalars = {"step": "count", "lr_max": "float", "weight_sum": "float"}

    def __init__(self, params, lr: float = 0.0025, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 0, r: float = 0.0, weight_lr_power: float = 2.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power,
                                      train_mode=True))

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups and "train_mode" not in param_group:  # a new group joins in the current mode
            param_group = {**param_group, "train_mode": self.param_groups[0]["train_mode"]}
        super().add_param_group(param_group)

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        beta1, _ = check_betas(group["betas"])
        if beta1 == 0:
            raise ValueError("Invalid betas[0]: Schedule-Free needs beta1 > 0 (x = (y - (1 - beta1) z) / beta1)")
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])
        check_int("warmup_steps", group["warmup_steps"], 0)
        check_number("r", group["r"], low=0.0)
        check_number("weight_lr_power", group["weight_lr_power"], low=0.0)
        check_bool("train_mode", group["train_mode"])

    def _expected_state(self, p, group):
        like = (tuple(p.shape), p.dtype, True)
        return {"z": like, "exp_avg_sq": like}

    def _validate(self) -> None:
        for gi, group in enumerate(self.param_groups):
            if group["train_mode"] is False:
                raise RuntimeError(f"Invalid call: step() with param_groups[{gi}] in eval mode (the parameters hold "
                                   "the average x); call optimizer.train() first. Nothing was written")
        super()._validate()
        for gi, group in enumerate(self.param_groups):  # the step's scalars must exist before any write
            g = self._read_floats(group)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state.get(p) or {}
                try:
                    schedule_free_weight(state.get("step", 0) + 1, g["lr"], warmup_steps=g["warmup_steps"], r=g["r"],
                                         weight_lr_power=g["weight_lr_power"], lr_max=state.get("lr_max", -1.0),
                                         weight_sum=state.get("weight_sum", 0.0))
                except (OverflowError, ZeroDivisionError) as e:
                    raise ValueError(f"Invalid r or weight_lr_power of param_groups[{gi}]: the averaging weight "
                                     f"t**r * lr_max**weight_lr_power of param_groups[{gi}]['params'][{pi}] at step "
                                     f"{state.get('step', 0) + 1} is not a float ({e}); nothing was written") from e

    @torch.no_grad()
    def _switch(self, to_train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] is to_train:
                continue
            beta1 = float(group["betas"][0])
            weight = 1 - beta1 if to_train else 1 - 1 / beta1  # y = lerp(x, z, 1 - b1); x = lerp(y, z, 1 - 1/b1)
            params = [p for p in group["params"] if "z" in self.state.get(p, {})]
            work = in_float32(params)
            zs = in_float32([self.state[p]["z"] for p in params])
            for w, z in zip(work, zs):
                w.lerp_(z, weight)
            write_back(params, work)
            group["train_mode"] = to_train

    def train(self) -> None:
        """Put the parameters at ``y`` (where gradients are taken); nothing to do if already in train mode."""
        self._switch(True)

    def eval(self) -> None:
        """Put the parameters at the average ``x`` (evaluate and save from here); call :meth:`train` before
        the next step."""
        self._switch(False)

    #: ``None`` (the eager step), or the :class:`optbook.optim.compiled.CompiledStep` whose compiled kernel
    #: runs this optimizer's arithmetic inside its own ``step()`` (set by :func:`optbook.optim.compiled_step`).
    compiled = None

    def _step_group(self, group: dict) -> None:
        params, steps, lrs, ckps = [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(step=0, lr_max=-1.0, weight_sum=0.0, z=p.detach().clone(memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            state["step"] += 1
            lr_t, state["lr_max"], state["weight_sum"], c = schedule_free_weight(
                state["step"], group["lr"], warmup_steps=group["warmup_steps"], r=group["r"],
                weight_lr_power=group["weight_lr_power"], lr_max=state["lr_max"], weight_sum=state["weight_sum"])
            params.append(p)
            steps.append(state["step"])
            lrs.append(lr_t)
            ckps.append(c)
        if self.compiled is not None:
            self.compiled.run_schedule_free(params, [self.state[p]["z"] for p in params],
                                            [self.state[p]["exp_avg_sq"] for p in params], steps, lrs, ckps, group)
            return
        beta1, beta2 = group["betas"]
        schedule_free_adamw(local(params), local([p.grad for p in params]),
                            local([self.state[p]["z"] for p in params]),
                            local([self.state[p]["exp_avg_sq"] for p in params]), steps, lrs, ckps,
                            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

