"""Chapter 18b, Exercise 18b.1: the smallest p-value of the table's test with ten seeds.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 18b.1"
ANCHOR = "### Exercise 18b.1"
SOLUTION = """\
# Solution 18b.1 (graded): U = 0, z = -(n^2/2 - 1/2) / sqrt(n^2 (2n + 1) / 12),
# p = Phi(z).
# answer_18b_1: (smallest p with 10 seeds each, fewest seeds each below 0.01 / 10)
def smallest_p(n):
    z = (n * n / 2 - 0.5) / math.sqrt(n * n * (2 * n + 1) / 12)
    return 0.5 * math.erfc(z / math.sqrt(2))


fewest = next(n for n in range(2, 50) if smallest_p(n) < 0.01 / 10)
answer_18b_1 = (smallest_p(10), fewest)
"""


def _p(n):
    from scipy.stats import mannwhitneyu
    return float(mannwhitneyu(list(range(n)), list(range(n, 2 * n)), alternative="less",
                              method="asymptotic").pvalue)


@test_case(points=1)
def smallest_p(answer_18b_1):
    assert answer_18b_1 is not ... and answer_18b_1 is not None, "answer_18b_1 is not filled in yet"
    want = _p(10)
    assert abs(float(answer_18b_1[0]) / want - 1) < 0.02, \
        f"p = {answer_18b_1[0]}; SciPy's asymptotic test gives {want:.2e} for a perfect separation"


@test_case(points=1)
def fewest_seeds(answer_18b_1):
    assert answer_18b_1 is not ... and answer_18b_1 is not None, "answer_18b_1 is not filled in yet"
    want = next(n for n in range(2, 50) if _p(n) < 0.01 / 10)
    assert int(answer_18b_1[1]) == want, f"{answer_18b_1[1]} seeds each; try n = 5, 6, 7, ..."
