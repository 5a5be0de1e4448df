"""Dion2 (microsoft/dion ``dion/dion2.py`` at commit 0a059a4): Newton–Schulz on the rows (or columns) of the
momentum with the largest L1 norms, with error feedback on the selected slices; compared with the reference in
``tools/conformance_dion2.py`` (tests/test_conformance.py)."""

import pytest
import torch

from optbook.optim import Dion2, Muon
from optbook.optim.dion2 import dion2_selection
from optbook.optim.functional import dion2

F64 = torch.float64
# the converged cubic iteration in float64: Newton–Schulz equal to the polar factor to ~1e-15
EXACT = dict(ns_dtype=F64, coefficients="cubic", ns_steps=60)


def _grads(shape, steps, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(steps)]


def _run(opt, p, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (7, 7)])
@pytest.mark.parametrize("ef_decay", [0.0, 0.9])
def test_at_fraction_one_dion2_is_muon_without_nesterov(shape, ef_decay):
    # every slice selected: M_t = ef_decay (M_{t-1} + G_t) and the update is NS(ef_decay B_{t-1} + G_t), Muon's
    # momentum in its sum form, which the normalisation of Newton–Schulz makes equal to the EMA form
    W0 = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    a, b = W0.clone().requires_grad_(), W0.clone().requires_grad_()
    dion = Dion2([a], lr=0.05, fraction=1.0, ef_decay=ef_decay, weight_decay=0.1, **EXACT)
    muon = Muon([b], lr=0.05, momentum=ef_decay, nesterov=False, weight_decay=0.1, scale_mode="unit_rms_norm",
                **EXACT)
    grads = _grads(shape, 6)
    _run(dion, a, grads)
    _run(muon, b, grads)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)   # float64: rounding of 60 iterations per step


def test_only_the_rows_with_the_largest_l1_norms_move_and_their_update_is_orthonormal():
    m, n, lr = 8, 12, 0.1
    W = torch.zeros(m, n, dtype=F64, requires_grad=True)
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(2), dtype=F64)
    G[[1, 5, 6]] *= 10                                          # the three rows with the largest L1 norms
    opt = Dion2([W], lr=lr, fraction=3 / 8, ef_decay=0.5, scale_mode="none", **EXACT)
    W.grad = G.clone()
    opt.step()
    moved = (W != 0).any(dim=1).nonzero().flatten().tolist()
    assert moved == [1, 5, 6]
    U = -W.detach()[[1, 5, 6]] / lr
    torch.testing.assert_close(U @ U.T, torch.eye(3, dtype=F64), rtol=0, atol=1e-12)   # orthonormal rows
    M = opt.state[W]["momentum_buffer"]
    torch.testing.assert_close(M[[1, 5, 6]], 0.5 * G[[1, 5, 6]], rtol=0, atol=0)   # used: decayed by ef_decay
    rest = [0, 2, 3, 4, 7]
    assert torch.equal(M[rest], G[rest])                          # not used: kept whole for a later step


def test_a_tall_matrix_selects_columns():
    assert dion2_selection((12, 8), 0.25) == (-1, 2)
    assert dion2_selection((8, 12), 0.25) == (-2, 2)
    assert dion2_selection((5, 5), 0.01) == (-2, 1)               # at least one slice
    W = torch.zeros(12, 8, dtype=F64, requires_grad=True)
    G = torch.randn(12, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    G[:, 4] *= 100
    opt = Dion2([W], lr=0.1, fraction=0.125, **EXACT)
    W.grad = G
    opt.step()
    assert (W != 0).any(dim=0).nonzero().flatten().tolist() == [4]


def test_equal_l1_norms_select_the_lower_index():
    W = torch.zeros(4, 6, dtype=F64, requires_grad=True)
    opt = Dion2([W], lr=0.1, fraction=0.5, **EXACT)
    W.grad = torch.ones(4, 6, dtype=F64)
    opt.step()
    assert (W != 0).any(dim=1).nonzero().flatten().tolist() == [0, 1]


def test_a_zero_gradient_gives_no_update_beyond_weight_decay():
    W = torch.ones(4, 6, requires_grad=True)
    opt = Dion2([W], lr=0.1, weight_decay=0.5)
    W.grad = torch.zeros(4, 6)
    opt.step()
    assert torch.equal(W.detach(), torch.full((4, 6), 0.95))
    assert torch.equal(opt.state[W]["momentum_buffer"], torch.zeros(4, 6))


def test_the_step_does_not_depend_on_the_parameters_memory_layout():
    W0 = torch.randn(6, 9, generator=torch.Generator().manual_seed(4))
    a = W0.clone().requires_grad_()
    b = W0.T.contiguous().T.requires_grad_()                      # the same values, column-major
    assert not b.is_contiguous()
    grads = _grads((6, 9), 3, dtype=torch.float32)
    for p in (a, b):
        _run(Dion2([p], lr=0.05, fraction=0.5, weight_decay=0.1), p, grads)
    assert torch.equal(a, b)


def test_the_functional_twin_is_the_class_step():
    W0 = torch.randn(5, 7, generator=torch.Generator().manual_seed(5), dtype=F64)
    a, b = W0.clone().requires_grad_(), W0.clone()
    opt = Dion2([a], lr=0.03, fraction=0.4, ef_decay=0.8, weight_decay=0.2, ns_dtype=F64)
    M = torch.zeros_like(b)
    for g in _grads((5, 7), 4):
        a.grad = g.clone()
        opt.step()
        dion2([b], [g], [M], lr=0.03, fraction=0.4, ef_decay=0.8, weight_decay=0.2, ns_dtype="float64")
    assert torch.equal(a.detach(), b) and torch.equal(opt.state[a]["momentum_buffer"], M)


def test_ns_dtype_is_kept_by_name_and_a_resume_is_bitwise():
    W0 = torch.randn(6, 8, generator=torch.Generator().manual_seed(6))
    a = W0.clone().requires_grad_()
    opt = Dion2([a], lr=0.05, fraction=0.5, ns_dtype=torch.float32)
    assert opt.param_groups[0]["ns_dtype"] == "float32"          # a string: DCP saves param groups as such
    grads = _grads((6, 8), 6, dtype=torch.float32)
    _run(opt, a, grads[:3])
    saved = opt.state_dict()
    b = a.detach().clone().requires_grad_()
    resumed = Dion2([b], lr=0.05, fraction=0.5, ns_dtype="float32")
    resumed.load_state_dict(saved)
    _run(opt, a, grads[3:])
    _run(resumed, b, grads[3:])
    assert torch.equal(a, b)


def test_a_bfloat16_parameter_steps_in_float32_and_rounds_once():
    W0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    low = W0.bfloat16().requires_grad_()
    ref = low.detach().float().requires_grad_()
    g = torch.randn(4, 8, generator=torch.Generator().manual_seed(8)).bfloat16()
    for p, grad in ((low, g), (ref, g.float())):
        opt = Dion2([p], lr=0.05, fraction=0.5, ns_dtype="float32")
        p.grad = grad
        opt.step()
    assert torch.equal(low.detach(), ref.detach().bfloat16())


@pytest.mark.parametrize("kwargs, word", [(dict(fraction=0.0), "fraction"), (dict(fraction=1.01), "fraction"),
                                          (dict(ef_decay=-0.1), "ef_decay"), (dict(ns_dtype="bf16"), "ns_dtype"),
                                          (dict(scale_mode="spectral_norm"), "scale_mode"), (dict(eps=0.0), "eps")])
def test_bad_hyperparameters_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Dion2([torch.zeros(2, 3, requires_grad=True)], **kwargs)


def test_a_tensor_fraction_and_a_vector_are_refused():
    with pytest.raises(TypeError, match="fraction"):
        Dion2([torch.zeros(2, 3, requires_grad=True)], fraction=torch.tensor(0.5))
    with pytest.raises(ValueError, match="2-D"):
        Dion2([torch.zeros(3, requires_grad=True)])
