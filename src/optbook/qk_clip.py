"""Per-head QK-clip (MuonClip). Explained in chapter 8.

Source: Kimi K2 (arXiv:2507.20534, §2.1 and Appendix D/E): after the optimizer
step, for every head ``h`` with ``S_max^h > tau`` (the largest pre-softmax logit seen in this step's
forward), the logits are scaled by ``gamma_h = tau / S_max^h`` by rescaling weights:

* MHA: the head's rows of ``W_q`` and ``W_k`` by ``sqrt(gamma_h)`` each (a logit is bilinear in q, k).
* GQA, one K head shared by a group of Q heads:
  - ``gqa_rule="group"`` (Megatron-LM): every head of the group and the shared K head use the
    group's smallest gamma, ``g = min_h gamma_h``: Q rows by ``sqrt(g)``, K rows by ``sqrt(g)``.
    Heads below tau in a clipped group are clipped too (over-clipping).
  - ``gqa_rule="per_head"``: each head's logits scaled by exactly its own ``gamma_h``. With a K
    factor ``beta`` shared by the group and a Q factor ``alpha_h`` per head we need
    ``alpha_h * beta = gamma_h``; we take ``beta = sqrt(g)`` (the group minimum, so the most
    clipped head is scaled symmetrically like MHA) and ``alpha_h = gamma_h / sqrt(g)`` (``>= sqrt(g)``).
* MLA: the head's content parts ``W_qc`` and ``W_kc`` by ``sqrt(gamma_h)``, its rotary query
  ``W_qr`` by ``gamma_h``; the rotary key, shared by all heads, is never touched.

Heads (GQA: groups) with no logit above tau are left bit-for-bit untouched; V, the output projection
and every other weight never change. With ``torch.distributed`` initialised, the per-head maxima are
first all-reduced with MAX over ``process_group`` (default: the whole world), so every data-parallel
rank clips identically.
"""

from __future__ import annotations

import torch
from torch import nn

from .models.transformer import CausalSelfAttention, MultiHeadLatentAttention

__all__ = ["qk_clip_", "qk_clip_factors"]


def qk_clip_factors(max_logits: torch.Tensor, tau: float, n_kv_heads: int | None = None,
                    gqa_rule: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(q_factor, k_factor)`` for one layer: shapes ``(n_heads,)`` and ``(n_kv_heads,)``.

    For MHA (``n_kv_heads`` None or equal to ``n_heads``) both are ``sqrt(gamma)``. See the module
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


def _scale_rows_(weight: torch.Tensor, factors: torch.Tensor, rows_per_head: int) -> None:
    """Multiply row block ``h`` (``rows_per_head`` rows) of ``weight`` by ``factors[h]``, skipping 1s."""
    for h, f in enumerate(factors.tolist()):
        if f != 1.0:
            weight[h * rows_per_head:(h + 1) * rows_per_head].mul_(f)


@torch.no_grad()
def qk_clip_(model: nn.Module, tau: float = 100.0, *, gqa_rule: str = "group", process_group=None) -> list[dict]:
    """Clip every attention head of ``model`` whose recorded max logit exceeds ``tau``, in place.

    Call it after ``optimizer.step()``, with the maxima recorded by that step's training forward
    (:class:`optbook.models.TinyTransformer` records them). The recorded maxima are consumed
    (reset to ``None``), so a second call without a new forward raises instead of clipping twice.

    Args:
        model: a module containing :class:`CausalSelfAttention` or :class:`MultiHeadLatentAttention`.
        tau: threshold on ``S_max`` (pre-softmax logit units), ``> 0``; K2 uses 100.
        gqa_rule: ``"group"`` or ``"per_head"`` (module docstring); ignored for MHA and MLA.
        process_group: group for the MAX all-reduce when ``torch.distributed`` is initialised.

    Returns:
        One dict per clipped head: ``layer``, ``head``, ``s_max``, ``gamma`` (``tau / s_max``),
        ``q_factor`` and ``k_factor`` applied (MLA: the content factor).

    Raises:
        ValueError: ``tau <= 0``; recorded maxima whose length does not match the layer's heads.
        RuntimeError: no attention layer, or a layer with no recorded maxima (no training forward).
        Nothing is modified when it raises.
    """
    if not (isinstance(tau, (int, float)) and tau > 0):
        raise ValueError(f"Invalid tau: expected a number > 0, got {tau!r}")
    layers = [m for m in model.modules() if isinstance(m, (CausalSelfAttention, MultiHeadLatentAttention))]
    if not layers:
        raise RuntimeError("qk_clip_ found no attention layer (CausalSelfAttention or MultiHeadLatentAttention)")
    plans = []
    for i, attn in enumerate(layers):  # validate everything before touching any weight
        if attn.max_logits is None:
            raise RuntimeError(f"Attention layer {i} recorded no max logits: run a training-mode forward "
                               "before qk_clip_ (and call it once per step)")
        if attn.max_logits.numel() != attn.n_heads:
            raise ValueError(f"Attention layer {i}: {attn.max_logits.numel()} recorded maxima for "
                             f"{attn.n_heads} heads")
        plans.append(attn.max_logits.clone())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        stacked = torch.stack(plans)
        torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX, group=process_group)
        plans = list(stacked)

    report = []
    for i, (attn, s_max) in enumerate(zip(layers, plans)):
        attn.max_logits = None
        if isinstance(attn, MultiHeadLatentAttention):
            content, _ = qk_clip_factors(s_max, tau)
            rotary = content ** 2                                           # gamma on W_qr
            _scale_rows_(attn.q_c_proj.weight, content, attn.d_head)
            _scale_rows_(attn.k_c_proj.weight, content, attn.d_head)
            _scale_rows_(attn.q_r_proj.weight, rotary, attn.d_rope)
            q_factor, k_factor = content, content
        else:
            q_factor, k_factor = qk_clip_factors(s_max, tau, attn.n_kv_heads, gqa_rule)
            _scale_rows_(attn.q_proj.weight, q_factor, attn.d_head)
            _scale_rows_(attn.k_proj.weight, k_factor, attn.d_head)
        group = attn.n_heads // getattr(attn, "n_kv_heads", attn.n_heads)
        for h in range(attn.n_heads):
            if float(s_max[h]) > tau or q_factor[h] != 1.0:
                report.append(dict(layer=i, head=h, s_max=float(s_max[h]), gamma=min(1.0, tau / float(s_max[h])),
                                   q_factor=float(q_factor[h]), k_factor=float(k_factor[h // group])))
    return report
