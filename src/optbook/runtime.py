"""Seeds, threads and device choice for reproducible notebooks. Explained in the Preface.

CPU results can differ in the last bits across instruction sets (AVX2 vs AVX-512) and thread
counts; fixing the seed and the thread count makes a run repeatable on one machine, and the book only
prints summaries that hold across machines.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_everything", "default_device"]


def seed_everything(seed: int = 0, *, num_threads: int | None = 2) -> torch.Generator:
    """Seed Python, NumPy and PyTorch (CPU and CUDA) and fix PyTorch's CPU thread count.

    Args:
        seed: non-negative integer.
        num_threads: intra-op CPU threads (``None`` leaves PyTorch's choice).

    Returns:
        A ``torch.Generator`` seeded with ``seed``, for code that takes an explicit generator.

    Raises:
        ValueError: ``seed`` is negative or ``num_threads < 1``.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"Invalid seed: expected a non-negative int, got {seed!r}")
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"Invalid num_threads: expected >= 1 or None, got {num_threads!r}")
        torch.set_num_threads(num_threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
