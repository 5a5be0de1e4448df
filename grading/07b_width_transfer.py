"""Chapter 7b, Exercise 7b.1: the learning-rate factor from width 64 to width 1024.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 7b.1"
ANCHOR = "### Exercise 7b.1"
SOLUTION = """\
# Solution 7b.1 (graded): the factor of the solution above, one per scale mode.
# answer_7b_1: {"spectral": factor, "unit_rms_norm": factor}, lr(1024) / lr(64)
def spectral_size(shape, mode, extra):
    return muon_scale(shape, mode, extra) / math.sqrt(shape[0] / shape[1])


answer_7b_1 = {
    mode: spectral_size(shapes(64)[0], mode, extra)
    / spectral_size(shapes(1024)[0], mode, extra)
    for mode, extra in (("spectral", 0.2), ("unit_rms_norm", 1.0))
}
"""


def _factors(mode, extra, shapes):
    """lr(1024) / lr(64) keeping eta * s(A, B) / sqrt(A / B) for every hidden matrix (one value expected)."""
    import math
    from optbook.optim import muon_scale
    return {round((muon_scale(a, mode, extra) / math.sqrt(a[0] / a[1]))
                  / (muon_scale(b, mode, extra) / math.sqrt(b[0] / b[1])), 12)
            for a, b in zip(shapes(64), shapes(1024))}


@test_case(points=1)
def spectral(answer_7b_1, shapes):
    assert answer_7b_1 is not ... and answer_7b_1 is not None, "answer_7b_1 is not filled in yet"
    assert shapes is not None, "the chapter's shapes() is not defined: run the notebook from the top"
    (want,) = _factors("spectral", 0.2, shapes)
    assert abs(float(answer_7b_1["spectral"]) - want) < 1e-9, \
        f'"spectral": {answer_7b_1["spectral"]} does not keep the spectral size of the steps'


@test_case(points=1)
def unit_rms_norm(answer_7b_1, shapes):
    assert answer_7b_1 is not ... and answer_7b_1 is not None, "answer_7b_1 is not filled in yet"
    assert shapes is not None, "the chapter's shapes() is not defined: run the notebook from the top"
    (want,) = _factors("unit_rms_norm", 1.0, shapes)
    assert abs(float(answer_7b_1["unit_rms_norm"]) - want) < 1e-9, \
        f'"unit_rms_norm": {answer_7b_1["unit_rms_norm"]} does not keep the spectral size of the steps'
