"""Chapter 5, Exercise 5.3: the odd quintic with phi(1) = 1 and phi'(1) = phi''(1) = 0.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 5.3"
ANCHOR = "### Exercise 5.3"
SOLUTION = """\
# Solution 5.3 (graded): a + b + c = 1, a + 3b + 5c = 0, 6b + 20c = 0.
# answer_5_3: the coefficients (a, b, c) of phi(s) = a s + b s^3 + c s^5
answer_5_3 = tuple(
    float(x) for x in torch.linalg.solve(
        torch.tensor([[1.0, 1, 1], [1, 3, 5], [0, 6, 20]], dtype=torch.float64),
        torch.tensor([1.0, 0, 0], dtype=torch.float64),
    )
)
"""


def _coefficients(answer):
    assert answer is not ... and answer is not None, "answer_5_3 is not filled in yet"
    a, b, c = (float(x) for x in answer)
    return a, b, c


@test_case(points=1)
def value_at_one(answer_5_3):
    a, b, c = _coefficients(answer_5_3)
    assert abs(a + b + c - 1) < 1e-9, f"phi(1) = a + b + c = {a + b + c}, not 1"


@test_case(points=1)
def slope_at_one(answer_5_3):
    a, b, c = _coefficients(answer_5_3)
    assert abs(a + 3 * b + 5 * c) < 1e-9, f"phi'(1) = a + 3b + 5c = {a + 3 * b + 5 * c}, not 0"


@test_case(points=1)
def curvature_at_one(answer_5_3):
    a, b, c = _coefficients(answer_5_3)
    assert abs(6 * b + 20 * c) < 1e-9, f"phi''(1) = 6b + 20c = {6 * b + 20 * c}, not 0"
