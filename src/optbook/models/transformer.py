"""A tiny causal transformer that records per-head maximum attention logits. Chapters 7 and 8.

Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> GELU MLP -> residual), learned
position embeddings, optional tied output head, grouped-query attention (``n_kv_heads`` divides
``n_heads``). Every weight is in PyTorch layout ``(out, in)``; the Q, K and V projections are
separate ``nn.Linear`` layers whose rows are grouped by head (rows ``h*d_head:(h+1)*d_head``).
Each attention module describes its heads once, in its ``head_layout``
(:class:`optbook.models.heads.HeadLayout`), which its forward, per-head Muon
(:func:`optbook.optim.muon_param_groups`) and :func:`optbook.qk_clip_` all read.

In training mode each attention layer keeps ``max_logits``: a tensor ``(n_heads,)`` (float32;
float64 for a float64 model) with ``S_max^h = max over batch, query i, key j <= i`` of head ``h``'s
pre-softmax logit -- taken from the logits attention computes anyway (no second pass) -- as a
running maximum over every training forward since it was last reset (by :func:`optbook.qk_clip_`,
which consumes it, or by ``reset_max_logits()``): with gradient accumulation the clip sees every
micro-batch of the step, not only the last one. Source: Kimi K2 (arXiv:2507.20534, §2.1, the
per-head ``S_max``); DeepSeek-V2 (arXiv:2405.04434, §2.1) for multi-head latent attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .heads import HeadLayout
from .._checks import check_int

__all__ = ["CausalSelfAttention", "MultiHeadLatentAttention", "TinyTransformer"]


def _causal_logits(scores: torch.Tensor) -> torch.Tensor:
    T = scores.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) over the last dimension of ``(..., T, d)``."""
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype).repeat(1, 2), angles.sin().to(x.dtype).repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _running_max(recorded: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """The per-head maximum of ``logits`` ``(B, H, T, T)`` folded into ``recorded`` ``(H,)``.

    Kept in float32, or in the logits' dtype when that is wider (float64): a float64 model's maxima
    rounded to float32 could sit 6e-8 (relative) below the true logit, and a clip computed from them
    would leave the logit that much above tau. An empty batch (``B = 0`` or ``T = 0``) records nothing:
    ``recorded`` is returned unchanged (``None`` before any non-empty batch).
    """
    if logits.numel() == 0:
        return recorded
    current = logits.detach().amax(dim=(0, 2, 3))
    current = current.to(torch.promote_types(current.dtype, torch.float32))
    return current if recorded is None else torch.maximum(recorded, current)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with GQA and optional per-head QK RMSNorm.

    Args:
        d_model: width; ``n_heads * d_head == d_model``.
        n_heads, n_kv_heads: query heads and key/value heads (``n_heads % n_kv_heads == 0``).
        qk_norm: apply RMSNorm over each head's query and key vectors (DeepSeek-V4's alternative to
            QK-clip, chapter 8).

    Input/output ``(batch, seq, d_model)``. ``head_layout`` (:meth:`HeadLayout.multi_head`) holds
    ``n_heads``, ``n_kv_heads`` and ``d_head`` (read-only attributes of the module read from it) and
    which rows of ``q_proj``, ``k_proj``, ``v_proj`` belong to which head.

    Raises:
        ValueError: ``d_model`` not divisible by ``n_heads`` or ``n_heads`` by ``n_kv_heads``.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, qk_norm: bool = False):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads:
            raise ValueError(f"Invalid n_heads: {n_heads} does not divide d_model={d_model}")
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"Invalid n_kv_heads: {n_kv_heads} does not divide n_heads={n_heads}")
        self.head_layout = HeadLayout.multi_head(n_heads, n_kv_heads, d_model // n_heads, qk_norm)
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=False)
        self.o_proj = nn.Linear(n_heads * self.d_head, d_model, bias=False)
        self.q_norm = nn.RMSNorm(self.d_head) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.d_head) if qk_norm else None
        self.max_logits: torch.Tensor | None = None

    n_heads = property(lambda self: self.head_layout.n_heads)
    n_kv_heads = property(lambda self: self.head_layout.n_kv_heads)
    d_head = property(lambda self: self.head_layout.d_head)

    def attention_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-softmax logits ``(B, n_heads, T, T)`` for the input ``x`` ``(B, T, d_model)``, in the
        model's dtype, with the masked entries (key after query) at ``-inf``: what :meth:`forward`
        feeds to the softmax. Records nothing."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k = k.repeat_interleave(self.head_layout.group, dim=1)  # query head h reads kv head h // group
        return _causal_logits((q @ k.transpose(-2, -1)) / math.sqrt(self.d_head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        logits = self.attention_logits(x)                                             # (B, H, T, T)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)
        v = v.repeat_interleave(self.head_layout.group, dim=1)
        if self.training:
            self.max_logits = _running_max(self.max_logits, logits)              # (H,)
        out = F.softmax(logits, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.d_head))


class MultiHeadLatentAttention(nn.Module):
    """A small multi-head latent attention (DeepSeek-V2/V3 style), enough to show MLA's QK-clip.

    Per head ``h``: a content query ``q_c^h = W_qc^h x`` and a rotary query ``q_r^h = W_qr^h x``; keys and
    values come from a compressed latent ``c = W_dkv x`` (``kv_rank`` wide): content key
    ``k_c^h = W_kc^h c`` and value ``v^h = W_v^h c``; one rotary key ``k_r = W_kr x`` is *shared by all
    heads*. The logit is ``(q_c^h . k_c^h + rope(q_r^h) . rope(k_r)) / sqrt(d_head + d_rope)``.
    Source: DeepSeek-V2 (arXiv:2405.04434, §2.1.2-2.1.3: low-rank key-value compression and the
    decoupled rotary key); the query here is not compressed.

    Args:
        d_model, n_heads: width and heads (``n_heads * d_head == d_model``).
        d_rope: width of the rotary parts (even).
        kv_rank: width of the compressed key/value latent (default ``d_model // 2``).

    Records ``max_logits`` ``(n_heads,)`` in training mode, like :class:`CausalSelfAttention`.
    ``head_layout`` (:meth:`HeadLayout.latent`) holds ``n_heads``, ``d_head``, ``d_rope``, ``kv_rank``
    (read-only attributes read from it; ``n_kv_heads == n_heads``) and the row blocks of every projection.

    Raises:
        ValueError: ``n_heads`` not dividing ``d_model``, odd ``d_rope``, ``kv_rank < 1``.
    """

    def __init__(self, d_model: int, n_heads: int, d_rope: int = 8, kv_rank: int | None = None):
        super().__init__()
        if d_model % n_heads or d_rope % 2:
            raise ValueError(f"Invalid MLA shape: n_heads={n_heads} must divide d_model={d_model} and d_rope={d_rope} "
                             "must be even")
        kv_rank = d_model // 2 if kv_rank is None else kv_rank
        check_int("kv_rank", kv_rank, 1)
        self.head_layout = HeadLayout.latent(n_heads, d_model // n_heads, d_rope, kv_rank)
        self.q_c_proj = nn.Linear(d_model, d_model, bias=False)
        self.q_r_proj = nn.Linear(d_model, n_heads * d_rope, bias=False)
        self.kv_down = nn.Linear(d_model, kv_rank, bias=False)
        self.k_c_proj = nn.Linear(kv_rank, d_model, bias=False)
        self.v_proj = nn.Linear(kv_rank, d_model, bias=False)
        self.k_r_proj = nn.Linear(d_model, d_rope, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.max_logits: torch.Tensor | None = None

    n_heads = property(lambda self: self.head_layout.n_heads)
    n_kv_heads = property(lambda self: self.head_layout.n_kv_heads)
    d_head = property(lambda self: self.head_layout.d_head)
    d_rope = property(lambda self: self.head_layout.d_rope)
    kv_rank = property(lambda self: self.head_layout.kv_rank)

    def attention_logits(self, x: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
        """The pre-softmax logits ``(B, n_heads, T, T)`` for ``x`` ``(B, T, d_model)``, masked entries at
        ``-inf`` (see :meth:`CausalSelfAttention.attention_logits`); ``c`` is ``kv_down(x)`` when the
        caller has it already. Records nothing."""
        B, T, _ = x.shape
        H, d, r = self.n_heads, self.d_head, self.d_rope
        c = self.kv_down(x) if c is None else c
        q_c = self.q_c_proj(x).view(B, T, H, d).transpose(1, 2)
        q_r = _rope(self.q_r_proj(x).view(B, T, H, r).transpose(1, 2))
        k_c = self.k_c_proj(c).view(B, T, H, d).transpose(1, 2)
        k_r = _rope(self.k_r_proj(x).view(B, 1, T, r))                        # shared by every head
        scores = (q_c @ k_c.transpose(-2, -1) + q_r @ k_r.transpose(-2, -1)) / math.sqrt(d + r)
        return _causal_logits(scores)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.kv_down(x)
        logits = self.attention_logits(x, c)
        v = self.v_proj(c).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        if self.training:
            self.max_logits = _running_max(self.max_logits, logits)
        out = F.softmax(logits, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.d_head))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None, mlp_ratio: int, qk_norm: bool,
                 attention: str = "mha"):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model)
        if attention == "mla":
            self.attn = MultiHeadLatentAttention(d_model, n_heads)
        elif attention == "mha":
            self.attn = CausalSelfAttention(d_model, n_heads, n_kv_heads, qk_norm)
        else:
            raise ValueError(f"Invalid attention: expected 'mha' or 'mla', got {attention!r}")
        self.mlp_norm = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model, bias=False), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """A small decoder-only language model.

    Args:
        vocab_size, max_seq_len: token and position table sizes.
        d_model, n_layers, n_heads, n_kv_heads: shape (``n_kv_heads=None`` means MHA).
        mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
        tie_embeddings: share the token embedding with the output head.
        qk_norm: per-head QK RMSNorm in every attention layer.
        attention: ``"mha"`` (multi-head, GQA when ``n_kv_heads < n_heads``, MQA when it is 1) or
            ``"mla"`` (:class:`MultiHeadLatentAttention`: one content key per head, so ``n_kv_heads``
            None or ``n_heads``, and no ``qk_norm``).

    Input: int64 token ids ``(batch, seq)`` with ``seq <= max_seq_len``; output: logits
    ``(batch, seq, vocab_size)``.

    Raises:
        ValueError: a shape the attention cannot take (see :class:`CausalSelfAttention`), an unknown
            ``attention``, or ``n_kv_heads``/``qk_norm`` with ``attention="mla"`` (they would be ignored).
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: int | None = None, max_seq_len: int = 64, mlp_ratio: int = 4,
                 tie_embeddings: bool = False, qk_norm: bool = False, attention: str = "mha"):
        super().__init__()
        if attention == "mla" and n_kv_heads not in (None, n_heads):
            raise ValueError(f"Invalid n_kv_heads: attention='mla' has one content key per head, got "
                             f"n_kv_heads={n_kv_heads} for n_heads={n_heads}")
        if attention == "mla" and qk_norm:
            raise ValueError("Invalid qk_norm: attention='mla' has no QK-norm (it would be ignored)")
        self.max_seq_len = max_seq_len
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.embed_positions = nn.Embedding(max_seq_len, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, n_kv_heads, mlp_ratio, qk_norm, attention)
                                    for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def get_output_embeddings(self) -> nn.Linear:
        """The output head (the convention parameter routing uses to find it)."""
        return self.lm_head

    def attention_layers(self) -> list[nn.Module]:
        return [block.attn for block in self.layers]

    def reset_max_logits(self) -> None:
        """Forget the recorded maxima (the next training forward starts a new running maximum)."""
        for attn in self.attention_layers():
            attn.max_logits = None

    def max_logits(self) -> torch.Tensor:
        """``(n_layers, n_heads)`` float32 (float64 for a float64 model): the per-head ``S_max``, a
        running maximum over every training forward since the last :func:`optbook.qk_clip_` or
        :meth:`reset_max_logits`.

        Raises:
            RuntimeError: no training-mode forward has run since the model was built.
        """
        values = [a.max_logits for a in self.attention_layers()]
        if any(v is None for v in values):
            raise RuntimeError("No max logits recorded: run a forward pass in training mode first")
        return torch.stack(values)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"Invalid idx: sequence length {T} exceeds max_seq_len={self.max_seq_len}")
        x = self.embed_tokens(idx) + self.embed_positions(torch.arange(T, device=idx.device))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))
