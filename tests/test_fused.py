"""``fused=True`` on SGD, Adam and AdamW hands the step to torch's fused kernels: bitwise
``torch.optim.X(fused=True)`` with the hyperparameters mapped, the same algorithm as optbook's default path
(rounded otherwise), and a clear error naming ``fused`` where the kernel cannot apply."""

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from optbook.optim import SGD, Adam, AdamW


class Ops(TorchDispatchMode):
    """The names of the ATen ops run inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [(40, 30), (7,), (3, 5)]


def twins(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ours = [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    return ours, theirs


def drive(pairs, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in pairs[0][1]]
        for opt, params in pairs:
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls, torch_cls, options", [
    (AdamW, torch.optim.AdamW, dict(weight_decay=0.1)),
    (AdamW, torch.optim.AdamW, dict(weight_decay=0.1, amsgrad=True, maximize=True)),
    (Adam, torch.optim.Adam, dict(weight_decay=0.01)),
    (Adam, torch.optim.Adam, dict(amsgrad=True, betas=(0.8, 0.9), eps=1e-6)),
], ids=["adamw", "adamw-amsgrad-maximize", "adam-l2", "adam-amsgrad"])
def test_fused_adam_is_bitwise_torchs_fused_adam(cls, torch_cls, options, dtype):
    ours, theirs = twins(dtype)
    opt = cls(ours, lr=1e-2, fused=True, **options)
    ref = torch_cls(theirs, lr=1e-2, fused=True, **options)
    drive([(opt, ours), (ref, theirs)])
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if options.get("amsgrad") else ()):
            assert torch.equal(opt.state[p][key], ref.state[q][key]), key
        assert opt.state[p]["step"] == int(ref.state[q]["step"]) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [dict(momentum=0.9, weight_decay=0.1), dict(momentum=0.0),
                                     dict(momentum=0.5, maximize=True)], ids=["momentum-wd", "plain", "maximize"])
def test_fused_sgd_is_bitwise_torchs_fused_sgd_with_dampening_equal_to_momentum(options, dtype):
    # optbook's EMA m <- lerp(m, g, 1 - mu) from m = 0 is torch's b <- mu*b + (1 - dampening)*g with
    # dampening = mu from a zero buffer (torch copies g into b at its first step unless a buffer is there)
    ours, theirs = twins(dtype)
    mu = options["momentum"]
    opt = SGD(ours, lr=0.1, fused=True, **options)
    ref = torch.optim.SGD(theirs, lr=0.1, fused=True, dampening=mu, **options)
    if mu:
        for q in theirs:
            ref.state[q]["momentum_buffer"] = torch.zeros_like(q)
    drive([(opt, ours), (ref, theirs)])
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        if mu:
            assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    if not mu:
        assert len(opt.state) == 0


@pytest.mark.parametrize("make", [
    lambda ps, **kw: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, **kw),
    lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
    lambda ps, **kw: Adam(ps, lr=1e-2, weight_decay=0.01, **kw)], ids=["SGD", "AdamW", "Adam"])
def test_fused_is_the_same_algorithm_as_the_default_path_rounded_otherwise(make):
    ours, theirs = twins(torch.float64)
    drive([(make(ours, fused=True), ours), (make(theirs), theirs)], steps=10)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_fused_where_it_cannot_apply_is_refused_naming_fused(cls):
    p = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"Invalid fused=True with foreach=True"):
        cls([p], lr=0.1, fused=True, foreach=True)
    with pytest.raises(TypeError, match="Invalid fused"):
        cls([p], lr=0.1, fused="yes")
    meta = torch.empty(3, 4, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match=r"Invalid fused=True: parameter 0 is torch.float32 on meta"):
        cls([meta], lr=0.1, fused=True)
    opt = cls([p], lr=0.1)   # a group edited to fused=True on a device without the kernel: refused at step
    opt.add_param_group({"params": [torch.empty(2, device="meta", requires_grad=True)]})
    opt.param_groups[1]["fused"] = True
    with pytest.raises(ValueError, match="Invalid fused=True"):
        opt.step()


def test_fused_sgd_refuses_nesterov_naming_both():
    p = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"Invalid fused=True with nesterov=True"):
        SGD([p], lr=0.1, momentum=0.9, nesterov=True, fused=True)


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_switching_fused_on_mid_run_continues_from_the_same_state(cls):
    # the state means the same thing on both paths (SGD: the EMA buffer; Adam: the int step count)
    ours, theirs = twins(torch.float64)
    kw = dict(lr=0.05, momentum=0.9) if cls is SGD else dict(lr=1e-2)
    a, b = cls(ours, **kw), cls(theirs, **kw)
    drive([(a, ours), (b, theirs)], steps=3)
    a.param_groups[0]["fused"] = True
    with Ops() as ops:
        drive([(a, ours)], steps=1, seed=2)
    assert any(name.startswith("_fused_") for name in ops.names), ops.names   # the fused kernel ran
    drive([(b, theirs)], steps=1, seed=2)
    drive([(a, ours), (b, theirs)], steps=2, seed=3)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_sgd_refuses_low_precision_on_the_cpu_where_torchs_kernel_is_wrong(dtype):
    # pytorch/pytorch#191763: torch 2.13's CPU _fused_sgd_ mishandles float16/bfloat16 SIMD blocks
    p = torch.randn(40, 30).to(dtype).requires_grad_()
    with pytest.raises(ValueError, match=r"Invalid fused=True: parameter 0 is torch\.(b?float16) on the CPU.*191763"):
        SGD([p], lr=0.1, momentum=0.9, fused=True)
    SGD([p], lr=0.1, momentum=0.9, fused=False)


def test_fused_and_compiled_step_are_not_taken_together():
    from optbook.optim import compiled_step
    p = torch.randn(4, 3, requires_grad=True)
    opt = AdamW([p], lr=1e-2, fused=True)
    compiled_step(opt, backend="eager")
    p.grad = torch.randn(4, 3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="Invalid fused=True: .*compiled_step"):
        opt.step()
    assert torch.equal(p, before) and len(opt.state) == 0
