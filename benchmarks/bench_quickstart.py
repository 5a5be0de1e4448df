#!/usr/bin/env python3
"""How long the README's package quick start (Muon + AdamW learning a copying task) takes on this CPU, under
the OpenMP settings a user may or may not have: a benchmark, not a test.

The snippet is read from ``README.md`` (the block with ``ChainedOptimizer(``, the one ``tests/test_readme.py``
runs) and executed in a fresh Python process per run, so that each run starts OpenMP under its own
environment: ``OMP_WAIT_POLICY`` is read once, when the OpenMP runtime loads with torch, so it cannot be
set from inside a running program. Configurations, interleaved round by round:

* ``as written``: ``OMP_WAIT_POLICY`` unset, torch's default threads (one per core). Idle OpenMP threads
  spin between parallel regions; on a machine whose cores other jobs also use, the spinning threads take
  cores from the thread that has work, and the many small ops of a small model slow down many times over.
* ``OMP_WAIT_POLICY=PASSIVE``: idle threads sleep (what every ``make`` target sets).
* ``torch.set_num_threads(1)``: no other OpenMP thread to spin (the variable unset; the line added after
  ``torch.manual_seed(0)``). For a model this small one thread loses little.

Prints one line per configuration (median seconds, every run, the final training loss) and records it with
the environment and the load average before and after (``benchmarks/recording.py``). The README's sentence
on the quick start's time is generated from this record (``tools/readme_numbers.py``).

    .venv/bin/python benchmarks/bench_quickstart.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from recording import save  # noqa: E402

#: name -> (environment changes, whether the snippet calls torch.set_num_threads(1))
CONFIGS = {"as written": ({"OMP_WAIT_POLICY": None}, False),
           "OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
           "torch.set_num_threads(1)": ({"OMP_WAIT_POLICY": None}, True)}


def snippet(one_thread: bool) -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    source = next(b for b in re.findall(r"(?ms)^```python\n(.*?)^```$", readme) if "ChainedOptimizer(" in b)
    if one_thread:
        source = source.replace("torch.manual_seed(0)\n", "torch.manual_seed(0)\ntorch.set_num_threads(1)\n", 1)
    return source + "\nprint(f'final loss {loss.item():.4f}')\n"


def run_once(name: str, workdir: Path) -> tuple[float, str]:
    changes, one_thread = CONFIGS[name]
    env = dict(os.environ)
    for key, value in changes.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    env["PYTHONPATH"] = str(ROOT / "src")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", snippet(one_thread)], cwd=workdir, env=env, capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name}: the snippet failed:\n{done.stderr[-2000:]}")
    return seconds, done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs per configuration, interleaved (1)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"Invalid --rounds: expected >= 1, got {args.rounds}")
    import tempfile

    load_before = round(os.getloadavg()[0], 2)
    runs: dict[str, list[float]] = {name: [] for name in CONFIGS}
    losses: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.rounds):
            for name in CONFIGS:
                seconds, loss = run_once(name, Path(workdir))
                runs[name].append(round(seconds, 1))
                losses[name] = loss
                print(f"  {name}: {seconds:.1f} s ({loss})", flush=True)
    load_after = round(os.getloadavg()[0], 2)
    lines = [f"README package quick start (100 steps, Muon + AdamW, TinyTransformer d_model=64), fresh process per "
             f"run, {args.rounds} round(s); load average (1 min) {load_before} before, {load_after} after",
             f"{'configuration':<28} {'median s':>9}  runs (s)"]
    for name, values in runs.items():
        lines.append(f"{name:<28} {statistics.median(values):9.1f}  {', '.join(f'{v:.1f}' for v in values)}"
                     f"  ({losses[name]})")
    save("bench_quickstart", lines, seconds={k: statistics.median(v) for k, v in runs.items()}, runs=runs,
         load_average_before=load_before, load_average_after=load_after)


if __name__ == "__main__":
    main()
