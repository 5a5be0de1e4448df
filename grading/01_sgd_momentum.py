"""Chapter 1, Exercise 1.1: how many steps until momentum's average reaches 99 % of a constant gradient.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell, inserted after the cell holding ``ANCHOR``
(``tools/grade.py --apply-edits``); the student build replaces it by ``answer_1_1 = ...``.
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 1.1"
ANCHOR = "### Exercise 1.1"
SOLUTION = """\
# Solution 1.1 (graded): m_t = (1 - mu^t) g, so the first t with mu^t <= 0.01.
# answer_1_1: (t for mu = 0.9, t for mu = 0.99), two integers
answer_1_1 = tuple(math.ceil(math.log(0.01) / math.log(mu)) for mu in (0.9, 0.99))
"""


def _first_step(mu):
    """The first step t at which m_t >= 0.99 g for g = 1, by running the average itself."""
    m, t = 0.0, 0
    while m < 0.99:
        t += 1
        m = mu * m + (1 - mu) * 1.0
    return t


@test_case(points=1)
def mu_09(answer_1_1):
    assert answer_1_1 is not ... and answer_1_1 is not None, "answer_1_1 is not filled in yet"
    assert int(answer_1_1[0]) == _first_step(0.9), \
        f"mu = 0.9: {answer_1_1[0]} is not the first step with m_t >= 0.99 g (solve 1 - 0.9^t >= 0.99)"


@test_case(points=1)
def mu_099(answer_1_1):
    assert answer_1_1 is not ... and answer_1_1 is not None, "answer_1_1 is not filled in yet"
    assert int(answer_1_1[1]) == _first_step(0.99), \
        f"mu = 0.99: {answer_1_1[1]} is not the first step with m_t >= 0.99 g (round up, not to nearest)"
