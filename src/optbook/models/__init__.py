"""Small models for the book's experiments (PyTorch layout: ``Linear.weight`` is ``(out, in)``)."""

from .mlp import MLP, LogisticRegression

__all__ = ["LogisticRegression", "MLP"]
