"""A tiny causal transformer that records per-head maximum attention logits. Chapters 7 and 8.

Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> GELU MLP -> residual), learned
position embeddings, optional tied output head, grouped-query attention (``n_kv_heads`` divides
``n_heads``). Every weight is in PyTorch layout ``(out, in)``; the Q, K and V projections are
separate ``nn.Linear`` layers whose rows are grouped by head (rows ``h*d_head:(h+1)*d_head``).

In training mode each attention layer stores ``max_logits``: a float32 tensor ``(n_heads,)`` with
``S_max^h = max over batch, query i, key j <= i of q_i . k_j / sqrt(d_head)`` -- taken from the
logits attention computes anyway (no second pass). Source: Kimi K2 (arXiv:2507.20534, §2.1) for S_max.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

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


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with GQA and optional per-head QK RMSNorm.

    Args:
        d_model: width; ``n_heads * d_head == d_model``.
        n_heads, n_kv_heads: query heads and key/value heads (``n_heads % n_kv_heads == 0``).
        qk_norm: apply RMSNorm over each head's query and key vectors (DeepSeek-V4's alternative to
            QK-clip, chapter 8).

    Input/output ``(batch, seq, d_model)``.

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
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=False)
        self.o_proj = nn.Linear(n_heads * self.d_head, d_model, bias=False)
        self.q_norm = nn.RMSNorm(self.d_head) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.d_head) if qk_norm else None
        self.max_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        logits = _causal_logits((q @ k.transpose(-2, -1)) / math.sqrt(self.d_head))  # (B, H, T, T)
        if self.training:
            self.max_logits = logits.detach().amax(dim=(0, 2, 3)).float()       # (H,)
        out = F.softmax(logits, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MultiHeadLatentAttention(nn.Module):
    """A small multi-head latent attention (DeepSeek-V2/V3 style), enough to show MLA's QK-clip.

    Per head ``h``: a content query ``q_c^h = W_qc^h x`` and a rotary query ``q_r^h = W_qr^h x``; keys and
    values come from a compressed latent ``c = W_dkv x`` (``kv_rank`` wide): content key
    ``k_c^h = W_kc^h c`` and value ``v^h = W_v^h c``; one rotary key ``k_r = W_kr x`` is *shared by all
    heads*. The logit is ``(q_c^h . k_c^h + rope(q_r^h) . rope(k_r)) / sqrt(d_head + d_rope)``.

    Args:
        d_model, n_heads: width and heads (``n_heads * d_head == d_model``).
        d_rope: width of the rotary parts (even).
        kv_rank: width of the compressed key/value latent.

    Records ``max_logits`` ``(n_heads,)`` in training mode, like :class:`CausalSelfAttention`.
    """

    def __init__(self, d_model: int, n_heads: int, d_rope: int = 8, kv_rank: int | None = None):
        super().__init__()
        if d_model % n_heads or d_rope % 2:
            raise ValueError(f"Invalid MLA shape: n_heads={n_heads} must divide d_model={d_model} and d_rope={d_rope} "
                             "must be even")
        self.n_heads, self.d_head, self.d_rope = n_heads, d_model // n_heads, d_rope
        kv_rank = kv_rank or d_model // 2
        self.q_c_proj = nn.Linear(d_model, d_model, bias=False)
        self.q_r_proj = nn.Linear(d_model, n_heads * d_rope, bias=False)
        self.kv_down = nn.Linear(d_model, kv_rank, bias=False)
        self.k_c_proj = nn.Linear(kv_rank, d_model, bias=False)
        self.v_proj = nn.Linear(kv_rank, d_model, bias=False)
        self.k_r_proj = nn.Linear(d_model, d_rope, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.max_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, d, r = self.n_heads, self.d_head, self.d_rope
        c = self.kv_down(x)
        q_c = self.q_c_proj(x).view(B, T, H, d).transpose(1, 2)
        q_r = _rope(self.q_r_proj(x).view(B, T, H, r).transpose(1, 2))
        k_c = self.k_c_proj(c).view(B, T, H, d).transpose(1, 2)
        k_r = _rope(self.k_r_proj(x).view(B, 1, T, r))                        # shared by every head
        v = self.v_proj(c).view(B, T, H, d).transpose(1, 2)
        scores = (q_c @ k_c.transpose(-2, -1) + q_r @ k_r.transpose(-2, -1)) / math.sqrt(d + r)
        logits = _causal_logits(scores)
        if self.training:
            self.max_logits = logits.detach().amax(dim=(0, 2, 3)).float()
        out = F.softmax(logits, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


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
        attention: ``"mha"`` (multi-head, GQA when ``n_kv_heads < n_heads``) or ``"mla"``
            (:class:`MultiHeadLatentAttention`).

    Input: int64 token ids ``(batch, seq)`` with ``seq <= max_seq_len``; output: logits
    ``(batch, seq, vocab_size)``.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: int | None = None, max_seq_len: int = 64, mlp_ratio: int = 4,
                 tie_embeddings: bool = False, qk_norm: bool = False, attention: str = "mha"):
        super().__init__()
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

    def max_logits(self) -> torch.Tensor:
        """``(n_layers, n_heads)`` float32: the last training forward's per-head ``S_max``.

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
