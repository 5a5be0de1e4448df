"""Diagnostics of a model: relative update size per layer, grouped by role (explained in chapter 9),
and the attention maps of a transformer (the section "Why logit growth matters" of chapter 8).

Source: the relative update ``rho_l = ||Delta theta_l||_F / (||theta_l||_F + eps)``; layers whose
``rho`` differ by orders of magnitude point at a parametrisation, learning-rate, scaling or routing
problem. Grouped by attention, MLP, embedding, norm (and output head / other). The attention entropy
``H = -sum_j p_j log p_j`` of each softmax row measures how sharp attention is (0 nats: one-hot).
"""

from __future__ import annotations

import torch
from torch import nn

from .models.transformer import CausalSelfAttention, MultiHeadLatentAttention
from .optim.param_groups import classify_parameters, output_head

__all__ = ["snapshot", "relative_update", "parameter_kind", "attention_logits", "attention_entropy"]

ATTENTION_TYPES = (CausalSelfAttention, MultiHeadLatentAttention, nn.MultiheadAttention)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every trainable parameter, by name (the ``before``/``after`` arguments)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def parameter_kind(model: nn.Module) -> dict[str, str]:
    """Map each parameter name to ``"attention"``, ``"mlp"``, ``"embedding"``, ``"norm"``, ``"output"``
    or ``"other"``, by module type and role (never by name).

    The ``"output"`` tensors are those of :func:`optbook.optim.param_groups.output_head` (the head
    :func:`optbook.optim.muon_param_groups` routes to AdamW): ``get_output_embeddings()`` or, for a model
    without that method, its last ``nn.Linear``. A head tied to the input embedding is an ``"embedding"``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    inside_attention = {id(p) for m in model.modules() if isinstance(m, ATTENTION_TYPES) for p in m.parameters()}
    module = output_head(model)
    head = {id(p) for p in module.parameters()} if module is not None else set()
    kinds = {}
    for info in classify_parameters(model):
        if info.role == "embedding":
            kind = "embedding"
        elif info.role == "norm":
            kind = "norm"
        elif id(info.param) in head:
            kind = "output"
        elif id(info.param) in inside_attention:
            kind = "attention"
        elif info.role in ("weight", "bias"):
            kind = "mlp"
        else:
            kind = "other"
        kinds[info.name] = kind
    return kinds


def relative_update(model: nn.Module, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                    eps: float = 1e-12) -> dict[str, dict[str, float]]:
    """``||after - before||_F / (||before||_F + eps)`` per parameter, grouped by kind.

    Args:
        model: the model the snapshots came from (for the grouping).
        before, after: :func:`snapshot` results (name -> tensor).
        eps: guards an all-zero parameter.

    Returns:
        ``{kind: {name: rho}}`` with kinds as in :func:`parameter_kind`; float64 arithmetic.

    Raises:
        KeyError: a parameter missing from ``before`` or ``after``.
    """
    out: dict[str, dict[str, float]] = {}
    for name, kind in parameter_kind(model).items():
        b, a = before[name].double(), after[name].double()
        out.setdefault(kind, {})[name] = float((a - b).norm() / (b.norm() + eps))
    return out


@torch.no_grad()
def attention_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The pre-softmax attention logits of every attention layer of ``model`` on the batch ``idx``.

    Runs one forward in eval mode (so the layers' recorded ``max_logits`` are left as they are; the
    model's training mode is restored afterwards), captures each attention layer's input and returns
    what that layer feeds to its softmax (its ``attention_logits(x)``).

    Args:
        model: a model with ``attention_layers()`` (:class:`optbook.models.TinyTransformer`) whose layers
            have ``attention_logits`` (:class:`~optbook.models.CausalSelfAttention`,
            :class:`~optbook.models.MultiHeadLatentAttention`).
        idx: the model's input, int64 token ids ``(batch, seq)``.

    Returns:
        ``(n_layers, batch, n_heads, seq, seq)`` in the model's dtype (float64 for a ``.double()`` copy);
        the causally masked entries (key after query) are ``-inf``.

    Raises:
        TypeError: ``model`` has no ``attention_layers()`` or a layer has no ``attention_logits``.
    """
    layers = model.attention_layers() if hasattr(model, "attention_layers") else None
    if not layers or not all(hasattr(a, "attention_logits") for a in layers):
        raise TypeError(f"Invalid model: expected attention_layers() whose layers have attention_logits(x), "
                        f"got {type(model).__name__}")
    inputs = {}
    hooks = [a.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, a in enumerate(layers)]
    was_training = model.training
    try:
        model.eval()
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return torch.stack([a.attention_logits(inputs[i]) for i, a in enumerate(layers)])


def attention_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of ``softmax(logits)`` over the last dimension: ``-sum_j p_j log p_j``.

    ``-inf`` entries (masked keys) have ``p_j = 0`` and add nothing. 0 for a one-hot row, ``log n`` for a
    uniform row over ``n`` keys. Floating dtype in, same dtype out, shape ``logits.shape[:-1]``.

    Raises:
        TypeError: ``logits`` is not a floating-point tensor.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"Invalid logits: expected a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    return torch.special.entr(torch.softmax(logits, dim=-1)).sum(dim=-1)
