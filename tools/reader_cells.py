#!/usr/bin/env python3
"""Make code cells show the reader the computation, not the test harness (standard library only).

Two mechanical rewrites of ``book/*.ipynb``, idempotent, that leave every output nbval compares as it is:

* **Solutions stay closed.** A code cell whose first line starts with ``# Solution`` is tagged
  ``hide-cell`` (myst-nb folds its source *and* its output under one toggle, "Show the solution"),
  instead of ``hide-input``, which showed the answer under the exercise before the reader asked.
* **No bare return values.** A cell whose last line is an expression that returns a number (``glue``,
  ``assert_claim``) printed it as the cell's result (``0.03``). A ``;`` is put at the end of that line
  (before a trailing comment) and the stored result, which IPython no longer produces, is dropped.
* **Equations by their number.** With ``--site _build/html`` (a built book), a comment that names an
  equation by its label (``# eq-adam-m``) names it by the number the reader sees (``# (2.3)``). Only
  comments change; strings (claim names, printed text) are left alone.

    python tools/reader_cells.py book/10_anatomy_of_a_step.ipynb ...   # rewrite in place
    python tools/reader_cells.py --check book/*.ipynb                  # exit 1 if something would change
    python tools/reader_cells.py --site _build/html book/*.ipynb       # also equation labels in comments
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tokenize
from pathlib import Path

SOLUTION = re.compile(r"^#\s*Solutions?\b")
# What a reader should not see as a cell's result: a number, a bool or None, or a tuple/list of them.
_ATOM = r"[-+]?(?:\d[\d_,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|True|False|None|nan|inf|np\.float64\([^)]*\)"
BARE = re.compile(rf"^[\s(\[]*(?:{_ATOM})(?:[\s,]+(?:{_ATOM}))*[\s,)\]]*$")
PROMPTS = {"code_prompt_show": "Show the solution", "code_prompt_hide": "Hide the solution"}


def _first_line(source: str) -> str:
    lines = (line.strip() for line in source.splitlines())
    return next((line for line in lines if line and not line.startswith("# NBVAL_")), "")


def _silence_last_line(source: str) -> str | None:
    """``source`` with ``;`` ending its last statement (before a trailing comment), or None if unsure."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    code = [t for t in tokens if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT,
                                                 tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)]
    if not code or code[-1].string == ";":
        return None
    row, col = code[-1].end
    lines = source.splitlines(keepends=True)
    line = lines[row - 1]
    lines[row - 1] = line[:col] + ";" + line[col:]
    return "".join(lines)


LABEL = re.compile(r"\((eq-[a-z0-9]+(?:-[a-z0-9]+)*)\)|\b(eq-[a-z0-9]+(?:-[a-z0-9]+)*)\b")


def equation_numbers(site: Path) -> dict[str, str]:
    """``{label: "(2.3)"}`` from a built book: Sphinx writes ``<span class="eqno">(2.3)`` before the
    anchor ``id="equation-<label>"``."""
    numbers = {}
    pattern = re.compile(r'<span class="eqno">(\([^)<]*\))<a class="headerlink" href="#equation-([^"]+)"')
    for page in site.rglob("*.html"):
        for number, label in pattern.findall(page.read_text(encoding="utf-8", errors="replace")):
            numbers[label] = number
    return numbers


def _number_comments(source: str, numbers: dict[str, str]) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    lines = source.splitlines(keepends=True)
    for tok in reversed([t for t in tokens if t.type == tokenize.COMMENT]):
        new = LABEL.sub(lambda m: numbers.get(m.group(1) or m.group(2), m.group(0)), tok.string)
        if new != tok.string:
            row, col = tok.start
            line = lines[row - 1]
            lines[row - 1] = line[:col] + new + line[col + len(tok.string):]
    return "".join(lines)


def rewrite_cell(cell: dict, numbers: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """Return ``(cell, what changed)``; ``cell`` itself is not modified."""
    if cell.get("cell_type") != "code":
        return cell, []
    source = "".join(cell.get("source", []))
    changes = []
    if numbers:
        numbered = _number_comments(source, numbers)
        if numbered != source:
            source = numbered
            changes.append("equation labels in comments numbered")
    metadata = dict(cell.get("metadata", {}))
    tags = list(metadata.get("tags", []))
    if SOLUTION.match(_first_line(source)) and "hide-cell" not in tags:
        tags = [t for t in tags if t not in ("hide-input", "hide-output")] + ["hide-cell"]
        metadata["tags"] = tags
        metadata["mystnb"] = dict(metadata.get("mystnb", {}), **PROMPTS)
        changes.append("solution folded (hide-cell)")
    outputs = cell.get("outputs", [])
    results = [o for o in outputs if o.get("output_type") == "execute_result"]
    bare = [o for o in results if set(o.get("data", {})) == {"text/plain"}
            and BARE.match("".join(o["data"]["text/plain"]))]
    if bare:
        quiet = _silence_last_line(source)
        if quiet is not None:
            source = quiet
            outputs = [o for o in outputs if o not in bare]
            changes.append("bare result silenced: " + "".join(bare[0]["data"]["text/plain"])[:40])
    if not changes:
        return cell, []
    return dict(cell, source=source.splitlines(keepends=True), metadata=metadata, outputs=outputs), changes


def rewrite(path: Path, write: bool = True, numbers: dict[str, str] | None = None) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    report, cells = [], []
    for i, cell in enumerate(nb["cells"]):
        new, changes = rewrite_cell(cell, numbers)
        report += [f"{path}: cell {i}: {c}" for c in changes]
        cells.append(new)
    if report and write:
        nb["cells"] = cells
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a cell would change")
    parser.add_argument("--site", type=Path, help="a built book (_build/html): number equation labels in comments")
    args = parser.parse_args(argv)
    numbers = equation_numbers(args.site) if args.site else None
    if args.site and not numbers:
        parser.error(f"no numbered equations found under {args.site}")
    changed = False
    for path in args.notebooks:
        for line in rewrite(path, write=not args.check, numbers=numbers):
            print(line)
            changed = True
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
