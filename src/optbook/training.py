"""One small training loop that records what the chapters plot. Used from chapter 2 on.

Mini-batches come from a seeded permutation per epoch (sampling without replacement), so a run is
repeatable on one machine for a fixed seed, device and thread count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .clipping import clip_grad_norm_

__all__ = ["TrainLog", "train", "evaluate", "SequenceLog", "train_sequence_model", "train_copy_task"]


@dataclass
class TrainLog:
    """What :func:`train` recorded.

    ``losses``: training loss of each step's mini-batch (before the step), length ``steps``.
    ``update_rms``: when requested, a float64 tensor ``(steps, n_params)`` with, per step and per
    trainable parameter, ``RMS(p_after - p_before) / lr`` -- the size of the update direction in
    units of the learning rate (it includes decoupled weight decay, if any).
    ``param_names``: the names of those parameters, in column order.
    """

    losses: list[float] = field(default_factory=list)
    update_rms: torch.Tensor | None = None
    param_names: list[str] = field(default_factory=list)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, X: torch.Tensor, y: torch.Tensor, *,
          steps: int, batch_size: int | None = None, generator: torch.Generator | None = None,
          loss_fn: Callable = F.cross_entropy, scheduler=None, record_update_rms: bool = False) -> TrainLog:
    """Train ``model`` for ``steps`` optimizer steps on ``(X, y)``.

    Args:
        model: maps ``X[idx]`` to predictions accepted by ``loss_fn``.
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        X, y: inputs ``(n, ...)`` and targets ``(n, ...)`` on the model's device.
        steps: number of steps, ``>= 1``.
        batch_size: mini-batch size; ``None`` means full batch.
        generator: CPU ``torch.Generator`` for the permutations (default: a fresh one seeded 0).
        loss_fn: ``loss_fn(prediction, target) -> scalar``.
        scheduler: optional ``torch.optim.lr_scheduler`` stepped after each optimizer step.
        record_update_rms: record :attr:`TrainLog.update_rms` (needs a ``lr`` in each group).

    Raises:
        ValueError: ``steps < 1``, ``batch_size < 1``, or ``X`` and ``y`` of different lengths.
    """
    if steps < 1:
        raise ValueError(f"Invalid steps: expected >= 1, got {steps!r}")
    n = X.shape[0]
    if y.shape[0] != n:
        raise ValueError(f"Invalid y: expected {n} targets to match X, got {y.shape[0]}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"Invalid batch_size: expected >= 1 or None, got {batch_size!r}")
    batch = n if batch_size is None else min(batch_size, n)
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    lr_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    log = TrainLog(param_names=names if record_update_rms else [])
    rms_rows = []
    order, cursor = torch.randperm(n, generator=generator), 0
    model.train()
    for _ in range(steps):
        if cursor + batch > n:
            order, cursor = torch.randperm(n, generator=generator), 0
        idx = order[cursor: cursor + batch].to(X.device)
        cursor += batch
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(X[idx]), y[idx])
        loss.backward()
        before = [p.detach().clone() for p in params] if record_update_rms else None
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        log.losses.append(loss.item())
        if record_update_rms:
            rms_rows.append([float((p.detach() - b).double().pow(2).mean().sqrt()) / lr_of[id(p)]["lr"]
                             if lr_of[id(p)]["lr"] > 0 else float("nan") for p, b in zip(params, before)])
    if record_update_rms:
        log.update_rms = torch.tensor(rms_rows, dtype=torch.float64)
    return log


@torch.no_grad()
def evaluate(model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn: Callable = F.cross_entropy
             ) -> tuple[float, float]:
    """Return ``(loss, accuracy)`` of ``model`` on ``(X, y)``; accuracy for class-index targets."""
    was_training = model.training
    model.eval()
    out = model(X)
    loss = float(loss_fn(out, y))
    acc = float((out.argmax(-1) == y).double().mean()) if out.ndim == 2 else float("nan")
    model.train(was_training)
    return loss, acc


@dataclass
class SequenceLog:
    """What :func:`train_sequence_model` recorded: ``losses`` (per step, before the step) and, for
    models with ``max_logits()``, ``max_logits`` ``(steps, n_layers, n_heads)`` (float32; float64 for a
    float64 model) -- the per-head maximum attention logit of each step's forward, before any
    clipping -- ``after_step``'s return values in ``extras``, and in ``skipped_steps`` the steps whose
    optimizer step was skipped because the gradient norm was not finite (only with ``max_grad_norm``)."""

    losses: list[float] = field(default_factory=list)
    max_logits: torch.Tensor | None = None
    extras: list = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)


def train_sequence_model(model: nn.Module, optimizer: torch.optim.Optimizer, sample: Callable, *, steps: int,
                         scheduler=None, after_step: Callable | None = None, max_grad_norm: float | None = None
                         ) -> SequenceLog:
    """Train a next-token model on generated batches.

    Args:
        model: maps int64 ``(batch, seq)`` to logits ``(batch, seq, vocab)``.
        optimizer: any optimizer over the model's parameters.
        sample: ``sample(step) -> (inputs, targets)``; targets equal to -100 are ignored.
        steps: number of steps, ``>= 1``.
        scheduler: optional LR scheduler, stepped after each applied optimizer step.
        after_step: optional ``after_step(step, model, optimizer)`` run after ``optimizer.step()``
            (e.g. ``optbook.qk_clip_``); what it returns is kept in ``SequenceLog.extras``.
        max_grad_norm: clip the global gradient norm to this value before the step
            (:func:`optbook.clipping.clip_grad_norm_`). When that norm is ``inf`` or ``NaN`` the gradients
            are left as they are and ``optimizer.step()`` is skipped for that step (recorded in
            ``SequenceLog.skipped_steps``) and the scheduler is not stepped (a skipped step applied
            nothing, so it consumes none of the schedule); ``after_step`` still runs.

    Raises:
        ValueError: ``steps < 1``.
    """
    if steps < 1:
        raise ValueError(f"Invalid steps: expected >= 1, got {steps!r}")
    log = SequenceLog()
    maxima = []
    model.train()
    for step in range(steps):
        inputs, targets = sample(step)
        optimizer.zero_grad(set_to_none=True)
        if hasattr(model, "reset_max_logits"):  # the maxima are a running max: log this step's forward
            model.reset_max_logits()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        if hasattr(model, "max_logits"):
            maxima.append(model.max_logits().clone())
        norm = None if max_grad_norm is None else clip_grad_norm_(model.parameters(), max_grad_norm)
        if norm is not None and not torch.isfinite(norm):
            log.skipped_steps.append(step)  # an inf/NaN gradient: stepping would write it into the weights
        else:
            optimizer.step()
            if scheduler is not None:  # a skipped step applied nothing: it does not advance the schedule
                scheduler.step()
        if after_step is not None:
            log.extras.append(after_step(step, model, optimizer))
        log.losses.append(loss.item())
    if maxima:
        log.max_logits = torch.stack(maxima)
    return log


def train_copy_task(optimizer: str, seed: int, generator: torch.Generator, *, steps: int = 200,
                    tau: float | None = None, record: Callable | None = None, vocab_size: int = 16,
                    seq_len: int = 32, batch_size: int = 32, **model_options) -> tuple[nn.Module, SequenceLog]:
    """The MuonClip chapters' experiment: a fresh ``TinyTransformer`` trained on the copy task.

    The model has 2 layers, ``d_model = 64`` and 4 heads of 16 (``model_options`` are passed on to
    :class:`optbook.models.TinyTransformer`, e.g. ``n_kv_heads=2``, ``attention="mla"``, ``qk_norm=True``);
    its parameters are drawn after ``torch.manual_seed(seed)``. Each step trains on a fresh batch of
    :func:`optbook.data.copy_task` ``(batch_size, seq_len)`` of int64 tokens in ``[0, vocab_size)`` drawn
    from ``generator``, with no weight decay anywhere.

    Args:
        optimizer: ``"AdamW"`` (lr 3e-3 on every parameter) or ``"Muon"`` (Muon, lr 0.02, momentum 0.95,
            Nesterov, Newton--Schulz in float32, on the hidden matrices; AdamW, lr 3e-3, on the
            embeddings, the output head and the norm gains, routed by
            :func:`optbook.optim.muon_param_groups`).
        seed: the model's seed, used as given (pass a seed from :func:`optbook.runtime.seeds`).
        generator: CPU generator of the batches (the run's data order).
        steps: optimizer steps, ``>= 1``.
        tau: when set, :func:`optbook.qk_clip_` with this threshold after every optimizer step.
        record: optional ``record(model)`` called after each step (after the clip).

    Returns:
        ``(model, log)``: the trained model and the :class:`SequenceLog`, whose ``extras[t]`` is
        ``(what qk_clip_ returned at step t or None, record(model) or None)``.

    Raises:
        ValueError: ``optimizer`` is not ``"AdamW"`` or ``"Muon"``, ``tau`` is not positive, ``steps < 1``
            (before any training).
    """
    from .data import copy_task
    from .models import TinyTransformer
    from .optim import AdamW, ChainedOptimizer, Muon, muon_param_groups
    from .qk_clip import qk_clip_

    if optimizer not in ("AdamW", "Muon"):
        raise ValueError(f"Invalid optimizer: expected 'AdamW' or 'Muon', got {optimizer!r}")
    if tau is not None and not tau > 0:
        raise ValueError(f"Invalid tau: expected a positive number or None, got {tau!r}")
    if steps < 1:
        raise ValueError(f"Invalid steps: expected >= 1, got {steps!r}")
    torch.manual_seed(seed)
    model = TinyTransformer(vocab_size, d_model=64, n_layers=2, n_heads=4, max_seq_len=seq_len, **model_options)
    if optimizer == "AdamW":
        opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    else:
        routing = muon_param_groups(model, muon_options=dict(lr=0.02, ns_dtype=torch.float32),
                                    adamw_options=dict(lr=3e-3))
        opt = ChainedOptimizer([Muon(routing.muon), AdamW(routing.adamw)])
    after = lambda step, m, o: (qk_clip_(m, tau) if tau else None, record(m) if record else None)
    log = train_sequence_model(model, opt, lambda step: copy_task(batch_size, seq_len, vocab_size, generator=generator),
                               steps=steps, after_step=after)
    return model, log
