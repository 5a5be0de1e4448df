"""Data the book uses: scikit-learn's bundled digits and generated toy problems.

Nothing here downloads anything: ``sklearn.datasets.load_digits`` ships with scikit-learn, and the
quadratics are generated from a seed. Explained in chapter 1 (quadratics) and chapter 2 (digits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sklearn.datasets import load_digits as _sk_load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

__all__ = ["Digits", "load_digits", "Quadratic", "ill_conditioned_quadratic"]


@dataclass(frozen=True)
class Digits:
    """A train/test split of the 8x8 digits: ``X_*`` float ``(n, 64)`` standardised with the
    training mean and standard deviation, ``y_*`` int64 ``(n,)`` class labels in 0..9."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_features(self) -> int:
        return self.X_train.shape[1]

    num_classes = 10


def load_digits(test_fraction: float = 0.25, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> Digits:
    """scikit-learn's 1,797 handwritten digits, split (stratified, deterministic) and standardised.

    Args:
        test_fraction: share of samples held out, in ``(0, 1)``.
        seed: seed of the split.
        dtype: floating dtype of the features.
        device: where the tensors live.

    Returns:
        :class:`Digits`; with the defaults, 1,347 training and 450 test samples.

    Raises:
        ValueError: ``test_fraction`` outside ``(0, 1)``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"Invalid test_fraction: expected a number in (0, 1), got {test_fraction!r}")
    X, y = _sk_load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=test_fraction, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(X_tr)
    as_x = lambda a: torch.as_tensor(scaler.transform(a), dtype=dtype, device=device)  # noqa: E731
    as_y = lambda a: torch.as_tensor(a, dtype=torch.int64, device=device)  # noqa: E731
    return Digits(as_x(X_tr), as_y(y_tr), as_x(X_te), as_y(y_te))


@dataclass(frozen=True)
class Quadratic:
    """``f(x) = 1/2 (x - x_star)^T A (x - x_star)`` with ``A`` symmetric positive definite ``(d, d)``.

    ``eigenvalues`` (ascending, ``(d,)``) run from ``mu`` (smallest curvature) to ``L`` (largest).
    """

    A: torch.Tensor
    x_star: torch.Tensor
    eigenvalues: torch.Tensor

    @property
    def L(self) -> float:
        return float(self.eigenvalues[-1])

    @property
    def mu(self) -> float:
        return float(self.eigenvalues[0])

    @property
    def condition_number(self) -> float:
        return self.L / self.mu

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """``f(x)`` for ``x`` of shape ``(d,)``; differentiable."""
        d = x - self.x_star
        return 0.5 * d @ (self.A @ d)

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        """``A (x - x_star)``, shape ``(d,)``."""
        return self.A @ (x - self.x_star)


def ill_conditioned_quadratic(dim: int = 2, condition_number: float = 100.0, *, rotate: bool = True,
                              seed: int = 0, dtype: torch.dtype = torch.float64) -> Quadratic:
    """A quadratic with eigenvalues spaced geometrically from ``1/condition_number`` to ``1``.

    Args:
        dim: dimension ``d >= 1``.
        condition_number: ``L / mu >= 1``.
        rotate: rotate the eigenbasis by a random orthogonal matrix (otherwise ``A`` is diagonal).
        seed: seed for the rotation and for ``x_star`` (drawn from a standard normal).
        dtype: floating dtype of ``A`` and ``x_star``.

    Raises:
        ValueError: ``dim < 1`` or ``condition_number < 1``.
    """
    if dim < 1:
        raise ValueError(f"Invalid dim: expected >= 1, got {dim!r}")
    if not condition_number >= 1.0:
        raise ValueError(f"Invalid condition_number: expected >= 1, got {condition_number!r}")
    g = torch.Generator().manual_seed(seed)
    lam = torch.as_tensor(np.geomspace(1.0 / condition_number, 1.0, dim), dtype=dtype)
    Q = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))[0].to(dtype) \
        if rotate else torch.eye(dim, dtype=dtype)
    A = Q @ torch.diag(lam) @ Q.T
    A = 0.5 * (A + A.T)
    x_star = torch.randn(dim, generator=g, dtype=torch.float64).to(dtype)
    return Quadratic(A, x_star, lam)
