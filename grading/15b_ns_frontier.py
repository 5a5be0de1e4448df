"""Chapter 15b, Exercise 15b.2: how many Polar Express steps bring [0.01, 1] within 0.02 of 1.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 15b.2"
ANCHOR = "### Exercise 15b.2"
SOLUTION = """\
# Solution 15b.2 (graded): the band of the schedule built for 1e-2, for k steps.
# answer_15b_2: the smallest number of steps (an int)
from optbook.polar import polar_express_band

answer_15b_2 = next(
    k for k in range(1, 10) if 1 - polar_express_band(k, 1e-2)[0] <= 0.02
)
"""


@test_case(points=2)
def steps(answer_15b_2):
    from optbook.polar import polar_express_band
    assert answer_15b_2 is not ... and answer_15b_2 is not None, "answer_15b_2 is not filled in yet"
    k = int(answer_15b_2)
    assert k >= 1 and max(abs(1 - x) for x in polar_express_band(k, 1e-2)) <= 0.02, \
        f"{k} steps: the band {polar_express_band(max(k, 1), 1e-2)} is wider than 0.02 around 1"
    assert k == 1 or max(abs(1 - x) for x in polar_express_band(k - 1, 1e-2)) > 0.02, \
        f"{k} steps: fewer steps already reach the band"
