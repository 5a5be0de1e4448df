"""The head layout of an attention module, described once. Chapters 7 and 8.

An attention module of :mod:`optbook.models` carries a frozen :class:`HeadLayout` as its
``head_layout`` attribute: how many query and key/value heads it has, their widths, and which rows
of which projection weight belong to which head. Everything that needs the heads reads it from
there: the module's own forward (its ``n_heads``, ``n_kv_heads``, ``d_head`` ... are read from it),
per-head Newton–Schulz in :func:`optbook.optim.muon_param_groups` (``split="head"`` or ``"qkv"``),
and per-head QK-clip in :func:`optbook.qk_clip_`. So the row blocks Muon orthogonalises one by one
are exactly the row blocks QK-clip rescales.

Weights are in PyTorch layout ``(out, in)``; a head owns a contiguous block of *rows* of a
projection (``rows`` rows starting at ``offset + b * rows`` for block ``b``). The output projection
owns its heads as columns, so it is not listed.

Roles of a part (what its rows produce):
    ``"query"``         per-head query (MLA: the content query), ``n_heads`` blocks;
    ``"key"``           per-head key (MLA: the content key), ``n_kv_heads`` blocks;
    ``"value"``         per-head value, ``n_kv_heads`` blocks;
    ``"rotary_query"``  MLA's per-head rotary (RoPE) query, ``n_heads`` blocks of ``d_rope`` rows;
    ``"rotary_key"``    MLA's rotary key, one block of ``d_rope`` rows shared by every head;
    ``"latent"``        MLA's compressed key/value latent ``c = W_dkv x``, one block of ``kv_rank`` rows.

Sources: Vaswani et al. (2017, arXiv:1706.03762) for multi-head attention; Ainslie et al. (2023,
arXiv:2305.13245) for grouped-query attention; DeepSeek-V2 (arXiv:2405.04434, §2.1) for multi-head
latent attention with a decoupled, shared rotary key.
"""

from __future__ import annotations

from dataclasses import dataclass
from .._checks import check_int

__all__ = ["HeadLayout", "HeadRows", "ROLES", "attention_modules"]

ROLES = ("query", "key", "value", "rotary_query", "rotary_key", "latent")


def _check_count(name: str, value, low: int = 1) -> None:
    check_int(name, value, low)


@dataclass(frozen=True)
class HeadRows:
    """One part of a projection weight: ``blocks`` blocks of ``rows`` rows each, from row ``offset``.

    Attributes:
        weight: the weight's name inside the attention module (``"q_proj.weight"``).
        role: one of :data:`ROLES`.
        blocks: the number of heads the part is cut into (1 for a part every head shares).
        rows: rows per block.
        offset: first row of the part (nonzero only when several parts share one fused weight).

    Raises:
        ValueError: unknown ``role``, a non-positive ``blocks`` or ``rows``, a negative ``offset``.
    """

    weight: str
    role: str
    blocks: int
    rows: int
    offset: int = 0

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Invalid role: expected one of {ROLES}, got {self.role!r}")
        _check_count("blocks", self.blocks)
        _check_count("rows", self.rows)
        _check_count("offset", self.offset, low=0)

    def slices(self) -> list[slice]:
        """The row range of each block: ``[slice(offset + b * rows, offset + (b + 1) * rows)]``."""
        start = self.offset
        return [slice(start + b * self.rows, start + (b + 1) * self.rows) for b in range(self.blocks)]


@dataclass(frozen=True)
class HeadLayout:
    """How the heads of one attention module are laid out (a frozen value; see the module docstring).

    Attributes:
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads, dividing ``H``; query head ``h`` reads key head
            ``h // (H // n_kv_heads)``. MLA: ``H`` (its content keys are per head).
        d_head: width of a query/key/value head (MLA: the content part).
        d_rope: width of MLA's rotary query/key parts, 0 without them.
        kv_rank: width of MLA's compressed key/value latent, 0 without one.
        qk_norm: each head's query and key are RMS-normalised after projection, so the logits do not
            scale with the query/key weights (QK-clip cannot act through them).
        parts: the row blocks of every projection weight whose rows are grouped by head.

    Build one with :meth:`multi_head` (MHA, GQA, MQA) or :meth:`latent` (MLA).

    Raises:
        ValueError: a count that is not a positive int, ``n_kv_heads`` not dividing ``n_heads``, a
            query/rotary-query part whose blocks are not ``n_heads``, a key/value part whose blocks are
            not ``n_kv_heads``, or parts of one weight that do not tile its rows from row 0 without gaps.
    """

    n_heads: int
    n_kv_heads: int
    d_head: int
    d_rope: int = 0
    kv_rank: int = 0
    qk_norm: bool = False
    parts: tuple[HeadRows, ...] = ()

    def __post_init__(self):
        _check_count("n_heads", self.n_heads)
        _check_count("n_kv_heads", self.n_kv_heads)
        _check_count("d_head", self.d_head)
        _check_count("d_rope", self.d_rope, low=0)
        _check_count("kv_rank", self.kv_rank, low=0)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Invalid n_kv_heads: {self.n_kv_heads} does not divide n_heads={self.n_heads}")
        want = {"query": self.n_heads, "rotary_query": self.n_heads, "key": self.n_kv_heads,
                "value": self.n_kv_heads}
        for part in self.parts:
            if part.role in want and part.blocks != want[part.role]:
                raise ValueError(f"Invalid parts: {part.weight} ({part.role}) has {part.blocks} blocks, "
                                 f"expected {want[part.role]}")
        for weight in self.weights():
            row = 0
            for part in self.parts_of(weight):
                if part.offset != row:
                    raise ValueError(f"Invalid parts: the parts of {weight} must tile its rows from row 0, "
                                     f"found a part at row {part.offset} where row {row} was expected")
                row += part.blocks * part.rows

    @classmethod
    def multi_head(cls, n_heads: int, n_kv_heads: int, d_head: int, qk_norm: bool = False) -> HeadLayout:
        """MHA (``n_kv_heads == n_heads``), GQA or MQA (``n_kv_heads == 1``) with separate Q, K, V
        projections ``q_proj``, ``k_proj``, ``v_proj`` whose rows are grouped by head."""
        return cls(n_heads, n_kv_heads, d_head, qk_norm=qk_norm, parts=(
            HeadRows("q_proj.weight", "query", n_heads, d_head),
            HeadRows("k_proj.weight", "key", n_kv_heads, d_head),
            HeadRows("v_proj.weight", "value", n_kv_heads, d_head)))

    @classmethod
    def latent(cls, n_heads: int, d_head: int, d_rope: int, kv_rank: int) -> HeadLayout:
        """MLA (DeepSeek-V2 §2.1): per-head content query ``q_c_proj`` and rotary query ``q_r_proj``
        from ``x``; latent ``kv_down`` (``kv_rank`` rows); per-head content key ``k_c_proj`` and value
        ``v_proj`` from the latent; one rotary key ``k_r_proj`` shared by every head."""
        return cls(n_heads, n_heads, d_head, d_rope=d_rope, kv_rank=kv_rank, parts=(
            HeadRows("q_c_proj.weight", "query", n_heads, d_head),
            HeadRows("q_r_proj.weight", "rotary_query", n_heads, d_rope),
            HeadRows("kv_down.weight", "latent", 1, kv_rank),
            HeadRows("k_c_proj.weight", "key", n_heads, d_head),
            HeadRows("v_proj.weight", "value", n_heads, d_head),
            HeadRows("k_r_proj.weight", "rotary_key", 1, d_rope)))

    @property
    def group(self) -> int:
        """Query heads per key/value head (``n_heads // n_kv_heads``; 1 for MHA and MLA)."""
        return self.n_heads // self.n_kv_heads

    def kv_head(self, h: int) -> int:
        """The key/value head query head ``h`` reads."""
        return h // self.group

    def weights(self) -> list[str]:
        """The names of the weights the layout describes, in order of first appearance."""
        return list(dict.fromkeys(part.weight for part in self.parts))

    def parts_of(self, weight: str) -> list[HeadRows]:
        """The parts of ``weight``, by first row."""
        return sorted((part for part in self.parts if part.weight == weight), key=lambda part: part.offset)

    def rows(self, weight: str) -> int:
        """The number of rows the parts of ``weight`` cover (the weight's ``shape[0]``)."""
        return sum(part.blocks * part.rows for part in self.parts_of(weight))

    def head_split(self, weight: str, per: str = "head") -> tuple[int, ...]:
        """Row counts for :class:`optbook.optim.Muon`'s ``head_split`` of ``weight``.

        ``per="head"``: one block per head of every part (a shared part is one block);
        ``per="qkv"``: one block per part (the Q, K, V blocks of a fused projection; a separate
        projection is then one block, the whole matrix).

        Raises:
            ValueError: ``weight`` not described here, or ``per`` not ``"head"`` or ``"qkv"``.
        """
        if per not in ("head", "qkv"):
            raise ValueError(f"Invalid per: expected 'head' or 'qkv', got {per!r}")
        parts = self.parts_of(weight)
        if not parts:
            raise ValueError(f"Invalid weight: {weight!r} is not one of {self.weights()}")
        if per == "qkv":
            return tuple(part.blocks * part.rows for part in parts)
        return tuple(part.rows for part in parts for _ in range(part.blocks))


def attention_modules(model) -> list:
    """The submodules of ``model`` (an ``nn.Module``) that describe their heads -- a :class:`HeadLayout`
    as ``head_layout`` -- in ``model.modules()`` order. Both per-head Muon routing and QK-clip find the
    attention layers with this function."""
    return [m for m in model.modules() if isinstance(getattr(m, "head_layout", None), HeadLayout)]
