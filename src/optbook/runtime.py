"""Seeds, threads, device choice and asserted claims for reproducible notebooks. Explained in the Preface.

A notebook's printed output is of two kinds. **Exact** results (float64 algebra, closed forms,
identities, configuration tables) are the same on every machine; nbval compares them. **Measured**
results (training trajectories, bf16/fp16 arithmetic) differ in their last bits between processors,
vector instruction sets, thread counts, PyTorch versions and GPUs, and those bits grow over a
trajectory. A measured number is shown in a cell that nbval does not compare (``# NBVAL_IGNORE_OUTPUT``)
and the claim made about it goes through :func:`optbook.testing.assert_claim`, whose bound was set by a sweep over seeds and
CPU kernel configurations (``sweeps/README.md`` in the repository lists every bound with the worst
value the sweep saw).

The sweep drives a notebook through three environment variables:

``OPTBOOK_SEED_OFFSET``
    an integer added to every seed that goes through :func:`seed_everything`, :func:`seeds` and
    :func:`generator`, so the same notebook runs on fresh seeds (default 0: the notebook's own seeds);
``OPTBOOK_CLAIMS_LOG``
    a file path: every :func:`~optbook.testing.assert_claim` appends one JSON line (notebook, claim, value, bound) to it and
    does not raise when the claim fails, so one run records every claim;
``OPTBOOK_NOTEBOOK``, ``OPTBOOK_KERNELS``
    labels written into those lines.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from ._checks import check_int

__all__ = ["seed_everything", "seed_offset", "seeds", "generator", "default_device", "glue"]


def seed_offset() -> int:
    """The sweep's seed offset, ``int(os.environ["OPTBOOK_SEED_OFFSET"])``, or 0 when unset.

    Raises:
        ValueError: the variable is set but is not a non-negative integer.
    """
    raw = os.environ.get("OPTBOOK_SEED_OFFSET", "0").strip() or "0"
    try:
        offset = int(raw)
    except ValueError:
        raise ValueError(f"Invalid OPTBOOK_SEED_OFFSET: expected a non-negative integer, got {raw!r}") from None
    if offset < 0:
        raise ValueError(f"Invalid OPTBOOK_SEED_OFFSET: expected a non-negative integer, got {raw!r}")
    return offset


def seeds(*base: int) -> tuple[int, ...]:
    """The notebook's seeds ``base``, each shifted by :func:`seed_offset` (unchanged outside a sweep).

    Raises:
        ValueError: a seed is not a non-negative int.
    """
    for s in base:
        check_int("seed", s, 0)
    offset = seed_offset()
    return tuple(s + offset for s in base)


def generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` shifted by :func:`seed_offset`."""
    return torch.Generator().manual_seed(seeds(seed)[0])


def seed_everything(seed: int = 0, *, num_threads: int | None = 2) -> torch.Generator:
    """Seed Python, NumPy and PyTorch (CPU and CUDA) and fix PyTorch's CPU thread count.

    The seed is shifted by :func:`seed_offset` (0 unless a sweep sets ``OPTBOOK_SEED_OFFSET``).

    Args:
        seed: non-negative integer.
        num_threads: intra-op CPU threads (``None`` leaves PyTorch's choice).

    Returns:
        A CPU ``torch.Generator`` seeded with the (shifted) seed, for code that takes an explicit generator.

    Raises:
        ValueError: ``seed`` is negative or ``num_threads < 1``.
    """
    check_int("seed", seed, 0)
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"Invalid num_threads: expected >= 1 or None, got {num_threads!r}")
        torch.set_num_threads(num_threads)
    (seed,) = seeds(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def glue(name: str, value, *, display: bool = False):
    """Make ``value`` available to the chapter's prose as ``{glue:text}`name:format```` (myst-nb).

    Numbers quoted in the text that come from a run are glued, so the page shows what was executed.
    Calls :func:`myst_nb.glue` when myst-nb is installed (as it is for the book build) and does nothing
    otherwise (for example on Colab, where the prose is static anyway). Glue from a cell marked
    ``# NBVAL_IGNORE_OUTPUT`` when the value comes from a trajectory.

    A NumPy scalar or a 0-d tensor is glued as the Python number it holds: NumPy 2 writes
    ``np.float64(1.5)`` as its text form, which ``{glue:text}`` cannot format.

    Returns:
        ``value`` unchanged.
    """
    try:
        from myst_nb import glue as _glue
    except ImportError:  # pragma: no cover - only without myst-nb
        return value
    plain = value.item() if hasattr(value, "item") and getattr(value, "ndim", None) == 0 else value
    _glue(name, plain, display=display)
    return value
