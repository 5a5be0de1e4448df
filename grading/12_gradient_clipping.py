"""Chapter 12, Exercise 2: the cosine between a gradient and its per-tensor clip.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 12.2"
ANCHOR = "### Exercise 2"
SOLUTION = """\
# Solution 2 (graded): the cosine (a + b) / (sqrt(2) sqrt(a^2 + b^2)) at a = 5, b = 12.
# answer_12_2: the cosine for a = 5, b = 12 (a float)
answer_12_2 = (5 + 12) / (math.sqrt(2) * math.sqrt(5**2 + 12**2))
"""


@test_case(points=2)
def cosine(answer_12_2):
    import torch
    from optbook.clipping import clip_grad_norm_
    assert answer_12_2 is not ... and answer_12_2 is not None, "answer_12_2 is not filled in yet"
    pair = [torch.zeros(2, dtype=torch.float64, requires_grad=True),
            torch.zeros(1, dtype=torch.float64, requires_grad=True)]
    pair[0].grad = torch.tensor([3.0, 4.0], dtype=torch.float64)      # norm 5
    pair[1].grad = torch.tensor([12.0], dtype=torch.float64)          # norm 12
    full = torch.cat([p.grad for p in pair])
    for p in pair:
        clip_grad_norm_([p], 1.0)
    clipped = torch.cat([p.grad for p in pair])
    measured = float(full @ clipped / (full.norm() * clipped.norm()))
    assert abs(float(answer_12_2) - measured) < 1e-4, \
        f"{answer_12_2} is not the cosine measured after clipping each tensor to 1 ({measured:.6f})"
