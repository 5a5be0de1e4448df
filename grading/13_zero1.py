"""Chapter 13, Exercise 13.3: bytes per parameter with float32 parameters under ZeRO-1.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 13.3"
ANCHOR = "### Exercise 13.3"
SOLUTION = """\
# Solution 13.3 (graded): a float32 parameter is its own master: 4 + 4 + (4 + 4) / d.
# answer_13_3: (bytes per parameter at d = 4, at d = 64), two floats
answer_13_3 = tuple(4 + 4 + (4 + 4) / d for d in (4, 64))
"""


def _bytes(d):
    import torch
    from optbook.memory import ledger
    return ledger(1, param_dtype=torch.float32, sharding="zero1", dp=d).bytes_per_param


@test_case(points=1)
def d4(answer_13_3):
    assert answer_13_3 is not ... and answer_13_3 is not None, "answer_13_3 is not filled in yet"
    assert abs(float(answer_13_3[0]) - _bytes(4)) < 1e-9, \
        f"d = 4: {answer_13_3[0]} bytes; which of parameter, gradient, master, m and v are sharded?"


@test_case(points=1)
def d64(answer_13_3):
    assert answer_13_3 is not ... and answer_13_3 is not None, "answer_13_3 is not filled in yet"
    assert abs(float(answer_13_3[1]) - _bytes(64)) < 1e-9, \
        f"d = 64: {answer_13_3[1]} bytes; a float32 parameter needs no separate master"
