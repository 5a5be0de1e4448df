"""Dion against microsoft/dion's reference implementation, run from a checkout of a pinned commit.

microsoft/dion is not on PyPI, so this conformance row runs against a git checkout named by an environment
variable, and its result is recorded in ``tools/conformance_dion.json`` (``tests/test_conformance.py`` runs it
when the checkout is given, and otherwise checks only the recorded file; CI has no checkout)::

    git clone https://github.com/microsoft/dion && git -C dion checkout <PINNED>
    OPTBOOK_DION_CHECKOUT=$PWD/dion python tools/conformance_dion.py          # print the comparison
    OPTBOOK_DION_CHECKOUT=$PWD/dion python tools/conformance_dion.py --write  # and record it

What is compared. ``dion_update`` of ``dion/dion_simple.py`` at commit ``PINNED`` (Algorithm 1 of Ahn et al.
2025, arXiv:2504.05295, single device: ``M += G``, ``P = QR(M Q)``, ``R = M^T P``, ``M -= (1 - mu) P R^T``,
``Q = R / (||R_col|| + eps)``, ``X = X (1 - lr wd) - lr sqrt(fan_out / fan_in) P Q^T``), called directly
(not through its ``torch.compile`` wrapper) on the same float64 matrices as ``optbook.optim.Dion``: the same
start ``Q`` (set into both states), the same Gaussian gradients, 50 steps, at full rank and at rank 2, and
once more at full rank in float32 (both sides then work in float32; the difference is float32 rounding in
different operation orders).

The reference runs its QR and its column normalisation in float32 whatever the parameter dtype
(``P32, _ = torch.linalg.qr(P.to(torch.float32))``, ``R32 = R.to(torch.float32)``), so the two agree to the
float32 rounding of those two steps, not to float64's. The second run removes that one difference: the name
``torch`` inside the reference module is replaced by a stand-in whose ``float32`` is ``torch.float64`` (all
else is torch), and the two then agree to float64 rounding.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import torch

PINNED = "0a059a4542e5aa74b40dcd1dce363836c7afcd48"
RECORD = pathlib.Path(__file__).with_name("conformance_dion.json")
SHAPES = [(6, 4), (3, 5)]
STEPS = 50
SETTINGS = dict(lr=0.01, momentum=0.95, weight_decay=0.1, eps=1e-8)
F64 = torch.float64


def load_reference(checkout: str | os.PathLike):
    """``dion/dion_simple.py`` of the checkout as a module, without running the package's ``__init__`` (which
    imports every optimizer of the repository); refuses a checkout that is not at ``PINNED``."""
    root = pathlib.Path(checkout)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0 or head.stdout.strip() != PINNED:
        raise SystemExit(f"{root} is not a git checkout of microsoft/dion at {PINNED} "
                         f"(found {head.stdout.strip() or head.stderr.strip()})")
    pkg = types.ModuleType("_dion_reference_pkg")
    pkg.__path__ = [str(root / "dion")]
    sys.modules["_dion_reference_pkg"] = pkg
    return importlib.import_module("_dion_reference_pkg.dion_simple")


class _Float32IsFloat64:
    """``torch`` for the reference module with ``float32`` meaning float64 (everything else is torch)."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _grads(t: int):
    g = torch.Generator().manual_seed(7919 + t)
    return [torch.randn(s, generator=g, dtype=F64) for s in SHAPES]


def compare(ref, rank: int | None, float64_reference: bool = False, dtype=F64) -> tuple[float, int | None]:
    """Largest difference between the weights over ``STEPS`` steps, and the first step above 1e-12 (the
    float64 draws are rounded to ``dtype`` for a float32 run)."""
    from optbook.optim import Dion

    update = getattr(ref.dion_update, "_torchdynamo_orig_callable", ref.dion_update)
    saved = ref.torch
    if float64_reference:
        ref.torch = _Float32IsFloat64()
    try:
        g = torch.Generator().manual_seed(1)
        start = [torch.randn(s, generator=g, dtype=F64) for s in SHAPES]
        ranks = [min(s) if rank is None else min(rank, *s) for s in SHAPES]
        q0 = [torch.randn((s[1], r), generator=g, dtype=F64) for s, r in zip(SHAPES, ranks)]
        start = [p.to(dtype) for p in start]
        q0 = [q.to(dtype) for q in q0]
        ours = [p.clone().requires_grad_() for p in start]
        opt = Dion(ours, rank_fraction=1.0, **SETTINGS)
        for p, q in zip(ours, q0):
            opt.state[p].update(momentum_buffer=torch.zeros_like(p), right_factor=q.clone())
        theirs = [dict(X=p.clone(), M=torch.zeros_like(p), Q=q.clone()) for p, q in zip(start, q0)]
        worst, first = 0.0, None
        for t in range(STEPS):
            grads = [gr.to(dtype) for gr in _grads(t)]
            for p, gr in zip(ours, grads):
                p.grad = gr.clone()
            opt.step()
            with torch.no_grad():
                for s, gr in zip(theirs, grads):
                    update(s["X"], gr.clone(), s["M"], s["Q"], SETTINGS["lr"], SETTINGS["momentum"],
                           SETTINGS["weight_decay"], SETTINGS["eps"])
            diff = max(float((p.detach() - s["X"]).abs().max()) for p, s in zip(ours, theirs))
            worst = max(worst, diff)
            if first is None and not diff <= 1e-12:
                first = t + 1
        return worst, first
    finally:
        ref.torch = saved


def run(checkout) -> dict:
    ref = load_reference(checkout)
    out = {"commit": PINNED, "file": "dion/dion_simple.py", "torch": torch.__version__, "steps": STEPS,
           "shapes": [list(s) for s in SHAPES], "settings": SETTINGS, "rows": {}}
    for label, rank in (("full rank", None), ("rank 2", 2)):
        worst, first = compare(ref, rank)
        worst64, first64 = compare(ref, rank, float64_reference=True)
        out["rows"][label] = {"as_is": {"max_difference": worst, "first_step_above_1e-12": first},
                              "reference_qr_in_float64": {"max_difference": worst64,
                                                          "first_step_above_1e-12": first64}}
    worst32, first32 = compare(ref, None, dtype=torch.float32)
    out["rows"]["full rank, float32"] = {"as_is": {"max_difference": worst32, "first_step_above_1e-12": first32}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"record the result in {RECORD.name}")
    args = ap.parse_args(argv)
    checkout = os.environ.get("OPTBOOK_DION_CHECKOUT")
    if not checkout:
        raise SystemExit("set OPTBOOK_DION_CHECKOUT to a checkout of microsoft/dion at " + PINNED)
    result = run(checkout)
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    print(text, end="")
    if args.write:
        RECORD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
