"""Relative update size per layer, grouped by role. Explained in chapter 9.

Source: the relative update ``rho_l = ||Delta theta_l||_F / (||theta_l||_F + eps)``; layers whose
``rho`` differ by orders of magnitude point at a parametrisation, learning-rate, scaling or routing
problem. Grouped by attention, MLP, embedding, norm (and output head / other).
"""

from __future__ import annotations

import torch
from torch import nn

from .models.transformer import CausalSelfAttention, MultiHeadLatentAttention
from .optim.param_groups import classify_parameters, output_head

__all__ = ["snapshot", "relative_update", "parameter_kind"]

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
