"""Known failure modes of optimizer implementations (shared/cases/README.md, cases 3-5), each
as a small input with its right value (float64)."""

import pytest
import torch

from optbook.optim import SGD, Adam, AdamW


def scalar(value=1.0):
    return torch.tensor([value], dtype=torch.float64, requires_grad=True)


def steps(opt, p, grads):
    out = []
    for g in grads:
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        out.append(float(p.detach()))
    return out


def test_lerp_momentum_update_is_one_minus_mu_times_the_sum_form():
    # Case 3: p = 1, grads 1 then -2, mu = 0.9, Nesterov
    p = scalar()
    assert steps(SGD([p], lr=0.1, momentum=0.9, nesterov=True), p, [1, -2]) == pytest.approx([0.981, 1.0109], abs=1e-14)
    p = scalar()
    assert steps(SGD([p], lr=1.0, momentum=0.9, nesterov=True), p, [1, -2]) == pytest.approx([0.81, 1.109], abs=1e-14)
    # the sum (heavy-ball) form, torch.optim.SGD with dampening 0, lr 0.1
    p = scalar()
    assert steps(torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True), p, [1, -2]) == pytest.approx(
        [0.81, 1.109], abs=1e-14)


def test_torch_dampening_is_not_the_ema_form_on_the_first_step():
    # dampening=mu seeds torch's buffer with the undamped first gradient, so the forms differ at step 1
    p, q = scalar(), scalar()
    ours = steps(SGD([p], lr=0.1, momentum=0.9), p, [1.0, 1.0])
    torchs = steps(torch.optim.SGD([q], lr=0.1, momentum=0.9, dampening=0.9), q, [1.0, 1.0])
    assert ours[0] == pytest.approx(0.99) and torchs[0] == pytest.approx(0.9)


def test_eps_is_outside_the_square_root():
    # Case 4: p = 0, constant g = 1e-8, lr 1, default betas, eps 1e-8
    p = scalar(0.0)
    trajectory = steps(Adam([p], lr=1.0), p, [1e-8] * 10)
    assert trajectory[0] == pytest.approx(-0.5, rel=1e-9)
    assert trajectory[-1] == pytest.approx(-5.0, rel=1e-9)


@pytest.mark.parametrize("g, lr, expected", [(0.0, 0.1, 0.95), (2.0, 0.1, 0.85), (0.0, 0.05, 0.975)])
def test_decoupled_decay_is_multiplied_by_the_current_lr(g, lr, expected):
    # Case 5: p = 1, wd 0.5; the lr 0.05 row is a scheduled lr
    p = scalar()
    opt = AdamW([p], lr=0.1, weight_decay=0.5)
    opt.param_groups[0]["lr"] = lr
    # eps shifts the g = 2 row by lr * eps / |g| ~ 1e-9, hence the tolerance
    assert steps(opt, p, [g]) == pytest.approx([expected], abs=1e-8)


def test_coupled_l2_differs_from_decoupled_decay():
    p = scalar()
    assert steps(Adam([p], lr=0.1, weight_decay=0.5), p, [0.0]) == pytest.approx([0.90], abs=1e-8)


def test_grad_none_leaves_parameter_untouched():
    p = scalar()
    opt = AdamW([p], lr=0.1, weight_decay=0.5)
    opt.step()
    assert float(p.detach()) == 1.0 and p not in opt.state


def test_zero_gradient_gives_zero_adam_update():
    p = scalar(3.0)
    assert steps(Adam([p], lr=0.1), p, [0.0, 0.0]) == [3.0, 3.0]
