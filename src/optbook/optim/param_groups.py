"""Which parameters get weight decay: decided by module type and tensor role, never by name.

Explained in chapter 3 (AdamW). Source: nanoGPT's ``configure_optimizers`` and Megatron-LM's
``_get_param_groups`` in ``megatron/core/optimizer/__init__.py`` (biases, norm gains and embeddings are
commonly excluded from decay); Loshchilov & Hutter (2019) for why decay is a per-parameter choice.

Name lists (``"bias" in name or "LayerNorm" in name``) silently miss ``layer_norm``, ``norm`` or
``ln_f``; asking what *kind of module* owns a tensor, and what role the tensor plays there, does not.

Roles:
    ``"weight"``     the weight matrix/kernel of a linear or convolutional layer (decayed);
    ``"bias"``       an additive bias of any module (not decayed);
    ``"norm"``       a gain or shift of a normalisation layer (LayerNorm, RMSNorm, BatchNorm, ...);
    ``"embedding"``  an embedding table (not decayed by default);
    ``"matrix"``     any other parameter with two or more dimensions (decayed);
    ``"vector"``     any other parameter with fewer than two dimensions: scales, gates (not decayed).

A bare ``nn.Parameter`` with two or more dimensions on a module of unknown type (say a GPT-2-style
position table stored as ``nn.Parameter(torch.zeros(T, d))``) is a ``"matrix"`` and is decayed: the
rule cannot tell it is a table. Wrap such tables in ``nn.Embedding`` or build the groups by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ParamInfo", "classify_parameters", "output_head", "weight_decay_param_groups", "format_param_groups"]

NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
              nn.modules.batchnorm._NormBase)
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
WEIGHT_TYPES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter with where it lives: ``name`` (first qualified name), the owning ``module``
    and its ``role`` (see the module docstring)."""

    name: str
    param: nn.Parameter
    module: nn.Module
    role: str


def _role(module: nn.Module, attr: str, p: torch.Tensor) -> str:
    if isinstance(module, NORM_TYPES):
        return "norm"
    if isinstance(module, EMBEDDING_TYPES):
        return "embedding"
    if isinstance(module, WEIGHT_TYPES):
        return "weight" if p is getattr(module, "weight", None) else "bias"
    if p is getattr(module, "bias", None) and p.ndim < 2:
        return "bias"
    return "matrix" if p.ndim >= 2 else "vector"


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that maps the last hidden state to the outputs (logits), or ``None``.

    It is ``model.get_output_embeddings()`` when the model defines that method (the Hugging Face
    convention; :class:`optbook.models.TinyTransformer` does, and a model may return ``None`` there to
    say it has no head), otherwise the last ``nn.Linear`` registered in the model (the classifier of
    an ``nn.Sequential`` MLP), otherwise ``None``. Parameter routing (:func:`optbook.optim.muon_param_groups`)
    and the per-role diagnostics (:func:`optbook.diagnostics.parameter_kind`) both ask this function,
    so they always agree on which tensors are the head.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Invalid model: expected an nn.Module, got {type(model).__name__}")
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        return getter()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def classify_parameters(model: nn.Module) -> list[ParamInfo]:
    """List every trainable parameter of ``model`` once, with its role.

    A tensor shared by two modules (tied input embedding and output head) is listed once; if any
    owner is an embedding, its role is ``"embedding"``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Invalid model: expected a torch.nn.Module, got {type(model).__name__}")
    found: dict[int, ParamInfo] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            info = ParamInfo(name, p, module, _role(module, attr, p))
            previous = found.get(id(p))
            if previous is None:
                found[id(p)] = info
            elif info.role == "embedding" and previous.role != "embedding":
                found[id(p)] = ParamInfo(previous.name, p, module, "embedding")
    return list(found.values())


NO_DECAY_ROLES = frozenset({"bias", "norm", "vector"})


def weight_decay_param_groups(model: nn.Module, weight_decay: float, *, decay_embeddings: bool = False,
                              **group_options) -> list[dict]:
    """Split ``model``'s parameters into a decayed and a non-decayed parameter group.

    Args:
        model: any ``nn.Module``.
        weight_decay: coefficient for the decayed group (``>= 0``).
        decay_embeddings: put embedding tables in the decayed group (default: no decay).
        **group_options: extra keys copied into both groups (e.g. ``lr``).

    Returns:
        ``[{"params": [...], "param_names": [...], "weight_decay": weight_decay, ...},
        {"params": [...], "param_names": [...], "weight_decay": 0.0, ...}]`` -- ready for any
        ``torch.optim.Optimizer``; ``param_names`` is PyTorch's own key for names in a group. An
        empty group is left out.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``weight_decay`` is negative or not finite.
    """
    from .._checks import check_weight_decay

    check_weight_decay(weight_decay)
    no_decay = set(NO_DECAY_ROLES) | (set() if decay_embeddings else {"embedding"})
    decay_infos, plain_infos = [], []
    for info in classify_parameters(model):
        (plain_infos if info.role in no_decay else decay_infos).append(info)
    groups = []
    for infos, wd in ((decay_infos, weight_decay), (plain_infos, 0.0)):
        if infos:
            groups.append({"params": [i.param for i in infos], "param_names": [i.name for i in infos],
                           "weight_decay": wd, **group_options})
    return groups


def format_param_groups(groups: list[dict]) -> str:
    """A short text table of parameter groups: weight decay, tensor count, element count, names."""
    lines = []
    for i, g in enumerate(groups):
        names = g.get("param_names") or [f"<{tuple(p.shape)}>" for p in g["params"]]
        numel = sum(p.numel() for p in g["params"])
        lines.append(f"group {i}: weight_decay={g.get('weight_decay', 0.0):g}, "
                     f"{len(g['params'])} tensors, {numel:,} elements")
        lines.extend(f"    {n:<32} {tuple(p.shape)}" for n, p in zip(names, g["params"]))
    return "\n".join(lines)
