"""Chapter 9, Exercise 9.1: the learning rate an optimizer holds once LambdaLR is built.

An otter-grader test file (exception format; ``tools/grade.py`` runs it after the student's notebook).
``ANCHOR`` and ``SOLUTION``: the book's solution cell (see ``grading/01_sgd_momentum.py``).
"""
from otter.test_files import test_case

OK_FORMAT = False
name = "Exercise 9.1"
ANCHOR = "### Exercise 9.1"
SOLUTION = """\
# Solution 9.1 (graded): LambdaLR evaluates the lambda at s = 0, which lr_lambda maps
# to n = 1.
# answer_9_1: (lr held after construction, first lr with lambda s: min(1, s / 4))
answer_9_1 = (1e-3 * 1 / 4, 1e-3 * min(1, 0 / 4))
"""


def _held(lr_lambda):
    import torch
    from optbook.optim import SGD
    p = torch.zeros(1, requires_grad=True)
    opt = SGD([p], lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return opt.param_groups[0]["lr"]


@test_case(points=1)
def lr_schedule(answer_9_1):
    from optbook.schedules import LRSchedule
    assert answer_9_1 is not ... and answer_9_1 is not None, "answer_9_1 is not filled in yet"
    want = _held(LRSchedule(1e-3, total=12, warmup=4).lr_lambda())
    assert abs(float(answer_9_1[0]) - want) < 1e-12, \
        f"LRSchedule: {answer_9_1[0]}; at which step does LambdaLR's constructor evaluate the lambda?"


@test_case(points=1)
def hand_written(answer_9_1):
    assert answer_9_1 is not ... and answer_9_1 is not None, "answer_9_1 is not filled in yet"
    want = _held(lambda s: min(1, s / 4))
    assert abs(float(answer_9_1[1]) - want) < 1e-12, \
        f"min(1, s / 4): {answer_9_1[1]}; evaluate it at the step LambdaLR starts from"
