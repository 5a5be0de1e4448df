"""Chapter 16, Exercise 1: bytes per parameter with float16 gradients and ZeRO-1 at d = 64.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 16.1"
ANCHOR = "### Exercise 1\n"
SOLUTION = """\
# Solution 1 (graded): 2 + 2 + (4 master + 4 main gradient + 8 moments) / 64.
# answer_16_1: bytes per parameter a rank holds (a float)
answer_16_1 = 2 + 2 + (4 + 4 + 8) / 64
"""


@test_case(points=2)
def bytes_per_param(answer_16_1):
    import torch
    from optbook.memory import ledger
    assert answer_16_1 is not ... and answer_16_1 is not None, "answer_16_1 is not filled in yet"
    want = ledger(1, param_dtype=torch.float16, grad_dtype=torch.float16, sharding="zero1", dp=64).bytes_per_param
    assert abs(float(answer_16_1) - want) < 1e-9, \
        f"{answer_16_1} bytes; count the float32 main gradient that float16 gradients need"
