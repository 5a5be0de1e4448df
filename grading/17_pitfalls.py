"""Chapter 17, Exercise 1: the global norm with a tied weight on two ranks.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 17.1"
ANCHOR = "Tied weights across ranks"
SOLUTION = """\
# Solution 1 (graded): [3, 4] counted once, sqrt(9 + 16 + 144 + 0) = 13, and twice,
# sqrt(2 (9 + 16) + 144) = sqrt(194).
# answer_17_1: (the global norm, the norm with the replicated gradient counted twice)
answer_17_1 = (math.sqrt(9 + 16 + 144 + 0), math.sqrt(2 * (9 + 16) + 144))
"""


def _norms():
    import torch
    from optbook.clipping import get_grad_norm

    def grad(values):
        p = torch.zeros(len(values), dtype=torch.float64, requires_grad=True)
        p.grad = torch.tensor(values, dtype=torch.float64)
        return p
    once = float(get_grad_norm([grad([3.0, 4.0]), grad([12.0]), grad([0.0])]))
    twice = float(get_grad_norm([grad([3.0, 4.0]), grad([3.0, 4.0]), grad([12.0]), grad([0.0])]))
    return once, twice


@test_case(points=1)
def once(answer_17_1):
    assert answer_17_1 is not ... and answer_17_1 is not None, "answer_17_1 is not filled in yet"
    assert abs(float(answer_17_1[0]) - _norms()[0]) < 1e-9, \
        f"global norm: {answer_17_1[0]}; the replicated [3, 4] counts once"


@test_case(points=1)
def twice(answer_17_1):
    assert answer_17_1 is not ... and answer_17_1 is not None, "answer_17_1 is not filled in yet"
    assert abs(float(answer_17_1[1]) - _norms()[1]) < 1e-9, \
        f"counted on both ranks: {answer_17_1[1]}"
