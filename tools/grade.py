#!/usr/bin/env python3
"""Grade students' copies of chapters against the hidden checks in ``grading/`` (``make grade NB=...``).

Each chapter with a graded exercise has an otter-grader test file ``grading/<chapter>.py`` (otter's
exception format: one file per exercise, one ``@test_case`` per point). A student's notebook is executed
from the top in a fresh kernel by otter-grader (``otter.execute.grade_notebook``; an error in a cell does
not stop the run), the checks read the names the exercise asks for (``answer_1_1``, ...), and this tool
prints each exercise's score with the checks' feedback::

    python tools/grade.py submissions/alice_02_adam.ipynb            # the chapter from the file name
    python tools/grade.py --chapter 02_adam submissions/*.ipynb --csv grades.csv   # a class, one table

The chapter is the longest chapter name (``02_adam``) contained in the notebook's file name, or
``--chapter``. The notebook runs with ``book/`` as its working directory, as the book's own do; it runs
the student's code with your permissions (otter's Docker mode is the sandbox for untrusted code).

Needs otter-grader (the ``grade`` extra: ``pip install -e '.[grade]'``; ``make grade`` installs it).

The solution cells that define the graded answers in the book are kept with their checks: ``SOLUTION``
and ``ANCHOR`` in each test file (read here without otter). ``--apply-edits`` inserts each missing one
into ``book/<chapter>.ipynb`` after the cell containing ``ANCHOR`` (and after the solution or check
cells that follow it); ``--edits-markdown`` prints the same edits as Markdown (``grading/NOTEBOOK_EDITS.md``).
The student build (``tools/student_build.py``) removes those cells and leaves ``answer_... = ...``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRADING = ROOT / "grading"
BOOK = ROOT / "book"


def test_files(chapter: str) -> list[Path]:
    """The otter test files of ``chapter`` (``grading/<chapter>.py`` and ``grading/<chapter>.*.py``)."""
    return sorted(p for p in GRADING.glob(f"{chapter}*.py") if p.stem.split(".")[0] == chapter)


def chapters() -> list[str]:
    """Every chapter that has a graded exercise."""
    return sorted({p.stem.split(".")[0] for p in GRADING.glob("[0-9]*.py")})


def chapter_of(notebook: Path) -> str:
    """The chapter whose name the notebook's file name contains (the longest such name).

    Raises:
        ValueError: no chapter's name is in the file name (pass ``--chapter``).
    """
    found = [c for c in chapters() if c in notebook.name]
    if not found:
        raise ValueError(f"notebook={str(notebook)!r}: its file name contains no chapter name "
                         f"({', '.join(chapters())}); pass --chapter")
    return max(found, key=len)


def spec(path: Path) -> dict:
    """``name``, ``ANCHOR``, ``SOLUTION`` and the graded answer names of a test file, read without running it."""
    values = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in ("name", "ANCHOR", "SOLUTION"):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    missing = {"name", "ANCHOR", "SOLUTION"} - set(values)
    if missing:
        raise ValueError(f"{path.name}: no {', '.join(sorted(missing))}")
    values["answers"] = _answers(values["SOLUTION"])
    if not values["answers"]:
        raise ValueError(f"{path.name}: its SOLUTION assigns no answer_... name")
    return values


def _answers(source: str) -> list[str]:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from student_build import graded_answers
    finally:
        sys.path.pop(0)
    return graded_answers(source)


def grade(notebook: Path, chapter: str | None = None) -> dict:
    """Execute ``notebook`` and run its chapter's checks; returns
    ``{"notebook", "chapter", "score", "possible", "exercises": [{"name", "score", "possible", "feedback"}]}``.

    Raises:
        FileNotFoundError: ``notebook`` does not exist.
        ValueError: unknown ``chapter``, or none found in the file name.
        ImportError: otter-grader is not installed.
    """
    notebook = Path(notebook).resolve()
    if not notebook.is_file():
        raise FileNotFoundError(f"notebook={str(notebook)!r}: no such file")
    chapter = chapter or chapter_of(notebook)
    files = test_files(chapter)
    if not files:
        raise ValueError(f"chapter={chapter!r}: no grading/{chapter}.py (graded: {', '.join(chapters())})")
    try:
        from otter.execute import grade_notebook
    except ImportError as e:
        raise ImportError("otter-grader is not installed: pip install -e '.[grade]' (or make grade)") from e
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "MPLBACKEND": "Agg"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.chdir(BOOK) if hasattr(contextlib, "chdir") else _chdir(BOOK):
            results = grade_notebook(str(notebook), tests_glob=[str(f) for f in files], test_dir=str(GRADING),
                                     ignore_errors=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    exercises = []
    for f in files:
        name = spec(f)["name"]
        try:
            result = results.get_result(name)
        except Exception:  # the checks never ran (the kernel died): no points, say why
            error = results.catastrophic_error or "the checks did not run"
            exercises.append({"name": name, "score": 0.0, "possible": None, "feedback": [str(error)]})
            continue
        feedback = [f"{r.test_case.name}: {_last_line(r.message)}" for r in result.test_case_results if not r.passed]
        exercises.append({"name": name, "score": float(result.score), "possible": float(result.possible),
                          "feedback": feedback})
    return {"notebook": str(notebook), "chapter": chapter, "exercises": exercises,
            "score": sum(e["score"] for e in exercises),
            "possible": sum(e["possible"] or 0.0 for e in exercises)}


def _last_line(message: str) -> str:
    """Otter's failure message ends with the exception (``AssertionError: <the check's feedback>``)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else message


@contextlib.contextmanager
def _chdir(path: Path):  # contextlib.chdir is Python 3.11+
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def report(result: dict) -> str:
    lines = [f"{Path(result['notebook']).name} ({result['chapter']}): "
             f"{result['score']:g} / {result['possible']:g}"]
    for e in result["exercises"]:
        possible = "?" if e["possible"] is None else f"{e['possible']:g}"
        lines.append(f"  {e['name']}: {e['score']:g} / {possible}")
        for message in e["feedback"]:
            lines += ["    " + line for line in message.splitlines() if line.strip()]
    return "\n".join(lines)


def apply_edits(paths: list[Path]) -> list[str]:
    """Insert each missing graded solution cell into its notebook (``book/<chapter>.ipynb`` by default);
    returns what was done, one line per chapter. The notebooks must be re-executed afterwards.

    Raises:
        ValueError: a notebook has no cell containing the test file's ``ANCHOR``.
    """
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from student_build import CODE_MARKERS, _first_line, graded_answers
    finally:
        sys.path.pop(0)
    done = []
    for path in paths:
        chapter = chapter_of(path)
        nb = json.loads(path.read_text(encoding="utf-8"))
        present = {n for c in nb["cells"] if c["cell_type"] == "code" for n in graded_answers("".join(c["source"]))}
        changed = False
        for f in test_files(chapter):
            s = spec(f)
            if set(s["answers"]) <= present:
                done.append(f"{path.name}: {s['name']} already there")
                continue
            at = next((i for i, c in enumerate(nb["cells"]) if s["ANCHOR"] in "".join(c["source"])), None)
            if at is None:
                raise ValueError(f"{path.name}: no cell contains {s['ANCHOR']!r} ({f.name})")
            at += 1
            while at < len(nb["cells"]) and nb["cells"][at]["cell_type"] == "code" and \
                    _first_line("".join(nb["cells"][at]["source"])).startswith(CODE_MARKERS):
                at += 1
            nb["cells"].insert(at, solution_cell(s))
            changed = True
            done.append(f"{path.name}: {s['name']} inserted as cell {at}")
        if changed:
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return done


def solution_cell(s: dict) -> dict:
    return {"cell_type": "code", "execution_count": None, "id": f"solution-{s['answers'][0]}".replace("_", "-"),
            "metadata": {"tags": ["hide-cell"]}, "outputs": [],
            "source": s["SOLUTION"].rstrip("\n").splitlines(keepends=True)}


def edits_markdown() -> str:
    out = ["## Graded exercises: one solution cell per chapter",
           "",
           "Apply all of them with `python tools/grade.py --apply-edits` (idempotent), then re-execute each "
           "changed notebook. Each cell is a code cell tagged `hide-cell`, inserted after the cell that "
           "contains the anchor (and after the `# Solution`/`# Checks` code cells right after it).", ""]
    for chapter in chapters():
        for f in test_files(chapter):
            s = spec(f)
            out += [f"### book/{chapter}.ipynb: {s['name']}", "",
                    f"After the cell containing `{s['ANCHOR']}`; checks in `grading/{f.name}`.", "",
                    "```python", s["SOLUTION"].rstrip("\n"), "```", ""]
    return "\n".join(out)


def points(path: Path) -> float:
    """The points of a test file: the sum of its ``@test_case(points=...)`` (1 where a case gives none)."""
    total = 0.0
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        for dec in getattr(node, "decorator_list", []):
            if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "test_case":
                given = [k.value for k in dec.keywords if k.arg == "points"]
                total += ast.literal_eval(given[0]) if given else 1
    return total


TABLE = GRADING / "teachers_table.md"


def teachers_table() -> str:
    """The teacher's guide's table (``book/teachers_guide.md`` includes ``grading/teachers_table.md``): per
    chapter in the order of ``_toc.yml``, the earlier chapters it cites (its prerequisites inside the book),
    the recorded run time of its notebook (``book/runtimes.json``), a reading time (Markdown words at 200
    a minute) and its graded exercise. ``--teachers-table`` rewrites the file; a test checks it is current."""
    import re

    toc = re.findall(r"(?m)^\s*(?:root|-\s*file):\s*book/(\S+)", (ROOT / "_toc.yml").read_text(encoding="utf-8"))
    runtimes = json.loads((BOOK / "runtimes.json").read_text(encoding="utf-8"))
    notebooks = [c for c in toc if (BOOK / f"{c}.ipynb").is_file()]
    rows = ["| Chapter | Builds on | Notebook run time | Reading | Graded exercise (answer, points) |",
            "|---|---|---|---|---|"]
    for i, chapter in enumerate(notebooks):
        nb = json.loads((BOOK / f"{chapter}.ipynb").read_text(encoding="utf-8"))
        text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        cited = set(re.findall(r"\{doc\}`(?:[^`<]*<)?(\w+)>?`", text))
        earlier = [c.split("_")[0] for c in notebooks[:i] if c in cited]
        words = len(re.findall(r"[A-Za-z]+", re.sub(r"\$[^$]*\$", " ", text)))
        run = runtimes.get(chapter, {}).get("seconds")
        graded = []
        for f in test_files(chapter):
            s = spec(f)
            graded.append(f"{s['name']} (`{'`, `'.join(s['answers'])}`, {points(f):g})")
        rows.append(f"| {{doc}}`{chapter}` | {', '.join(earlier) or '—'} | "
                    f"{'—' if run is None else f'{run:.0f} s'} | {max(5, 5 * round(words / 200 / 5))} min | "
                    f"{'; '.join(graded) or '— (no exercises)'} |")
    return ("<!-- Generated by `python tools/grade.py --teachers-table` from _toc.yml, book/runtimes.json and "
            "grading/: do not edit. -->\n\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="student notebooks to grade")
    parser.add_argument("--chapter", help="the chapter of every notebook (default: from each file name)")
    parser.add_argument("--json", type=Path, help="also write every result to this JSON file")
    parser.add_argument("--csv", type=Path, help="also write one row per notebook (scores per exercise)")
    parser.add_argument("--apply-edits", action="store_true",
                        help="insert the graded solution cells into the notebooks (default: every graded chapter)")
    parser.add_argument("--edits-markdown", action="store_true", help="print the notebook edits as Markdown")
    parser.add_argument("--teachers-table", action="store_true", help=f"rewrite {TABLE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.teachers_table:
        TABLE.write_text(teachers_table(), encoding="utf-8")
        print(f"wrote {TABLE.relative_to(ROOT)}")
        return 0
    if args.edits_markdown:
        print(edits_markdown())
        return 0
    if args.apply_edits:
        paths = args.notebooks or [BOOK / f"{c}.ipynb" for c in chapters()]
        print("\n".join(apply_edits(paths)))
        return 0
    if not args.notebooks:
        parser.error("give the notebooks to grade")
    results, failed = [], 0
    for nb in args.notebooks:
        try:
            result = grade(nb, args.chapter)
        except ImportError as e:
            print(f"not graded: {e}", file=sys.stderr)
            return 2
        except (FileNotFoundError, ValueError) as e:   # this notebook only: the others are graded
            print(f"{nb}: not graded: {e}", file=sys.stderr)
            failed += 1
            continue
        print(report(result), flush=True)
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if args.csv:
        names = sorted({e["name"] for r in results for e in r["exercises"]})
        with args.csv.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["notebook", "chapter", "score", "possible"] + names)
            for r in results:
                by_name = {e["name"]: e["score"] for e in r["exercises"]}
                writer.writerow([r["notebook"], r["chapter"], r["score"], r["possible"]]
                                + [by_name.get(n, "") for n in names])
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
