"""Chapter 8, Exercise 8.2 (b): a GQA clip that never enlarges a query row.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 8.2"
ANCHOR = "### Exercise 8.2"
SOLUTION = """\
# Solution 8.2 (b) (graded): beta = 1 and alpha_h = gamma_h = min(1, tau / S_h).
# answer_8_2: ((alpha_1, alpha_2), beta) for maxima 200 and 50 in a group, tau = 100
answer_8_2 = (tuple(min(1.0, 100 / s) for s in (200, 50)), 1.0)
"""


def _unpack(answer):
    assert answer is not ... and answer is not None, "answer_8_2 is not filled in yet"
    (a1, a2), beta = answer
    return float(a1), float(a2), float(beta)


@test_case(points=1)
def same_logits(answer_8_2):
    import torch
    from optbook.qk_clip import qk_clip_factors
    a1, a2, beta = _unpack(answer_8_2)
    q, k = qk_clip_factors(torch.tensor([200.0, 50.0]), 100.0, n_kv_heads=1, gqa_rule="per_head")
    want = (q * k).tolist()                      # the logit factors of the package's per-head rule
    got = [a1 * beta, a2 * beta]
    assert all(abs(g - w) < 1e-9 for g, w in zip(got, want)), \
        f"alpha_h * beta = {got}: the logits must be multiplied by {want}, as the package's rule does"


@test_case(points=1)
def no_row_enlarged(answer_8_2):
    a1, a2, beta = _unpack(answer_8_2)
    assert a1 <= 1 + 1e-12 and a2 <= 1 + 1e-12 and beta <= 1 + 1e-12, \
        f"alpha = ({a1}, {a2}), beta = {beta}: some weight grows; which beta keeps every alpha_h <= 1?"
