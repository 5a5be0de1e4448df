"""Chapter 4, Exercise 4.3: Shampoo with accumulation on a constant gradient.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 4.3"
ANCHOR = "### Exercise 4.3"
SOLUTION = """\
# Solution 4.3 (graded): L_t = t G G^T and R_t = t G^T G, so the step is
# U V^T / sqrt(t).
# answer_4_3: the length of step 4 divided by the length of step 1 (a float)
answer_4_3 = 1 / math.sqrt(4)
"""


@test_case(points=2)
def ratio(answer_4_3):
    import torch
    import optbook
    assert answer_4_3 is not ... and answer_4_3 is not None, "answer_4_3 is not filled in yet"
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    W = torch.zeros(6, 4, dtype=torch.float64, requires_grad=True)
    opt = optbook.optim.Shampoo([W], lr=1.0)
    lengths = []
    for _ in range(4):
        before = W.detach().clone()
        W.grad = G.clone()
        opt.step()
        lengths.append(float((W.detach() - before).norm()))
    measured = lengths[3] / lengths[0]
    assert abs(float(answer_4_3) - measured) < 1e-6, \
        f"{answer_4_3} is not the ratio optbook.optim.Shampoo takes ({measured:.6f}); how do L_t and R_t grow?"
