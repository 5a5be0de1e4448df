#!/usr/bin/env python3
"""Turn nbval's per-cell marker comments into the equivalent cell tags, so the reader does not see them.

nbval (0.11, ``nbval/plugin.py``) reads the same options from a comment line in the cell
(``# NBVAL_IGNORE_OUTPUT``) or from the cell's metadata tags (``nbval-ignore-output``): the tag is the
comment lower-cased with ``_`` as ``-``. This rewrites every code cell whose marker comments stand at the
top of the cell: the comment lines go, the tags are added (once), and nothing else changes (the outputs
and every other line stay byte for byte, so nbval compares exactly what it compared before). A marker
further down a cell is left alone and reported. Idempotent; standard library only::

    python tools/nbval_tags.py book/02_adam.ipynb ...   # rewrite in place, print what changed
    python tools/nbval_tags.py --check book/*.ipynb     # exit 1 if a marker comment is left
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MARKERS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_CHECK_OUTPUT", "NBVAL_RAISES_EXCEPTION", "NBVAL_SKIP")
MARKER_LINE = re.compile(r"^\s*#\s*(" + "|".join(MARKERS) + r")\s*$")


def tag_for(marker: str) -> str:
    """``NBVAL_IGNORE_OUTPUT`` -> ``nbval-ignore-output`` (nbval's ``metadata_tags``)."""
    return marker.lower().replace("_", "-")


def convert_cell(cell: dict) -> tuple[dict, list[str], list[str]]:
    """Return ``(cell, tags added, markers left in place)``; ``cell`` itself is not modified."""
    if cell.get("cell_type") != "code":
        return cell, [], []
    lines = "".join(cell.get("source", [])).splitlines(keepends=True)
    found = []
    while lines and MARKER_LINE.match(lines[0]):
        found.append(MARKER_LINE.match(lines.pop(0)).group(1))
    left = [m.group(1) for line in lines if (m := MARKER_LINE.match(line))]
    if not found:
        return cell, [], left
    metadata = dict(cell.get("metadata", {}))
    tags = list(metadata.get("tags", []))
    added = [tag_for(m) for m in found if tag_for(m) not in tags]
    metadata["tags"] = tags + added
    return dict(cell, source=lines, metadata=metadata), added, left


def convert(path: Path, write: bool = True) -> tuple[int, list[str]]:
    """Convert one notebook; returns ``(cells changed, problems)`` and rewrites it if ``write``."""
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    changed, problems, cells = 0, [], []
    for i, cell in enumerate(nb["cells"]):
        new, added, left = convert_cell(cell)
        if new is not cell:
            changed += 1
        problems += [f"{path}: code cell {i}: {m} is not on the cell's first lines; move it up" for m in left]
        cells.append(new)
    if changed and write:
        nb["cells"] = cells
        out = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
        path.write_text(out, encoding="utf-8")
    return changed, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a marker is left")
    args = parser.parse_args(argv)
    status = 0
    for path in args.notebooks:
        changed, problems = convert(path, write=not args.check)
        for p in problems:
            print(p, file=sys.stderr)
        if problems or (args.check and changed):
            status = 1
        if changed:
            print(f"{path}: {changed} cell(s) {'would change' if args.check else 'now use tags'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
