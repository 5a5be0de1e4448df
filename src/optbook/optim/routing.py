"""Which parameters Muon updates and which go to AdamW, and how Muon cuts them. Explained in chapter 7.

Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024: Muon only
for hidden 2-D weights; embeddings, output head, norm gains, biases and every non-2-D tensor to
AdamW); Liu et al. (2025), "Muon is Scalable for LLM Training" (arXiv:2502.16982).

Decided by module type and tensor role (:func:`classify_parameters`), never by name. The output
head is :func:`optbook.optim.param_groups.output_head`: ``model.get_output_embeddings()`` when the
model defines it (the Hugging Face convention; :class:`optbook.models.TinyTransformer` does), otherwise
the last ``nn.Linear`` registered in the model. A head tied to the input embedding is an embedding.

Per-head (or per-Q/K/V) Newton–Schulz: with ``split="head"`` every attention projection is cut into
the row blocks its module's ``head_layout`` (:class:`optbook.models.heads.HeadLayout`) gives, one per
head, and each block is orthogonalised on its own (Muon's ``head_split``); the query and key blocks
are exactly the blocks :func:`optbook.qk_clip_` rescales, because both read the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..models.heads import attention_modules
from .param_groups import NO_DECAY_ROLES, classify_parameters, output_head

__all__ = ["MuonRouting", "SPLITS", "head_splits", "muon_param_groups"]

#: The values of ``muon_param_groups(split=...)``.
SPLITS = (None, "head", "qkv")


@dataclass
class MuonRouting:
    """The result of :func:`muon_param_groups`: param groups for Muon and for AdamW, and why."""

    muon: list[dict]
    adamw: list[dict]
    reasons: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """One line per parameter: name, shape, optimizer, reason."""
        lines = []
        for target, groups in (("Muon", self.muon), ("AdamW", self.adamw)):
            for g in groups:
                for name, p in zip(g["param_names"], g["params"]):
                    lines.append(f"{name:<34} {str(tuple(p.shape)):<12} {target:<6} "
                                 f"wd={g.get('weight_decay', 0.0):g}  {self.reasons[name]}")
        return "\n".join(lines)


def head_splits(model: nn.Module, per: str = "head") -> dict[int, tuple[int, ...]]:
    """Muon's ``head_split`` for every attention weight of ``model`` that is cut into several blocks.

    Read from each attention module's ``head_layout`` (:func:`optbook.models.attention_modules`):
    ``per="head"`` one block per head, ``per="qkv"`` one block per Q/K/V part of a fused projection
    (:meth:`HeadLayout.head_split`). A weight left whole (one block) is not listed.

    Returns:
        ``{id(parameter): (rows of block 0, rows of block 1, ...)}``.

    Raises:
        ValueError: ``per`` not ``"head"``/``"qkv"``; a weight named by a layout that the module lacks,
            whose rows the layout does not match, or that two layouts cut differently.
    """
    splits: dict[int, tuple[int, ...]] = {}
    for attn in attention_modules(model):
        layout = attn.head_layout
        for weight in layout.weights():
            sizes = layout.head_split(weight, per)
            try:
                p = attn.get_parameter(weight)
            except AttributeError:
                raise ValueError(f"Invalid model: {type(attn).__name__} has no parameter {weight!r} named by "
                                 "its head layout") from None
            if p.ndim != 2 or p.shape[0] != sum(sizes):
                raise ValueError(f"Invalid model: {weight} of {type(attn).__name__} has shape "
                                 f"{tuple(p.shape)}, its head layout describes {sum(sizes)} rows")
            if len(sizes) < 2:
                continue
            if splits.get(id(p), sizes) != sizes:
                raise ValueError(f"Invalid model: {weight} is cut as {splits[id(p)]} and as {sizes} by two "
                                 "head layouts")
            splits[id(p)] = sizes
    return splits


def _describe(sizes: tuple[int, ...]) -> str:
    return f"{len(sizes)} x {sizes[0]} rows" if len(set(sizes)) == 1 else "+".join(map(str, sizes)) + " rows"


def muon_param_groups(model: nn.Module, *, weight_decay: float = 0.0, adamw_weight_decay: float | None = None,
                      muon_options: dict | None = None, adamw_options: dict | None = None,
                      split: str | None = None) -> MuonRouting:
    """Route ``model``'s parameters: 2-D hidden weights to Muon, everything else to AdamW.

    Args:
        model: any ``nn.Module``.
        weight_decay: Muon's decoupled decay.
        adamw_weight_decay: decay of AdamW's matrices (output head); default ``weight_decay``.
            Embeddings, norms, biases and other vectors get no decay.
        muon_options, adamw_options: extra keys for every Muon group / every AdamW group (e.g. ``lr``).
        split: how Muon cuts the attention projections before Newton–Schulz, read from each attention
            module's ``head_layout`` (:func:`head_splits`): ``None`` whole matrices (one Muon group, as
            before ``split`` existed); ``"head"`` one block per head (query, key, value and MLA's
            rotary-query rows; MLA's latent and shared rotary key stay whole); ``"qkv"`` one block per
            Q/K/V part (a separate projection, as in every model of :mod:`optbook.models`, is one part:
            the same cut as ``None``). The output projection and MLP weights are never cut.

    Returns:
        :class:`MuonRouting` with ``muon`` and ``adamw`` (up to two groups: decayed and not), each group
        carrying ``param_names``; ``reasons`` says why each tensor went where. ``muon`` is one group
        with ``split=None``; with a split, a first group of whole matrices (``head_split=None``) and
        one group per distinct ``head_split`` (a tuple of row counts), in order of first appearance.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``split`` not one of :data:`SPLITS`; ``split`` set on a model with no attention
            module describing its heads, or together with ``muon_options["head_split"]``; a head layout
            that does not match its weights (:func:`head_splits`).
    """
    if split not in SPLITS:
        raise ValueError(f"Invalid split: expected one of {SPLITS}, got {split!r}")
    if split is not None:
        if "head_split" in (muon_options or {}):
            raise ValueError(f"Invalid muon_options: 'head_split' is set by split={split!r}; give one of "
                             "them")
        if not attention_modules(model):
            raise ValueError(f"Invalid split: {split!r} needs attention modules that describe their heads "
                             f"(a head_layout), and {type(model).__name__} has none")
    splits = head_splits(model, split) if split is not None else {}
    head = output_head(model)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    muon, adamw_decay, adamw_plain, reasons = [], [], [], {}
    for info in classify_parameters(model):
        p = info.param
        if info.role == "embedding":
            adamw_plain.append(info)
            reasons[info.name] = "embedding table"
        elif id(p) in head_ids and p.ndim >= 2:
            adamw_decay.append(info)
            reasons[info.name] = "output head"
        elif info.role in NO_DECAY_ROLES:
            adamw_plain.append(info)
            reasons[info.name] = {"bias": "bias", "norm": "normalisation gain/shift", "vector": "not 2-D"}[info.role]
        elif p.ndim == 2:
            muon.append(info)
            reasons[info.name] = "2-D hidden weight"
        else:
            adamw_decay.append(info)
            reasons[info.name] = f"{p.ndim}-D tensor (Muon needs 2-D)"

    def group(infos, **extra):
        return {"params": [i.param for i in infos], "param_names": [i.name for i in infos], **extra}

    if split is None:
        muon_groups = [group(muon, weight_decay=weight_decay, **(muon_options or {}))] if muon else []
    else:
        by_split: dict = {None: []}  # whole matrices first, then one group per cut
        per = "head" if split == "head" else "Q/K/V part"
        for info in muon:
            sizes = splits.get(id(info.param))
            by_split.setdefault(sizes, []).append(info)
            if sizes is not None:
                reasons[info.name] += f", Newton-Schulz per {per}: {_describe(sizes)}"
        muon_groups = [group(infos, weight_decay=weight_decay, head_split=sizes, **(muon_options or {}))
                       for sizes, infos in by_split.items() if infos]
    adamw_groups = [group(infos, weight_decay=wd, **(adamw_options or {}))
                    for infos, wd in ((adamw_decay, adamw_wd), (adamw_plain, 0.0)) if infos]
    return MuonRouting(muon_groups, adamw_groups, reasons)
