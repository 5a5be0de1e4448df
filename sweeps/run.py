#!/usr/bin/env python3
"""Sweep the book's measured claims over seeds and CPU kernel configurations; write the table.

Every claim about a number from a training run or from bf16/fp16 arithmetic goes through
``optbook.testing.assert_claim(name, value, op, bound)``. This script re-executes notebooks with fresh seeds
(``OPTBOOK_SEED_OFFSET``) under three kernel configurations and records every claim's value
(``OPTBOOK_CLAIMS_LOG``) instead of stopping at the first failure; any other error a run raises (a
plain ``assert`` that depends on the seed, say) is recorded too. Then it writes ``sweeps/README.md``:
claim -> bound -> the notebook's own value -> the worst value seen per configuration.

    python sweeps/run.py book/06_muon.ipynb book/08_muonclip.ipynb   # sweep two chapters (appends)
    python sweeps/run.py --table                                      # only rebuild the table

Defaults: 10 fresh seed offsets natively and 3 of them under each of AVX2 and generic kernels, plus
the notebook's own seeds natively (offset 0), two notebooks at a time. Not part of the test command:
a full sweep takes hours on two cores. A run replaces the earlier records of the same notebook, kernel
configuration and seed offset and keeps the others, so after changing only a bound, re-running the
notebook's own seeds (`--native 0 --avx2 0 --generic 0`) updates the table: its bounds and its list of
claims are those of the latest run, and every recorded value is checked against them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "sweeps" / "data"
TABLE = ROOT / "sweeps" / "README.md"
KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"},
}
OFFSET_STEP = 1009        # seed offsets 1009, 2018, ...: far from the notebooks' own small seeds


def run_one(nb: Path, kernels: str, k: int, timeout: int) -> list[dict]:
    """Execute ``nb`` once; return its claim records plus one record per cell that raised."""
    with tempfile.TemporaryDirectory() as tmp:
        log, out = Path(tmp) / "claims.jsonl", Path(tmp) / "out.ipynb"
        env = dict(os.environ, OPTBOOK_SEED_OFFSET=str(k * OFFSET_STEP), OPTBOOK_CLAIMS_LOG=str(log),
                   OPTBOOK_NOTEBOOK=nb.stem, OPTBOOK_KERNELS=kernels, OMP_WAIT_POLICY="PASSIVE",
                   **KERNELS[kernels])
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(nb),
             "--output", str(out), "--ExecutePreprocessor.allow_errors=True",
             f"--ExecutePreprocessor.timeout={timeout}"], env=env, cwd=nb.parent, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        base = {"notebook": nb.stem, "kernels": kernels, "seed_offset": k * OFFSET_STEP}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        if proc.returncode != 0 or not out.exists():
            records.append({**base, "error": f"nbconvert failed: {proc.stderr.strip()[-300:]}"})
        else:
            cells = [c for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code"]
            for i, cell in enumerate(cells, start=1):
                for o in cell.get("outputs", []):
                    if o["output_type"] == "error":
                        records.append({**base, "error": f"code cell {i}: {o['ename']}: {o['evalue'][:200]}"})
        records.append({**base, "seconds": round(seconds, 1)})
        return [{**r, "run_at": stamp} for r in records]


def sweep(notebooks: list[Path], native: int, avx2: int, generic: int, jobs: int, timeout: int) -> None:
    plan = [(nb, "native", k) for nb in notebooks for k in range(native + 1)]
    plan += [(nb, "avx2", k) for nb in notebooks for k in range(1, avx2 + 1)]
    plan += [(nb, "generic", k) for nb in notebooks for k in range(1, generic + 1)]
    results: dict[Path, list[dict]] = {nb: [] for nb in notebooks}
    with cf.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_one, nb, kern, k, timeout): (nb, kern, k) for nb, kern, k in plan}
        for done, fut in enumerate(cf.as_completed(futures), start=1):
            nb, kern, k = futures[fut]
            recs = fut.result()
            results[nb].extend(recs)
            bad = [r for r in recs if "error" in r or r.get("holds") is False]
            print(f"[{done}/{len(plan)}] {nb.stem} {kern} offset {k * OFFSET_STEP}: {recs[-1]['seconds']} s, "
                  f"{len(bad)} failing", flush=True)
    DATA.mkdir(parents=True, exist_ok=True)
    for nb, recs in results.items():
        path = DATA / f"{nb.stem}.jsonl"
        rerun = {(r["kernels"], r["seed_offset"]) for r in recs}
        old = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        keep = [r for r in old if (r["kernels"], r["seed_offset"]) not in rerun]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep + recs))


def holds(value: float, op: str, bound: float) -> bool:
    """Whether a recorded value satisfies ``op bound`` (NaN never does), as optbook.testing.assert_claim decides."""
    return {"<": value < bound, "<=": value <= bound, ">": value > bound, ">=": value >= bound,
            "==": value == bound}[op]


def _worst(values: list[float], op: str) -> float:
    return min(values) if op in (">", ">=") else max(values) if op in ("<", "<=") else values[0]


def _fmt(x: float) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def render_table() -> str:
    """The text of sweeps/README.md, from the records in sweeps/data."""
    lines = [
        "# Sweep of the book's measured claims",
        "",
        "Generated by `python sweeps/run.py` (see its docstring); do not edit by hand. Every claim that a",
        "notebook makes about a number from a training run or from bf16/fp16 arithmetic is asserted with",
        "`optbook.testing.assert_claim(name, value, op, bound)`. The sweep re-executes each notebook with fresh",
        "seeds (offsets of 1009, 2018, ... added to every seed) natively, and with the first of them under",
        "PyTorch's/oneDNN's AVX2 kernels and under the generic kernels: at least 10 fresh seeds natively and",
        "at least 3 under each other configuration, counting the independent seeds each run evaluates a claim",
        "over (a notebook whose claims each cover 3 seeds needs 4 native runs and 1 of each other kind; the",
        "claim's name says what it covers). The number in brackets is the number of runs:",
        "",
        "- native: the machine's own kernels;",
        "- avx2: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2`;",
        "- generic: `ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE`.",
        "",
        "Columns: the claim as asserted; the notebook's own value (its own seeds, native kernels); the worst",
        "value seen over the fresh seeds per configuration (the minimum for a lower bound, the maximum for",
        "an upper bound); `fails` counts runs whose value does not meet the current bound (it must be 0: a",
        "bound is set with a margin over the worst value seen). The bounds and the list of claims are those of",
        "the notebook's latest run. Errors list cells that raised in some run (a plain `assert` that depends",
        "on the seed, for example); there must be none.",
        "",
    ]
    unswept = sorted(nb.stem for nb in (ROOT / "book").glob("*.ipynb") if not (DATA / f"{nb.stem}.jsonl").exists())
    if unswept:
        lines += [f"Notebooks without a sweep: {', '.join(unswept)}.", ""]
    for path in sorted(DATA.glob("*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        claims = [r for r in recs if "claim" in r]
        runs = {(r["kernels"], r["seed_offset"]) for r in recs if "seconds" in r}
        secs = {k: [r["seconds"] for r in recs if "seconds" in r and r["kernels"] == k] for k in KERNELS}
        counts = ", ".join(f"{k} {len(v)} (max {max(v):.0f} s)" for k, v in secs.items() if v)
        lines += [f"## {path.stem}", "", f"Runs: {counts}.", ""]
        lines += ["| claim | bound | own value | worst native | worst avx2 | worst generic | fails |",
                  "|---|---|---|---|---|---|---|"]
        latest = max((r.get("run_at", "") for r in recs), default="")
        current = {r["claim"]: (r["op"], r["bound"]) for r in claims if r.get("run_at", "") == latest}
        for name, (op, bound) in current.items():
            rs = [r for r in claims if r["claim"] == name]
            own = [r["value"] for r in rs if r["kernels"] == "native" and r["seed_offset"] == 0]
            cols = []
            for kern in KERNELS:
                vals = [r["value"] for r in rs if r["kernels"] == kern and r["seed_offset"] != 0]
                cols.append(f"{_fmt(_worst(vals, op))} ({len(vals)})" if vals else "–")
            fails = sum(not holds(r["value"], op, bound) for r in rs)
            cell = name.replace("|", "\\|")
            lines.append(f"| {cell} | {op} {_fmt(bound)} | {_fmt(own[0]) if own else '–'} | "
                         + " | ".join(cols) + f" | {fails} |")
        errors = [r for r in recs if "error" in r]
        if errors:
            lines += ["", "Errors:", ""]
            lines += [f"- {r['kernels']} offset {r['seed_offset']}: {r['error']}" for r in errors]
        lines += ["", f"({len(runs)} runs.)", ""]
    return "\n".join(lines)


def write_table() -> None:
    TABLE.write_text(render_table())
    print(f"wrote {TABLE.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--native", type=int, default=10, help="fresh seed offsets under the native kernels")
    ap.add_argument("--avx2", type=int, default=3)
    ap.add_argument("--generic", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="notebooks executed at once")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    ap.add_argument("--table", action="store_true", help="only rebuild sweeps/README.md from sweeps/data")
    args = ap.parse_args()
    if not args.table:
        if not args.notebooks:
            ap.error("name the notebooks to sweep (or --table)")
        sweep([nb.resolve() for nb in args.notebooks], args.native, args.avx2, args.generic, args.jobs, args.timeout)
    write_table()


if __name__ == "__main__":
    main()
