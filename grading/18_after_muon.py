"""Chapter 18, Exercise 18.2: the rank at which Dion's exchange costs as much as the matrix.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 18.2"
ANCHOR = "### Exercise 18.2"
SOLUTION = """\
# Solution 18.2 (graded): (m + n) r = m n.
# answer_18_2: (break-even rank of 4096 x 4096, of 4096 x 16384), r may be fractional
answer_18_2 = tuple(m * n / (m + n) for m, n in ((4096, 4096), (4096, 16384)))
"""


def _break_even(m, n):
    """The rank r at which P (m x r) and R (n x r) hold as many numbers as the m x n matrix."""
    return next(r for r in range(1, min(m, n) + 1) if (m + n) * r >= m * n)


@test_case(points=1)
def square(answer_18_2):
    assert answer_18_2 is not ... and answer_18_2 is not None, "answer_18_2 is not filled in yet"
    assert abs(float(answer_18_2[0]) - _break_even(4096, 4096)) < 1, \
        f"4096 x 4096: rank {answer_18_2[0]}; P is m x r and R is n x r"


@test_case(points=1)
def wide(answer_18_2):
    assert answer_18_2 is not ... and answer_18_2 is not None, "answer_18_2 is not filled in yet"
    assert abs(float(answer_18_2[1]) - _break_even(4096, 16384)) < 1, \
        f"4096 x 16384: rank {answer_18_2[1]}; P is m x r and R is n x r"
