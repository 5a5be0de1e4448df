"""The environment a benchmark ran in, printed above its table and kept with it in ``benchmarks/results/``.

Every benchmark of ``make bench`` ends with :func:`save`: it prints the environment line and the table,
and writes both to ``benchmarks/results/<name>.json``, the record that ``tools/readme_numbers.py`` copies
into the README (``--write``) and that ``tests/test_readme.py`` checks the README against. A timing is
only comparable with another taken under the same environment: ``OMP_WAIT_POLICY`` alone changed the
Muon benchmark's ratio from about 1.1 to about 0.65 on one 2-core machine (spinning OpenMP threads of
one contender steal the cores of the other), so it is part of the record.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ENV_VARS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(threads: int | None = None) -> dict:
    """What a timing depends on besides the code: CPU, cores, load, torch build, OpenMP and kernel settings.

    Args:
        threads: the torch intra-op threads the benchmark uses per process (None: ``torch.get_num_threads()``).
    """
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "load_average_1min": None if load is None else round(load, 2),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "threads": torch.get_num_threads() if threads is None else threads,
            "env": {k: os.environ.get(k, "unset") for k in ENV_VARS}}


def describe(env: dict) -> str:
    """One line: ``environment: <cpu>, <n> cores, torch <v>, <t> threads, OMP_WAIT_POLICY=..., load ...``."""
    settings = ", ".join(f"{k}={v}" for k, v in env["env"].items() if v != "unset" or k == "OMP_WAIT_POLICY")
    load = env.get("load_average_1min")
    return (f"environment: {env['cpu']}, {env['cores']} cores, torch {env['torch']}, "
            f"{env['threads']} thread{'' if env['threads'] == 1 else 's'}, "
            f"{settings}" + ("" if load is None else f", load average {load}") + f" ({env['date']})")


def save(name: str, lines: list[str], threads: int | None = None, results: Path = RESULTS, **data) -> Path:
    """Print the environment line and ``lines`` (the table), and record both in ``results/<name>.json``.

    Args:
        name: the record's file stem, e.g. ``bench_adamw``.
        lines: the printed table, one string per line.
        threads: torch threads per process, as in :func:`environment`.
        data: numbers the README quotes in prose (ratios etc.), stored under ``"data"``.

    An existing record's ``"history"`` (earlier runs, kept by hand) is carried over into the new one.

    Returns:
        The path written.
    """
    env = environment(threads)
    print(describe(env))
    for line in lines:
        print(line)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    record = {"name": name, "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "environment": env, "table": lines, "data": data}
    if path.exists():  # the earlier runs a record keeps (README tables of past runs) survive a new run
        history = json.loads(path.read_text()).get("history")
        if history is not None:
            record["history"] = history
    path.write_text(json.dumps(record, indent=1) + "\n")
    try:
        shown = path.relative_to(Path.cwd())
    except ValueError:
        shown = path
    print(f"recorded in {shown}")
    return path
