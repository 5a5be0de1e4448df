"""Every wrapper combination resumes bit-identically: chain, mixed precision, mixed precision around a chain."""

import copy
import io

import pytest
import torch

from optbook.contract import NonFiniteGradientError
from optbook.optim import AdamW, ChainedOptimizer, Muon
from optbook.precision import DynamicLossScaler, MixedPrecisionOptimizer

OVERFLOW_AT = {2, 5}  # iterations whose gradients hold an inf


def build(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if kind == "chain" else torch.bfloat16
    matrices = [torch.randn(8, 6, generator=g).to(dtype).requires_grad_() for _ in range(2)]
    vector = torch.randn(6, generator=g).to(dtype).requires_grad_()
    params = matrices + [vector]
    if kind == "precision":
        opt = MixedPrecisionOptimizer(AdamW(params, lr=1e-2, weight_decay=0.1),
                                      DynamicLossScaler(initial_scale=2.0 ** 8, growth_interval=2, hysteresis=1))
    else:
        chain = ChainedOptimizer([Muon(matrices, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
                                  AdamW([vector], lr=1e-2)], max_grad_norm=1.0)
        opt = chain if kind == "chain" else MixedPrecisionOptimizer(
            chain, DynamicLossScaler(initial_scale=2.0 ** 8, growth_interval=2, hysteresis=1), max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return params, opt, sched


def iterate(kind, params, opt, sched, start, stop):
    for it in range(start, stop):
        g = torch.Generator().manual_seed(100 + it)
        scale = opt.loss_scale if isinstance(opt, MixedPrecisionOptimizer) else 1.0
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)
        if it in OVERFLOW_AT:
            params[-1].grad[0] = float("inf")
        try:
            opt.step()
        except NonFiniteGradientError:  # no loss scaler: the chain refuses the step, nothing written
            assert kind == "chain" and it in OVERFLOW_AT
            continue
        if not opt.found_inf:
            sched.step()


@pytest.mark.parametrize("kind", ["chain", "precision", "precision+chain"])
def test_resume_mid_run_is_bit_identical(kind):
    params, opt, sched = build(kind)
    iterate(kind, params, opt, sched, 0, 8)

    params_a, opt_a, sched_a = build(kind)
    iterate(kind, params_a, opt_a, sched_a, 0, 4)
    buffer = io.BytesIO()
    torch.save({"model": [p.detach() for p in params_a], "optimizer": opt_a.state_dict(),
                "scheduler": sched_a.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)

    params_b, opt_b, sched_b = build(kind, seed=1)  # other initial values: all must come from the checkpoint
    with torch.no_grad():
        for p, saved in zip(params_b, checkpoint["model"]):
            p.copy_(saved)
    opt_b.load_state_dict(checkpoint["optimizer"])
    sched_b.load_state_dict(checkpoint["scheduler"])
    iterate(kind, params_b, opt_b, sched_b, 4, 8)

    for a, b in zip(params, params_b):
        assert torch.equal(a, b)
    # the chain refuses (raises) instead of skipping; the mixed-precision wrapper skips and saves its counter
    assert opt.skipped_steps == opt_b.skipped_steps == (0 if kind == "chain" else len(OVERFLOW_AT))
    assert sched.last_epoch == sched_b.last_epoch == 8 - len(OVERFLOW_AT)
    sa, sb = copy.deepcopy(opt.state_dict()), copy.deepcopy(opt_b.state_dict())
    flat = lambda d: [x for x in torch.utils._pytree.tree_leaves(d) if torch.is_tensor(x)]  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(flat(sa), flat(sb))) and len(flat(sa)) == len(flat(sb))
    if kind != "chain":
        assert opt.loss_scaler.state_dict() == opt_b.loss_scaler.state_dict()
