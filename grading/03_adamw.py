"""Chapter 3, Exercise 3.2 (a): how fast AdamW's decay shrinks a weight with zero gradient.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 3.2"
ANCHOR = "### Exercise 3.2"
SOLUTION = """\
# Solution 3.2 (a) (graded): the weight shrinks by 1 - lr * wd per step; it halves after
# ln 2 / -ln(1 - lr * wd) steps.
# answer_3_2: (shrink factor per step, steps to halve), two floats
shrink = 1 - 3e-4 * 0.1
answer_3_2 = (shrink, math.log(0.5) / math.log(shrink))
"""


def _shrink():
    """One step of optbook.optim.AdamW(lr=3e-4, weight_decay=0.1) on a weight with zero gradient."""
    import torch
    from optbook.optim import AdamW
    w = torch.ones(1, dtype=torch.float64, requires_grad=True)
    opt = AdamW([w], lr=3e-4, weight_decay=0.1)
    w.grad = torch.zeros_like(w)
    opt.step()
    return float(w.detach())


@test_case(points=1)
def factor(answer_3_2):
    assert answer_3_2 is not ... and answer_3_2 is not None, "answer_3_2 is not filled in yet"
    assert abs(float(answer_3_2[0]) - _shrink()) < 1e-12, \
        f"{answer_3_2[0]} is not the factor optbook.optim.AdamW applies in one step ({_shrink()!r})"


@test_case(points=1)
def half_life(answer_3_2):
    import math
    assert answer_3_2 is not ... and answer_3_2 is not None, "answer_3_2 is not filled in yet"
    steps = math.log(0.5) / math.log(_shrink())
    assert abs(float(answer_3_2[1]) / steps - 1) < 0.005, \
        f"{answer_3_2[1]} steps: the weight halves after about {steps:.0f} steps (solve factor^t = 1/2)"
