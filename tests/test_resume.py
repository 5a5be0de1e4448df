"""Checkpoint and resume: save at step k, load into fresh objects, continue -- bit-identical to an
uninterrupted run (same operations on the same bits, so the tolerance is zero)."""

import io

import pytest
import torch

from optbook.optim import SGD, Adam, AdamW
from helpers import clone_params, groups, make_params, run

FACTORIES = {
    "SGD": lambda ps, fe: SGD(groups(ps, momentum=0.5), lr=0.1, momentum=0.9, nesterov=True,
                              weight_decay=0.01, foreach=fe),
    "Adam": lambda ps, fe: Adam(groups(ps, betas=(0.8, 0.9)), lr=0.01, weight_decay=0.01, foreach=fe),
    "AdamW": lambda ps, fe: AdamW(groups(ps, weight_decay=0.0), lr=0.01, weight_decay=0.1, foreach=fe),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", FACTORIES)
def test_resume_is_bit_identical(name, foreach):
    make = FACTORIES[name]
    straight = make_params()
    run(make(straight, foreach), straight, 40)

    first = make_params()
    opt = make(first, foreach)
    run(opt, first, 17)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed = [p.clone().requires_grad_() for p in checkpoint["params"]]
    opt2 = make(resumed, foreach)
    opt2.load_state_dict(checkpoint["optimizer"])
    run(opt2, resumed, 40 - 17, start=17)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_adam_resume_case():
    # Case 6: p0 = 1 (fp64), Adam lr 0.1, grads 1, 2, 3, 4
    def step(opt, p, g):
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()

    p = torch.ones(1, dtype=torch.float64, requires_grad=True)
    opt = Adam([p], lr=0.1)
    for g in (1, 2, 3, 4):
        step(opt, p, g)
    assert float(p.detach()) == pytest.approx(0.6116406504883408, abs=1e-15)

    q = torch.ones(1, dtype=torch.float64, requires_grad=True)
    opt = Adam([q], lr=0.1)
    step(opt, q, 1)
    step(opt, q, 2)
    saved = opt.state_dict()
    q2 = q.detach().clone().requires_grad_()
    opt2 = Adam([q2], lr=0.1)
    opt2.load_state_dict(saved)
    assert opt2.state[q2]["step"] == 2
    step(opt2, q2, 3)
    step(opt2, q2, 4)
    assert torch.equal(p, q2)


def test_step_count_is_exact_with_low_precision_parameters():
    # bf16 can count only to 256 exactly; the count is an int whatever the parameter dtype
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([p], lr=1e-3)
    for _ in range(300):
        p.grad = torch.ones_like(p)
        opt.step()
    assert opt.state[p]["step"] == 300
    q = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt2 = AdamW([q], lr=1e-3)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[q]["step"] == 300
