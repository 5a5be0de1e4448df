#!/usr/bin/env python3
"""Write the book without its solutions, for handing to students (``make student``).

The book hides solutions in two forms, and both go:

* a Markdown block ``:::{admonition} Solution`` ... ``:::`` (chapters whose solutions are prose);
* a code cell whose first line, after any ``# NBVAL_...`` marker, starts with ``# Solution`` (chapters
  whose solutions are code), and the hidden cell that re-checks the numbers quoted in the solutions
  (its first line is ``# Checks of the numbers quoted in the solutions``).

Everything else (exercises, text, the outputs of the remaining cells) is kept byte for byte, and the
notebooks stay valid nbformat JSON. The copy goes to ``_build/student/src`` (configuration, table of
contents, ``book/``, ``_static/``, ``_ext/``, the conformance table the appendix includes), where
``make student`` builds it into ``_build/student/_build/html``; the notebooks there are the ones to hand out. Standard library only::

    python tools/student_build.py            # write _build/student/src, print what was removed
    python tools/student_build.py --check    # exit 1 if some chapter has exercises but nothing to remove
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "_build" / "student" / "src"
COPY = ["_config.yml", "_toc.yml", "_static", "_ext",
        "tests/conformance_table.md"]  # included by book/appendix_conformance.md

# A fenced MyST admonition titled Solution, with a colon fence of 3+ colons, up to its closing fence.
ADMONITION_RE = re.compile(r"(?ms)^(?P<fence>:{3,})\{admonition\}\s*Solutions?\b.*?^(?P=fence)[ \t]*\n?")
CODE_MARKERS = ("# Solution", "# Checks of the numbers quoted in the solutions")
POINTER_RE = re.compile(r"(?m)^The solutions are below[^\n]*\n?")


def _first_line(source: str) -> str:
    for line in source.splitlines():
        if line.strip() and not line.startswith("# NBVAL"):
            return line
    return ""


def strip_notebook(nb: dict) -> tuple[dict, int]:
    """Return ``(notebook without solutions, number of solutions removed)``; ``nb`` is not modified."""
    cells, removed = [], 0
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and _first_line(source).startswith(CODE_MARKERS):
            removed += 1
            continue
        if cell["cell_type"] == "markdown":
            new, n = ADMONITION_RE.subn("", source)
            new = POINTER_RE.sub("", new)
            if new != source:
                removed += n
                cell = dict(cell, source=new.splitlines(keepends=True))
        cells.append(cell)
    return dict(nb, cells=cells), removed


def has_exercises(nb: dict) -> bool:
    return any(cell["cell_type"] == "markdown" and re.search(r"(?m)^#+\s*Exercises", "".join(cell["source"]))
               for cell in nb["cells"])


def build(out: Path = OUT) -> dict[str, int]:
    """Write the student copy to ``out``; returns ``{notebook name: solutions removed}``."""
    if out.exists():
        shutil.rmtree(out)
    (out / "book").mkdir(parents=True)
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, out / name)
        elif src.exists():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / name)
    report = {}
    for path in sorted((ROOT / "book").iterdir()):
        if path.suffix == ".ipynb":
            nb, removed = strip_notebook(json.loads(path.read_text(encoding="utf-8")))
            (out / "book" / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            report[path.name] = removed
        elif path.is_file():
            shutil.copy2(path, out / "book" / path.name)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that every chapter's solutions are found")
    args = parser.parse_args(argv)
    if args.check:
        missing = []
        for path in sorted((ROOT / "book").glob("*.ipynb")):
            nb = json.loads(path.read_text(encoding="utf-8"))
            if has_exercises(nb) and strip_notebook(nb)[1] == 0:
                missing.append(path.name)
        if missing:
            print("exercises but no recognisable solutions:", ", ".join(missing))
            return 1
        print("every chapter with exercises has solutions the student build removes")
        return 0
    for name, removed in build().items():
        print(f"{name}: {removed} solution block(s) removed")
    print(f"student copy written to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
