"""Chapter 19, Exercise 19.1: the margin of the speedrun's record rule.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 19.1"
ANCHOR = "### Exercise 19.1"
SOLUTION = """\
# Solution 19.1 (graded): (target - mean) sqrt(n) >= 3.09 sigma.
# answer_19_1: how far below the target the mean of 10 runs must be, sigma = 0.01 nats
answer_19_1 = 3.09 * 0.01 / math.sqrt(10)
"""


@test_case(points=2)
def margin(answer_19_1):
    import math
    assert answer_19_1 is not ... and answer_19_1 is not None, "answer_19_1 is not filled in yet"
    margin = float(answer_19_1)
    assert margin > 0 and margin * math.sqrt(10) >= 3.09 * 0.01 * (1 - 1e-3) \
        and margin * math.sqrt(10) <= 3.09 * 0.01 * (1 + 1e-2), \
        f"{margin}: the smallest margin with margin * sqrt(n) >= 3.09 sigma is another value"
