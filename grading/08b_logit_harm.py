"""Chapter 8b, Exercise 8b.1: from which logit a rounded logit can double an attention weight.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 8b.1"
ANCHOR = "### Exercise 8b.1"
SOLUTION = """\
# Solution 8b.1 (graded): e^(2 Delta) >= 2 needs half the spacing Delta >= ln(2) / 2.
# The spacing on [2^e, 2^(e+1)) is 2^(e-7) in bfloat16 and 2^(e-10) in float16.
# answer_8b_1: (first logit size for bfloat16, for float16), two powers of two
answer_8b_1 = tuple(
    next(2.0**e for e in range(40) if math.exp(2.0 ** (e - p)) >= 2) for p in (7, 10)
)
"""


def _first(dtype):
    """The smallest power of two S from which half the spacing of ``dtype`` at S, Delta, has e^(2 Delta) >= 2."""
    import math
    import torch
    for e in range(40):
        s = torch.tensor(2.0 ** e, dtype=dtype)
        spacing = float(torch.nextafter(s, torch.tensor(float("inf"), dtype=dtype)) - s)
        if math.exp(spacing) >= 2:           # 2 * Delta = spacing
            return 2.0 ** e
    raise AssertionError("no such size")


@test_case(points=1)
def bfloat16(answer_8b_1):
    import torch
    assert answer_8b_1 is not ... and answer_8b_1 is not None, "answer_8b_1 is not filled in yet"
    assert float(answer_8b_1[0]) == _first(torch.bfloat16), \
        f"bfloat16: {answer_8b_1[0]}; find the binade where half the spacing reaches ln(2) / 2"


@test_case(points=1)
def float16(answer_8b_1):
    import torch
    assert answer_8b_1 is not ... and answer_8b_1 is not None, "answer_8b_1 is not filled in yet"
    assert float(answer_8b_1[1]) == _first(torch.float16), \
        f"float16: {answer_8b_1[1]}; float16 has 3 more significant bits than bfloat16"
