"""Chapter 2, Exercise 2.2: the RMS of Adam's normalised update on pure noise.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 2.2"
ANCHOR = "### Exercise 2.2"
SOLUTION = """\
# Solution 2.2 (graded): Var(m) -> sigma^2 (1 - beta1) / (1 + beta1) and v -> sigma^2,
# so the RMS of m / sqrt(v) is sqrt((1 - beta1) / (1 + beta1)).
# answer_2_2: (RMS for beta1 = 0.95, RMS for beta1 = 0), two floats
answer_2_2 = tuple(math.sqrt((1 - b1) / (1 + b1)) for b1 in (0.95, 0.0))
"""


def _rms(beta1, steps=8000, seed=0):
    """The RMS of m_t / sqrt(v_t) measured on unit Gaussian noise (beta2 = 0.999, late steps)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(steps, 64, dtype=torch.float64, generator=gen)
    m = torch.zeros(64, dtype=torch.float64)
    v = torch.zeros(64, dtype=torch.float64)
    out = []
    for t in range(1, steps + 1):
        m = beta1 * m + (1 - beta1) * g[t - 1]
        v = 0.999 * v + 0.001 * g[t - 1] ** 2
        if t > steps // 2:
            out.append((m / (1 - beta1 ** t)) / (v / (1 - 0.999 ** t)).sqrt())
    return float(torch.stack(out).pow(2).mean().sqrt())


@test_case(points=1)
def beta1_095(answer_2_2):
    assert answer_2_2 is not ... and answer_2_2 is not None, "answer_2_2 is not filled in yet"
    measured = _rms(0.95)
    assert abs(float(answer_2_2[0]) / measured - 1) < 0.05, \
        f"beta1 = 0.95: {answer_2_2[0]} is not the RMS measured on noise ({measured:.3f}); use Var(m_t)"


@test_case(points=1)
def beta1_0(answer_2_2):
    assert answer_2_2 is not ... and answer_2_2 is not None, "answer_2_2 is not filled in yet"
    assert abs(float(answer_2_2[1]) - 1.0) < 0.01, \
        f"beta1 = 0: {answer_2_2[1]}; with m = g each coordinate is g / sqrt(E g^2)"
