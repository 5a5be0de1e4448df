"""Learning-rate and weight-decay schedules, counted in samples. Explained in chapter 9.

Source: Megatron-LM, ``megatron/core/optimizer_param_scheduler.py`` (``OptimizerParamScheduler``: warmup from ``init_lr``, then
constant / inverse-square-root / linear / cosine / WSD with linear, cosine, exponential or
minus_sqrt decay, ``min_lr`` floor, counting in samples, a weight-decay schedule); Hägele et al. (2024) and Hu et al. (2024, MiniCPM) for WSD.

Convention. A schedule is a pure function of ``n``, the number of samples
(or steps: any unit, used consistently) consumed *once the step being taken is applied*, so
``n >= 1`` for the first step. Hence the first step gets ``init_lr + (max_lr - init_lr) / W``
(non-zero), the peak is hit exactly at ``n = W``, and decays end exactly at ``min_lr`` at
``n = total``. With ``ratio = (n - W) / (total - W)`` the decay coefficient is ``coeff(ratio)``
and ``lr = min_lr + coeff * (max_lr - min_lr)`` -- the floor rescales the curve, it does not clamp it.
Counting samples instead of steps keeps the schedule unchanged when the batch size changes mid-run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from ._checks import check_int

__all__ = ["LRSchedule", "WeightDecaySchedule", "SampleScheduler", "STYLES", "WSD_DECAY_STYLES"]

STYLES = ("constant", "linear", "cosine", "inverse_sqrt", "wsd")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def _count(name: str, value, minimum: int = 0) -> int:
    return check_int(name, value, minimum)


def _decay_coeff(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"Invalid decay style {style!r}")


@dataclass(frozen=True)
class LRSchedule:
    """Warmup followed by one decay style; ``lr(n)`` for ``n >= 1`` samples consumed after the step.

    Args:
        max_lr: peak learning rate ``> 0``.
        total: ``n`` at which the decay ends (``>= warmup``); ``min_lr`` afterwards (linear, cosine, wsd).
        warmup: length of the linear warmup (0 for none).
        style: ``"constant"``, ``"linear"``, ``"cosine"``, ``"inverse_sqrt"`` (``max_lr *
            sqrt(max(W, 1) / n)`` after warmup, floored at ``min_lr``) or ``"wsd"``.
        min_lr: floor, ``0 <= min_lr <= max_lr``.
        init_lr: warmup start (the value at ``n = 0``), ``0 <= init_lr <= max_lr``.
        wsd_decay: length of WSD's final decay phase (``<= total - warmup``); the stable phase runs
            at ``max_lr`` until ``total - wsd_decay``. Branching a decay at any point ``n0`` of a stable
            run is ``LRSchedule(..., total=n0 + D, wsd_decay=D)``.
        wsd_decay_style: ``"linear"``, ``"cosine"``, ``"exponential"`` (``2 * 0.5**r - 1``) or
            ``"minus_sqrt"`` (``1 - sqrt(r)``).

    Raises:
        ValueError: unknown style, warmup longer than the schedule, ``min_lr > max_lr``, negative
            lengths or ``n``, a WSD decay that does not fit.
    """

    max_lr: float
    total: int
    warmup: int = 0
    style: str = "cosine"
    min_lr: float = 0.0
    init_lr: float = 0.0
    wsd_decay: int | None = None
    wsd_decay_style: str = "linear"

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"Invalid style: expected one of {STYLES}, got {self.style!r}")
        if not (isinstance(self.max_lr, (int, float)) and math.isfinite(self.max_lr) and self.max_lr > 0):
            raise ValueError(f"Invalid max_lr: expected a finite number > 0, got {self.max_lr!r}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"Invalid min_lr: expected 0 <= min_lr <= max_lr={self.max_lr}, got {self.min_lr!r}")
        if not 0.0 <= self.init_lr <= self.max_lr:
            raise ValueError(f"Invalid init_lr: expected 0 <= init_lr <= max_lr={self.max_lr}, got {self.init_lr!r}")
        _count("warmup", self.warmup)
        _count("total", self.total, 1)
        if self.warmup > self.total:
            raise ValueError(f"Invalid warmup: {self.warmup} is longer than the schedule (total={self.total})")
        if self.style == "wsd":
            if self.wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(f"Invalid wsd_decay_style: expected one of {WSD_DECAY_STYLES}, "
                                 f"got {self.wsd_decay_style!r}")
            if self.wsd_decay is None:
                raise ValueError("Invalid wsd_decay: style='wsd' needs wsd_decay, the length of the final decay")
            _count("wsd_decay", self.wsd_decay, 1)
            if self.wsd_decay > self.total - self.warmup:
                raise ValueError(f"Invalid wsd_decay: {self.wsd_decay} does not fit after the warmup "
                                 f"({self.total - self.warmup} left)")

    def __call__(self, n: int) -> float:
        """The learning rate of the step after which ``n`` samples have been consumed."""
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0:
            raise ValueError(f"Invalid n: expected a sample count >= 0, got {n!r}")
        W, T = self.warmup, self.total
        if W > 0 and n <= W:
            return self.init_lr + (self.max_lr - self.init_lr) * n / W
        if self.style == "constant":
            return self.max_lr
        if self.style == "inverse_sqrt":
            return max(self.min_lr, self.max_lr * math.sqrt(max(W, 1) / max(n, 1)))
        if n >= T:
            return self.min_lr
        if self.style == "wsd":
            start = T - self.wsd_decay
            if n <= start:
                return self.max_lr
            coeff = _decay_coeff(self.wsd_decay_style, (n - start) / self.wsd_decay)
        else:
            coeff = _decay_coeff(self.style, (n - W) / (T - W))
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def lr_lambda(self, batch_size: int = 1):
        """A ``torch.optim.lr_scheduler.LambdaLR`` multiplier for a constant ``batch_size``.

        ``LambdaLR`` calls it with the number of steps already taken ``s``; the step about to run
        brings the count to ``(s + 1) * batch_size``. Set the optimizer's ``lr`` to ``max_lr``.
        """
        _count("batch_size", batch_size, 1)
        return lambda s: self((s + 1) * batch_size) / self.max_lr


@dataclass(frozen=True)
class WeightDecaySchedule:
    """Weight decay ramped from ``start`` to ``end`` over ``total`` samples (Megatron's ``get_wd``).

    ``style``: ``"constant"`` (always ``end``), ``"linear"`` or ``"cosine"`` (a half-cosine rise).
    ``wd(n)`` for ``n`` samples consumed after the step, constant at ``end`` beyond ``total``.

    Raises:
        ValueError: unknown style, negative values or lengths.
    """

    start: float
    end: float
    total: int
    style: str = "linear"

    def __post_init__(self):
        if self.style not in ("constant", "linear", "cosine"):
            raise ValueError(f"Invalid style: expected 'constant', 'linear' or 'cosine', got {self.style!r}")
        if self.start < 0 or self.end < 0:
            raise ValueError(f"Invalid start/end: weight decay must be >= 0, got {self.start!r}, {self.end!r}")
        _count("total", self.total, 1)

    def __call__(self, n: int) -> float:
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0:
            raise ValueError(f"Invalid n: expected a sample count >= 0, got {n!r}")
        if self.style == "constant":
            return self.end
        r = min(n, self.total) / self.total
        coeff = r if self.style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
        return self.start + coeff * (self.end - self.start)


class SampleScheduler:
    """Scale every group's ``lr`` (and set its ``weight_decay``) from schedules counted in samples.

    Each group's learning rate follows the schedule's *shape* from its own base learning rate, as
    ``torch.optim.lr_scheduler`` does: the base is the group's ``initial_lr`` (set to its ``lr`` when the
    scheduler is built, unless a scheduler set it before; a group added later gets its ``lr`` then), and

        lr = lr_schedule(n) * (initial_lr / lr_schedule.max_lr) * lr_mult

    so a Muon group at ``lr=0.02`` and an AdamW group at ``lr=3e-3`` under one schedule keep their own
    rates (writing one absolute rate into every group would train Muon with AdamW's). A group whose base
    is ``max_lr`` gets exactly ``lr_schedule(n) * lr_mult`` (the ratio is exactly 1). The weight decay is
    absolute: ``wd_schedule(n) * wd_mult``.

    Call :meth:`step` after each *applied* optimizer step with the samples that step consumed;
    it sets the values for the next step, assuming it consumes ``next_batch_size`` samples (default:
    the same as this one). A skipped step (non-finite gradients) is simply not counted.
    Each group's ``lr_mult`` and ``wd_mult`` (default 1) scale the scheduled values.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (a ``ChainedOptimizer`` too).
        lr_schedule: an :class:`LRSchedule`.
        batch_size: samples of the first step, ``>= 1``.
        wd_schedule: optional :class:`WeightDecaySchedule`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_schedule: LRSchedule, batch_size: int,
                 wd_schedule: WeightDecaySchedule | None = None):
        self.optimizer, self.lr_schedule, self.wd_schedule = optimizer, lr_schedule, wd_schedule
        self.batch_size = _count("batch_size", batch_size, 1)
        self.samples = 0
        self._apply()

    def _apply(self) -> None:
        n = self.samples + self.batch_size
        lr = self.lr_schedule(n)
        for group in self.optimizer.param_groups:
            base = group.setdefault("initial_lr", group["lr"])   # torch.optim.lr_scheduler's key
            group["lr"] = lr * (float(base) / self.lr_schedule.max_lr) * group.get("lr_mult", 1.0)
            if self.wd_schedule is not None:
                group["weight_decay"] = self.wd_schedule(n) * group.get("wd_mult", 1.0)

    def step(self, samples: int | None = None, next_batch_size: int | None = None) -> None:
        """Count ``samples`` (default: the current batch size) and set the next step's values."""
        samples = self.batch_size if samples is None else _count("samples", samples)
        if next_batch_size is not None:
            self.batch_size = _count("next_batch_size", next_batch_size, 1)
        self.samples += samples
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"samples": self.samples, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.samples, self.batch_size = int(state["samples"]), int(state["batch_size"])
        self._apply()
