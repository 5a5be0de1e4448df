#!/usr/bin/env python3
"""Chapter 19's full table: AdamW, Muon, NorMuon and Dion on real text, steps and seconds to a target.

    make capstone                      # = python tools/capstone.py  (writes records/capstone.json)
    python tools/capstone.py --quick   # a two-minute smoke run of the same code (writes nothing unless --out)
    python tools/capstone.py --optimizers Muon --no-logits --out part.json   # one slice of the work ...
    python tools/capstone.py --merge part*.json                               # ... and the table from slices

Each optimizer's learning rate is picked from ``GRID`` on ``TUNE_SEEDS`` (fewest total steps to the target,
the larger rate on a tie), seeds the table does not use; then ``TABLE_SEEDS`` (10 seeds) run at the chosen
rates and :func:`optbook.capstone.compare` applies chapter 18b's rule (one-sided Mann-Whitney U at 0.01,
Bonferroni over the three comparisons) to steps and to seconds. Seconds to the target are steps times each
optimizer's median cost of a step, measured with the optimizers taking turns in one process
(:func:`optbook.capstone.step_seconds`); the seconds each run measured itself are kept as
``seconds_measured`` (they depend on whatever else the machine ran at the time). Then the largest
attention logit over training with Muon at a high learning rate, with and without QK-clip. Runs on
CUDA when a GPU is visible (``--device`` overrides), else on the CPU with two threads: about 5 minutes
on a 2-core CPU (5,850 training steps).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from optbook import capstone, text  # noqa: E402

# Three learning rates a factor of about 3 apart; AdamW's grid sits one step lower (its best rate on this
# model is near 3e-3, the RMS-matched matrix optimizers' near 3e-2). A chosen rate at a grid's edge is
# reported: it would mean the grid was too small.
GRID = {"AdamW": (1e-3, 3e-3, 1e-2), "Muon": (1e-2, 3e-2, 1e-1), "NorMuon": (1e-2, 3e-2, 1e-1),
        "Dion": (1e-2, 3e-2, 1e-1)}
TUNE_SEEDS = (100, 101)
TABLE_SEEDS = tuple(range(10))
LOGIT_LR, LOGIT_TAU, LOGIT_STEPS, LOGIT_SEEDS = 0.3, 30.0, 200, (0, 1, 2)


def finite(x: float):
    return x if math.isfinite(x) else None   # JSON has no inf: null means "never reached the target"


def summarise(result: dict) -> dict:
    """Add the comparisons (chapter 18b's rule) to a result whose ``steps`` and ``seconds`` cover every
    optimizer; JSON ``null`` (never reached the target) counts as ``inf``."""
    as_inf = lambda v: [math.inf if x is None else x for x in v]  # noqa: E731
    cost = result["step_seconds"]
    result["seconds"] = {n: [None if s is None else s * cost[n] for s in result["steps"][n]]
                         for n in capstone.OPTIMIZERS}
    for key in ("steps", "seconds"):
        rows = capstone.compare({n: as_inf(result[key][n]) for n in capstone.OPTIMIZERS})
        result[f"compare_{key}"] = {n: {k: finite(v) if isinstance(v, float) else v for k, v in row.items()}
                                    for n, row in rows.items()}
    result["rule"] = ("one-sided Mann-Whitney U against AdamW, level 0.01 Bonferroni-corrected over "
                      f"{len(capstone.OPTIMIZERS) - 1} comparisons")
    edges = {n: (min(result["grid"][n]), max(result["grid"][n])) for n in capstone.OPTIMIZERS}
    result["lr_at_grid_edge"] = [n for n in capstone.OPTIMIZERS if result["lr"][n] in edges[n]]
    return result


def merge(paths: list[Path]) -> dict:
    """One result from partial ones (``--optimizers``/``--no-logits``/``--logits-only`` runs of one setup)."""
    parts = [json.loads(p.read_text()) for p in paths]
    result = {k: v for k, v in parts[0].items() if k not in PER_OPTIMIZER + ("max_logit",)}
    for part in parts:
        if part["setup"] != result["setup"] or part["quick"] != result["quick"]:
            raise ValueError(f"Invalid parts: {paths} were run with different setups")
        for key in PER_OPTIMIZER:
            result.setdefault(key, {}).update(part.get(key, {}))
        for key in ("max_logit", "step_seconds"):
            if key in part:
                result[key] = part[key]
    result["total_seconds"] = round(sum(p["total_seconds"] for p in parts), 1)
    missing = [n for n in capstone.OPTIMIZERS if n not in result["steps"]]
    missing += [key for key in ("max_logit", "step_seconds") if key not in result]
    if missing:
        raise ValueError(f"Invalid parts: nothing for {missing} in {paths}")
    return summarise(result)


PER_OPTIMIZER = ("grid", "tuning", "lr", "steps", "seconds_measured", "curves")


def report(result: dict) -> None:
    for name in capstone.OPTIMIZERS:
        s, t = result["compare_steps"][name], result["compare_seconds"][name]
        print(f"{name:<8} lr {result['lr'][name]:.0e}  median steps {s['median']}  AdamW/this {s['ratio']} "
              f"({s['verdict']})  median s {t['median']}  AdamW/this {t['ratio']} ({t['verdict']})")
    print(f"total {result['total_seconds']} s on {result['device']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="results file (default records/capstone.json; "
                    "--quick writes nothing unless given)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, 2 rates, 60 steps")
    ap.add_argument("--optimizers", default=",".join(capstone.OPTIMIZERS), help="comma-separated subset")
    ap.add_argument("--no-logits", action="store_true", help="skip the max-logit runs")
    ap.add_argument("--logits-only", action="store_true", help="only the max-logit runs")
    ap.add_argument("--step-cost-only", action="store_true", help="only the per-step cost, with the rates "
                    "given as --lrs NAME=LR,...")
    ap.add_argument("--lrs", default="", help="rates for --step-cost-only, e.g. AdamW=3e-3,Muon=3e-2")
    ap.add_argument("--merge", type=Path, nargs="+", help="combine partial results into --out")
    args = ap.parse_args(argv)
    out = args.out if args.out is not None or args.quick else ROOT / "records" / "capstone.json"
    if args.merge:
        result = merge(args.merge)
        report(result)
        out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
        print(f"wrote {out}")
        return 0
    names = [n for n in args.optimizers.split(",") if n]
    if not set(names) <= set(capstone.OPTIMIZERS):
        ap.error(f"--optimizers: expected names from {capstone.OPTIMIZERS}, got {names}")
    if args.logits_only or args.step_cost_only:
        names = []
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    setup = capstone.Setup()
    grid, tune_seeds, table_seeds = GRID, TUNE_SEEDS, TABLE_SEEDS
    logit_steps, logit_seeds = LOGIT_STEPS, LOGIT_SEEDS
    if args.quick:
        setup = replace(setup, max_steps=30, target=2.6)
        grid = {n: g[:2] for n, g in GRID.items()}
        tune_seeds, table_seeds, logit_steps, logit_seeds = TUNE_SEEDS[:1], (0, 1), 20, (0,)
    split = text.load_corpus()
    n_params = sum(p.numel() for p in capstone.new_model(setup, 0, split.tokenizer.vocab_size).parameters())
    start = time.perf_counter()

    tuning = {}
    for name in names:
        for lr in grid[name]:
            tuning[name, lr] = [capstone.steps_to_target(name, lr, s, setup, split, device).steps
                                for s in tune_seeds]
            print(f"tune {name:<8} lr {lr:.0e}: {tuning[name, lr]}", flush=True)
    lrs = {name: min(grid[name], key=lambda lr: (sum(tuning[name, lr]), -lr)) for name in names}
    runs = {}
    for name in names:
        runs[name] = [capstone.steps_to_target(name, lrs[name], s, setup, split, device) for s in table_seeds]
        print(f"table {name:<8} lr {lrs[name]:.0e}: steps {[r.steps for r in runs[name]]}", flush=True)

    result = {
        "setup": asdict(setup), "device": str(device), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "quick": args.quick,
        "n_params": n_params,
        "tune_seeds": list(tune_seeds), "table_seeds": list(table_seeds),
        "grid": {n: list(grid[n]) for n in names},
        "tuning": {n: {f"{lr:g}": [finite(s) for s in tuning[n, lr]] for lr in grid[n]} for n in names},
        "lr": lrs,
        "steps": {n: [finite(r.steps) for r in rs] for n, rs in runs.items()},
        "seconds_measured": {n: [finite(r.seconds) for r in rs] for n, rs in runs.items()},
        "curves": {n: [r.curve for r in rs] for n, rs in runs.items()},
    }
    if args.step_cost_only:
        given = dict(kv.split("=") for kv in args.lrs.split(",") if kv)
        rates = {n: float(given[n]) for n in capstone.OPTIMIZERS}
        result["step_seconds"] = capstone.step_seconds(rates, setup, split, device)
        print(f"seconds per step: {result['step_seconds']}", flush=True)
    elif set(names) == set(capstone.OPTIMIZERS):
        result["step_seconds"] = capstone.step_seconds(lrs, setup, split, device)
    if not args.no_logits and not args.step_cost_only:
        logits = {}
        for label, tau in (("Muon", None), ("Muon + QK-clip", LOGIT_TAU)):
            logits[label] = [capstone.max_logit_run(LOGIT_LR, s, setup, logit_steps, tau, split)
                             for s in logit_seeds]
            finals = [round(r["max_logit"][-1], 1) for r in logits[label]]
            print(f"logits {label}: final max {finals}", flush=True)
        result["max_logit"] = {"lr": LOGIT_LR, "tau": LOGIT_TAU, "steps": logit_steps,
                               "seeds": list(logit_seeds),
                               "runs": {k: [{"max_logit": r["max_logit"], "loss": r["loss"]} for r in v]
                                        for k, v in logits.items()}}
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    if set(names) == set(capstone.OPTIMIZERS):
        summarise(result)
        report(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
