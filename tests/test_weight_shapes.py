"""Muon, NorMuon, AdaMuon, Dion and Dion2 on weights that are not plain matrices (``matrix_view``).

A conv kernel ``(out, in, kh, kw)`` is stepped as the matrix ``(out, in*kh*kw)``, whatever its memory
format, with the learning-rate scale of that matrix; a stack ``(E, M, N)`` as ``E`` matrices, bitwise the
step of the ``E`` matrices given as separate parameters; ``muon_param_groups`` routes both and says so.
"""

import math

import pytest
import torch
from torch import nn

from optbook.optim import AdaMuon, AdamW, ChainedOptimizer, Dion, Dion2, Muon, NorMuon, muon_param_groups
from optbook.optim import functional as F

F64 = torch.float64
#: Each class with options that make it run in float64 (Newton–Schulz included) and move every step.
CLASSES = {
    "Muon": (Muon, dict(lr=0.05, weight_decay=0.1, ns_dtype=F64)),
    "NorMuon": (NorMuon, dict(lr=0.05, weight_decay=0.1, ns_dtype=F64)),
    "AdaMuon": (AdaMuon, dict(lr=0.05, weight_decay=0.1, ns_dtype=F64)),
    "Dion": (Dion, dict(lr=0.05, weight_decay=0.1, rank_fraction=0.5)),
    "Dion2": (Dion2, dict(lr=0.05, weight_decay=0.1, fraction=0.5, ns_dtype="float64")),
}
NAMES = list(CLASSES)


def _grads(shape, steps, seed=0, memory_format=torch.contiguous_format):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=F64).to(memory_format=memory_format) for _ in range(steps)]


def _run(name, params, grads_per_param, **options):
    """Step ``CLASSES[name]`` on ``params`` (one group) with the given gradients; return the optimizer."""
    cls, hp = CLASSES[name]
    opt = cls(params, **hp, **options)
    for grads in zip(*grads_per_param):
        for p, g in zip(params, grads):
            p.grad = g.clone(memory_format=torch.preserve_format)
        opt.step()
    return opt


# ---------------------------------------------------------------- conv kernels: flattened

@pytest.mark.parametrize("name", NAMES)
def test_a_channels_last_kernel_steps_bitwise_as_the_contiguous_one(name):
    shape = (8, 4, 3, 3)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    out = {}
    for fmt in (torch.contiguous_format, torch.channels_last):
        p = w.clone().to(memory_format=fmt).requires_grad_()
        _run(name, [p], [_grads(shape, 4, memory_format=fmt)], matrix_view="flatten")
        assert p.is_contiguous(memory_format=fmt)          # stepped in place: the layout is kept
        out[fmt] = p.detach()
    assert torch.equal(out[torch.contiguous_format], out[torch.channels_last])
    assert not torch.equal(out[torch.contiguous_format], w)  # it moved


@pytest.mark.parametrize("name", NAMES)
def test_a_flattened_kernel_steps_bitwise_as_the_matrix_out_by_in_kh_kw(name):
    # the same numbers as a (16, 2*3*3) = (16, 18) parameter: every shape-dependent factor (scale, Dion's
    # sqrt(m/n) and rank, AdaMuon's sqrt(min(m, n)), Dion2's selection) is the flattened matrix's
    shape = (16, 2, 3, 3)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    kernel = w.clone().requires_grad_()
    matrix = w.reshape(16, 18).clone().requires_grad_()
    grads = _grads(shape, 3)
    _run(name, [kernel], [grads], matrix_view="flatten")
    _run(name, [matrix], [[g.reshape(16, 18) for g in grads]])
    assert torch.equal(kernel.detach().reshape(16, 18), matrix.detach())


def test_muons_flattened_kernel_scale_is_the_flattened_shapes_by_hand():
    # (64, 2, 3, 3) -> (64, 18): shape_scaling sqrt(max(1, 64/18)) = 1.8856. The converged polar factor (cubic
    # Newton-Schulz, 60 float64 steps) has every singular value 1, so every singular value of the step is
    # lr * 1.8856. Readings found elsewhere give 1 (the kernel's (kh, kw) = (3, 3)) or sqrt(32) (the first
    # two dims, (64, 2)).
    from optbook.optim.matrix_views import matrix_shape

    assert matrix_shape((64, 2, 3, 3), "flatten") == (64, 18)
    lr, scale = 0.1, math.sqrt(64 / 18)
    p = torch.zeros(64, 2, 3, 3, dtype=F64, requires_grad=True)
    p.grad = _grads((64, 2, 3, 3), 1, seed=5)[0]
    Muon([p], lr=lr, momentum=0.0, nesterov=False, coefficients="cubic", ns_steps=60, ns_dtype=F64,
         matrix_view="flatten").step()
    s = torch.linalg.svdvals(-p.detach().reshape(64, 18))
    torch.testing.assert_close(s, torch.full((18,), lr * scale, dtype=F64), rtol=1e-9, atol=0)


@pytest.mark.parametrize("shape", [(8, 4, 3, 3), (64, 32, 3, 3), (192, 3, 16, 16)])
def test_adamuons_flattened_kernel_step_has_rms_point_two_lr_by_hand(shape):
    # AdaMuon's defaults (spectral, 0.2) rescale A to ||A||_F = sqrt(min(m, n)) and multiply by
    # 0.2 sqrt(max(m, n)):
    # RMS(step) = 0.2 lr sqrt(mn) / sqrt(mn) = 0.2 lr for the flattened (m, n). timm's AdaMuon read (kh, kw)
    # and made these steps 5.7x, 45x and 24x smaller (huggingface/pytorch-image-models#2791).
    lr = 0.01
    p = torch.zeros(shape, dtype=F64, requires_grad=True)
    p.grad = _grads(shape, 1, seed=6)[0]
    AdaMuon([p], lr=lr, ns_dtype=F64, matrix_view="flatten").step()
    rms = float(p.detach().square().mean().sqrt())
    assert rms == pytest.approx(0.2 * lr, rel=1e-6)


# ---------------------------------------------------------------- stacks (E, M, N)

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(3, 6, 4), (2, 2, 4, 6)], ids=["E-M-N", "L-E-M-N"])
def test_a_stack_steps_bitwise_as_its_matrices_given_separately(name, shape):
    *E, M, N = shape
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    stack = w.clone().requires_grad_()
    grads = _grads(shape, 3, seed=8)
    opt = _run(name, [stack], [grads], matrix_view="stacked")
    flat_w, flat_g = w.reshape(-1, M, N), [g.reshape(-1, M, N) for g in grads]
    separate = [flat_w[e].clone().requires_grad_() for e in range(math.prod(E))]
    _run(name, separate, [[g[e] for g in flat_g] for e in range(len(separate))])
    for e, q in enumerate(separate):
        assert torch.equal(stack.detach().reshape(-1, M, N)[e], q.detach())
    assert not torch.equal(stack.detach(), w)
    state = opt.state[stack]
    if name == "NorMuon":
        assert tuple(state["variance"].shape) == (*E, M, 1)
    if name == "Dion":
        assert tuple(state["right_factor"].shape) == (*E, N, 2)    # r = ceil(0.5 * min(6, 4)) = 2


def test_muons_head_split_cuts_each_matrix_of_a_stack_as_it_cuts_a_separate_matrix():
    # per-head Newton-Schulz inside each expert: head_split=2 cuts every (8, 4) matrix into two (4, 4) blocks
    w = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(15), dtype=F64)
    grads = _grads((3, 8, 4), 2, seed=16)
    stack = w.clone().requires_grad_()
    _run("Muon", [stack], [grads], matrix_view="stacked", head_split=2)
    separate = [w[e].clone().requires_grad_() for e in range(3)]
    _run("Muon", separate, [[g[e] for g in grads] for e in range(3)], head_split=2)
    whole = [w[e].clone().requires_grad_() for e in range(3)]
    _run("Muon", whole, [[g[e] for g in grads] for e in range(3)])
    for e in range(3):
        assert torch.equal(stack.detach()[e], separate[e].detach())
        assert not torch.equal(stack.detach()[e], whole[e].detach())      # the cut matters
    with pytest.raises(ValueError, match="Invalid head_split: 3 heads do not divide the 8 rows"):
        Muon([torch.zeros(3, 8, 4, requires_grad=True)], matrix_view="stacked", head_split=3)


@pytest.mark.parametrize("name", ["NorMuon", "Dion"])
def test_a_stacks_state_dict_round_trips_and_the_run_continues_bitwise(name):
    shape = (3, 6, 4)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    grads = _grads(shape, 4, seed=10)
    straight = w.clone().requires_grad_()
    _run(name, [straight], [grads], matrix_view="stacked")
    first = w.clone().requires_grad_()
    saved = _run(name, [first], [grads[:2]], matrix_view="stacked").state_dict()
    second = first.detach().clone().requires_grad_()
    cls, hp = CLASSES[name]
    opt = cls([second], **hp, matrix_view="stacked")
    opt.load_state_dict(saved)
    for g in grads[2:]:
        second.grad = g.clone()
        opt.step()
    assert torch.equal(straight.detach(), second.detach())


# ---------------------------------------------------------------- the compiled Muon step

@pytest.mark.parametrize("view, shape, fmt", [("flatten", (8, 4, 3, 3), torch.channels_last),
                                              ("stacked", (3, 8, 4), torch.contiguous_format)])
def test_the_compiled_muon_step_traces_kernels_and_stacks_in_one_graph(view, shape, fmt):
    # compiled_muon_step's kernel (fullgraph=True) traced by Dynamo without Inductor (backend="eager"): the
    # copy of a channels_last kernel and the unbinding of a stack are in the graph. It passes lr as a 0-d
    # tensor (addcmul) where the eager step passes a float (alpha): the same product in another rounding
    # order, measured 1.2e-7 (flatten) and 4.7e-10 (stacked) after two float32 steps; asserted 1e-6.
    from torch._dynamo.utils import counters

    from optbook.optim import compiled_muon_step

    w = torch.randn(shape, generator=torch.Generator().manual_seed(13))
    eager, traced = (w.clone().to(memory_format=fmt).requires_grad_() for _ in range(2))
    opt_eager = Muon([eager], matrix_view=view, ns_dtype=torch.float32)
    step = compiled_muon_step(Muon([traced], matrix_view=view, ns_dtype=torch.float32), backend="eager")
    torch._dynamo.reset()
    counters.clear()
    for g in _grads(shape, 2, seed=14, memory_format=fmt):
        eager.grad, traced.grad = g.float(), g.float()
        opt_eager.step()
        step()
    graphs = counters["stats"]["unique_graphs"]
    counters.clear()
    torch._dynamo.reset()
    assert graphs == 1
    assert (eager - w).abs().max() > 1e-3
    torch.testing.assert_close(traced, eager, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the functional twins

def _twin(name, params, grads, view):
    """One step of ``name``'s functional twin on fresh state; ``params`` updated in place."""
    hp = dict(CLASSES[name][1])
    M = [torch.zeros_like(p) for p in params]
    if name == "Muon":
        F.muon(params, grads, M, momentum=0.95, nesterov=True, matrix_view=view, **hp)
    elif name == "NorMuon":
        v = [p.new_zeros(*p.shape[:-1], 1) if view == "stacked" else p.new_zeros(p.shape[0], 1)
             for p in params]
        F.normuon(params, grads, M, v, momentum=0.95, nesterov=True, beta2=0.95, eps=1e-8, matrix_view=view,
                  **hp)
    elif name == "AdaMuon":
        F.adamuon(params, grads, M, [torch.zeros_like(p) for p in params], [1] * len(params), momentum=0.95,
                  nesterov=True, beta2=0.95, eps=1e-8, matrix_view=view, **hp)
    elif name == "Dion":
        del hp["rank_fraction"]
        Q = []
        for p in params:
            n = math.prod(p.shape[1:]) if view == "flatten" else p.shape[-1]
            q = torch.randn((n, 2), generator=torch.Generator().manual_seed(0), dtype=F64)
            Q.append(q.expand(*p.shape[:-2], n, 2).clone() if view == "stacked" else q)
        F.dion(params, grads, M, Q, momentum=0.95, matrix_view=view, **hp)
    else:
        F.dion2(params, grads, M, ef_decay=0.95, matrix_view=view, **hp)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("view, shape", [("flatten", (4, 2, 3, 3)), ("stacked", (2, 4, 6))])
def test_each_class_equals_its_functional_twin_on_kernels_and_stacks(name, view, shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(11), dtype=F64)
    g = _grads(shape, 1, seed=12)[0]
    ours = w.clone().requires_grad_()
    _run(name, [ours], [[g]], matrix_view=view)
    theirs = w.clone()
    _twin(name, [theirs], [g.clone()], view)
    assert torch.equal(ours.detach(), theirs)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("name", NAMES)
def test_shapes_a_view_cannot_step_are_refused_naming_the_argument(name):
    cls, hp = CLASSES[name]
    with pytest.raises(ValueError, match=rf"{name} updates 2-D matrices only.*\(8,\)"):
        cls([torch.zeros(8, requires_grad=True)], **hp)
    with pytest.raises(ValueError, match=r"\(8, 4, 3, 3\).*matrix_view.*'flatten'.*'stacked'"):
        cls([torch.zeros(8, 4, 3, 3, requires_grad=True)], **hp)          # the default never guesses
    with pytest.raises(ValueError, match=r"Invalid matrix_view: 'stacked'.*\(8, 4\)"):
        cls([torch.zeros(8, 4, requires_grad=True)], **hp, matrix_view="stacked")
    with pytest.raises(ValueError, match=r"Invalid matrix_view: 'flatten'.*\(8,\)"):
        cls([torch.zeros(8, requires_grad=True)], **hp, matrix_view="flatten")
    with pytest.raises(ValueError, match=r"Invalid matrix_view: expected one of"):
        cls([torch.zeros(8, 4, requires_grad=True)], **hp, matrix_view="conv")


@pytest.mark.parametrize("name", NAMES)
def test_a_view_edited_into_a_group_is_refused_at_step_before_any_write(name):
    p = torch.randn(6, 4, dtype=F64, requires_grad=True)
    opt = _run(name, [p], [_grads((6, 4), 1)])
    before = p.detach().clone()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
    opt.param_groups[0]["matrix_view"] = "stacked"
    p.grad = _grads((6, 4), 1, seed=1)[0]
    with pytest.raises(ValueError, match="Invalid matrix_view: 'stacked'"):
        opt.step()
    assert torch.equal(p.detach(), before)
    for k, v in state.items():
        assert torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v


def test_a_muon_subclass_with_a_step_of_its_own_takes_matrices_only():
    class OwnStep(Muon):   # as the distributed Muons, whose steps gather 2-D matrices
        def step(self, closure=None):
            return super().step(closure)

    OwnStep([torch.zeros(4, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="Invalid matrix_view: OwnStep steps 2-D matrices only"):
        OwnStep([torch.zeros(4, 2, 3, 3, requires_grad=True)], matrix_view="flatten")


# ---------------------------------------------------------------- routing

class ConvMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.up = nn.ConvTranspose2d(16, 8, 2)
        self.experts = nn.Parameter(torch.randn(4, 8, 16))
        self.other = nn.Parameter(torch.randn(2, 3, 5))
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)


def test_muon_param_groups_routes_kernels_and_stacks_and_its_table_says_how():
    model = ConvMoE()
    routing = muon_param_groups(model, weight_decay=0.1, conv="flatten", stacked=[model.experts])
    assert [(g.get("matrix_view"), g["param_names"]) for g in routing.muon] == [
        (None, ["fc.weight"]), ("flatten", ["conv.weight"]), ("stacked", ["experts"])]
    assert {n: t for n, t in routing.treatments.items() if t != "AdamW"} == {
        "fc.weight": "matrix", "conv.weight": "flattened conv", "experts": "stacked"}
    lines = {line.split()[0]: line for line in routing.table().splitlines()}
    assert "Muon" in lines["conv.weight"] and "conv kernel, flattened to (16, 27)" in lines["conv.weight"]
    assert "Muon" in lines["experts"] and "stacked: 4 matrices (8, 16)" in lines["experts"]
    assert "AdamW" in lines["other"] and "3-D tensor (Muon needs 2-D)" in lines["other"]   # never guessed
    assert "AdamW" in lines["up.weight"] and "transposed-conv" in lines["up.weight"]      # (in, out, kh, kw)
    assert routing.treatments["head.weight"] == "AdamW"
    # the groups feed the optimizers as they are
    opt = ChainedOptimizer([Muon(routing.muon, lr=0.02), AdamW(routing.adamw, lr=1e-3)])
    x = torch.randn(2, 3, 6, 6)
    before = model.conv.weight.detach().clone()
    (model.fc(model.conv(x).mean((2, 3))).sum() + model.experts.square().sum()).backward()
    opt.step()
    assert not torch.equal(model.conv.weight.detach(), before)


def test_muon_param_groups_default_keeps_kernels_and_stacks_with_adamw_and_checks_its_arguments():
    model = ConvMoE()
    routing = muon_param_groups(model)
    assert routing.treatments["conv.weight"] == routing.treatments["experts"] == "AdamW"
    assert routing.reasons["conv.weight"] == "4-D tensor (Muon needs 2-D)"
    assert [g.get("matrix_view") for g in routing.muon] == [None]
    with pytest.raises(ValueError, match="Invalid conv"):
        muon_param_groups(model, conv="flat")
    with pytest.raises(ValueError, match=r"Invalid stacked: entry 0 \(fc.weight, shape \(16, 16\)\)"):
        muon_param_groups(model, stacked=[model.fc.weight])
    with pytest.raises(ValueError, match="Invalid stacked: entry 0 .* not a trainable parameter"):
        muon_param_groups(model, stacked=[torch.zeros(2, 3, 4)])
    with pytest.raises(TypeError, match="Invalid stacked: entry 0 is a str"):
        muon_param_groups(model, stacked=["experts"])
    with pytest.raises(ValueError, match="Invalid muon_options: 'matrix_view'"):
        muon_param_groups(model, muon_options={"matrix_view": "flatten"})
