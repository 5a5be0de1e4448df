"""Parity with torch.optim in float64 over 120 steps: several groups, weight decay, Nesterov, and a
learning rate that changes every step. Tolerance 1e-12 absolute: both sides evaluate the same
formula in float64, differing only in operation order (a few ulps per step on O(1) values)."""

import pytest
import torch

from optbook.optim import SGD, Adam, AdamW
from helpers import clone_params, groups, make_params, run

STEPS = 120
TOL = 1e-12


def lr_schedule(base):
    # changes mid-run: warm up, hold, then a step drop; group 1 runs at half the lr
    def lr(t, group_index):
        value = base * min(1.0, (t + 1) / 10) * (0.3 if t >= 70 else 1.0)
        return value * (0.5 if group_index else 1.0)
    return lr


def max_diff(a, b):
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_equals_torch_heavy_ball_with_rescaled_lr(nesterov, foreach):
    # optbook.SGD(lr=a, momentum=mu) == torch.optim.SGD(lr=a*(1-mu), momentum=mu, dampening=0)
    mus = (0.9, 0.5)
    ours, ref = make_params(), make_params()
    opt = SGD(groups(ours, momentum=mus[1], weight_decay=0.01), lr=0.1, momentum=mus[0],
              nesterov=nesterov, weight_decay=1e-3, foreach=foreach)
    torch_opt = torch.optim.SGD(groups(ref, momentum=mus[1], weight_decay=0.01), lr=0.1, momentum=mus[0],
                                nesterov=nesterov, weight_decay=1e-3, dampening=0)
    schedule = lr_schedule(0.1)
    run(opt, ours, STEPS, lr_schedule=schedule)
    run(torch_opt, ref, STEPS, lr_schedule=lambda t, gi: schedule(t, gi) * (1 - mus[gi]))
    assert max_diff(ours, ref) <= TOL


def test_sgd_without_momentum_is_torch_sgd():
    ours, ref = make_params(), make_params()
    run(SGD(ours, lr=0.05, weight_decay=0.1), ours, STEPS)
    run(torch.optim.SGD(ref, lr=0.05, weight_decay=0.1), ref, STEPS)
    assert max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("ours_cls, torch_cls", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)])
def test_adam_family_equals_torch(ours_cls, torch_cls, foreach):
    ours, ref = make_params(), make_params()
    second = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    opt = ours_cls(groups(ours, **second), lr=1e-2, weight_decay=0.1, foreach=foreach)
    torch_opt = torch_cls(groups(ref, **second), lr=1e-2, weight_decay=0.1, foreach=False)
    schedule = lr_schedule(1e-2)
    run(opt, ours, STEPS, lr_schedule=schedule)
    run(torch_opt, ref, STEPS, lr_schedule=schedule)
    assert max_diff(ours, ref) <= TOL
    for p, q in zip(ours, ref):
        assert opt.state[p]["step"] == int(torch_opt.state[q]["step"]) == STEPS
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"], rtol=0, atol=TOL)


@pytest.mark.parametrize("shapes", [[(200, 200)], [(3, 4), (5,)], [(200, 200), (3, 4)]],
                         ids=["only-large", "only-small", "both"])
@pytest.mark.parametrize("ours_cls, torch_cls", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)])
def test_adam_loop_path_with_tensors_on_either_side_of_the_batching_threshold_equals_torch(ours_cls, torch_cls,
                                                                                           shapes):
    # the CPU loop path batches tensors under 32768 elements through the foreach kernels and walks the
    # others; a group with none of one kind must work too
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = ours_cls(ours, lr=1e-2, weight_decay=0.1, foreach=False)
    torch_opt = torch_cls(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            q.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    assert max_diff(ours, ref) <= TOL


def test_parameters_without_grad_are_skipped_like_torch():
    ours, ref = make_params(), make_params()
    opt, torch_opt = AdamW(ours, lr=0.1, weight_decay=0.5), torch.optim.AdamW(ref, lr=0.1, weight_decay=0.5)
    for o, params in ((opt, ours), (torch_opt, ref)):
        for t in range(5):
            for i, p in enumerate(params):
                p.grad = None if i == 1 else torch.full_like(p, 0.1 * (t + 1))
            o.step()
    assert max_diff(ours, ref) <= TOL
    assert torch.equal(ours[1], make_params()[1])  # never decayed: its grad was always None
    assert 1 not in [i for i, p in enumerate(ours) if p in opt.state]


def test_works_with_torch_lr_scheduler_and_closure():
    ours, ref = make_params(), make_params()
    results = []
    for cls, params in ((AdamW, ours), (torch.optim.AdamW, ref)):
        opt = cls(params, lr=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
        losses = []
        for _ in range(20):
            def closure():
                opt.zero_grad()
                loss = sum((p ** 2).sum() for p in params)
                loss.backward()
                return loss
            losses.append(float(opt.step(closure).detach()))
            sched.step()
        results.append(losses)
    assert results[0] == pytest.approx(results[1], abs=1e-12)
    assert max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("amsgrad, maximize", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("ours_cls, torch_cls", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)])
def test_amsgrad_and_maximize_equal_torch(ours_cls, torch_cls, amsgrad, maximize, foreach):
    # reference: torch.optim.Adam / AdamW with the same flags, float64, weight decay in both groups and a
    # schedule; TOL = 1e-12 as above (same formula, ops in another order: a few ulps per step). The second
    # group switches the flags off, so both code paths run in one step.
    ours, ref = make_params(), make_params()
    second = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=False, maximize=False)
    opt = ours_cls(groups(ours, **second), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize,
                   foreach=foreach)
    torch_opt = torch_cls(groups(ref, **second), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize,
                          foreach=False)
    schedule = lr_schedule(1e-2)
    run(opt, ours, STEPS, lr_schedule=schedule)
    run(torch_opt, ref, STEPS, lr_schedule=schedule)
    assert max_diff(ours, ref) <= TOL
    for p, q in zip(ours[:2], ref[:2]):  # the first group ran with the flags
        if amsgrad:
            torch.testing.assert_close(opt.state[p]["max_exp_avg_sq"], torch_opt.state[q]["max_exp_avg_sq"],
                                       rtol=0, atol=TOL)
    assert all("max_exp_avg_sq" not in opt.state[p] for p in ours[2:])


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_maximize_on_g_is_bitwise_minimising_on_minus_g(cls, foreach):
    # negation is exact, so the two runs do the same arithmetic on the same numbers
    up, down = make_params(), make_params()
    opt_up = cls(up, lr=1e-2, weight_decay=0.1, maximize=True, foreach=foreach)
    opt_down = cls(down, lr=1e-2, weight_decay=0.1, foreach=foreach)
    for t in range(10):
        for p, q in zip(up, down):
            g = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(t))
            p.grad, q.grad = g, -g
        opt_up.step()
        opt_down.step()
    assert all(torch.equal(p, q) for p, q in zip(up, down))


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("kwargs", [dict(amsgrad=1), dict(maximize="yes")])
def test_amsgrad_and_maximize_must_be_bools(cls, kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        cls(make_params(), **kwargs)
