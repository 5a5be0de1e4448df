"""Small models for the book's experiments (PyTorch layout: ``Linear.weight`` is ``(out, in)``)."""

from .mlp import MLP, LogisticRegression
from .transformer import CausalSelfAttention, MultiHeadLatentAttention, TinyTransformer

__all__ = ["CausalSelfAttention", "LogisticRegression", "MLP", "MultiHeadLatentAttention", "TinyTransformer"]
