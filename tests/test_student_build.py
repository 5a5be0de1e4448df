"""The student build (tools/student_build.py, `make student`) removes every solution and nothing else."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("student_build", ROOT / "tools" / "student_build.py")
student_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(student_build)
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))


def text(nb, kind=None):
    return "\n".join("".join(c["source"]) for c in nb["cells"] if kind is None or c["cell_type"] == kind)


def headings(markdown: str) -> list[str]:
    """The Markdown headings, not the comment lines of fenced code (a solution's code starts lines with #)."""
    prose = re.sub(r"(?ms)^(`{3,}|~{3,}).*?^\1[ \t]*$", "", markdown)
    return re.findall(r"(?m)^#+ .*$", prose)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_solutions_go_and_exercises_stay(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    student, removed = student_build.strip_notebook(nb)
    md = text(student, "markdown")
    assert "{admonition} Solution" not in md
    assert not any(c["cell_type"] == "code" and student_build._first_line("".join(c["source"])).startswith("# Solution")
                   for c in student["cells"])
    assert "Checks of the numbers quoted in the solutions" not in text(student, "code")
    # Exercises, their headings and every non-solution cell survive unchanged.
    assert headings(md) == headings(text(nb, "markdown"))
    kept = [c for c in nb["cells"] if c["cell_type"] == "code"
            and not student_build._first_line("".join(c["source"])).startswith(student_build.CODE_MARKERS)]
    # A removed solution that assigns graded answers leaves the answer cell for the student (make grade).
    stubs = [c for c in student["cells"] if "graded-answer" in c["metadata"].get("tags", [])]
    assert [c for c in student["cells"] if c["cell_type"] == "code" and c not in stubs] == kept
    graded = [n for c in nb["cells"] if c["cell_type"] == "code" and _first_line_is_solution(c)
              for n in student_build.graded_answers("".join(c["source"]))]
    assert [n for c in stubs for n in student_build.graded_answers("".join(c["source"]))] == graded
    if student_build.has_exercises(nb):
        assert removed >= 3, f"{path.name}: a chapter with exercises should have at least three solutions"


def _first_line_is_solution(cell):
    return student_build._first_line("".join(cell["source"])).startswith("# Solution")


def test_graded_solution_leaves_an_answer_cell():
    solution = ("# Solution 1 (graded): the first t.\n# answer_1_1: (t for 0.9, t for 0.99)\n"
                "import math\nanswer_1_1 = (44, 459)\ndef answer_1_2(k):\n    return k\nother = 3\n")
    nb = {"cells": [{"cell_type": "code", "id": "a", "metadata": {}, "outputs": [], "execution_count": 1,
                     "source": solution.splitlines(keepends=True)},
                    {"cell_type": "code", "id": "b", "metadata": {}, "outputs": [], "execution_count": 2,
                     "source": ["# Solution 2: not graded\n", "x = 1\n"]}]}
    student, removed = student_build.strip_notebook(nb)
    assert removed == 2 and len(student["cells"]) == 1
    assert "".join(student["cells"][0]["source"]) == (
        student_build.STUB_HEADER + "\n# answer_1_1: (t for 0.9, t for 0.99)\nanswer_1_1 = ...\nanswer_1_2 = ...")
    assert student["cells"][0]["id"] == "graded-answer_1_1" and student["cells"][0]["outputs"] == []


def test_admonition_removal_is_exact():
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": [
        "### Exercise 1\n", "\n", "Prove it.\n", "\n", ":::{admonition} Solution\n", ":class: dropdown\n",
        "\n", "Because $a = b$.\n", ":::\n", "\n", "### Exercise 2\n"]}]}
    student, removed = student_build.strip_notebook(nb)
    assert removed == 1
    assert "".join(student["cells"][0]["source"]) == "### Exercise 1\n\nProve it.\n\n\n### Exercise 2\n"
    assert "Because" in "".join(nb["cells"][0]["source"])   # the input is not modified


def test_student_branch_for_launch_buttons(tmp_path):
    """The student copy names the branch its launch buttons open, is that branch's whole content (Binder
    installs its requirements.txt, which takes the package from the book's branch: there is no src/), and
    the site extension turns the record into the theme's repository branch."""
    out = tmp_path / "src"
    student_build.build(out)
    record = json.loads((out / student_build.MARKER).read_text())
    assert record == {"branch": "student", "path_to_book": ""}
    requirements = (out / "requirements.txt").read_text()
    assert not re.search(r"(?m)^-e \.", requirements)
    assert "optbook @ git+https://github.com/optbook/optimizers-derived@main" in requirements
    assert (out / "book" / "02_adam.ipynb").is_file() and (out / "_config.yml").is_file()

    spec = importlib.util.spec_from_file_location("optbook_site", ROOT / "_ext" / "optbook_site.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    from types import SimpleNamespace

    config = SimpleNamespace(html_theme_options={"repository_url": "u", "repository_branch": "main"})
    site.student_launch_buttons(SimpleNamespace(srcdir=str(out)), config)
    assert config.html_theme_options["repository_branch"] == "student"
    assert config.html_theme_options["path_to_docs"] == ""
    book = SimpleNamespace(html_theme_options={"repository_branch": "main"})
    site.student_launch_buttons(SimpleNamespace(srcdir=str(ROOT)), book)  # the book itself: unchanged
    assert book.html_theme_options == {"repository_branch": "main"}


def test_student_branch_is_not_the_books(tmp_path):
    with pytest.raises(ValueError, match="branch='main'"):
        student_build.build(tmp_path / "src", branch="main")
    with pytest.raises(ValueError, match="branch=''"):
        student_build.build(tmp_path / "src", branch="")
