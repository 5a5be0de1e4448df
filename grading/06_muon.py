"""Chapter 6, Exercise 6.1: the RMS of Muon's default update for a 1024 x 4096 matrix.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 6.1"
ANCHOR = "### Exercise 6.1"
SOLUTION = """\
# Solution 6.1 (graded): RMS(U V^T) = 1 / sqrt(max(A, B)), times shape_scaling's s = 1.
# answer_6_1: RMS of the "shape_scaling" update of a 1024 x 4096 matrix, per unit lr
answer_6_1 = 1 / math.sqrt(max(1024, 4096))
"""


@test_case(points=2)
def rms(answer_6_1):
    import torch
    from optbook import polar_factor
    from optbook.optim import muon_scale
    assert answer_6_1 is not ... and answer_6_1 is not None, "answer_6_1 is not filled in yet"
    # ||U V^T||_F^2 = min(A, B): checked on a 32 x 128 polar factor, then used for 1024 x 4096
    small = polar_factor(torch.randn(32, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    assert abs(float(small.pow(2).sum()) - 32) < 1e-9
    measured = muon_scale((1024, 4096)) * (min(1024, 4096) / (1024 * 4096)) ** 0.5
    assert abs(float(answer_6_1) / measured - 1) < 1e-3, \
        f"{answer_6_1} is not the RMS of muon_scale((1024, 4096)) * polar_factor(G) ({measured:.6f})"
