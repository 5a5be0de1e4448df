"""Per-head QK-clip (MuonClip). Explained in chapter 8.

Source: Kimi K2 (arXiv:2507.20534, §2.1 and Appendix D/E): after the optimizer
step, for every head ``h`` with ``S_max^h > tau`` (the largest pre-softmax logit seen in every
forward of this step, all micro-batches), the logits are scaled by ``gamma_h = tau / S_max^h`` by
rescaling weights. Which rows belong to which head is read from the attention module's
``head_layout`` (:class:`optbook.models.heads.HeadLayout`), the same description per-head Muon
(:func:`optbook.optim.muon_param_groups` with ``split="head"``) reads:

* MHA: the head's rows of ``W_q`` and ``W_k`` by ``sqrt(gamma_h)`` each (a logit is bilinear in q, k).
* GQA and MQA, one K head shared by a group of Q heads:
  - ``gqa_rule="group"`` (Megatron-LM): every head of the group and the shared K head use the
    group's smallest gamma, ``g = min_h gamma_h``: Q rows by ``sqrt(g)``, K rows by ``sqrt(g)``.
    Heads below tau in a clipped group are clipped too (over-clipping).
  - ``gqa_rule="per_head"``: each head's logits scaled by exactly its own ``gamma_h``. With a K
    factor ``beta`` shared by the group and a Q factor ``alpha_h`` per head we need
    ``alpha_h * beta = gamma_h``; we take ``beta = sqrt(g)`` (the group minimum, so the most
    clipped head is scaled symmetrically like MHA) and ``alpha_h = gamma_h / sqrt(g)`` (``>= sqrt(g)``).
* MLA: the head's content parts ``W_qc`` and ``W_kc`` by ``sqrt(gamma_h)``, its rotary query
  ``W_qr`` by ``gamma_h`` (``alpha_h * beta``); the rotary key, shared by all heads, is never touched.

Heads (GQA: groups) with no logit above tau are left bit-for-bit untouched; V, the output projection
and every other weight never change. Every scaling goes through :func:`optbook.contract.scale_weights_`
with one ``(rows, 1)`` factor column per weight (exactly 1 on untouched rows): a wrapper that keeps its
own copy of the weights (the float32 masters of :class:`~optbook.precision.MixedPrecisionOptimizer`, the
host copies of :class:`~optbook.memory.OffloadOptimizer`) scales that copy and rewrites the model's weight
from it, so its next step does not undo the clip (ZeRO-1's :class:`~optbook.distributed.DistributedOptimizer`
takes all of a step's scalings in one call and republishes each bucket once). With ``torch.distributed``
initialised, every layer's per-head maxima are first reduced over ``process_group`` (default: the whole
world) by one packed all-reduce (MAX) whatever the number of layers, so every data-parallel rank clips
identically; an FSDP2 ``DTensor`` weight then has its local rows scaled, with no further communication.

What it guarantees: recomputing a layer's logits on the inputs it saw gives ``S_max^h <= tau`` for
every head (up to the rounding of the scaled weights, a few ulps of their dtype). It acts only
where the weights it scales set the logits; a layer where they do not -- per-head QK-norm (the
RMS norm undoes any scale of ``W_q``, ``W_k``; the norm gains set the logits) or a bias on a query/key
projection (a part of the logit no row scale reaches) -- makes it raise instead of reporting heads
as clipped.
"""

from __future__ import annotations

import torch
from torch import nn

from .contract import owner_of, scale_weights_
from .models.heads import attention_modules
from ._checks import check_int

__all__ = ["clipped_heads", "qk_clip_", "qk_clip_factors"]

#: The roles of :class:`~optbook.models.heads.HeadRows` that qk_clip_ rescales.
CLIPPED_ROLES = ("query", "key", "rotary_query")


def qk_clip_factors(max_logits: torch.Tensor, tau: float, n_kv_heads: int | None = None,
                    gqa_rule: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(q_factor, k_factor)`` for one layer: float64, shapes ``(n_heads,)`` and ``(n_kv_heads,)``.

    ``max_logits``: the layer's per-head ``S_max``, shape ``(n_heads,)``, any real dtype. For MHA and
    MLA (``n_kv_heads`` None or equal to ``n_heads``) both are ``sqrt(gamma)``. See the module
    docstring for the GQA rules. Factors are exactly 1 where nothing is clipped.

    Raises:
        ValueError: ``tau <= 0``, ``n_kv_heads`` that does not divide the heads, unknown ``gqa_rule``.
    """
    if not tau > 0:
        raise ValueError(f"Invalid tau: expected > 0, got {tau!r}")
    H = max_logits.numel()
    n_kv = H if n_kv_heads is None else n_kv_heads
    if n_kv < 1 or H % n_kv:
        raise ValueError(f"Invalid n_kv_heads: {n_kv} does not divide the {H} heads")
    if gqa_rule not in ("group", "per_head"):
        raise ValueError(f"Invalid gqa_rule: expected 'group' or 'per_head', got {gqa_rule!r}")
    s = max_logits.double()
    gamma = torch.where(s > tau, tau / s, torch.ones_like(s))                    # (H,)
    group_min = gamma.view(n_kv, H // n_kv).amin(dim=1)                          # (n_kv,)
    k_factor = group_min.sqrt()
    if n_kv == H:
        return gamma.sqrt(), k_factor
    if gqa_rule == "group":
        return k_factor.repeat_interleave(H // n_kv), k_factor
    return gamma / k_factor.repeat_interleave(H // n_kv), k_factor


def clipped_blocks(attn: nn.Module) -> dict[str, list[slice]]:
    """The row blocks :func:`qk_clip_` rescales in attention module ``attn``: weight name -> one slice per
    block (query and rotary-query blocks per query head, key blocks per key head), read from
    ``attn.head_layout``."""
    layout, blocks = attn.head_layout, {}
    for weight in layout.weights():
        for part in layout.parts_of(weight):  # a fused weight has several parts
            if part.role in CLIPPED_ROLES:
                blocks.setdefault(weight, []).extend(part.slices())
    return blocks


def _check_clippable(i: int, attn: nn.Module) -> None:
    """Raise unless the weights qk_clip_ scales set layer ``i``'s logits (checked before any write)."""
    layout = attn.head_layout
    if layout.qk_norm:
        raise ValueError(f"Invalid model: attention layer {i} RMS-normalises each head's query and key "
                         "(qk_norm=True), so its logits do not scale with W_q and W_k and qk_clip_ cannot "
                         "bound them (the norm gains set them); use QK-norm or QK-clip, not both")
    roles = {part.role for part in layout.parts}
    if not {"query", "key"} <= roles:
        raise ValueError(f"Invalid model: the head layout of attention layer {i} has no query or no key part")
    for weight in layout.weights():
        if not any(part.role in CLIPPED_ROLES for part in layout.parts_of(weight)):
            continue
        try:
            w = attn.get_parameter(weight)
        except AttributeError:
            raise ValueError(f"Invalid model: attention layer {i} has no parameter {weight!r} "
                             "named by its head layout") from None
        if w.ndim != 2 or w.shape[0] != layout.rows(weight):
            raise ValueError(f"Invalid model: {weight} of attention layer {i} has shape {tuple(w.shape)}, "
                             f"its head layout describes {layout.rows(weight)} rows")
        owner = attn.get_submodule(weight.rpartition(".")[0])
        if getattr(owner, "bias", None) is not None:
            raise ValueError(f"Invalid model: {weight.rpartition('.')[0]} of attention layer {i} has a bias, "
                             "a part of the logits qk_clip_ does not scale")


def row_factors(weight: torch.Tensor, factors: torch.Tensor, blocks: list[slice],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``(rows, 1)`` factor column that multiplies row block ``b`` of ``weight`` by ``factors[b]``.

    Args:
        weight: the 2-D weight (its row count and dtype are read).
        factors: float64, one per block.
        blocks: row slices of ``weight``.
        out: a column from an earlier call for another part of the same (fused) weight, updated in place.

    Returns:
        Shape ``(weight.shape[0], 1)``, dtype float64 for a float64 weight, else float32 (the precision a
        Python-scalar multiply of the weight computes in); exactly 1 on every row no block names.
    """
    if out is None:
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        out = torch.ones(weight.shape[0], 1, dtype=dtype, device=weight.device)
    for rows, f in zip(blocks, factors.tolist()):
        if f != 1.0:
            out[rows] = f
    return out


def _recorded(i: int, attn: nn.Module, missing_ok: bool) -> torch.Tensor | None:
    """Layer ``i``'s recorded maxima ``(n_heads,)``, after checking them and the layer (before any write).
    ``None`` when nothing was recorded and ``missing_ok`` (a data-parallel rank whose share held no data)."""
    if attn.max_logits is None:
        if missing_ok:
            _check_clippable(i, attn)
            return None
        raise RuntimeError(f"Attention layer {i} recorded no max logits: run a training-mode forward "
                           "before qk_clip_ (and call it once per step)")
    if attn.max_logits.numel() != attn.head_layout.n_heads:
        raise ValueError(f"Attention layer {i}: {attn.max_logits.numel()} recorded maxima for "
                         f"{attn.head_layout.n_heads} heads")
    _check_clippable(i, attn)
    return attn.max_logits


def _reduce_maxima(layers: list, process_group=None) -> list[torch.Tensor]:
    """Every layer's per-head ``S_max`` over this process and, with ``torch.distributed`` initialised, over
    every rank of ``process_group``: float64, one ``(n_heads,)`` tensor per layer of ``layers`` (attention
    modules, :func:`optbook.models.attention_modules`). Nothing is written.

    Distributed, it is **one** all-reduce (MAX) whatever the number of layers and heads: a float64 tensor of
    ``1 + sum(n_heads)`` elements -- slot 0 an error flag (``1 + rank`` of a rank whose own check failed),
    then each layer's maxima (exact: the maxima are float32 or float64). A NaN is packed as ``+inf``: a
    MAX over ranks may drop a NaN (gloo's does, depending on the order it meets it), an ``inf`` always
    survives; a rank that recorded nothing for a layer (its share of the batch was empty) packs ``-inf``,
    which every other rank's maximum beats. Errors are raised after the all-reduce, on every rank alike, so
    no rank is left waiting in a collective the others never join.

    Raises:
        RuntimeError: a layer with no recorded maxima (no training forward since the last clip) -- on every
            rank, only when no rank of the group recorded any.
        ValueError: recorded maxima whose length does not match the layer's heads, or a layer
            :func:`qk_clip_` cannot clip (on the rank that found it; the other ranks raise a ``ValueError``
            naming that rank); maxima that are NaN or infinite on some rank (on every rank).
    """
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    local_error, recorded = None, []
    for i, attn in enumerate(layers):  # validate everything before touching any weight
        try:
            recorded.append(_recorded(i, attn, missing_ok=distributed))
        except (RuntimeError, ValueError) as e:
            if not distributed:
                raise
            local_error = local_error or e
            recorded.append(None)
    sizes = [attn.head_layout.n_heads for attn in layers]
    device = next((m.device for m in recorded if m is not None), torch.device("cpu"))
    if distributed and torch.distributed.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    packed = torch.full((1 + sum(sizes),), float("-inf"), dtype=torch.float64, device=device)
    packed[0] = 0.0
    for m, part in zip(recorded, packed[1:].split(sizes)):
        if m is not None:
            part.copy_(torch.nan_to_num(m.detach().double(), nan=float("inf"), posinf=float("inf"),
                                        neginf=float("-inf")))
    if distributed:
        if local_error is not None:
            packed[0] = 1 + torch.distributed.get_rank(process_group)
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=process_group)
        if local_error is not None:
            raise local_error
        if packed[0] > 0:
            raise ValueError(f"Invalid input on rank {int(packed[0]) - 1} of the process group (its qk_clip_ "
                             "raised there, naming the problem); nothing was modified")
    maxima = list(packed[1:].cpu().split(sizes))
    for i, s_max in enumerate(maxima):  # after the all-reduce, so every rank raises alike
        if bool((s_max == float("-inf")).all()):
            raise RuntimeError(f"Attention layer {i} recorded no max logits on any rank: run a training-mode "
                               "forward before qk_clip_ (and call it once per step)")
        if not torch.isfinite(s_max).all():
            raise ValueError(f"Attention layer {i} recorded non-finite max logits {s_max.tolist()} (a NaN is "
                             "shown as inf): the forward overflowed; skip this step instead of clipping")
    return maxima


def _scale_all_(scalings: list) -> None:
    """Apply ``[(param, (rows, 1) factor column)]`` through :func:`optbook.contract.scale_weights_`, every
    parameter of one owner that can take them together (``_scale_weights_many_``, as
    :class:`~optbook.distributed.DistributedOptimizer`) in one call: its weights are then published once
    (ZeRO-1: one gather per bucket touched, not one per weight). Every rank calls this with the same list."""
    batched = {}
    for param, column in scalings:
        owner = owner_of(param)
        if owner is not None and hasattr(owner, "_scale_weights_many_"):
            batched.setdefault(id(owner), (owner, []))[1].append((param, column))
        else:
            scale_weights_(param, column)
    for owner, pairs in batched.values():
        owner._scale_weights_many_(pairs)


@torch.no_grad()
def qk_clip_(model: nn.Module, tau: float = 100.0, *, gqa_rule: str = "group", process_group=None) -> list[dict]:
    """Clip every attention head of ``model`` whose recorded max logit exceeds ``tau``, in place.

    Call it after ``optimizer.step()``. The maxima it reads are the running maxima the attention
    layers recorded over every training forward since the last call (every micro-batch of a step with
    gradient accumulation, and the forwards that activation checkpointing re-runs in the backward: the
    maximum of the same logits twice is the same maximum; :class:`optbook.models.TinyTransformer` records
    them), so the clip bounds the logits of all of them, not only of the last micro-batch. The recorded
    maxima are consumed (reset to ``None``), so a second call without a new forward raises instead of
    clipping twice.

    With ``torch.distributed`` initialised (data parallelism, ZeRO-1, FSDP2), every rank calls it: the
    maxima of all layers are reduced over ``process_group`` by one packed all-reduce (MAX) whatever the
    number of layers (:func:`_reduce_maxima`), after which every rank computes the same factors and scales
    its own copy: a replicated weight, the float32 master shards of
    :class:`~optbook.distributed.DistributedOptimizer` (the gathered weights republished once for all the
    clipped weights), the local rows of an FSDP2 ``DTensor`` (no communication). A rank whose share of the
    batch was empty contributes nothing. Sources: Kimi K2 (arXiv:2507.20534, §2.1); the packed reduction as
    in torchtitan pull request #4243 (all layers' and heads' maxima in one MAX all-reduce per optimizer
    step); NVIDIA/Megatron-LM pull request #7382 for what crashes when the master of a weight is a flat shard
    of a distributed optimizer or a layer has no attention.

    Args:
        model: a module containing attention modules with a ``head_layout``
            (:class:`~optbook.models.CausalSelfAttention`: MHA, GQA, MQA;
            :class:`~optbook.models.MultiHeadLatentAttention`: MLA) and their recorded ``max_logits``
            (float32 or float64, shape ``(n_heads,)``); layers may have different head counts, and
            modules without attention are skipped.
        tau: threshold on ``S_max`` (pre-softmax logit units), a real number ``> 0``; K2 uses 100.
        gqa_rule: ``"group"`` or ``"per_head"`` (module docstring); no effect for MHA and MLA.
        process_group: group for the MAX all-reduce when ``torch.distributed`` is initialised.

    Returns:
        One dict per clipped head: ``layer``, ``head``, ``s_max``, ``gamma`` (``tau / s_max``),
        ``q_factor`` and ``k_factor`` applied (MLA: the content factors; the rotary query gets
        their product).

    Raises:
        ValueError: ``tau`` not a real number ``> 0``; unknown ``gqa_rule``; recorded maxima whose
            length does not match the layer's heads, or that are NaN or infinite; a layer whose logits
            the scaled weights do not set (``qk_norm=True``, a bias on a scaled projection) or whose
            weights do not match its head layout.
        RuntimeError: no attention layer, or a layer with no recorded maxima (no training forward; when
            distributed, on no rank).
        Nothing is modified when it raises, and distributed, every rank raises (:func:`_reduce_maxima`).
    """
    if isinstance(tau, bool) or not (isinstance(tau, (int, float)) and tau > 0):
        raise ValueError(f"Invalid tau: expected a number > 0, got {tau!r}")
    if gqa_rule not in ("group", "per_head"):
        raise ValueError(f"Invalid gqa_rule: expected 'group' or 'per_head', got {gqa_rule!r}")
    layers = attention_modules(model)
    if not layers:
        raise RuntimeError("qk_clip_ found no attention layer (a module with a head_layout: "
                           "CausalSelfAttention or MultiHeadLatentAttention)")
    plans = _reduce_maxima(layers, process_group)

    report, scalings = [], []
    for i, (attn, s_max) in enumerate(zip(layers, plans)):
        attn.max_logits = None
        layout = attn.head_layout
        q_factor, k_factor = qk_clip_factors(s_max, tau, layout.n_kv_heads, gqa_rule)
        factors = {"query": q_factor, "key": k_factor,
                   # the rotary key is shared and untouched: the rotary query carries the whole alpha_h * beta
                   "rotary_query": q_factor * k_factor.repeat_interleave(layout.group)}
        columns = {}  # weight name -> its (rows, 1) factor column, every clipped part of a fused weight in one
        for part in layout.parts:
            if part.role in CLIPPED_ROLES:
                w = attn.get_parameter(part.weight)
                columns[part.weight] = row_factors(w, factors[part.role], part.slices(), columns.get(part.weight))
        for weight, column in columns.items():
            if not bool((column == 1).all()):  # a weight with no clipped row is not written at all
                scalings.append((attn.get_parameter(weight), column))
        for h in range(layout.n_heads):
            if float(s_max[h]) > tau or q_factor[h] != 1.0:
                report.append(dict(layer=i, head=h, s_max=float(s_max[h]), gamma=min(1.0, tau / float(s_max[h])),
                                   q_factor=float(q_factor[h]), k_factor=float(k_factor[layout.kv_head(h)])))
    _scale_all_(scalings)
    return report


def clipped_heads(report: list[dict], n_layers: int, n_heads: int, *, triggered: bool = False) -> torch.Tensor:
    """Which heads one :func:`qk_clip_` call clipped: a bool mask of shape ``(n_layers, n_heads)``.

    Args:
        report: the list :func:`qk_clip_` returned for one step (``[]`` when it clipped nothing).
        n_layers: number of attention layers of the model, an int ``>= 1``.
        n_heads: query heads per layer, an int ``>= 1``.
        triggered: ``False``: every head whose query rows were rescaled (under GQA that includes the
            quiet heads of a clipped group: the ``"group"`` rule shrinks their logits, the ``"per_head"``
            rule enlarges their query rows to keep them). ``True``: only heads whose own
            ``S_max`` exceeded ``tau`` (``gamma < 1``), the heads that "triggered QK-Clip" in the
            sense of the Kimi K2 report (arXiv:2507.20534, Appendix D). Identical for MHA and MLA.

    Returns:
        ``torch.bool``, shape ``(n_layers, n_heads)``. Stack one mask per step into
        ``(steps, n_layers, n_heads)``: ``.any(0)`` marks the heads clipped at least once, and
        ``.float().mean((1, 2))`` is the share of heads clipped at each step.

    Raises:
        ValueError: ``n_layers`` or ``n_heads`` not an int ``>= 1``; a record without an int
            ``layer`` and ``head`` and a ``gamma``, or outside ``(n_layers, n_heads)``; a head named twice.
    """
    for name, value in (("n_layers", n_layers), ("n_heads", n_heads)):
        check_int(name, value, 1)
    mask, seen = torch.zeros(n_layers, n_heads, dtype=torch.bool), set()
    for record in report:
        try:
            layer, head, gamma = record["layer"], record["head"], float(record["gamma"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"Invalid report: expected records of qk_clip_ with 'layer', 'head' and 'gamma', "
                             f"got {record!r}") from None
        if not (isinstance(layer, int) and isinstance(head, int) and 0 <= layer < n_layers and 0 <= head < n_heads):
            raise ValueError(f"Invalid report: head {head!r} of layer {layer!r} is outside "
                             f"n_layers={n_layers}, n_heads={n_heads}")
        if (layer, head) in seen:
            raise ValueError(f"Invalid report: head {head} of layer {layer} is named twice (a report of one call "
                             "names each head at most once)")
        seen.add((layer, head))
        mask[layer, head] = gamma < 1.0 or not triggered
    return mask
