"""Chapter 11, Exercise 11.1: the largest downward step that leaves a float16 weight of 1 unchanged.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 11.1"
ANCHOR = "### Exercise 11.1"
SOLUTION = """\
# Solution 11.1 (graded): below 1 the float16 spacing is 2^-11; 1 - delta rounds back
# to 1 up to half of it, the tie included (1 is the even neighbour).
# answer_11_1: the largest delta with float16(1 - delta) == 1 (a float)
answer_11_1 = 2.0**-12
"""


def _rounds_to_one(delta):
    import torch
    return float((torch.ones((), dtype=torch.float32) - delta).to(torch.float16)) == 1.0


@test_case(points=1)
def unchanged(answer_11_1):
    assert answer_11_1 is not ... and answer_11_1 is not None, "answer_11_1 is not filled in yet"
    d = float(answer_11_1)
    assert d > 0 and _rounds_to_one(d), f"delta = {d!r}: float16(1 - delta) is not 1"


@test_case(points=1)
def largest(answer_11_1):
    assert answer_11_1 is not ... and answer_11_1 is not None, "answer_11_1 is not filled in yet"
    d = float(answer_11_1)
    assert not _rounds_to_one(d * (1 + 2.0 ** -8)), \
        f"delta = {d!r}: a slightly larger delta still leaves 1 unchanged; find the threshold"
