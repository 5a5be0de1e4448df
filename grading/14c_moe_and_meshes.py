"""Chapter 14c, Exercise 14c.1: how much too small timm's AdaMuon made a conv kernel's step.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 14c.1"
ANCHOR = "### Exercise 14c.1"
SOLUTION = """\
# Solution 14c.1 (graded): RMS 0.2 lr / sqrt(out * in) instead of 0.2 lr.
# answer_14c_1: the factor for a (256, 64, 3, 3) kernel (a float)
answer_14c_1 = math.sqrt(256 * 64)
"""


@test_case(points=2)
def timm_conv_factor(answer_14c_1):
    import math
    assert answer_14c_1 is not ... and answer_14c_1 is not None, "answer_14c_1 is not filled in yet"
    out, cin, kh, kw = 256, 64, 3, 3
    right = 0.2                                                  # RMS / lr of AdaMuon's step
    timm = 0.2 * math.sqrt(kh * kw) / math.sqrt(out * cin * kh * kw)   # factor read from (kh, kw)
    want = right / timm
    assert abs(float(answer_14c_1) - want) < 1e-6 * want, \
        (f"{answer_14c_1}; the step is normalised over all out*in*kh*kw elements but scaled by "
         "0.2 sqrt(kh*kw) only")
