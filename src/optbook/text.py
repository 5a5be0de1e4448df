"""Real text for the capstone (chapter 19): a public-domain corpus, a character tokenizer, a fixed split.

The corpus ships with the package (``optbook/corpora/kjv_genesis_exodus.txt``, 366,194 bytes, ASCII,
SHA-256 :data:`CORPUS_SHA256`), so nothing is downloaded and every machine trains on the same bytes.
It is the books of Genesis and Exodus of the King James Version of the Bible (1611), one verse per
line with the verse references removed, as printed by ``bible -f`` from Debian's ``bible-kjv``
4.38 with the text of the package ``bible-kjv-text`` 4.38 (Chip Chapin's Bible Retrieval System).
Licence: the text is in the public domain (its Debian copyright file: "The copyright for the King
James Version text of the Bible is expired"; in the United Kingdom the Crown's letters patent still
govern printing). ``optbook/corpora/README.md`` says how the file was made.

The split is fixed: the first ``1 - val_fraction`` of the characters (cut at a line start) train, the
rest validate; for the default ``val_fraction=0.1`` the validation text is the last 10 % of Exodus.
The tokenizer maps each of the corpus's 62 distinct characters to an id (sorted by code point).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ._checks import check_int

__all__ = ["CORPUS_PATH", "CORPUS_SHA256", "CharTokenizer", "TextSplit", "load_text", "load_corpus",
           "sample_batch", "eval_batches"]

CORPUS_PATH = Path(__file__).with_name("corpora") / "kjv_genesis_exodus.txt"
CORPUS_SHA256 = "3faae4bdcd163d415b11d75992ab625db87570a8fc93632209a0cae3244b7f2a"


def load_text() -> str:
    """The corpus as a ``str`` (366,194 ASCII characters, 2,746 lines).

    Raises:
        RuntimeError: the file's SHA-256 is not :data:`CORPUS_SHA256` (a changed or truncated copy,
            which would silently change every number of chapter 19).
    """
    data = CORPUS_PATH.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise RuntimeError(f"Corpus {CORPUS_PATH.name} has SHA-256 {digest}, expected {CORPUS_SHA256}")
    return data.decode("ascii")


class CharTokenizer:
    """Characters <-> int64 ids: ``vocab`` is the sorted set of characters of ``text``.

    ``encode(s)`` returns an int64 tensor ``(len(s),)``; ``decode(ids)`` takes any integer tensor or
    sequence of ids and returns the ``str``.

    Raises:
        ValueError: ``text`` is empty; ``encode`` of a character outside the vocabulary; ``decode`` of
            an id outside ``[0, vocab_size)``.
    """

    def __init__(self, text: str):
        if not text:
            raise ValueError("Invalid text: expected a non-empty string")
        self.vocab = "".join(sorted(set(text)))
        self._ids = {ch: i for i, ch in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, s: str) -> torch.Tensor:
        try:
            return torch.tensor([self._ids[ch] for ch in s], dtype=torch.int64)
        except KeyError as e:
            raise ValueError(f"Invalid s: character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        ids = torch.as_tensor(ids).flatten().tolist()
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"Invalid ids: {bad[0]} is outside [0, {self.vocab_size})")
        return "".join(self.vocab[i] for i in ids)


@dataclass(frozen=True)
class TextSplit:
    """``train`` and ``val``: int64 token ids ``(n_train,)`` and ``(n_val,)``; ``tokenizer`` made them."""

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: CharTokenizer


def load_corpus(val_fraction: float = 0.1) -> TextSplit:
    """The corpus tokenized and split: training text first, validation text after it (no overlap).

    The cut is the first line start at or after ``(1 - val_fraction) * len(text)``. With the default,
    329,688 training and 36,506 validation characters.

    Raises:
        ValueError: ``val_fraction`` outside ``(0, 1)``.
        RuntimeError: see :func:`load_text`.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"Invalid val_fraction: expected a number in (0, 1), got {val_fraction!r}")
    text = load_text()
    cut = text.find("\n", int((1.0 - val_fraction) * len(text))) + 1
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    return TextSplit(ids[:cut], ids[cut:], tok)


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``tokens`` ``(n,)``: inputs ``x`` and next-token targets ``y``, both int64
    ``(batch_size, seq_len)``.

    The window starts are drawn uniformly from ``[0, n - seq_len - 1]`` with ``generator`` (a CPU generator).

    Raises:
        TypeError: ``batch_size`` or ``seq_len`` not an int.
        ValueError: ``batch_size`` or ``seq_len`` below 1, or ``seq_len + 1 > n``.
    """
    n = _tokens_for(tokens, seq_len, (("batch_size", batch_size), ("seq_len", seq_len)))
    return _windows(tokens, torch.randint(0, n - seq_len, (batch_size,), generator=generator), seq_len)


def eval_batches(tokens: torch.Tensor, seq_len: int, n_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_windows`` fixed, evenly spaced windows of ``tokens`` ``(n,)`` for a held-out loss that is
    the same on every call: ``x``, ``y`` int64 ``(n_windows, seq_len)``.

    Raises:
        TypeError: ``seq_len`` or ``n_windows`` not an int.
        ValueError: ``seq_len`` or ``n_windows`` below 1, or ``seq_len + 1 > n``.
    """
    n = _tokens_for(tokens, seq_len, (("seq_len", seq_len), ("n_windows", n_windows)))
    return _windows(tokens, torch.linspace(0, n - seq_len - 1, n_windows).long(), seq_len)


def _tokens_for(tokens: torch.Tensor, seq_len: int, counts: tuple) -> int:
    """Check ``counts`` (``(name, value)`` pairs, ``seq_len``'s among them: ints ``>= 1``, in this order), then
    ``seq_len + 1 <= n``; return ``n``, the number of tokens."""
    for name, value in counts:
        check_int(name, value, 1)
    n = tokens.numel()
    if seq_len + 1 > n:
        raise ValueError(f"Invalid seq_len: {seq_len} + 1 exceeds the {n} tokens")
    return n


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of ``seq_len + 1`` tokens at ``starts`` ``(k,)``, as inputs and next-token targets."""
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]
