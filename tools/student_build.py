#!/usr/bin/env python3
"""Write the book without its solutions, for handing to students (``make student``).

The book hides solutions in two forms, and both go:

* a Markdown block ``:::{admonition} Solution`` ... ``:::`` (chapters whose solutions are prose);
* a code cell whose first line, after any ``# NBVAL_...`` marker, starts with ``# Solution`` (chapters
  whose solutions are code), and the hidden cell that re-checks the numbers quoted in the solutions
  (its first line is ``# Checks of the numbers quoted in the solutions``).

A removed code solution that assigns a graded answer (a top-level name ``answer_...``, which
``make grade`` checks: ``grading/``) leaves an answer cell in its place, ``answer_... = ...``, for the student to
fill in. Everything else (exercises, text, the outputs of the remaining cells) is kept byte for byte, and the
notebooks stay valid nbformat JSON. The copy goes to ``_build/student/src`` (configuration, table of
contents, ``book/``, ``_static/``, ``_ext/``, the conformance table the appendix includes), where
``make student`` builds it into ``_build/student/_build/html``; the notebooks there are the ones to hand out. Standard library only::

    python tools/student_build.py            # write _build/student/src, print what was removed
    python tools/student_build.py --check    # exit 1 if some chapter has exercises but nothing to remove
    python tools/student_build.py --branch student-2027   # launch buttons to another branch

**Launch buttons.** The student site's Colab and Binder buttons must open the student notebooks, not
the full ones that the repository's ``main`` holds. They open ``book/<chapter>.ipynb`` on the branch
``student`` (``--branch``) of the repository in ``_config.yml``: ``_build/student/src`` is that branch's
whole content (the notebooks without solutions, the configuration, and a ``requirements.txt`` that
installs ``optbook`` from the main branch instead of ``-e .``, for Binder), to be pushed as it is, e.g.
``git -C _build/student/src init -b student && git -C _build/student/src add -A && git -C
_build/student/src commit -m student && git -C _build/student/src push --force <repository> student``.
The branch is recorded in ``_build/student/src/_student.json``, which ``_ext/optbook_site.py`` reads
when it builds that copy (``make student`` writes its own ``_config.yml`` from the book's, so the
branch cannot live there); jupyter-book then builds
``https://colab.research.google.com/github/<owner>/<name>/blob/student/book/<chapter>.ipynb`` and
``https://mybinder.org/v2/gh/<owner>/<name>/student?urlpath=tree/book/<chapter>.ipynb``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "_build" / "student" / "src"
BRANCH = "student"  # the repository branch that holds the student notebooks (see the docstring)
MARKER = "_student.json"
COPY = ["_config.yml", "_toc.yml", "_static", "_ext",
        "tests/conformance_table.md",  # included by book/appendix_conformance.md
        "grading/teachers_table.md"]   # included by book/teachers_guide.md (the checks in grading/ stay behind)

# A fenced MyST admonition titled Solution, with a colon fence of 3+ colons, up to its closing fence.
ADMONITION_RE = re.compile(r"(?ms)^(?P<fence>:{3,})\{admonition\}\s*Solutions?\b.*?^(?P=fence)[ \t]*\n?")
CODE_MARKERS = ("# Solution", "# Checks of the numbers quoted in the solutions")
POINTER_RE = re.compile(r"(?m)^The solutions are below[^\n]*\n?")


ANSWER_RE = re.compile(r"answer_\w+")
STUB_HEADER = "# Your answer (graded by `make grade`): replace each ... by your value."


def graded_answers(source: str) -> list[str]:
    """Names ``answer_...`` that a code cell assigns at its top level, in order (none if it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name) and ANSWER_RE.fullmatch(leaf.id) and leaf.id not in names:
                    names.append(leaf.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ANSWER_RE.fullmatch(node.name) \
                and node.name not in names:
            names.append(node.name)
    return names


def answer_stub(names: list[str], source: str = "") -> dict:
    """The code cell that replaces a removed solution assigning the graded ``names``; the solution's
    comment lines that describe an answer (``# answer_1_1: ...``) are kept."""
    described = [line for line in source.splitlines() if re.match(r"#\s*answer_\w+\s*:", line)]
    lines = [STUB_HEADER] + described + [f"{name} = ..." for name in names]
    source = "\n".join(lines)
    return {"cell_type": "code", "execution_count": None, "id": f"graded-{names[0]}"[:64],
            "metadata": {"tags": ["graded-answer"]},
            "outputs": [], "source": source.splitlines(keepends=True)}


def _first_line(source: str) -> str:
    for line in source.splitlines():
        if line.strip() and not line.startswith("# NBVAL"):
            return line
    return ""


def strip_notebook(nb: dict) -> tuple[dict, int]:
    """Return ``(notebook without solutions, number of solutions removed)``; ``nb`` is not modified.

    A removed ``# Solution`` cell that assigns graded answers (:func:`graded_answers`) is replaced by
    :func:`answer_stub` of those names."""
    cells, removed = [], 0
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and _first_line(source).startswith(CODE_MARKERS):
            removed += 1
            names = graded_answers(source)
            if names and _first_line(source).startswith("# Solution"):
                cells.append(answer_stub(names, source))
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


def _repository() -> tuple[str, str]:
    """``(url, branch)`` of ``repository:`` in ``_config.yml`` (read without a YAML library)."""
    text = (ROOT / "_config.yml").read_text(encoding="utf-8")
    block = re.search(r"(?ms)^repository:\n((?:[ \t]+.*\n?)*)", text)
    fields = dict(re.findall(r"(?m)^[ \t]+(\w+):[ \t]*\"?([^\"\n#]*?)\"?[ \t]*(?:#.*)?$", block.group(1) if block else ""))
    return fields.get("url", "").rstrip("/"), fields.get("branch", "main") or "main"


def student_requirements(text: str, url: str, branch: str) -> str:
    """``requirements.txt`` for the student branch: ``-e .`` (there is no package there) becomes the
    package from ``branch`` of ``url``."""
    if not url:
        raise ValueError("_config.yml has no repository url: the student branch cannot install optbook")
    return re.sub(r"(?m)^-e \.[ \t]*$", f"optbook @ git+{url}@{branch}", text)


def build(out: Path = OUT, branch: str = BRANCH) -> dict[str, int]:
    """Write the student copy to ``out``; returns ``{notebook name: solutions removed}``. ``branch``:
    the repository branch the student site's launch buttons open (recorded in ``out/_student.json``).

    Raises:
        ValueError: ``branch`` is empty or is the book's own branch (the buttons would open the full
            notebooks), or ``_config.yml`` names no repository.
    """
    url, main_branch = _repository()
    if not branch or branch == main_branch:
        raise ValueError(f"branch={branch!r}: the student notebooks need a branch of their own, not "
                         f"{main_branch!r}, which holds the notebooks with their solutions")
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
    (out / "requirements.txt").write_text(
        student_requirements((ROOT / "requirements.txt").read_text(encoding="utf-8"), url, main_branch),
        encoding="utf-8")
    (out / MARKER).write_text(json.dumps({"branch": branch, "path_to_book": ""}) + "\n", encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that every chapter's solutions are found")
    parser.add_argument("--branch", default=BRANCH, help="repository branch of the student notebooks "
                        f"(the launch buttons open it; default {BRANCH})")
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
    for name, removed in build(branch=args.branch).items():
        print(f"{name}: {removed} solution block(s) removed")
    print(f"student copy written to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
