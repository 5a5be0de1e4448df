"""Chapter 15, Exercise 1: from how many ranks repeated Newton-Schulz passes 10 % of the FLOPs.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 15.1"
ANCHOR = "from how many ranks"
SOLUTION = """\
# Solution 1 (graded): P > 6 T / (250 d) = 24.576.
# answer_15_1: the smallest number of ranks P above 10 % (an int)
import math

answer_15_1 = math.floor(6 * 2**22 / (250 * 4096)) + 1
"""


@test_case(points=2)
def ranks(answer_15_1):
    from optbook.bench import ns_overhead
    assert answer_15_1 is not ... and answer_15_1 is not None, "answer_15_1 is not filled in yet"
    want = next(P for P in range(1, 1000) if ns_overhead(4096, 32, 2**22, P).ratio > 0.1)
    assert int(answer_15_1) == want, \
        f"P = {answer_15_1}: optbook.bench.ns_overhead first passes 10 % at another P; round up"
