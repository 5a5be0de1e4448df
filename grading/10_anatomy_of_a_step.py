"""Chapter 10, Exercise 3: the total norm after clipping each of k members.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 10.3"
ANCHOR = "### Exercise 3"
SOLUTION = """\
# Solution 3 (graded): k orthogonal parts, each clipped to norm tau.
# answer_10_3: a function (k, tau) -> the total gradient norm after per-member clipping
import math


def answer_10_3(k, tau):
    return math.sqrt(k) * tau
"""


@test_case(points=2)
def total_norm(answer_10_3):
    import torch
    from optbook.clipping import clip_grad_norm_, get_grad_norm
    assert answer_10_3 is not ... and answer_10_3 is not None, "answer_10_3 is not filled in yet"
    assert callable(answer_10_3), "answer_10_3 should be a function (k, tau) -> total norm"
    gen = torch.Generator().manual_seed(0)
    for k, tau in [(1, 1.0), (2, 0.5), (4, 1.0), (7, 3.0)]:
        params = [torch.zeros(5, dtype=torch.float64, requires_grad=True) for _ in range(k)]
        for p in params:
            p.grad = torch.randn(5, dtype=torch.float64, generator=gen) * 100 * tau
            clip_grad_norm_([p], tau)                       # each member clipped on its own
        measured = float(get_grad_norm(params))
        got = float(answer_10_3(k, tau))
        assert abs(got / measured - 1) < 1e-5, \
            f"k = {k}, tau = {tau}: your formula gives {got}, clipping each member gives {measured:.6f}"
