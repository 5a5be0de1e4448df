#!/usr/bin/env python3
"""Time ``make test`` on fresh clones of this repository, alone or beside more copies, and record it.

The README promises that ``make test`` passes on a fresh 2-core clone with the machine otherwise idle in
at most 15 minutes, and still passes (slower) with a second copy of the suite running beside it. This
script is how that is measured: it clones the committed ``HEAD`` into a temporary folder once per copy,
runs ``make setup`` in each (not timed: it installs the virtual environment), then starts ``make test``
in every copy at the same moment and waits for all of them. Each copy's wall time, exit status and
pytest's closing summary line are recorded in ``records/test_times.json`` with the commit, the date, the
CPU, its cores and the load average before and after, so that a later reader can tell an idle run from
a crowded one (a run is appended; earlier runs stay)::

    python tools/time_tests.py                  # one copy: make test on an otherwise idle machine
    python tools/time_tests.py --copies 2       # two copies side by side
    python tools/time_tests.py --copies 2 --keep /tmp/clones   # keep the clones (and their logs)

The time is shown, never asserted by a test (a loaded machine is slower, and that is not a failure);
what the record asserts is that every copy passed. Standard library only (and the benchmarks'
``recording.cpu_model``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from recording import cpu_model  # noqa: E402  (the CPU as every benchmark record names it)
RECORD = ROOT / "records" / "test_times.json"
SUMMARY_RE = re.compile(r"^=+ (.*(?:passed|failed|error).*) in [\d.]+s.*=+$", re.M)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def clone(dest: Path) -> None:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)


def run_copies(clones: list[Path], env: dict) -> list[dict]:
    """Start ``make test`` in every clone at once; wait for all; each copy's time, status and summary."""
    started, procs = [], []
    for path in clones:
        log = open(path / "make-test.log", "w")
        started.append(time.monotonic())
        procs.append((subprocess.Popen(["make", "test"], cwd=path, stdout=log, stderr=subprocess.STDOUT,
                                       env=env), log))
    results = []
    for (proc, log), t0 in zip(procs, started):
        status = proc.wait()
        seconds = time.monotonic() - t0
        log.close()
        text = Path(log.name).read_text(errors="replace")
        found = SUMMARY_RE.findall(text)
        results.append({"seconds": round(seconds, 1), "exit_status": status,
                        "summary": found[-1] if found else "no pytest summary line"})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=1, help="copies of the suite started together (1 or more)")
    parser.add_argument("--keep", type=Path, help="put the clones here and keep them (default: a temporary folder)")
    parser.add_argument("--record", type=Path, default=RECORD, help="the JSON record to append to")
    args = parser.parse_args(argv)
    if args.copies < 1:
        parser.error(f"--copies must be at least 1, got {args.copies}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    base = args.keep or Path(tempfile.mkdtemp(prefix="optbook-time-tests-"))
    base.mkdir(parents=True, exist_ok=True)
    clones = [base / f"copy{i}" for i in range(args.copies)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    try:
        for path in clones:
            clone(path)
        setups = [subprocess.Popen(["make", "setup"], cwd=path, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL) for path in clones]   # side by side: not timed
        if any([p.wait() != 0 for p in setups]):   # wait for every one
            raise SystemExit("make setup failed in a clone; run it there by hand to see why")
        before = load_average()
        results = run_copies(clones, env)
        after = load_average()
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    run = {"date": datetime.date.today().isoformat(), "commit": commit, "copies": args.copies,
           "cpu": cpu_model(), "cores": os.cpu_count(),
           "timeout_scale": os.environ.get("OPTBOOK_TEST_TIMEOUT_SCALE", "default"),
           "load_average_before": before, "load_average_after": after, "runs": results}
    record = json.loads(args.record.read_text()) if args.record.exists() else []
    record.append(run)
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(run, indent=1))
    return 0 if all(r["exit_status"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
