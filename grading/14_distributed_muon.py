"""Chapter 14, Exercise 1: LPT against the optimum on Graham's tight example.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 14.1"
ANCHOR = "Graham's bound is tight"
SOLUTION = """\
# Solution 1 (graded): LPT's makespan and the optimum by brute force, as above.
# answer_14_1: (LPT's makespan, optimal makespan), costs (5, 5, 4, 4, 3, 3, 3), d = 3
import itertools

from optbook.distributed.assignment import lpt_assign, rank_loads

small = [5, 5, 4, 4, 3, 3, 3]  # not `costs`: the chapter's own costs are checked below
every = itertools.product(range(3), repeat=len(small))
answer_14_1 = (
    max(rank_loads(small, lpt_assign(small, 3), 3)),
    min(max(rank_loads(small, list(a), 3)) for a in every),
)
"""
COSTS = [5, 5, 4, 4, 3, 3, 3]


@test_case(points=1)
def lpt(answer_14_1):
    from optbook.distributed.assignment import lpt_assign, rank_loads
    assert answer_14_1 is not ... and answer_14_1 is not None, "answer_14_1 is not filled in yet"
    want = max(rank_loads(COSTS, lpt_assign(COSTS, 3), 3))
    assert int(answer_14_1[0]) == want, \
        f"LPT: {answer_14_1[0]}; give each cost, largest first, to the least loaded rank (lpt_assign)"


@test_case(points=1)
def optimum(answer_14_1):
    import itertools
    from optbook.distributed.assignment import rank_loads
    assert answer_14_1 is not ... and answer_14_1 is not None, "answer_14_1 is not filled in yet"
    want = min(max(rank_loads(COSTS, list(a), 3)) for a in itertools.product(range(3), repeat=len(COSTS)))
    assert int(answer_14_1[1]) == want, f"optimum: {answer_14_1[1]}; try every assignment of the 7 costs"
