#!/usr/bin/env python3
"""Point the book at one GitHub repository: ``repository.url`` in ``_config.yml`` and the install line
of every notebook's first code cell (``%pip install --quiet "optbook @ git+<url>"``).

Jupyter Book derives the repository, issue, Colab and Binder buttons from ``repository.url``; the install
line is the one copy of the URL that lives in the notebooks, so that a chapter opened on Colab installs
the package from the same repository. A fork runs, from the repository root::

    python tools/set_repository_url.py https://github.com/OWNER/NAME   # rewrite _config.yml + book/*.ipynb
    python tools/set_repository_url.py --check                         # exit 1 if they disagree

Only the URL's characters change: the notebooks are edited as text (no re-serialisation, outputs and
metadata untouched), and ``_config.yml`` keeps its comments. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Colab's /github/ route and Binder's gh provider (which Jupyter Book's launch buttons use) need GitHub.
URL_RE = re.compile(r"^https://github\.com/[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
# The install line as it appears inside a notebook's JSON text (the quote is escaped there as \").
INSTALL_RE = re.compile(r'(%pip install --quiet \\"optbook @ git\+)([^"\\\s]+)(\\")')
# The same line in a cell's source (after JSON decoding).
INSTALL_SOURCE_RE = re.compile(r'%pip install --quiet "optbook @ git\+([^"\s]+)"')


def normalise(url: str) -> str:
    """``https://github.com/OWNER/NAME`` from the forms people paste (trailing ``/`` or ``.git``)."""
    url = url.strip().rstrip("/")
    url = url.removesuffix(".git")
    if not URL_RE.match(url):
        raise ValueError(f"expected https://github.com/OWNER/NAME, got {url!r}")
    return url


def _repository_url_line(lines: list[str]) -> int:
    """Index of the ``url:`` line inside the top-level ``repository:`` block of ``_config.yml``."""
    inside = False
    for i, line in enumerate(lines):
        if re.match(r"^repository:\s*(#.*)?$", line):
            inside = True
        elif inside and re.match(r"^\S", line) and not line.startswith("#"):
            break  # the next top-level key: the block had no url
        elif inside and re.match(r"^\s+url:", line):
            return i
    raise ValueError("_config.yml has no repository.url")


def config_url(root: Path = ROOT) -> str:
    lines = (root / "_config.yml").read_text(encoding="utf-8").splitlines()
    value = lines[_repository_url_line(lines)].split(":", 1)[1].split(" #", 1)[0].strip()
    return value.strip("\"'")


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "book").glob("*.ipynb"))


def notebook_urls(path: Path) -> list[str]:
    """Every install URL in the notebook's code cells (one expected, in the first code cell)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    urls = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            urls += INSTALL_SOURCE_RE.findall(source)
    return urls


def set_url(url: str, root: Path = ROOT) -> list[Path]:
    """Rewrite ``_config.yml`` and every notebook to ``url``; return the files that changed."""
    url = normalise(url)
    changed = []
    config = root / "_config.yml"
    text = config.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    i = _repository_url_line([line.rstrip("\n") for line in lines])
    indent = re.match(r"^(\s+)url:", lines[i]).group(1)
    new_line = f"{indent}url: {url}\n"
    if lines[i] != new_line:
        lines[i] = new_line
        config.write_text("".join(lines), encoding="utf-8")
        changed.append(config)
    for path in notebooks(root):
        text = path.read_text(encoding="utf-8")
        new, count = INSTALL_RE.subn(lambda m: m.group(1) + url + m.group(3), text)
        if count == 0:
            print(f"warning: {path.relative_to(root)} has no install line", file=sys.stderr)
        if new != text:
            json.loads(new)  # still valid JSON
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def mismatches(root: Path = ROOT) -> list[str]:
    """Human-readable disagreements between ``repository.url`` and the notebooks (empty when in sync)."""
    url = config_url(root)
    problems = []
    for path in notebooks(root):
        found = notebook_urls(path)
        if found != [url]:
            problems.append(f"{path.relative_to(root)}: install URL(s) {found}, _config.yml has {url}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", help="https://github.com/OWNER/NAME")
    parser.add_argument("--check", action="store_true", help="only check that every copy agrees")
    parser.add_argument("--root", type=Path, default=ROOT, help="book root (default: this repository)")
    args = parser.parse_args(argv)
    if args.check == bool(args.url):
        parser.error("give a URL, or --check")
    if args.url:
        try:
            changed = set_url(args.url, args.root)
        except ValueError as e:
            parser.error(str(e))
        for path in changed:
            print(f"rewrote {path.relative_to(args.root)}")
        print(f"repository URL: {config_url(args.root)} ({len(changed)} file(s) changed)")
    problems = mismatches(args.root)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
