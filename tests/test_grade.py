"""`make grade` (tools/grade.py, otter-grader): every chapter with exercises has a graded one, the book's
solutions get full marks and a blank student notebook fewer.

The checks of all chapters run in-process against each solution cell (fast); one chapter is graded end to
end, the way `make grade` does it: the notebook executed from the top in a fresh kernel, then the checks.
The otter-grader parts need the `grade` extra (`pip install -e '.[grade]'`) and are skipped without it.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_tool, scaled_timeout

ROOT = Path(__file__).resolve().parents[1]



grade = load_tool("grade")
student_build = load_tool("student_build")
GRADED = grade.chapters()
FILES = [f for c in GRADED for f in grade.test_files(c)]


def _notebook(chapter):
    return json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text(encoding="utf-8"))


def test_every_chapter_with_exercises_is_graded():
    with_exercises = {p.stem for p in (ROOT / "book").glob("*.ipynb")
                      if student_build.has_exercises(json.loads(p.read_text(encoding="utf-8")))}
    assert "00_preface" not in with_exercises      # the preface has no exercises, so nothing to grade
    assert with_exercises == set(GRADED), (sorted(with_exercises - set(GRADED)), sorted(set(GRADED) - with_exercises))


def test_teachers_table_is_current():
    """book/teachers_guide.md includes grading/teachers_table.md: regenerated from _toc.yml, the recorded run
    times and grading/ (`python tools/grade.py --teachers-table`), so it cannot go stale."""
    assert grade.TABLE.read_text(encoding="utf-8") == grade.teachers_table()
    runtimes = json.loads((ROOT / "book" / "runtimes.json").read_text(encoding="utf-8"))
    row = next(line for line in grade.teachers_table().splitlines() if "`02_adam`" in line)
    assert f"| {runtimes['02_adam']['seconds']:.0f} s |" in row and "`answer_2_2`" in row and "| 01 |" in row


def test_student_copy_has_the_table_but_not_the_checks(tmp_path):
    out = tmp_path / "src"
    student_build.build(out)
    assert (out / "grading" / "teachers_table.md").is_file() and (out / "book" / "teachers_guide.md").is_file()
    assert not list((out / "grading").glob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_solution_cell_has_a_place_and_a_stub(path):
    """The solution cell goes after an existing cell of its chapter, and the student build turns it into
    an answer cell that names the answer and says what it is."""
    s = grade.spec(path)
    nb = _notebook(path.stem.split(".")[0])
    assert sum(s["ANCHOR"] in "".join(c["source"]) for c in nb["cells"]) >= 1, s["ANCHOR"]
    assert student_build._first_line(s["SOLUTION"]).startswith("# Solution")
    cell = grade.solution_cell(s)
    student, removed = student_build.strip_notebook(dict(nb, cells=[cell]))
    assert removed == 1 and len(student["cells"]) == 1
    stub = "".join(student["cells"][0]["source"])
    for name in s["answers"]:
        assert f"\n{name} = ...\n" in stub + "\n" and f"# {name}:" in stub


def _prelude(chapter):
    """The names a solution cell takes from the chapter above it (the cells before it define them)."""
    from optbook.optim import muon_scale
    env = {"math": math, "torch": torch, "muon_scale": muon_scale}
    if chapter == "07b_width_transfer":
        env["shapes"] = lambda d: [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    return env


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_checks_pass_the_solution_and_fail_the_blank(path):
    """Every check of the chapter passes on the book's solution and fails on the untouched answer cell."""
    pytest.importorskip("otter", reason="otter-grader is the `grade` extra: pip install -e '.[grade]'")
    from otter.test_files import ExceptionTestFile

    s = grade.spec(path)
    chapter = path.stem.split(".")[0]
    solved = _prelude(chapter)
    exec(compile(s["SOLUTION"], f"<{path.name} SOLUTION>", "exec"), solved)
    blank = _prelude(chapter)
    exec("".join(student_build.answer_stub(s["answers"], s["SOLUTION"])["source"]), blank)
    tests = ExceptionTestFile.from_file(str(path))
    tests.run(solved)
    assert tests.possible > 0
    assert tests.score == tests.possible, [r.message for r in tests.test_case_results if not r.passed]
    tests.run(blank)
    assert tests.score == 0, [r.message for r in tests.test_case_results if r.passed]


@pytest.mark.parametrize("chapter", ["05_newton_schulz", "10_anatomy_of_a_step"])
def test_grader_end_to_end(tmp_path, chapter):
    """tools/grade.py (what `make grade` runs) on the chapter with its solution cell: full marks; on the
    student build of it: fewer (none)."""
    pytest.importorskip("otter", reason="otter-grader is the `grade` extra: pip install -e '.[grade]'")
    full = tmp_path / f"full_{chapter}.ipynb"
    full.write_text((ROOT / "book" / f"{chapter}.ipynb").read_text(encoding="utf-8"), encoding="utf-8")
    grade.apply_edits([full])                       # a no-op once the book has the cell
    nb, _ = student_build.strip_notebook(json.loads(full.read_text(encoding="utf-8")))
    blank = tmp_path / f"student_{chapter}.ipynb"
    blank.write_text(json.dumps(nb), encoding="utf-8")
    out = tmp_path / "grades.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "grade.py"), str(full), str(blank), "--json", str(out)],
                         capture_output=True, text=True, timeout=scaled_timeout(200))
    assert run.returncode == 0, run.stderr[-3000:]
    solved, unsolved = json.loads(out.read_text())
    assert solved["possible"] > 0 and solved["score"] == solved["possible"], run.stdout
    assert unsolved["possible"] == solved["possible"] and unsolved["score"] < solved["possible"], run.stdout
    assert unsolved["score"] == 0 and "not filled in" in run.stdout


def test_notebook_edits_apply_once(tmp_path):
    """tools/apply_notebook_edits.py finds the place of every graded solution cell and every figure in
    the book, inserts each once (a second run changes nothing), and the student build turns each graded
    cell into its answer cell; grading/NOTEBOOK_EDITS.md is what the tool prints."""
    edits = load_tool("apply_notebook_edits")
    chapters = sorted(set(GRADED) | {f["chapter"] for f in edits.figures()})
    paths = []
    for chapter in chapters:
        (tmp_path / f"{chapter}.ipynb").write_bytes((ROOT / "book" / f"{chapter}.ipynb").read_bytes())
        paths.append(tmp_path / f"{chapter}.ipynb")
    assert edits.main([str(p) for p in paths]) == 0
    first = {p: p.read_bytes() for p in paths}
    assert edits.main(["--check"] + [str(p) for p in paths]) == 0
    assert edits.main([str(p) for p in paths]) == 0 and {p: p.read_bytes() for p in paths} == first
    for path in paths:
        nb = json.loads(path.read_text(encoding="utf-8"))
        names = {f["name"] for f in edits.figures() if f["chapter"] == path.stem}
        cells = [c for c in nb["cells"] if c["metadata"].get("mystnb", {}).get("figure", {}).get("name") in names]
        assert len(cells) == len(names) and all(c["metadata"]["tags"] == ["remove-input"] for c in cells)
        assert all("Try it:" in c["metadata"]["mystnb"]["figure"]["caption"] for c in cells)
        student, _ = student_build.strip_notebook(nb)
        stubs = [n for c in student["cells"] if "graded-answer" in c["metadata"].get("tags", [])
                 for n in student_build.graded_answers("".join(c["source"]))]
        assert stubs == [n for f in grade.test_files(path.stem) for n in grade.spec(f)["answers"]]
    assert (ROOT / "grading" / "NOTEBOOK_EDITS.md").read_text(encoding="utf-8") == edits.markdown() + "\n"
