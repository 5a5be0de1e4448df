#!/usr/bin/env python3
"""Measure how long each chapter takes to execute, record it, and state it in the chapter's header.

``book/runtimes.json`` holds the last measurement of every chapter: wall-clock seconds for a top-to-bottom
execution in a fresh kernel (one notebook at a time, nothing else running), with the machine it was
measured on. Each chapter's first Markdown cell carries one line derived from it::

    *Run time: about 40 s on a 2-core CPU without a GPU (measured 2026-12-02, PyTorch 2.13.0).*

``tests/test_chapter_times.py`` checks that every header agrees with the record, that every chapter has
been measured, and that every recorded time fits ``BUDGET`` (chapters allowed over it are listed there with
the reason; one that is re-measured under the budget simply passes). Re-measure after a chapter changes
(minutes for the whole book on 2 cores)::

    .venv/bin/python tools/chapter_times.py --measure [book/05_newton_schulz.ipynb ...]   # update runtimes.json
    .venv/bin/python tools/chapter_times.py --write                                       # headers from runtimes.json

Headers are edited as Markdown text: outputs stay as they are, so no re-execution is needed. ``--write``
also writes the Preface's sentence on run times (:func:`preface_sentence`: the range and the longest
chapters), and the README's summary comes from the same record (``tools/readme_numbers.py``): one source.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from recording import cpu_model  # noqa: E402  (the CPU's model name, as every benchmark record names it)
RECORD = ROOT / "book" / "runtimes.json"
HEADER_RE = re.compile(r"(?m)^\*Run time: [^\n]*\*\n\n?")
BUDGET = 120  # seconds: every chapter within two minutes on a 2-core CPU without a GPU


def chapters() -> list[Path]:
    return [p for p in sorted((ROOT / "book").glob("*.ipynb")) if not p.name.startswith("00_")]


def rounded(seconds: float) -> str:
    """``about 40 s`` / ``about 2 min 10 s``: 5-second steps under two minutes, 10-second steps above."""
    step = 5 if seconds < 120 else 10
    s = max(step, int(round(seconds / step)) * step)
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"


def header(entry: dict) -> str:
    where = f"a {entry['cores']}-core CPU without a GPU" if not entry.get("gpu") else f"{entry['gpu']}"
    return (f"*Run time: about {rounded(entry['seconds'])} on {where} "
            f"(measured {entry['date']}, PyTorch {entry['torch']}).*\n\n")


def measure(paths: list[Path]) -> dict:
    import nbformat
    import torch
    from nbclient import NotebookClient

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as `make` sets it (the kernel inherits it)
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
        start = time.perf_counter()
        client.execute()
        seconds = time.perf_counter() - start
        record[path.stem] = {"seconds": round(seconds, 1), "cores": os.cpu_count(), "gpu": gpu,
                             "cpu": cpu_model(),
                             "torch": torch.__version__.split("+")[0], "date": datetime.date.today().isoformat()}
        print(f"{path.name}: {seconds:.1f} s", flush=True)
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


PREFACE = ROOT / "book" / "00_preface.ipynb"
#: The Preface's sentence on run times, from its fixed start to the end of the sentence.
PREFACE_RE = re.compile(r"Each chapter states under its title how long it took to execute.*?the longest\.", re.S)


def preface_sentence(record: dict) -> str:
    """The Preface's sentence on run times from ``record`` (``book/runtimes.json``): the shortest and longest
    chapters with the rounded times their headers show, and the chapters over :data:`BUDGET`."""
    seconds = {k: v["seconds"] for k, v in record.items()}
    order = sorted(seconds, key=seconds.get)
    cores = "/".join(str(c) for c in sorted({v["cores"] for v in record.values()}))
    over = [k for k in order if seconds[k] > BUDGET]
    budget = (f"{len(over)} over the {BUDGET // 60}-minute budget" if over else
              f"every one within the {BUDGET // 60}-minute budget")
    return (f"Each chapter states under its title how long it took to execute, measured on a {cores}-core CPU "
            f"without\na GPU (and without bf16 matrix instructions): from about {rounded(seconds[order[0]])} "
            f"({{doc}}`{order[0]}`) to about\n{rounded(seconds[order[-1]])} ({{doc}}`{order[-1]}`), "
            f"{budget}; {{doc}}`{order[-2]}` (about {rounded(seconds[order[-2]])}) is\nnext to the longest.")


def expected_preface(source: str, record: dict) -> str:
    """The Preface's Markdown cell ``source`` with its run-time sentence set from ``record``."""
    if not PREFACE_RE.search(source):
        raise ValueError("the Preface has no sentence starting 'Each chapter states under its title how long'")
    return PREFACE_RE.sub(lambda m: preface_sentence(record), source, count=1)


def preface_cell(nb: dict) -> dict:
    return next(c for c in nb["cells"] if c["cell_type"] == "markdown" and PREFACE_RE.search("".join(c["source"])))


def expected_first_cell(source: str, entry: dict) -> str:
    """The first Markdown cell with its run-time line (after the title line) set from ``entry``."""
    body = HEADER_RE.sub("", source)
    title, _, rest = body.partition("\n\n")
    return f"{title}\n\n{header(entry)}{rest}"


def write_headers() -> None:
    record = json.loads(RECORD.read_text())
    for path in chapters():
        if path.stem not in record:
            print(f"{path.name}: not measured yet (run --measure)")
            continue
        text = path.read_text(encoding="utf-8")
        nb = json.loads(text)
        cell = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
        old = "".join(cell["source"])
        new = expected_first_cell(old, record[path.stem])
        if new != old:
            cell["source"] = new.splitlines(keepends=True)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"{path.name}: header set to {header(record[path.stem]).strip()}")
    nb = json.loads(PREFACE.read_text(encoding="utf-8"))
    cell = preface_cell(nb)
    old = "".join(cell["source"])
    new = expected_preface(old, record)
    if new != old:
        cell["source"] = new.splitlines(keepends=True)
        PREFACE.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{PREFACE.name}: run-time sentence set from {RECORD.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="execute the chapters and record their run time")
    parser.add_argument("--write", action="store_true", help="write every chapter's header from the record")
    parser.add_argument("notebooks", nargs="*", type=Path, help="chapters to measure (default: all)")
    args = parser.parse_args(argv)
    if not (args.measure or args.write):
        parser.error("give --measure, --write or both")
    if args.measure:
        measure([p.resolve() for p in args.notebooks] or chapters())
    if args.write:
        write_headers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
