"""optbook.optim.compiled_muon_step: a torch.compile-d Muon step that compiles once across an LR schedule.

Reference: the eager ``optbook.optim.Muon`` (itself tested against ``torch.optim.Muon``). The test marked
``compile`` runs Inductor once (about 30 s on 2 busy CPU cores); the others run eagerly.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from optbook.optim import AdamW, Muon, compiled_muon_step
from optbook.optim.functional import muon


def _pair(shapes, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g) for s in shapes]
    eager = [b.clone().requires_grad_() for b in base]
    compiled = [b.clone().requires_grad_() for b in base]
    return base, eager, compiled, Muon(eager, **kw), Muon(compiled, **kw)


def test_a_tensor_lr_gives_the_float_lr_step():
    # eager, float64 Newton-Schulz: lr * scale as a float (alpha) vs lr (0-d tensor) times -scale
    # (addcmul): the same product rounded in another order, a few ulps of the update
    g = torch.Generator().manual_seed(1)
    shapes = [(8, 8), (32, 8), (8, 32)]
    p_f = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    p_t = [p.clone() for p in p_f]
    bufs = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(2)]
    hyper = dict(momentum=0.95, nesterov=True, weight_decay=0.1, ns_dtype=torch.float64, ns_algorithm="auto")
    for lr in (0.02, 0.01):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        muon(p_f, grads, bufs[0], lr=lr, **hyper)
        muon(p_t, grads, bufs[1], lr=torch.tensor(lr, dtype=torch.float64), **hyper)
    for a, b in zip(p_f, p_t):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-15)


def test_compiled_muon_step_refuses_other_optimizers_and_symmetric_gram():
    with pytest.raises(TypeError, match="Invalid optimizer: compiled_muon_step supports"):
        compiled_muon_step(AdamW([torch.zeros(2, requires_grad=True)]))
    with pytest.raises(ValueError, match="Invalid gram"):
        compiled_muon_step(Muon([torch.zeros(2, 2, requires_grad=True)], gram="symmetric", ns_dtype=torch.float32))


def test_a_non_finite_gradient_raises_before_anything_is_written_or_compiled():
    _, _, params, _, opt = _pair([(4, 4)])
    step = compiled_muon_step(opt)
    params[0].grad = torch.full((4, 4), float("nan"))
    before = params[0].detach().clone()
    with pytest.raises(ValueError):
        step()
    assert torch.equal(params[0].detach(), before) and not opt.state


@pytest.mark.compile
def test_compiled_muon_compiles_once_over_an_lr_schedule_and_equals_eager():
    # four steps, four learning rates, one compiled graph: Dynamo's counters see one unique graph and
    # error_on_recompile raises on any recompile after the first step. Square, tall and wide blocks with
    # ns_algorithm="auto" (Gram Newton-Schulz for the 4:1 blocks). Tolerance: float32 Newton-Schulz,
    # the compiled and eager kernels differ in the rounding of fused element-wise code and of the products'
    # order: measured 2.4e-7 after four steps; asserted 1e-5, against an update of ~1e-2 per step.
    shapes = [(16, 16), (16, 16), (64, 16), (16, 64)]
    base, eager, compiled, opt_eager, opt = _pair(shapes, lr=0.02, weight_decay=0.1, ns_algorithm="auto",
                                                  ns_dtype=torch.float32)
    step = compiled_muon_step(opt)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(2)
    for k, lr in enumerate((0.02, 0.01, 0.005, 0.0025)):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for ps, o in ((eager, opt_eager), (compiled, opt)):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            o.param_groups[0]["lr"] = lr
        opt_eager.step()
        with torch._dynamo.config.patch(error_on_recompile=k > 0):
            step()
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    counters.clear()                 # leave Dynamo as found: other modules count their own graphs
    torch._dynamo.reset()
    assert graphs == 1 and not breaks
    for a, b, b0 in zip(eager, compiled, base):
        assert (a - b0).abs().max() > 1e-3          # it moved
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for p, q in zip(eager, compiled):
        # the lerp of the momentum, fused by Inductor: float32 rounding of values ~1
        torch.testing.assert_close(opt.state[q]["momentum_buffer"], opt_eager.state[p]["momentum_buffer"],
                                   rtol=0, atol=1e-6)


@pytest.mark.compile
def test_compiled_muon_step_runs_the_step_hooks_and_optimizer_step_uses_the_kernel():
    _, _, params, _, opt = _pair([(8, 8)], ns_dtype=torch.float32)
    params[0].grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    step = compiled_muon_step(opt)
    assert opt.compiled_kernel is step.kernel
    torch._dynamo.reset()
    counters.clear()
    step()
    opt.step()          # the optimizer's own step runs the installed kernel: no second graph
    graphs = counters["stats"]["unique_graphs"]
    counters.clear()
    torch._dynamo.reset()
    assert calls == ["pre", "post", "pre", "post"] and graphs == 1


def test_compiled_muon_step_refuses_a_subclass_with_its_own_step():
    from optbook.optim import NorMuon

    class MyMuon(Muon):
        pass

    with pytest.raises(TypeError, match="Invalid optimizer: compiled_muon_step supports optbook.optim.Muon itself"):
        compiled_muon_step(MyMuon([torch.zeros(2, 2, requires_grad=True)]))
    with pytest.raises(TypeError, match="Invalid optimizer"):
        compiled_muon_step(NorMuon([torch.zeros(2, 2, requires_grad=True)]))
