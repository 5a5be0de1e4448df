"""Dion2 against microsoft/dion's reference implementation, from a checkout of a pinned commit.

microsoft/dion is not on PyPI, so this runs against a checkout named by ``--checkout`` (or the environment
variable ``OPTBOOK_DION_CHECKOUT``) and writes what it measured to ``tools/conformance_dion2.json``; the
test ``tests/test_dion2.py`` reads that record, and reruns this comparison where a checkout is given (it is
skipped in CI, which has none)::

    git clone https://github.com/microsoft/dion /tmp/dion && git -C /tmp/dion checkout 0a059a4542e5
    .venv/bin/python tools/conformance_dion2.py --checkout /tmp/dion

Both optimizers step the same float64 matrices for 5 steps. The reference casts the selected submatrix to
bfloat16 before Newton–Schulz (``dion2_pre_orthogonalize``), so the gradients are small integers and
``ef_decay=0.5``: every momentum value is then a bfloat16 number and the cast loses nothing. Its
Newton–Schulz is replaced by the exact polar factor (an SVD in float64) through its ``newton_schulz_func``
argument, ours by 60 cubic steps in float64; what is left to compare is the selection, the error feedback,
the scale and the decay. The reference holds ``lr``, ``weight_decay`` and the scaled ``lr`` as float32
tensors (``torch.tensor(group["lr"])``), so with ``lr=0.05, weight_decay=0.1`` and shapes whose
``sqrt(fan_out / fan_in)`` is irrational its factors ``1 - lr * weight_decay`` and ``lr * scale`` are
rounded to float32 (relative error up to 6e-8): the "as given" cases. The "exact scalars" cases remove that
difference -- ``lr = 2**-4``, ``weight_decay = 2**-3`` and shapes with a rational square root of
``fan_out / fan_in`` that float32 holds exactly -- and must agree to float64 rounding. A tie between the last
selected and the first unselected slice is avoided (the reference's ``topk(sorted=False)`` leaves ties to the
kernel, ours takes the lower index) by drawing that step's gradient again.
"""

from __future__ import annotations

import argparse
import os
import json
import pathlib
import subprocess
import sys

import torch

PINNED = "0a059a4542e5aa74b40dcd1dce363836c7afcd48"
RECORD = pathlib.Path(__file__).with_name("conformance_dion2.json")
AS_GIVEN = dict(lr=0.05, weight_decay=0.1, cases=[((6, 10), 0.25), ((6, 10), 0.5), ((10, 6), 0.5), ((12, 20), 0.1)])
EXACT = dict(lr=2.0**-4, weight_decay=2.0**-3, cases=[((4, 16), 0.25), ((16, 4), 0.5), ((9, 16), 0.5),
                                                     ((8, 8), 1.0), ((25, 16), 0.1)])


def _polar64(X, epsilon=None):
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U @ Vh


def _gradient(opt, param, fraction, generator):
    """An integer gradient for which the k-th and (k+1)-th largest slice norms of ``M + G`` differ (read from
    our optimizer's momentum, which equals the reference's while the two agree): a tie there is the one place
    where the two selections could differ."""
    from optbook.optim.dion2 import dion2_selection

    select_dim, k = dion2_selection(param.shape, fraction)
    state = opt.state[param]
    M = state["momentum_buffer"] if state else torch.zeros_like(param)
    while True:
        G = torch.randint(-4, 5, tuple(param.shape), generator=generator).double()
        norms = (M + G).abs().sum(dim=-1 if select_dim == -2 else -2).sort(descending=True).values
        if k == norms.numel() or norms[k - 1] != norms[k]:
            return G


def _run(Reference, setting: dict, steps: int) -> list[dict]:
    from optbook.optim import Dion2

    rows = []
    for k, (shape, fraction) in enumerate(setting["cases"]):
        W0 = torch.randn(shape, generator=torch.Generator().manual_seed(100 + k), dtype=torch.float64)
        ours, ref = W0.clone().requires_grad_(), W0.clone().requires_grad_()
        kw = dict(lr=setting["lr"], fraction=fraction, ef_decay=0.5, weight_decay=setting["weight_decay"])
        a = Dion2([ours], **kw, ns_dtype=torch.float64, coefficients="cubic", ns_steps=60)
        b = Reference([ref], **kw, adjust_lr="spectral_norm", newton_schulz_func=_polar64)
        generator = torch.Generator().manual_seed(200 + k)
        for _ in range(steps):
            G = _gradient(a, ours, fraction, generator)
            ours.grad, ref.grad = G.clone(), G.clone()
            a.step()
            b.step()
        rows.append({"shape": list(shape), "fraction": fraction, "max_abs_diff": float((ours - ref).detach().abs().max())})
    return rows


def compare(checkout: str, steps: int = 5) -> dict:
    """Both settings; returns the record (``max_abs_diff`` per case and the worst of each setting)."""
    sys.path.insert(0, checkout)
    # the reference wraps its pre- and post-steps in torch.compile(fullgraph=True): imported with torch.compile
    # as the identity, they run eagerly -- the same arithmetic on a CPU, without a compile per shape, and
    # nothing else of the process is touched
    real_compile = torch.compile
    torch.compile = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    try:
        from dion.dion2 import Dion2 as Reference
    finally:
        torch.compile = real_compile

    result = {"reference": "microsoft/dion dion/dion2.py", "torch": torch.__version__, "steps": steps,
              "commit": subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True,
                                       text=True).stdout.strip() or None}
    for name, setting in (("as_given", AS_GIVEN), ("exact_scalars", EXACT)):
        rows = _run(Reference, setting, steps)
        result[name] = {"lr": setting["lr"], "weight_decay": setting["weight_decay"], "cases": rows,
                        "max_abs_diff": max(r["max_abs_diff"] for r in rows)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", default=os.environ.get("OPTBOOK_DION_CHECKOUT"))
    parser.add_argument("--write", action="store_true", help=f"write the result to {RECORD.name}")
    args = parser.parse_args()
    if not args.checkout:
        parser.error("give --checkout or OPTBOOK_DION_CHECKOUT: a checkout of microsoft/dion at " + PINNED[:12])
    result = compare(args.checkout)
    print(json.dumps(result, indent=1))
    if args.write:
        RECORD.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
