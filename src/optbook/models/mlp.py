"""Logistic regression and a small MLP. Used from chapter 2 on (digits)."""

from __future__ import annotations

from torch import nn

__all__ = ["LogisticRegression", "MLP"]


class LogisticRegression(nn.Sequential):
    """Multinomial logistic regression: one ``nn.Linear(in_features, num_classes)``.

    Input ``(batch, in_features)`` float, output logits ``(batch, num_classes)``.
    """

    def __init__(self, in_features: int, num_classes: int):
        super().__init__(nn.Linear(in_features, num_classes))


class MLP(nn.Sequential):
    """``depth`` hidden blocks ``Linear -> [LayerNorm] -> GELU``, then a linear classifier.

    Args:
        in_features, hidden, num_classes: layer widths.
        depth: number of hidden blocks, ``>= 1``.
        norm: insert a ``LayerNorm(hidden)`` after each hidden ``Linear``.

    Input ``(batch, in_features)``, output logits ``(batch, num_classes)``.

    Raises:
        ValueError: ``depth < 1``.
    """

    def __init__(self, in_features: int, hidden: int, num_classes: int, depth: int = 2, norm: bool = False):
        if depth < 1:
            raise ValueError(f"Invalid depth: expected >= 1, got {depth!r}")
        layers, width = [], in_features
        for _ in range(depth):
            layers.append(nn.Linear(width, hidden))
            if norm:
                layers.append(nn.LayerNorm(hidden))
            layers.append(nn.GELU())
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
