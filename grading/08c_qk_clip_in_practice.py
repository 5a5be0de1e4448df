"""Chapter 8c, Exercise 8.6: the group and per-head GQA rules on one group.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 8.6"
ANCHOR = "### Exercise 8.6"
SOLUTION = """\
# Solution 8.6 (graded): gamma = (0.5, 1) and beta = sqrt(0.5) under both rules; the
# group rule gives alpha = beta to both heads, the per-head rule gamma_h / beta.
# answer_8_6: {"group": (alpha_1, alpha_2, beta), "per_head": (alpha_1, alpha_2, beta)}
answer_8_6 = {
    "group": (math.sqrt(0.5), math.sqrt(0.5), math.sqrt(0.5)),
    "per_head": (0.5 / math.sqrt(0.5), 1 / math.sqrt(0.5), math.sqrt(0.5)),
}
"""


def _check(answer, rule):
    import torch
    from optbook.qk_clip import qk_clip_factors
    assert answer is not ... and answer is not None, "answer_8_6 is not filled in yet"
    q, k = qk_clip_factors(torch.tensor([200.0, 90.0]), 100.0, n_kv_heads=1, gqa_rule=rule)
    want = q.tolist() + k.tolist()
    got = [float(x) for x in answer[rule]]
    assert len(got) == 3 and all(abs(g - w) < 1e-6 for g, w in zip(got, want)), \
        f'"{rule}": (alpha_1, alpha_2, beta) = {got}, not the factors of the {rule} rule'


@test_case(points=1)
def group(answer_8_6):
    _check(answer_8_6, "group")


@test_case(points=1)
def per_head(answer_8_6):
    _check(answer_8_6, "per_head")
