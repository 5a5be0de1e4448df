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

from ._checks import check_int

__all__ = ["Digits", "load_digits", "Quadratic", "ill_conditioned_quadratic", "IGNORE_INDEX", "copy_task",
           "associative_recall", "markov_chain", "sample_markov", "markov_entropy"]


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


# --- generated sequence tasks (chapters 7-9) -------------------------------------------------------

IGNORE_INDEX = -100  #: target value ``F.cross_entropy`` ignores (its default ``ignore_index``)


def copy_task(batch_size: int, seq_len: int, vocab_size: int, *, generator: torch.Generator | None = None,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copying: a random first half, then the same tokens again; only the second half is scored.

    Returns ``(inputs, targets)``, both int64 ``(batch_size, seq_len)``: next-token targets, with
    :data:`IGNORE_INDEX` where nothing can be predicted (the first half). A model that has learned to
    copy reaches zero loss; one that has not sits at ``log(vocab_size)``.

    Raises:
        TypeError: an argument is not an int (named).
        ValueError: ``seq_len`` odd or < 4, ``vocab_size < 2``, ``batch_size < 1`` (named).
    """
    check_int("batch_size", batch_size, 1)
    check_int("vocab_size", vocab_size, 2)
    if check_int("seq_len", seq_len, 4) % 2:
        raise ValueError(f"Invalid seq_len: expected an even number >= 4, got {seq_len!r}")
    half = seq_len // 2
    first = torch.randint(0, vocab_size, (batch_size, half), generator=generator)
    seq = torch.cat([first, first], dim=1)
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[:, : half - 1] = IGNORE_INDEX
    inputs = torch.cat([inputs, torch.zeros(batch_size, 1, dtype=torch.int64)], dim=1)
    targets = torch.cat([targets, torch.full((batch_size, 1), IGNORE_INDEX)], dim=1)
    return inputs.to(device), targets.to(device)


def associative_recall(batch_size: int, n_pairs: int, vocab_size: int, *, generator: torch.Generator | None = None,
                       device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Associative recall: ``k1 v1 k2 v2 ... kN vN q`` and the model must answer the value of key ``q``.

    Keys are distinct tokens from the first half of the vocabulary, values from the second half.
    Returns ``(inputs, targets)`` int64 ``(batch_size, 2 * n_pairs + 1)``; only the last position is
    scored (its target is the queried value), every other target is :data:`IGNORE_INDEX`.

    Raises:
        TypeError: an argument is not an int (named).
        ValueError: ``batch_size < 1``, ``vocab_size < 4`` or fewer than ``n_pairs`` distinct keys available.
    """
    check_int("batch_size", batch_size, 1)
    check_int("n_pairs", n_pairs, 1)
    half = check_int("vocab_size", vocab_size, 4) // 2
    if n_pairs > half:
        raise ValueError(f"Invalid n_pairs/vocab_size: need 1 <= n_pairs <= vocab_size // 2, got {n_pairs!r}, "
                         f"{vocab_size!r}")
    keys = torch.rand(batch_size, half, generator=generator).argsort(dim=1)[:, :n_pairs]
    values = half + torch.randint(0, vocab_size - half, (batch_size, n_pairs), generator=generator)
    pick = torch.randint(0, n_pairs, (batch_size, 1), generator=generator)
    seq = torch.stack([keys, values], dim=2).reshape(batch_size, 2 * n_pairs)
    inputs = torch.cat([seq, keys.gather(1, pick)], dim=1)
    targets = torch.full_like(inputs, IGNORE_INDEX)
    targets[:, -1] = values.gather(1, pick).squeeze(1)
    return inputs.to(device), targets.to(device)


def markov_chain(vocab_size: int, *, concentration: float = 0.1, seed: int = 0) -> torch.Tensor:
    """A random bigram "language": a row-stochastic ``(vocab_size, vocab_size)`` float64 transition matrix
    drawn from a symmetric Dirichlet(``concentration``) per row (small values: peaky, low entropy)."""
    gamma = torch.distributions.Gamma(torch.full((vocab_size,), float(concentration), dtype=torch.float64), 1.0)
    with torch.random.fork_rng():  # torch.distributions samples from the global generator
        torch.manual_seed(seed)
        P = gamma.sample((vocab_size,)) + 1e-12
    return P / P.sum(dim=1, keepdim=True)


def sample_markov(P: torch.Tensor, batch_size: int, seq_len: int, *, generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences from the chain ``P`` (uniform start); returns ``(inputs, targets)`` int64
    ``(batch_size, seq_len)`` with next-token targets (every position scored). The best possible
    loss is the chain's entropy rate, :func:`markov_entropy`."""
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, P.shape[0], (batch_size,), generator=generator)
    for t in range(seq_len):
        tokens[:, t + 1] = torch.multinomial(P[tokens[:, t]], 1, generator=generator).squeeze(1)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def markov_entropy(P: torch.Tensor) -> float:
    """Entropy rate (nats per token) of the chain ``P`` under its stationary distribution."""
    evals, evecs = torch.linalg.eig(P.T)
    pi = evecs[:, torch.argmin((evals - 1).abs())].real
    pi = pi / pi.sum()
    return float(-(pi[:, None] * P * P.clamp_min(1e-300).log()).sum())
