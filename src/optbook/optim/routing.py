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

Weights that are not matrices (:mod:`optbook.optim.matrix_views`) go to Muon only when asked: with
``conv="flatten"`` every convolution kernel ``(out, in/groups, *k)`` is stepped as the matrix
``(out, in/groups * prod(k))`` (a Muon group with ``matrix_view="flatten"``), and the tensors listed in
``stacked`` (MoE experts ``(E, M, N)``, per-head weights) as ``prod(E)`` matrices ``(M, N)`` (a group with
``matrix_view="stacked"``). By default both stay with AdamW, as before: whether a kernel or a stack is a
matrix is a choice about the algorithm, and a ``(E, M, N)`` tensor does not say which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..models.heads import attention_modules
from .matrix_views import matrix_shape
from .param_groups import NO_DECAY_ROLES, classify_parameters, output_head

__all__ = ["CONV_ROUTES", "MuonRouting", "SPLITS", "TREATMENTS", "head_splits", "muon_param_groups"]

#: The values of ``muon_param_groups(split=...)``.
SPLITS = (None, "head", "qkv")
#: The values of ``muon_param_groups(conv=...)``: convolution kernels to AdamW (default) or flattened to Muon.
CONV_ROUTES = ("adamw", "flatten")
#: How :func:`muon_param_groups` treats a tensor (:attr:`MuonRouting.treatments`).
TREATMENTS = ("matrix", "flattened conv", "stacked", "AdamW")


@dataclass
class MuonRouting:
    """The result of :func:`muon_param_groups`: param groups for Muon and for AdamW, and why.

    ``reasons``: name -> why the tensor went where it did (for a flattened kernel or a stack, the matrices
    Muon steps). ``treatments``: name -> one of :data:`TREATMENTS`: ``"matrix"`` (a 2-D weight stepped
    by Muon), ``"flattened conv"``, ``"stacked"`` (``prod(E)`` matrices ``(M, N)``) or ``"AdamW"``.
    """

    muon: list[dict]
    adamw: list[dict]
    reasons: dict[str, str] = field(default_factory=dict)
    treatments: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """One line per parameter: name, shape, optimizer, reason (which, for Muon, says how the tensor is
        seen as matrices: a 2-D weight, a conv kernel flattened to ``(out, in*kh*kw)``, or a stack of
        ``E`` matrices ``(M, N)``)."""
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
                      split: str | None = None, conv: str = "adamw", stacked=()) -> MuonRouting:
    """Route ``model``'s parameters: 2-D hidden weights to Muon (and, when asked, conv kernels and stacks of
    matrices), everything else to AdamW.

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
        conv: ``"adamw"`` (default: convolution kernels to AdamW, reason ``"4-D tensor (Muon needs 2-D)"``) or
            ``"flatten"``: the kernel ``(out, in/groups, *k)`` of every ``nn.Conv1d/2d/3d`` (not the output
            head) to Muon as the matrix ``(out, in/groups * prod(k))``, in a group with
            ``matrix_view="flatten"`` (its learning-rate scale that of the flattened shape). A transposed
            convolution's kernel, ``(in, out/groups, *k)``, has its inputs first and stays with AdamW.
        stacked: parameters of ``model`` of 3 or more dimensions ``(*E, M, N)`` that are stacks of matrices
            (MoE experts, per-head weights): each goes to Muon as ``prod(E)`` matrices ``(M, N)``, in a group
            with ``matrix_view="stacked"`` (before ``conv``: a kernel listed here is a stack). Given as
            tensors, not names. Any other tensor of 3 or more dimensions goes to AdamW, never guessed.

    Returns:
        :class:`MuonRouting` with ``muon`` and ``adamw`` (up to two groups: decayed and not), each group
        carrying ``param_names``; ``reasons`` says why each tensor went where, ``treatments`` how it is
        treated. ``muon`` is one group of 2-D matrices with ``split=None``; with a split, a first group of
        whole matrices (``head_split=None``) and one group per distinct ``head_split`` (a tuple of row
        counts), in order of first appearance; then, if any, a group of flattened kernels and one of stacks.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``stacked`` holds something that is not a tensor.
        ValueError: ``split`` not one of :data:`SPLITS`; ``split`` set on a model with no attention
            module describing its heads, or together with ``muon_options["head_split"]``; a head layout
            that does not match its weights (:func:`head_splits`); ``conv`` not one of :data:`CONV_ROUTES`;
            a ``stacked`` entry that is not a trainable parameter of ``model`` or has fewer than 3
            dimensions, or is the output head's; ``muon_options["matrix_view"]`` (set per group here).
    """
    if split not in SPLITS:
        raise ValueError(f"Invalid split: expected one of {SPLITS}, got {split!r}")
    if conv not in CONV_ROUTES:
        raise ValueError(f"Invalid conv: expected one of {CONV_ROUTES}, got {conv!r}")
    if "matrix_view" in (muon_options or {}):
        raise ValueError("Invalid muon_options: 'matrix_view' is set per group by muon_param_groups "
                         "(conv='flatten' and stacked=...); leave it out")
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
    stacked_ids = _stacked_ids(model, stacked, head_ids)
    adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    muon, adamw_decay, adamw_plain, reasons = [], [], [], {}
    by_view: dict[str, list] = {"flatten": [], "stacked": []}
    for info in classify_parameters(model):
        p = info.param
        if id(p) in stacked_ids:
            by_view["stacked"].append(info)
            E, (M, N) = tuple(p.shape[:-2]), matrix_shape(p.shape, "stacked")
            count = " x ".join(map(str, E))
            reasons[info.name] = f"stacked: {count} matrices {(M, N)}, each stepped on its own"
        elif (conv == "flatten" and info.role == "weight" and isinstance(info.module, nn.modules.conv._ConvNd)
              and not info.module.transposed and p.ndim >= 3 and id(p) not in head_ids):
            by_view["flatten"].append(info)
            reasons[info.name] = f"conv kernel, flattened to {matrix_shape(p.shape, 'flatten')}"
        elif info.role == "embedding":
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
        elif conv == "flatten" and isinstance(info.module, nn.modules.conv._ConvNd) and info.role == "weight":
            adamw_decay.append(info)   # (in, out/groups, *k): its rows are inputs
            reasons[info.name] = f"{p.ndim}-D transposed-conv kernel (inputs first: not flattened)"
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
    muon_groups += [group(infos, weight_decay=weight_decay, matrix_view=view, **(muon_options or {}))
                    for view, infos in by_view.items() if infos]
    adamw_groups = [group(infos, weight_decay=wd, **(adamw_options or {}))
                    for infos, wd in ((adamw_decay, adamw_wd), (adamw_plain, 0.0)) if infos]
    words = {"flatten": "flattened conv", "stacked": "stacked"}
    treatments = {i.name: "matrix" for i in muon}
    treatments.update({i.name: words[view] for view, infos in by_view.items() for i in infos})
    treatments.update({i.name: "AdamW" for i in adamw_decay + adamw_plain})
    return MuonRouting(muon_groups, adamw_groups, reasons, treatments)


def _stacked_ids(model: nn.Module, stacked, head_ids: set[int]) -> set[int]:
    """The ids of the tensors in ``stacked``, each checked to be a trainable parameter of ``model`` with 3 or
    more dimensions, not the output head's (raises ``TypeError``/``ValueError`` naming ``stacked``)."""
    if isinstance(stacked, torch.Tensor):
        stacked = [stacked]
    mine = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    ids = set()
    for i, p in enumerate(stacked):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"Invalid stacked: entry {i} is a {type(p).__name__}, expected a parameter of "
                            "the model (a tensor, not its name)")
        if id(p) not in mine:
            raise ValueError(f"Invalid stacked: entry {i} (shape {tuple(p.shape)}) is not a trainable "
                             f"parameter of this {type(model).__name__}")
        if p.ndim < 3:
            raise ValueError(f"Invalid stacked: entry {i} ({mine[id(p)]}, shape {tuple(p.shape)}) has "
                             f"{p.ndim} dimensions; a stack (*E, M, N) has 3 or more (a 2-D weight is one "
                             "matrix and goes to Muon as it is)")
        if id(p) in head_ids:
            raise ValueError(f"Invalid stacked: entry {i} ({mine[id(p)]}) belongs to the output head, which "
                             "goes to AdamW")
        ids.add(id(p))
    return ids
