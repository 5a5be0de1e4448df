"""Chapter 14b, Exercise 14b.1: the bytes an owner receives in FSDP2's padded gather.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 14b.1"
ANCHOR = "### Exercise 14b.1"
SOLUTION = """\
# Solution 14b.1 (graded): shards of ceil(10 / 3) = 4 rows of 12 float64 values;
# the owner receives the two shards it does not hold.
# answer_14b_1: bytes the owner of the 10 x 12 weight receives at 3 ranks (an int)
import math

answer_14b_1 = (3 - 1) * math.ceil(10 / 3) * 12 * 8
"""


@test_case(points=2)
def padded_gather(answer_14b_1):
    import torch
    assert answer_14b_1 is not ... and answer_14b_1 is not None, "answer_14b_1 is not filled in yet"
    rows = max(s.shape[0] for s in torch.chunk(torch.zeros(10, 12, dtype=torch.float64), 3))
    want = (3 - 1) * rows * 12 * 8                     # every shard padded to the largest chunk
    assert int(answer_14b_1) == want, \
        f"{answer_14b_1} bytes; every shard is padded to {rows} rows, and the owner receives the others"
