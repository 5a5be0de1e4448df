"""AdaMuon against the authors' code (Chongjie-Si/AdaMuon), from a checkout of a pinned commit.

Chongjie-Si/AdaMuon is not on PyPI, so this runs against a git checkout named by ``--checkout`` (or the
environment variable ``OPTBOOK_ADAMUON_CHECKOUT``) and writes what it measured to
``tools/conformance_adamuon.json``; ``tests/test_conformance.py`` checks that record, and reruns this
comparison where a checkout is given (it is skipped in CI, which has none)::

    git clone https://github.com/Chongjie-Si/AdaMuon /tmp/adamuon && git -C /tmp/adamuon checkout 369f0b3bd9d9
    .venv/bin/python tools/conformance_adamuon.py --checkout /tmp/adamuon          # print the comparison
    .venv/bin/python tools/conformance_adamuon.py --checkout /tmp/adamuon --write  # and record it

What is compared. The class ``AdaMuon`` of ``gpt2/models/optimizers/adamuon.py`` at commit ``PINNED`` (the
current AdaMuon, arXiv:2507.11005 v2) against ``optbook.optim.AdaMuon`` (default ``version="2025-08"``,
``beta2=0.95``: the reference's second moment decays with its ``momentum``), both with ``lr=0.02,
momentum=0.95, nesterov=True, weight_decay=0.01, eps=1e-8``, on the same float64 matrices of shapes
``SHAPES`` and the same Gaussian gradients for ``STEPS`` steps; ours runs its Newton–Schulz in float64.
The reference is written for CUDA and ``torch.distributed``; the harness only lets it run on one CPU
process: the name ``torch`` in its module is a stand-in whose ``empty`` ignores ``device="cuda"``, and the
name ``dist`` one whose ``all_gather_into_tensor`` copies the tensor into the buffer (what the collective
does with ``world_size=1``). Its arithmetic is untouched.

The reference runs its Newton–Schulz in bfloat16 (``X = G.bfloat16()``), and so also its second moment
``v`` (``torch.zeros_like`` of that output), the division and the rescale, and gathers the update in a
bfloat16 buffer before applying it to the float64 weights: the "as given" case records that difference.
Two more cases remove it, with the gather buffer in float64:

- "reference_ns_float64": its own Newton–Schulz run in float64 (its input's ``bfloat16()`` returns float64).
  What is left is the normalisation before the iteration: ``X / (||X||_F + 1e-7)`` there, ``X / ||X||_F``
  here (after an exact power-of-two rescale), a relative difference of about ``1e-7 / ||X||_F``.
- "same_newton_schulz": its Newton–Schulz function replaced, during the step, by ours in float64
  (``optbook.optim.normuon.orthogonalize``); the sign, the momentum, the second moment, the rescale, the decay
  and the step are then compared, and must agree to float64 rounding.

The first version (``version="2025-07"``, arXiv v1) is compared the same way against ``adamuon.py`` of the
authors' first commit ``FIRST`` (read from the same clone with ``git show``), with ``beta2=0.999`` (its
default).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import types
import warnings

import torch

PINNED = "369f0b3bd9d97f82bb8ba81664207ac513e233b0"
FIRST = "3b84e03186b7c58a5e4bf70175896bea7f4c5d4f"
FILES = {PINNED: "gpt2/models/optimizers/adamuon.py", FIRST: "adamuon.py"}
RECORD = pathlib.Path(__file__).with_name("conformance_adamuon.json")
SHAPES = [(6, 10), (10, 6), (8, 8)]
STEPS = 50
SETTINGS = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, eps=1e-8)
F64 = torch.float64


def _git(checkout, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True)


def load_reference(checkout: str | os.PathLike, commit: str) -> types.ModuleType:
    """The reference optimizer file at ``commit`` as a module (read with ``git show``, so one clone serves
    both versions); refuses a checkout whose ``HEAD`` is not ``PINNED``."""
    head = _git(checkout, "rev-parse", "HEAD")
    if head.returncode != 0 or head.stdout.strip() != PINNED:
        raise SystemExit(f"{checkout} is not a git checkout of Chongjie-Si/AdaMuon at {PINNED} "
                         f"(found {head.stdout.strip() or head.stderr.strip()})")
    source = _git(checkout, "show", f"{commit}:{FILES[commit]}")
    if source.returncode != 0:
        raise SystemExit(f"{FILES[commit]} at {commit} not found in {checkout}: {source.stderr.strip()}")
    mod = types.ModuleType(f"_adamuon_reference_{commit[:7]}")
    exec(compile(source.stdout, f"{commit[:7]}:{FILES[commit]}", "exec"), mod.__dict__)
    return mod


class _TorchOnCPU:
    """``torch`` for the reference module: ``empty`` ignores ``device`` and makes a ``buffer_dtype`` tensor
    where a bfloat16 one is asked for (the gather buffer); everything else is torch."""

    def __init__(self, buffer_dtype):
        self.buffer_dtype = buffer_dtype

    def empty(self, *size, dtype=None, device=None):
        return torch.empty(*size, dtype=self.buffer_dtype if dtype is torch.bfloat16 else dtype)

    def __getattr__(self, name):
        return getattr(torch, name)


class _Handle:
    def wait(self):
        return None


class _OneProcess:
    """``torch.distributed`` for one process: the all-gather copies the tensor into the one-row buffer."""

    @staticmethod
    def all_gather_into_tensor(output, tensor, async_op=False):
        output.view(-1).copy_(tensor.view(-1))
        return _Handle() if async_op else None


class _Bfloat16IsFloat64(torch.Tensor):
    """A tensor whose ``bfloat16()`` returns plain float64: the reference's Newton–Schulz then runs in float64."""

    def bfloat16(self):
        return self.as_subclass(torch.Tensor).to(F64)


def _ours_ns(G, steps):
    from optbook.optim.normuon import orthogonalize

    return orthogonalize(G, ns_steps=steps, coefficients="simple", ns_dtype=F64)


def _grads(t: int):
    g = torch.Generator().manual_seed(4057 + t)
    return [torch.randn(s, generator=g, dtype=F64) for s in SHAPES]


def compare(ref: types.ModuleType, case: str, version: str) -> dict:
    """Largest difference between the weights over ``STEPS`` steps and the first step above 1e-12."""
    from optbook.optim import AdaMuon

    saved = {name: getattr(ref, name) for name in ("torch", "dist", "zeropower_via_newtonschulz5")}
    ref.torch = _TorchOnCPU(torch.bfloat16 if case == "as_given" else F64)
    ref.dist = _OneProcess()
    original_ns = saved["zeropower_via_newtonschulz5"]
    if case == "reference_ns_float64":
        ref.zeropower_via_newtonschulz5 = lambda G, steps: original_ns(G.as_subclass(_Bfloat16IsFloat64), steps)
    elif case == "same_newton_schulz":
        ref.zeropower_via_newtonschulz5 = _ours_ns
    beta2 = SETTINGS["momentum"] if version == "2025-08" else 0.999
    try:
        g = torch.Generator().manual_seed(1)
        start = [torch.randn(s, generator=g, dtype=F64) for s in SHAPES]
        ours = [p.clone().requires_grad_() for p in start]
        theirs = [p.clone().requires_grad_() for p in start]
        a = AdaMuon(ours, **SETTINGS, beta2=beta2, ns_dtype=F64, version=version)
        extra = {} if version == "2025-08" else {"beta2": beta2}
        b = ref.AdaMuon(theirs, **SETTINGS, **extra, rank=0, world_size=1)
        worst, first = 0.0, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # the reference's deprecated addcmul_(value, t1, t2)
            for t in range(STEPS):
                for p, q, gr in zip(ours, theirs, _grads(t)):
                    p.grad, q.grad = gr.clone(), gr.clone()   # the reference overwrites its grad (lerp_)
                a.step()
                b.step()
                diff = max(float((p - q).detach().abs().max()) for p, q in zip(ours, theirs))
                worst = max(worst, diff)
                if first is None and not diff <= 1e-12:
                    first = t + 1
        return {"max_difference": worst, "first_step_above_1e-12": first}
    finally:
        for name, value in saved.items():
            setattr(ref, name, value)


CASES = ("as_given", "reference_ns_float64", "same_newton_schulz")


def run(checkout) -> dict:
    out = {"commit": PINNED, "file": FILES[PINNED], "torch": torch.__version__, "steps": STEPS,
           "shapes": [list(s) for s in SHAPES], "settings": SETTINGS, "versions": {}}
    for version, commit in (("2025-08", PINNED), ("2025-07", FIRST)):
        ref = load_reference(checkout, commit)
        out["versions"][version] = {"commit": commit, "file": FILES[commit],
                                    "beta2": SETTINGS["momentum"] if version == "2025-08" else 0.999,
                                    **{case: compare(ref, case, version) for case in CASES}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", default=os.environ.get("OPTBOOK_ADAMUON_CHECKOUT"))
    ap.add_argument("--write", action="store_true", help=f"record the result in {RECORD.name}")
    args = ap.parse_args(argv)
    if not args.checkout:
        ap.error("give --checkout or OPTBOOK_ADAMUON_CHECKOUT: a checkout of Chongjie-Si/AdaMuon at " + PINNED)
    text = json.dumps(run(args.checkout), indent=1, sort_keys=True) + "\n"
    print(text, end="")
    if args.write:
        RECORD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
