"""Small models for the book's experiments (PyTorch layout: ``Linear.weight`` is ``(out, in)``)."""

from .heads import HeadLayout, HeadRows, attention_modules
from .mlp import MLP, LogisticRegression
from .transformer import CausalSelfAttention, MultiHeadLatentAttention, TinyTransformer

__all__ = ["CausalSelfAttention", "HeadLayout", "HeadRows", "LogisticRegression", "MLP",
           "MultiHeadLatentAttention", "TinyTransformer", "attention_modules"]
