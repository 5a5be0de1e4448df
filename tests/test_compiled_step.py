"""optbook.optim.compiled_step: a torch.compile-d Adam/AdamW, SGD, Lion, Adafactor or Schedule-Free step
that compiles once.

Reference: the eager optimizers (``optbook.optim.AdamW`` itself tested against ``torch.optim.AdamW``). The tests
marked ``compile`` run Inductor (one compilation, about 10-40 s on 2 CPU cores); the others check the
capturable functional core eagerly, in float64, against :func:`optbook.optim.functional.adam`, and run the compiled
path through Dynamo with ``backend="eager"`` (tracing, no code generation: seconds) to check that it is
the optimizer's own ``step()`` (hooks, scheduler, chain member, mixed-precision inner optimizer).
"""

import copy

import pytest
import torch

from optbook.contract import NonFiniteGradientError
from optbook.optim import (SGD, Adafactor, Adam, AdamW, ChainedOptimizer, Lion, Muon, ScheduleFreeAdamW, adam_tensor,
                           compiled_step)
from optbook.optim.functional import adam


@pytest.mark.parametrize("decoupled, amsgrad, maximize", [(True, False, False), (False, True, True),
                                                          (True, True, False)])
def test_tensor_step_count_and_lr_give_the_eager_functional_step(decoupled, amsgrad, maximize):
    # float64: the two differ only by the order of a few scalar operations (Python ** vs torch.pow,
    # lr * c2 / c1 formed once vs the same in one expression): a few ulps of 1 after 3 steps
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,)]
    ref = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    new = [p.clone() for p in ref]
    state = {k: [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(3)]
             for k in ("ref", "new")}
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=decoupled,
                 amsgrad=amsgrad, maximize=maximize)
    for t, lr in zip((1, 2, 3), (1e-2, 5e-3, 2e-3)):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        m, v, vmax = state["ref"]
        adam(ref, grads, m, v, [t, t], lr=lr, max_exp_avg_sqs=vmax, **hyper)
        m, v, vmax = state["new"]
        adam_tensor(new, grads, m, v, torch.tensor([t, t], dtype=torch.float64),
                    torch.tensor(lr, dtype=torch.float64), max_exp_avg_sqs=vmax, **hyper)
    for a, b in zip(ref, new):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-15)
    for ka, kb in zip(state["ref"], state["new"]):
        for a, b in zip(ka, kb):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-15)


def test_what_torch_compile_does_with_python_numbers_that_change():
    # the statement of optbook.optim.compiled's docstring and chapter 15, checked against the installed
    # torch (Dynamo only, backend="eager"): a Python int step count and float lr are constants of the
    # first graph; their first change compiles once more with them as inputs; later values reuse it.
    # Passed as tensors, one graph serves every step from the first.
    from torch._dynamo.testing import CompileCounter

    def update(p, m, lr, t):
        return p - lr * m / (1 - 0.9 ** t)

    p, m = torch.randn(4), torch.randn(4)
    for as_tensors, graphs in ((False, 2), (True, 1)):
        torch._dynamo.reset()
        counter = CompileCounter()
        step = torch.compile(update, backend=counter)
        for t in range(1, 7):
            lr = 0.01 * t
            if as_tensors:
                step(p, m, torch.tensor(lr), torch.tensor(float(t)))
            else:
                step(p, m, lr, t)
        assert counter.frame_count == graphs
    torch._dynamo.reset()


def test_compiled_step_refuses_an_optimizer_it_does_not_know():
    w = torch.zeros(3, 2, requires_grad=True)
    with pytest.raises(TypeError, match="Invalid optimizer: compiled_step supports .*ScheduleFreeAdamW"):
        compiled_step(Muon([w], lr=0.02))
    with pytest.raises(TypeError, match="Invalid optimizer"):
        compiled_step(torch.optim.AdamW([torch.zeros(2, requires_grad=True)]))
    with pytest.raises(TypeError, match="Invalid optimizer: compiled_step found no .* in this ChainedOptimizer"):
        compiled_step(ChainedOptimizer([Muon([w], lr=0.02)]))

    class MySGD(SGD):   # a subclass may have a step of its own, which would bypass the kernel
        pass

    with pytest.raises(TypeError, match="not subclasses"):
        compiled_step(MySGD([torch.zeros(2, requires_grad=True)], lr=0.1))


def test_a_bad_hyperparameter_raises_before_anything_is_written_or_compiled():
    p = torch.randn(4, 3, requires_grad=True)
    opt = Adam([p], lr=1e-2)
    p.grad = torch.randn(4, 3)
    opt.step()   # eager: state exists
    step = compiled_step(opt)
    before, state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["lr"] = -1.0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with pytest.raises(ValueError, match="lr"):
        step()
    opt.param_groups[0]["lr"] = 1e-2
    p.grad[1, 2] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        step()
    assert torch.equal(p.detach(), before)
    assert opt.state[p]["step"] == state["state"][0]["step"] == 1
    assert torch.equal(opt.state[p]["exp_avg"], state["state"][0]["exp_avg"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def _chain(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(6, 4, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(4, generator=g, dtype=dtype).requires_grad_()
    return [W, b], ChainedOptimizer([Muon([W], lr=0.02, ns_dtype=torch.float32), AdamW([b], lr=1e-2)])


def _grads(params, k):
    g = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def test_the_compiled_step_is_the_optimizers_step_hooks_scheduler_and_chain_included():
    # backend="eager": Dynamo traces the kernel without generating code, so this runs in seconds; the
    # Inductor path is the compile-marked test below. The chain's AdamW member runs the kernel inside
    # its own step(); hooks of the chain and of the member run; the scheduler sees an optimizer step.
    import warnings

    params, chain = _chain()
    ref_params, ref_chain = _chain()
    step = compiled_step(chain, backend="eager")
    adamw = chain.optimizers[1]
    assert adamw.compiled is step and chain.optimizers[0].__class__.__name__ == "Muon"
    assert step.optimizers == [adamw]
    calls = []
    chain.register_step_pre_hook(lambda o, a, k: calls.append("chain pre"))
    chain.register_step_post_hook(lambda o, a, k: calls.append("chain post"))
    adamw.register_step_post_hook(lambda o, a, k: calls.append("adamw post"))
    runs = []
    kernel = step.kernels["adam"]
    step.kernels["adam"] = lambda *a, **k: (runs.append(1), kernel(*a, **k))[1]
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, 10) for o in (chain, ref_chain)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "lr_scheduler.step() before optimizer.step()" would fail here
        for k in range(3):
            _grads(params, k)
            _grads(ref_params, k)
            assert step(lambda: torch.tensor(1.5)).item() == 1.5
            ref_chain.step()
            for s in scheds:
                s.step()
    assert calls == ["chain pre", "adamw post", "chain post"] * 3
    assert len(runs) == 3 and chain.optimizers[1].state[params[1]]["step"] == 3
    for a, b, start in zip(params, ref_params, _chain()[0]):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
        assert float((a - start).detach().abs().max()) > 1e-3   # it moved


def test_compiled_step_under_mixed_precision_steps_the_float32_masters():
    from optbook.precision import MixedPrecisionOptimizer

    def build():
        g = torch.Generator().manual_seed(0)
        ps = [torch.randn(5, 3, generator=g).bfloat16().requires_grad_(), torch.randn(3, generator=g).bfloat16().requires_grad_()]
        return ps, MixedPrecisionOptimizer(AdamW(ps, lr=1e-2, weight_decay=0.1))

    params, opt = build()
    ref_params, ref = build()
    step = compiled_step(opt, backend="eager")
    assert step.optimizers == [opt.optimizer]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    for k in range(3):
        _grads(params, k)
        _grads(ref_params, k)
        step()
        ref.step()
        sched.step()
        ref.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert sched._step_count == 4 and getattr(opt, "_opt_called", False)
    for a, b in zip(opt.master_params(), ref.master_params()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert a.dtype == torch.float32


def _step_both(eager, compiled, opt_eager, opt, step, lrs, new_grad):
    """One step per ``lr`` of ``lrs`` on both sides with the same gradients (``new_grad(param)``), the eager
    optimizer's ``step()`` and the compiled ``step``; from the second on under Dynamo's error_on_recompile,
    and one graph in all."""
    for k, lr in enumerate(lrs):
        grads = [new_grad(p) for p in eager]
        for ps, o in ((eager, opt_eager), (compiled, opt)):
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            o.param_groups[0]["lr"] = lr
        opt_eager.step()
        with torch._dynamo.config.patch(error_on_recompile=k > 0):
            step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.compile
def test_compiled_adamw_compiles_once_and_equals_eager_for_three_steps_with_a_new_lr_each():
    # 3 steps, lr changed before each (as a scheduler does) and the step count growing: the graph of the
    # first step must serve the other two (Dynamo's error_on_recompile raises otherwise). Tolerance: float32
    # rounding of a 3-step trajectory, a few ulps of the O(1) parameters (measured 3e-8); a wrong
    # bias correction or lr would be off by ~1e-3. The bf16 parameter is computed in float32 and rounded
    # once on both paths: at most one bf16 ulp apart.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()   # graphs counted by earlier tests
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8,), (3, 4, 5)]
    base = [torch.randn(s, generator=g) for s in shapes] + [torch.randn(6, generator=g).bfloat16()]
    eager = [b.clone().requires_grad_() for b in base]
    compiled = [b.clone().requires_grad_() for b in base]
    opt_eager = AdamW(eager, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = AdamW(compiled, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    step = compiled_step(opt)
    _step_both(eager, compiled, opt_eager, opt, step, (1e-2, 5e-3, 2e-3),
               lambda b: torch.randn(b.shape, generator=g).to(b.dtype))
    for a, b, b0 in zip(eager, compiled, base):
        assert float((a.float() - b0.float()).detach().abs().max()) > 1e-3    # it moved
        tol = 2 ** -7 if a.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=tol)
    # the state is the eager optimizer's: int step counts, and eager steps continue from it
    assert [opt.state[p]["step"] for p in compiled] == [3] * 4
    sd = opt.state_dict()
    assert all(isinstance(s["step"], int) for s in sd["state"].values())


# ---------------------------------------------------------------- SGD, Lion, Adafactor, Schedule-Free

#: the element-wise optimizers beside Adam, with options that run every line of their kernels
#: (optbook.optim.compiled_elementwise): Nesterov, maximize and weight decay for SGD, a warmup for Schedule-Free
ELEMENTWISE = {
    "SGD": (SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True)),
    "Lion": (Lion, dict(betas=(0.9, 0.99), weight_decay=0.5)),
    "Adafactor": (Adafactor, dict(weight_decay=0.1)),
    "ScheduleFreeAdamW": (ScheduleFreeAdamW, dict(betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=2)),
}
LRS = (0.05, 0.03, 0.02, 0.01, 0.005)   # a new lr before each step, as a scheduler sets it


def _side_by_side(name, base, **compile_options):
    """Five steps of the eager optimizer and of the same optimizer under compiled_step, the same gradients,
    a new lr each step; the second and later steps under Dynamo's error_on_recompile (one graph)."""
    cls, options = ELEMENTWISE[name]
    g = torch.Generator().manual_seed(1)
    eager = [b.clone().requires_grad_() for b in base]
    compiled = [b.clone().requires_grad_() for b in base]
    opt_eager, opt = cls(eager, lr=LRS[0], **options), cls(compiled, lr=LRS[0], **options)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()   # graphs counted by earlier tests
    step = compiled_step(opt, **compile_options)
    _step_both(eager, compiled, opt_eager, opt, step, LRS,
               lambda b: torch.randn(b.shape, generator=g, dtype=b.dtype))
    torch._dynamo.reset()
    return eager, compiled, opt_eager, opt


def _assert_same_state(opt_eager, opt, atol=None):
    """The same state dict: the same keys, Python numbers equal (step counts ints, Schedule-Free's lr_max
    and weight_sum floats), tensors close (``atol=None``: one ulp of the tensor's largest entry per step)."""
    a, b = opt_eager.state_dict()["state"], opt.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for key, x in a[i].items():
            if isinstance(x, torch.Tensor):
                assert b[i][key].dtype == x.dtype
                tol = atol if atol is not None else len(LRS) * torch.finfo(x.dtype).eps * float(x.abs().max())
                torch.testing.assert_close(b[i][key], x, rtol=0, atol=tol)
            else:
                assert type(b[i][key]) is type(x) and b[i][key] == x, key


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_each_elementwise_kernel_gives_the_eager_step_in_float64(name):
    # backend="eager": Dynamo traces the kernel once and runs the traced ops without generating code, so
    # this checks each kernel's lines and the eagerly formed numbers of the step (lr, bias corrections,
    # Schedule-Free's weights) against the eager optimizer in seconds. float64: the two orders of the same
    # few operations differ by a few ulps of the O(1) parameters; a wrong lr, momentum or bias correction
    # would be off by ~1e-3.
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((6, 4), (5,), (2, 3, 4))]
    eager, compiled, opt_eager, opt = _side_by_side(name, base, backend="eager")
    for a, b, b0 in zip(eager, compiled, base):
        assert float((a - b0).detach().abs().max()) > 1e-2    # it moved
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-14)
    _assert_same_state(opt_eager, opt, atol=1e-14)


@pytest.mark.compile
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_each_compiled_elementwise_step_compiles_once_and_equals_eager_over_five_lrs(name):
    # Inductor, float32 and bfloat16 parameters in one group. Tolerance: each step may round a parameter
    # differently once (an FMA, a reduction in another order; Lion's eager bf16 step rounds p * (1 - lr *
    # wd) once more): one ulp of the largest parameter per step. The bf16 parameter is small (|p| < 0.5),
    # so that bound (5 ulps, 0.01) stays far below what a wrong lr or bias correction would move it.
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=g) for s in ((16, 8), (8,), (2, 3, 4))]
    base.append((torch.randn(6, 5, generator=g) * 0.1).bfloat16())
    eager, compiled, opt_eager, opt = _side_by_side(name, base)
    for a, b, b0 in zip(eager, compiled, base):
        assert float((a.float() - b0.float()).detach().abs().max()) > 1e-2    # it moved
        ulp = torch.finfo(a.dtype).eps * float(a.detach().abs().max())
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=len(LRS) * ulp)
    _assert_same_state(opt_eager, opt)


def test_compiled_step_of_a_chain_and_a_mixed_precision_wrapper_runs_their_members_kernels():
    # (backend="eager", seconds) a chain's Lion runs its kernel, its Muon stays eager; a mixed-precision
    # Adafactor steps its float32 masters with its kernel, after the wrapper's unscale and check.
    from optbook.precision import MixedPrecisionOptimizer

    def build():
        g = torch.Generator().manual_seed(0)
        W, b = torch.randn(6, 4, generator=g).requires_grad_(), torch.randn(4, generator=g).requires_grad_()
        low = [torch.randn(5, 3, generator=g).bfloat16().requires_grad_()]
        return ([W, b], ChainedOptimizer([Muon([W], lr=0.02, ns_dtype=torch.float32), Lion([b], lr=1e-2)]),
                low, MixedPrecisionOptimizer(Adafactor(low, lr=1e-2)))

    params, chain, low, mixed = build()
    ref_params, ref_chain, ref_low, ref_mixed = build()
    steps = [compiled_step(chain, backend="eager"), compiled_step(mixed, backend="eager")]
    assert steps[0].optimizers == [chain.optimizers[1]] and chain.optimizers[0].compiled_kernel is None
    assert steps[1].optimizers == [mixed.optimizer] and mixed.optimizer.compiled is steps[1]
    for k in range(3):
        for ps in (params, ref_params, low, ref_low):
            _grads(ps, k)
        for s in steps:
            s()
        ref_chain.step()
        ref_mixed.step()
    for a, b in zip(params + list(mixed.master_params()), ref_params + list(ref_mixed.master_params())):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert chain.optimizers[1].state[params[1]]["exp_avg"].abs().max() > 0


def test_sgd_refuses_fused_under_compiled_step_before_writing():
    p = torch.randn(4, 3, requires_grad=True)
    opt = SGD([p], lr=0.1, momentum=0.9, fused=True)
    compiled_step(opt, backend="eager")
    p.grad = torch.randn(4, 3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="Invalid fused=True: .*compiled_step"):
        opt.step()
    assert torch.equal(p, before) and len(opt.state) == 0
