"""Assertions for measured claims: bounds that hold across seeds, CPUs and GPUs. Explained in the Preface.

``torch.testing.assert_close`` checks a value against a reference; a number measured from a training run
or from bf16/fp16 arithmetic has no reference that holds on every machine, only a claim such as "Muon's
update has at least twice the effective rank of AdamW's". :func:`assert_claim` asserts such a claim
against a bound set by the sweep in ``sweeps/`` of the repository (the worst value seen over fresh seeds
and CPU kernel configurations, plus a margin), and records it instead when a sweep is running.
"""

from __future__ import annotations

import json
import math
import operator
import os

import torch

from .runtime import seed_offset

__all__ = ["assert_claim"]

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq}


def assert_claim(name: str, value, op: str, bound: float) -> float:
    """Assert a measured claim ``value <op> bound`` (``op`` one of ``<``, ``<=``, ``>``, ``>=``, ``==``).

    Use it for every claim about a number that comes from a training run or from low-precision
    arithmetic; the bound must come from the sweep in ``sweeps/`` (worst value seen, plus a margin).
    Outside a sweep a failed claim raises ``AssertionError`` naming the claim, the value and the bound.
    Inside a sweep (``OPTBOOK_CLAIMS_LOG`` set) the claim is appended to that file as one JSON line and
    nothing is raised.

    Args:
        name: a short, stable description; it keys the sweep table, so keep it unique per notebook.
        value: a real number (Python number, NumPy scalar or one-element tensor); ``bool`` counts as 0/1.
        op: the comparison.
        bound: the threshold (a finite real number).

    Returns:
        ``value`` as a Python float.

    Raises:
        ValueError: ``op`` is unknown, or ``value``/``bound`` is not a real number, or ``bound`` is not finite.
        AssertionError: the claim fails (outside a sweep); a NaN value always fails.
    """
    if op not in _OPS:
        raise ValueError(f"Invalid op: expected one of {sorted(_OPS)}, got {op!r}")
    try:
        x = float(value.item() if isinstance(value, torch.Tensor) else value)
        b = float(bound)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"Invalid claim {name!r}: value and bound must be real numbers, got {value!r}, {bound!r}") from None
    if not math.isfinite(b):
        raise ValueError(f"Invalid bound for claim {name!r}: expected a finite number, got {bound!r}")
    holds = bool(_OPS[op](x, b))          # NaN compares False: a NaN value never holds
    log = os.environ.get("OPTBOOK_CLAIMS_LOG")
    if log:
        record = {"notebook": os.environ.get("OPTBOOK_NOTEBOOK", ""), "kernels": os.environ.get("OPTBOOK_KERNELS", ""),
                  "seed_offset": seed_offset(), "claim": name, "value": x, "op": op, "bound": b, "holds": holds}
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        return x
    assert holds, f"claim failed: {name}: {x!r} {op} {b!r} does not hold"
    return x


