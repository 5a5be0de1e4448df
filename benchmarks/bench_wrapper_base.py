#!/usr/bin/env python3
"""What the wrapper base (``optbook.wrapper.OptimizerWrapper``) costs, against the code before it, side by side.

The step contract became code in one base class with a template ``step()`` (``optbook/wrapper.py``): every
wrapper now runs the same phases (validate, prepare gradients, clip, step the inner optimizers, publish the
weights) and fills one report. The target: the base adds at most 5 % to a
``MixedPrecisionOptimizer(ChainedOptimizer([Muon, AdamW]))`` step over bfloat16 parameters (float32
masters), against the same step of the package as it was just before the base landed (``--before``, by
default the first parent of the merge that brought the base in).

How it is measured in one run: the older ``src/optbook`` is unpacked from git (``git archive``) into a
temporary folder; then the same timing program runs in a fresh Python process on each version in turn,
alternating old/new for ``--rounds`` rounds, so both see the same machine load. Each process builds the
same model-shaped parameter set (4 transformer blocks of width 256: the matrices to Muon, the rest to
AdamW), takes 3 warm-up steps and reports the median of ``--steps`` timed steps. The table gives each
version's median over rounds and the median of the per-round ratios new / old. A benchmark, not a test.

    .venv/bin/python benchmarks/bench_wrapper_base.py [--rounds 7] [--steps 15] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from recording import save

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "252dadc^1"  # main just before "Merge h4a-wrapper" (the wrapper base and its first wrappers)

CHILD = r"""
import json, statistics, sys, time
import torch
from optbook.optim import AdamW, ChainedOptimizer, Muon
from optbook.precision import MixedPrecisionOptimizer
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
width, layers = 256, 4
shapes = [(width, width)] * (4 * layers) + [(4 * width, width), (width, 4 * width)] * layers
vectors = [(width,)] * (4 * layers) + [(4096, width)]
mats = [torch.randn(s, dtype=torch.bfloat16) * 0.02 for s in shapes]
rest = [torch.randn(s, dtype=torch.bfloat16) * 0.02 for s in vectors]
for p in mats + rest:
    p.requires_grad_(True)
opt = MixedPrecisionOptimizer(ChainedOptimizer([Muon(mats, lr=0.02), AdamW(rest, lr=1e-3)]))
gen = torch.Generator().manual_seed(1)
grads = [torch.randn(p.shape, generator=gen, dtype=torch.float32).to(torch.bfloat16) * 1e-2 for p in mats + rest]
def one():
    for p, g in zip(mats + rest, grads):
        p.grad = g.clone()
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t
for _ in range(3):
    one()
times = [one() for _ in range(int(sys.argv[2]))]
print(json.dumps({"ms": 1e3 * statistics.median(times), "params": sum(p.numel() for p in mats + rest)}))
"""


def unpack(rev: str, dest: Path) -> None:
    """``src/optbook`` at ``rev`` into ``dest`` (``dest/optbook``)."""
    blob = subprocess.run(["git", "archive", rev, "src/optbook"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")


def time_once(src: Path, threads: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(steps)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--before", default=BEFORE, help="the revision of the code before the base")
    args = parser.parse_args()
    before = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    now = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    old_ms, new_ms, ratios, params = [], [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        unpack(args.before, Path(tmp))
        old_src, new_src = Path(tmp) / "src", ROOT / "src"
        for _ in range(args.rounds):
            old = time_once(old_src, args.threads, args.steps)
            new = time_once(new_src, args.threads, args.steps)
            old_ms.append(old["ms"])
            new_ms.append(new["ms"])
            ratios.append(new["ms"] / old["ms"])
            params = new["params"]
    ratio = statistics.median(ratios)
    lines = [
        f"MixedPrecisionOptimizer(ChainedOptimizer([Muon, AdamW])) step, {params / 1e6:.2f}M bfloat16 parameters, "
        f"{args.threads} threads, median of {args.steps} steps per process, {args.rounds} alternating rounds",
        f"{'code':40s} {'ms/step':>8s}",
        f"{'before the wrapper base (' + before + ')':40s} {statistics.median(old_ms):8.2f}",
        f"{'with the wrapper base (' + now + ')':40s} {statistics.median(new_ms):8.2f}",
        f"median of the per-round ratios with / before = {ratio:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
        f"target <= 1.05: {'met' if ratio <= 1.05 else 'missed'}",
    ]
    save("bench_wrapper_base", lines, threads=args.threads, before=before, after=now, ratio=ratio,
         ratios=ratios, ms_before=old_ms, ms_after=new_ms)


if __name__ == "__main__":
    main()
