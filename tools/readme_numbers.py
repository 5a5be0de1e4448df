#!/usr/bin/env python3
"""Write the measured numbers that the README, CONTRIBUTING.md, benchmarks/README.md (the current table of each
benchmark) and records/README.md (the earlier runs) quote, from the records the repository keeps, so they
cannot go stale.

Every number these pages quote from a run sits between two marker lines, ``<!-- numbers:KEY -->`` and
``<!-- /numbers:KEY -->`` (in any of :data:`PAGES`), and is generated from one record:

=======================  =================================================================================
KEY                      record (written by)
=======================  =================================================================================
``tests``                ``records/tests.json`` (``--record-tests``: pytest's collection of ``make test``)
``chapter-times``        ``book/runtimes.json`` (``tools/chapter_times.py --measure``)
``bench:NAME``           ``benchmarks/results/NAME.json`` (``make bench``: each benchmark writes its own)
``quickstart``           ``benchmarks/results/bench_quickstart.json`` (the package quick start's run time)
``muon-runs``            the ``history`` of ``benchmarks/results/bench_muon.json``
``zero1-targets``        the ``history`` of ``benchmarks/results/bench_zero1.json``
``adamw-runs``           the ``history`` of ``benchmarks/results/bench_adamw.json``
``compiled-runs``        the ``history`` of ``benchmarks/results/bench_compiled_step.json``
``fsdp2-runs``           the ``history`` of ``benchmarks/results/bench_fsdp2.json``
``limits-runs``          every run of ``benchmarks/results/bench_limits.json`` (its ``history`` and the record)
``pdf``                  ``records/pdf.json`` (``make pdf-numbers``: ``tools/build_pdf.py``'s record)
``book-link``            ``repository.url`` in ``_config.yml`` (the GitHub Pages address of the built book)
``install``              ``repository.url`` (the package's install lines)
``citation``             ``CITATION.cff`` (a BibTeX entry), whose ``repository-code`` and ``url`` follow
                         ``repository.url`` too (``--write`` rewrites them)
=======================  =================================================================================

::

    python tools/readme_numbers.py --check          # exit 1 (and a diff) when a page disagrees
    python tools/readme_numbers.py --write          # rewrite the marked blocks of every page from the records
    python tools/readme_numbers.py --record-tests   # re-count the tests (pytest --collect-only), then --write

``tests/test_readme.py`` runs the check.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages with ``numbers:`` blocks.
PAGES = (README, ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md", ROOT / "records" / "README.md")
RESULTS = ROOT / "benchmarks" / "results"
RECORDS = ROOT / "records"
BLOCK_RE = re.compile(r"(<!-- numbers:(?P<key>[\w:-]+) -->\n)(?P<body>.*?)(<!-- /numbers:(?P=key) -->)", re.S)
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tools")]
from chapter_times import BUDGET, rounded  # noqa: E402  (the chapters' run-time budget and rounding, one copy)
from recording import describe  # noqa: E402  (the benchmarks' environment line, one copy)
from set_repository_url import config_url  # noqa: E402


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def bench_block(name: str) -> str:
    rec = load(RESULTS / f"{name}.json")
    env = rec["environment"]
    lines = [describe(env), *rec["table"]]
    script, _, options = rec["command"].partition(" ")
    how = f"`{script}`" + (f" with `{options}`" if options else "")
    note = f" {env['note'][0].upper()}{env['note'][1:]}." if env.get("note") else ""
    return ("```text\n" + "\n".join(lines) + f"\n```\n\nRecord: `benchmarks/results/{name}.json`, written by "
            f"{how}.{note}\n")


def ratios(run: dict) -> str:
    if "ratio_range" in run:
        lo, hi = run["ratio_range"]
        return f"{lo:.2f}-{hi:.2f}"
    return ", ".join(f"{r:.2f}" for r in run["ratios"])


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table: the header row, the separator, one line per row."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def muon_runs() -> str:
    rec = load(RESULTS / "bench_muon.json")
    runs = rec["history"] + [{"environment": rec["environment"], "ratios": [rec["data"]["ratio"]],
                              "what": "the table above"}]
    return markdown_table(["date", "CPU", "runs", "source", "OMP_WAIT_POLICY", "optbook / torch"],
                          [[r["environment"]["date"], r["environment"]["cpu"], r["what"],
                            r["environment"].get("note", "the benchmark"), r["environment"]["env"]["OMP_WAIT_POLICY"],
                            ratios(r)] for r in runs])


def zero1_targets() -> str:
    rec = load(RESULTS / "bench_zero1.json")
    targets = (("ZeRO default", 0.8), ("ZeRO bucket view", 1.0))
    out = ["Every recorded set of runs, the latest last:", "",
           "| date | CPU | runs | load average | " + " | ".join(
               f"time <= {bound}x ZeroRedundancyOptimizer, {target}: ratios, sorted (met in)" for target, bound in targets)
           + " |", "|---|---|---|---|" + "---|" * len(targets)]
    for run in rec["history"]:
        env = run["environment"]
        cells = []
        for target, bound in targets:
            values = sorted(run["ratios_by_target"][target])
            met = sum(v <= bound for v in values)
            cells.append(f"{', '.join(f'{v:.2f}' for v in values)} ({met} of {len(values)})")
        out.append(f"| {env['date']} | {env['cpu']} | {run['what']} | {env['load_average_1min']} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def fsdp2_runs() -> str:
    rec = load(RESULTS / "bench_fsdp2.json")
    return markdown_table(["date", "CPU", "runs", "source", "FSDP2 + Muon / FSDP2 + AdamW", "turbo"],
                          [[r["environment"]["date"], r["environment"]["cpu"], r["what"],
                            r["environment"].get("note", ""), ratios(r),
                            ", ".join(f"{v:.2f}" for v in r["ratios_turbo"])] for r in rec["history"]])


def adamw_runs() -> str:
    rec = load(RESULTS / "bench_adamw.json")
    return markdown_table(["date", "runs", "load average", "source", "optbook / faster of torch loop and foreach"],
                          [[r["environment"]["date"], r["what"], r["environment"]["load_average_1min"],
                            r["environment"].get("note", ""), ratios(r)] for r in rec["history"]])


def compiled_runs() -> str:
    rec = load(RESULTS / "bench_compiled_step.json")
    parts = []
    for run in rec["history"]:
        env = run["environment"]
        parts.append(f"{run['what']} ({env['date']}, load average {env['load_average_1min']}): compiled / fused "
                     f"= {ratios(run)}, first step {run['compile_seconds']} s")
    return "Earlier: " + "; ".join(parts) + ".\n"


def limits_runs() -> str:
    rec = load(RESULTS / "bench_limits.json")
    runs = rec.get("history", []) + [{"environment": rec["environment"], "data": rec["data"],
                                      "what": "the table in benchmarks/README.md"}]

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}" if values else "n/a"

    rows = []
    for run in runs:
        d, env = run["data"], run["environment"]
        vs = d["elementwise"]["vs_limit"]
        ns = d["newton_schulz"]
        rows.append([env["date"], run["what"], f"{d.get('load_average_start', env['load_average_1min'])}",
                     f"{max(d['elementwise']['bandwidth_gb_s'].values()):.1f}",
                     span([v for k, v in vs.items() if k.endswith("optbook eager")]),
                     span([v for k, v in vs.items() if k.endswith("torch fused")]),
                     span([v for k, v in vs.items() if k.endswith("optbook compiled")]),
                     span([v for k, v in ns.items() if k.endswith("float32")]),
                     span([v for k, v in ns.items() if k.endswith("bfloat16")])])
    return markdown_table(["date", "run", "load average at the end", "best pass GB/s", "optbook eager / limit",
                           "torch fused / limit", "compiled / limit", "NS / GEMMs float32", "NS / GEMMs bfloat16"],
                          rows)


def tests_block() -> str:
    rec = load(RECORDS / "tests.json")
    return (f"`make test` collects {rec['collected']} tests (unit tests plus one per notebook cell; "
            f"counted {rec['date']} at commit {rec['commit']}, `records/tests.json`).\n")


def test_times_block() -> str:
    """The latest timed ``make test`` runs on fresh clones (``records/test_times.json``, written by
    ``tools/time_tests.py``): the last run alone and the last run beside other copies."""
    runs = json.loads((RECORDS / "test_times.json").read_text())
    parts = []
    for label, pick in (("alone", lambda r: r["copies"] == 1), ("side by side", lambda r: r["copies"] > 1)):
        chosen = [r for r in runs if pick(r)]
        if not chosen:
            continue
        r = chosen[-1]
        times = " and ".join(f"{x['seconds'] / 60:.1f} min ({x['summary']})" for x in r["runs"])
        what = "one copy" if r["copies"] == 1 else f"{r['copies']} copies started together"
        parts.append(f"{label}, {what}: {times}; load average {r['load_average_before']} before, "
                     f"{r['load_average_after']} after ({r['date']}, commit {r['commit']}, {r['cores']} cores, "
                     f"{r['cpu']})")
    return ("`make test` timed on fresh clones (`tools/time_tests.py`, `records/test_times.json`): "
            + "; ".join(parts) + ".\n")


def chapter_times_block() -> str:
    record = load(ROOT / "book" / "runtimes.json")
    seconds = {k: v["seconds"] for k, v in record.items()}
    total = sum(seconds.values())
    dates = sorted({v["date"] for v in record.values()})
    cores = sorted({v["cores"] for v in record.values()})
    longest = sorted(seconds, key=seconds.get, reverse=True)[:3]
    over = [k for k in sorted(seconds) if seconds[k] > BUDGET]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    text = (f"The chapters' run times, one at a time (`book/runtimes.json`, measured {when} on a "
            f"{'/'.join(map(str, cores))}-core CPU), add up to {total / 60:.0f} min; the longest are "
            + ", ".join(f"{k} (about {rounded(seconds[k])})" for k in longest) + ". ")
    text += (f"Over the {BUDGET} s budget: " + ", ".join(over) + "." if over else
             f"Every chapter fits the {BUDGET} s budget.")
    return text + "\n"


def pdf_block() -> str:
    rec = load(RECORDS / "pdf.json")
    what = f"{rec['notebooks']} notebooks" + (f" and {rec['other_pages']} other pages" if "other_pages" in rec else
                                               " (a count of the table of contents' pages, Markdown ones included)")
    commit = f" at commit {rec['commit']}" if "commit" in rec else ", commit not recorded"
    return (f"Last recorded run ({rec['date']}{commit}, {rec['cores']} cores, {what}): {rec['pages']} pages, "
            f"{rec['formulas']} formulas, {rec['seconds_to_typeset']:.0f} s to typeset (`records/pdf.json`, "
            "written by `make pdf-numbers`; `make pdf` writes only under `_build`).\n")


def quickstart_block() -> str:
    rec = load(RESULTS / "bench_quickstart.json")
    s, env, data = rec["data"]["seconds"], rec["environment"], rec["data"]
    load_range = f"{data['load_average_before']:.0f} before the runs, {data['load_average_after']:.0f} after"
    return (f"How long: on a {env['cores']}-core {env['cpu']} shared with other jobs (load average {load_range}), "
            f"the snippet took {s['OMP_WAIT_POLICY=PASSIVE']:.0f} s with `OMP_WAIT_POLICY=PASSIVE` set before "
            f"Python starts (idle OpenMP threads sleep; every `make` target sets it), "
            f"{s['torch.set_num_threads(1)']:.0f} s with `torch.set_num_threads(1)` added after "
            f"`torch.manual_seed(0)`, and {s['as written']:.0f} s as written, where idle OpenMP threads spin and take "
            f"the cores from the thread that has work (`benchmarks/bench_quickstart.py`, {env['date']}). Spinning "
            "costs most when other jobs share the cores, as here: then `export OMP_WAIT_POLICY=PASSIVE` before "
            "starting Python, or use one thread. The OpenMP runtime reads the variable once, when torch loads, so a package "
            "imported after torch cannot set it.\n")


def pages_url(url: str) -> str:
    """GitHub Pages address of the repository ``https://github.com/OWNER/NAME``."""
    owner, name = url.rstrip("/").split("/")[-2:]
    return f"https://{owner.lower()}.github.io/{name}/"


def book_link() -> str:
    url = config_url(ROOT)
    return (f"Read it online once the built book is published with GitHub Pages: <{pages_url(url)}> "
            f"(repository: <{url}>).\n")


def install_block() -> str:
    url = config_url(ROOT)
    return ("```bash\n"
            "python3 -m venv ~/optbook-env                  # or any environment of yours\n"
            "# optional, first: PyTorch's CPU build (PyPI's torch on Linux is the CUDA build, several GB)\n"
            "~/optbook-env/bin/python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu\n"
            "~/optbook-env/bin/python -m pip install .      # the package alone, from this clone\n"
            f'~/optbook-env/bin/python -m pip install "optbook @ git+{url}"   # or straight from GitHub\n'
            "```\n")


CITATION = ROOT / "CITATION.cff"


def citation_fields(text: str) -> dict:
    """The top-level ``key: value`` lines of ``CITATION.cff`` (enough for the fields used here)."""
    return {m.group(1): m.group(2).strip().strip('"') for m in re.finditer(r"(?m)^([\w-]+): (.+)$", text)}


def citation_text(text: str) -> str:
    """``CITATION.cff`` with ``repository-code`` and ``url`` set from ``repository.url``."""
    url = config_url(ROOT)
    text = re.sub(r'(?m)^repository-code: .*$', f'repository-code: "{url}"', text)
    return re.sub(r'(?m)^url: .*$', f'url: "{pages_url(url)}"', text)


def citation_block() -> str:
    fields = citation_fields(citation_text(CITATION.read_text()))
    author = re.search(r'(?m)^  - name: "?([^"\n]+)"?$', CITATION.read_text()).group(1)
    year = re.search(r'(?m)^copyright: "?(\d{4})', (ROOT / "_config.yml").read_text()).group(1)
    return ("```bibtex\n@software{optbook,\n"
            f"  title   = {{{fields['title']}}},\n  author  = {{{{{author}}}}},\n  year    = {{{year}}},\n"
            f"  version = {{{fields['version']}}},\n  license = {{{fields['license']}}},\n"
            f"  url     = {{{fields['repository-code']}}}\n}}\n```\n")


def generate(key: str) -> str:
    if key.startswith("bench:"):
        return bench_block(key.split(":", 1)[1])
    makers = {"tests": tests_block, "test-times": test_times_block, "chapter-times": chapter_times_block, "muon-runs": muon_runs,
              "quickstart": quickstart_block, "limits-runs": limits_runs,
              "zero1-targets": zero1_targets, "compiled-runs": compiled_runs, "adamw-runs": adamw_runs, "fsdp2-runs": fsdp2_runs, "pdf": pdf_block,
              "book-link": book_link, "install": install_block, "citation": citation_block}
    if key not in makers:
        raise KeyError(f"README marker numbers:{key} names no record (known: {sorted(makers)} and bench:NAME)")
    return makers[key]()


def render(text: str) -> str:
    """``text`` with every marked block regenerated from its record."""
    return BLOCK_RE.sub(lambda m: m.group(1) + generate(m.group("key")) + m.group(4), text)


def record_tests(path: Path = RECORDS / "tests.json") -> dict:
    """Count the tests ``make test`` runs (``pytest --collect-only``) and write ``records/tests.json``."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-n", "0"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    found = re.search(r"(\d+) tests? collected", out.stdout)
    if out.returncode != 0 or not found:
        raise SystemExit(f"pytest --collect-only failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    rec = {"collected": int(found.group(1)), "date": datetime.date.today().isoformat(), "commit": commit}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README disagrees with the records")
    parser.add_argument("--write", action="store_true", help="rewrite the README's marked blocks")
    parser.add_argument("--record-tests", action="store_true", help="re-count the tests first (then --write)")
    args = parser.parse_args(argv)
    if not (args.check or args.write or args.record_tests):
        parser.error("give --check, --write or --record-tests")
    if args.record_tests:
        print(f"records/tests.json: {record_tests()}")
    stale = 0
    for path, make in [*((page, render) for page in PAGES), (CITATION, citation_text)]:
        text = path.read_text(encoding="utf-8")
        new = make(text)
        if new == text:
            continue
        if args.write or args.record_tests:
            path.write_text(new, encoding="utf-8")
            print(f"{path.relative_to(ROOT)}: rewritten from the records")
        else:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       path.name, f"{path.name} (from the records)"))
            print(f"{path.relative_to(ROOT)} disagrees with the records: run .venv/bin/python tools/readme_numbers.py --write",
                  file=sys.stderr)
            stale = 1
    return stale


if __name__ == "__main__":
    sys.exit(main())
