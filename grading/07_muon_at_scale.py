"""Chapter 7, Exercise 7.1: Keller's learning rate 0.02 under Moonlight's convention.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 7.1"
ANCHOR = "### Exercise 7.1"
SOLUTION = """\
# Solution 7.1 (graded): the same step needs
# eta_M = 0.02 * s_Keller / s_Moonlight = 0.1 / sqrt(fan-in).
# answer_7_1: (lr of the 3072 x 768 up-projection, lr of the 768 x 3072 down-projection)
answer_7_1 = (0.1 / math.sqrt(768), 0.1 / math.sqrt(3072))
"""


def _lr(shape):
    from optbook.optim import muon_scale
    return 0.02 * muon_scale(shape) / muon_scale(shape, "spectral", 0.2)


@test_case(points=1)
def up(answer_7_1):
    assert answer_7_1 is not ... and answer_7_1 is not None, "answer_7_1 is not filled in yet"
    want = _lr((3072, 768))
    assert abs(float(answer_7_1[0]) / want - 1) < 5e-3, \
        f"up-projection: {answer_7_1[0]} does not give Keller's step (compare muon_scale's two modes)"


@test_case(points=1)
def down(answer_7_1):
    assert answer_7_1 is not ... and answer_7_1 is not None, "answer_7_1 is not filled in yet"
    want = _lr((768, 3072))
    assert abs(float(answer_7_1[1]) / want - 1) < 5e-3, \
        f"down-projection: {answer_7_1[1]} does not give Keller's step (compare muon_scale's two modes)"
