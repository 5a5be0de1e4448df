#!/usr/bin/env python3
"""Write or check the composition matrix of ``book/api_contract.md`` (the README links it) from the outcome of
every cell of ``tests/composition_matrix.py``: the single-process cells run here, the distributed ones in one
launch of gloo processes (about a minute on 2 cores). The section between ``<!-- composition-matrix:start -->``
and ``<!-- composition-matrix:end -->`` is :func:`composition_matrix.render` of that table, never written by
hand; ``tests/test_composition_matrix.py`` fails when the page differs (``OPTBOOK_UPDATE_README=1`` there
rewrites it too).

::

    python tools/composition_matrix.py           # rewrite the section from a fresh run of every cell
    python tools/composition_matrix.py --check   # exit 1 (and a diff) when the page differs
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "book" / "api_contract.md"
NAME = "composition-matrix"


def rewrite(text: str, body: str, name: str = NAME) -> str:
    """``text`` with the section ``name`` (between its marker lines) replaced by ``body``.

    Raises:
        ValueError: the page lacks the markers, or holds them more than once or out of order.
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"Invalid page: expected one {start} followed by one {end}")
    i, j = text.index(start) + len(start), text.index(end)
    return text[:i] + "\n" + body.strip("\n") + "\n" + text[j:]


def generated() -> str:
    """The section's body from a fresh run of every cell."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]
    from composition_matrix import matrix_table, render

    with tempfile.TemporaryDirectory() as directory:
        return render(matrix_table(directory))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs; write nothing")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    new = rewrite(text, generated())
    if args.check:
        if new != text:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       str(PAGE), "generated"))
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
