"""Low-precision parameters: the update is computed in float32 and rounded into the parameter once."""

import pytest
import torch

from optbook.optim import SGD, SOAP, Adafactor, Adam, AdamW, Shampoo


@pytest.mark.parametrize("foreach", [False, True])
def test_adam_fp16_tiny_and_zero_gradients_match_float64_rounded_once(foreach):
    # in fp16, eps * sqrt(1 - beta2) = 3e-10 underflows to 0: g = 0 gave NaN and g = 6e-8 gave -inf
    p = torch.ones(4, dtype=torch.float16, requires_grad=True)
    opt = Adam([p], lr=1e-3, foreach=foreach)
    p.grad = torch.tensor([0.0, 1.0, 6e-8, 1e-4], dtype=torch.float16)
    opt.step()
    reference = torch.tensor([1.0, 0.999, 0.999144, 0.999], dtype=torch.float64)  # float64, from the issue
    assert torch.isfinite(p).all()
    assert torch.equal(p.detach(), reference.half())  # one rounding of the float64 value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [
    lambda ps, fe: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, foreach=fe),
    lambda ps, fe: Adam(ps, lr=1e-2, weight_decay=0.1, foreach=fe),
    lambda ps, fe: AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=fe),
    lambda ps, fe: AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, foreach=fe),
], ids=["SGD", "Adam", "AdamW", "AdamW-amsgrad-maximize"])
def test_foreach_and_loop_agree_bitwise(make, dtype):
    # fp16 AdamW differed: _foreach_mul_ rounded 1 - lr * wd to fp16, the loop did not
    g = torch.Generator().manual_seed(0)
    # (181, 183) has more than 32768 elements: AdamW's loop path steps it alone, the small ones together
    shapes = [(4, 6), (7,), (181, 183), (2, 3, 4), ()]
    init = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    loop = [t.clone().requires_grad_() for t in init]
    each = [t.clone().requires_grad_() for t in init]
    opt_loop, opt_each = make(loop, False), make(each, True)
    for _ in range(5):
        grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        for ps, opt in ((loop, opt_loop), (each, opt_each)):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            opt.step()
    for a, b in zip(loop, each):
        assert a.dtype == dtype and torch.equal(a, b)
    for sa, sb in zip(opt_loop.state_dict()["state"].values(), opt_each.state_dict()["state"].values()):
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k]


@pytest.mark.parametrize("cls, kw", [(Shampoo, dict(lr=1e-2, beta2=0.99, momentum=0.5)),
                                     (SOAP, dict(lr=1e-2, precondition_frequency=2))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shampoo_and_soap_keep_statistics_and_bases_in_float32(cls, kw, dtype):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 4, generator=g).to(dtype).requires_grad_()
    W64 = W.detach().double().requires_grad_()
    opt, ref = cls([W], **kw), cls([W64], **kw)
    for _ in range(30):
        G = torch.randn(6, 4, generator=g)
        W.grad, W64.grad = G.to(dtype), G.to(dtype).double()
        opt.step()
        ref.step()
    state, state64 = opt.state[W], ref.state[W64]
    for key in ("L", "R", "L_inv_root", "R_inv_root", "momentum_buffer", "Q_L", "Q_R"):
        if key in state:
            assert state[key].dtype == torch.float32, key
    # L in float32 follows the float64 statistics closely (in bf16 it drifted by percents)
    rel = float((state["L"].double() - state64["L"]).norm() / state64["L"].norm())
    assert rel < 1e-5
    if "Q_L" in state:  # the basis stays orthogonal
        Q = state["Q_L"].double()
        assert float((Q.mT @ Q - torch.eye(6, dtype=torch.float64)).abs().max()) < 1e-5
    assert W.dtype == dtype and torch.isfinite(W).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 6), (2, 8, 6), (6,)], ids=["matrix", "batch", "vector"])
def test_adafactor_keeps_statistics_in_float32_and_rounds_the_parameter_once(shape, dtype):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    # the float32 twin: same start, the parameter rounded to dtype after every step, as ours rounds it
    twin = p.detach().float().requires_grad_()
    kw = dict(lr=1e-2, weight_decay=0.1, eps=(torch.finfo(dtype).eps, 1e-3))
    opt, ref = Adafactor([p], **kw), Adafactor([twin], **kw)
    for scale in (1.0, 300.0, 1.0):   # 300**2 = 90000 > float16's 65504
        grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        p.grad, twin.grad = grad, grad.float()
        opt.step()
        ref.step()
        with torch.no_grad():
            twin.copy_(twin.to(dtype))
        assert torch.equal(p.detach(), twin.detach().to(dtype))
    assert all(v.dtype == torch.float32 for v in opt.state[p].values() if torch.is_tensor(v))
    assert torch.isfinite(p).all()


def test_torch_adafactor_writes_nan_for_a_float16_gradient_whose_square_overflows():
    # what the float32 statistics avoid (torch 2.13 keeps them in the parameter's dtype)
    p = torch.ones(8, 6, dtype=torch.float16, requires_grad=True)
    opt = torch.optim.Adafactor([p], lr=1e-2)
    p.grad = torch.full_like(p, 300.0)
    opt.step()
    assert opt.state[p]["row_var"].dtype == torch.float16 and torch.isnan(p).all()
    ours = torch.ones(8, 6, dtype=torch.float16, requires_grad=True)
    ours.grad = torch.full_like(ours, 300.0)
    Adafactor([ours], lr=1e-2).step()
    assert torch.isfinite(ours).all() and not torch.equal(ours.detach(), torch.ones(8, 6, dtype=torch.float16))
