"""The optimizers' numerical edges (issue 40, second half): each test fails on the code before its fix.

Dion after an all-zero gradient and under a strided layout; Muon, NorMuon and AdaMuon on rounding-noise
gradients; Shampoo before its statistics are ready; SOAP's first step in float32; the compiled Muon step
under hyperparameter schedules; AdaMuon's two versions; ``polar_express_coefficients`` on numpy scalars;
param groups that torch.distributed.checkpoint can save.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from optbook.optim import Dion

F64 = torch.float64


# --- Dion ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_dion_after_an_all_zero_gradient_keeps_q_and_continues_as_if_it_never_happened(dtype):
    """A zero gradient on a zero buffer leaves ``Q`` and the weights alone; the next steps are bitwise the
    steps of an optimizer that never saw it. Before the guard ``Q`` became exactly zero and the next update
    had singular values from 0.05 to 1.86 (float64, seed 0) instead of Dion's usual ones."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(16, 12, generator=gen, dtype=dtype)
    grads = [torch.randn(16, 12, generator=gen, dtype=dtype) for _ in range(4)]
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_a, opt_b = Dion([a], lr=0.1, momentum=0.9), Dion([b], lr=0.1, momentum=0.9)
    a.grad = torch.zeros_like(a)
    opt_a.step()
    assert torch.equal(a.detach(), w0)                                   # no update from a zero buffer
    q = opt_a.state[a]["right_factor"]
    assert torch.linalg.vector_norm(q) > 1                               # Q kept (was exactly zero)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        assert torch.equal(a.detach(), b.detach())
    assert torch.equal(opt_a.state[a]["right_factor"], opt_b.state[b]["right_factor"])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("rank_fraction", [1.0, 0.5])
def test_dion_update_does_not_depend_on_the_parameters_memory_layout(dtype, rank_fraction):
    """A parameter stored as the transpose of a contiguous tensor (strides (1, m)) gets bitwise the
    update of its contiguous twin (before: up to 2.4e-7 apart in float32, from strided GEMMs)."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(24, 40, generator=gen, dtype=dtype)
    grads = [torch.randn(24, 40, generator=gen, dtype=dtype) for _ in range(5)]
    dense = torch.nn.Parameter(w0.clone())
    strided = torch.nn.Parameter(w0.T.contiguous().T)                    # same values, column-major
    assert not strided.is_contiguous()
    opts = [Dion([p], lr=0.05, weight_decay=0.1, rank_fraction=rank_fraction) for p in (dense, strided)]
    for g in grads:
        dense.grad = g.clone()
        strided.grad = g.T.contiguous().T
        for o in opts:
            o.step()
        assert torch.equal(dense.detach(), strided.detach())


# --- Muon, NorMuon, AdaMuon on rounding-noise gradients -------------------------------------------------------

def _step_norm(cls, grad, **options):
    p = torch.nn.Parameter(torch.zeros(8, 6, dtype=F64))
    opt = cls([p], lr=1.0, **options)
    p.grad = grad.clone()
    opt.step()
    return float(p.detach().norm())


def _unit_gradient():
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    return g / g.norm()


@pytest.mark.parametrize("name", ["Muon", "NorMuon"])
def test_scale_invariant_false_shrinks_rounding_noise_steps_as_torch_muon_does(name):
    """``scale_invariant=False``: Newton–Schulz's floor acts as ``torch.optim.Muon``'s ``eps``. Measured
    (this seed): a step of 4.3e-8 of a real one at gradient norm 2e-16 and 3.5e-11 at 1.6e-19, torch
    4.3e-8 and 3.4e-11 (the option did not exist before: TypeError on the old code)."""
    from optbook import optim
    cls, g = getattr(optim, name), _unit_gradient()
    real = _step_norm(cls, g, scale_invariant=False)
    ref = _step_norm(torch.optim.Muon, g)
    for size, bound in ((2e-16, 1e-7), (1.6e-19, 1e-10)):
        ours = _step_norm(cls, g * size, scale_invariant=False) / real
        theirs = _step_norm(torch.optim.Muon, g * size) / ref
        assert ours < bound and theirs < bound
        assert 0.5 < ours / theirs < 2                                   # the same floor, to its form
        assert _step_norm(cls, g * size) / _step_norm(cls, g) == pytest.approx(1, abs=1e-12)   # default kept


@pytest.mark.parametrize("name", ["Muon", "NorMuon"])
def test_scale_invariant_false_changes_no_bit_above_the_floor(name):
    from optbook import optim
    cls = getattr(optim, name)
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(16, 24, generator=gen)
    runs = []
    for invariant in (True, False):
        p = torch.nn.Parameter(w0.clone())
        opt = cls([p], lr=0.02, weight_decay=0.1, scale_invariant=invariant)
        for k in range(3):
            p.grad = torch.randn(16, 24, generator=torch.Generator().manual_seed(10 + k)) * 10.0 ** -k
            opt.step()
        runs.append(p.detach().clone())
    assert torch.equal(*runs)


def test_adamuon_takes_full_steps_on_rounding_noise_by_construction():
    """Documented, not a floor: AdaMuon's Frobenius rescale restores the full norm of any non-zero update."""
    from optbook.optim import AdaMuon
    g = _unit_gradient()
    for size in (2e-16, 1.6e-19):
        assert _step_norm(AdaMuon, g * size) / _step_norm(AdaMuon, g) == pytest.approx(1, rel=1e-6)


def test_scale_invariant_must_be_a_bool():
    from optbook.optim import Muon
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="Invalid scale_invariant"):
        Muon([p], scale_invariant="yes")


# --- Shampoo's safeguards ----------------------------------------------------------------------------------

def _least_squares(steps=200, **options):
    """Least squares ``0.5 ||(W - W*) X||^2 / 8`` with a fresh 32 x 8 batch ``X`` each step: gradients of
    rank 8 on a 16 x 32 matrix. Returns (step 2's ``||dW|| / (lr ||G||)``, first loss, last loss)."""
    from optbook.optim import Shampoo
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(16, 32, generator=gen, dtype=F64)
    W = torch.nn.Parameter(torch.zeros(16, 32, dtype=F64))
    opt = Shampoo([W], **options)
    ratio, losses = None, []
    for t in range(steps):
        X = torch.randn(32, 8, generator=gen, dtype=F64)
        loss = 0.5 * ((W - target) @ X).pow(2).sum() / 8
        losses.append(float(loss.detach()))
        W.grad = torch.autograd.grad(loss, W)[0]
        before, g = W.detach().clone(), W.grad.clone()
        opt.step()
        if t == 1:
            ratio = float((before - W.detach()).norm() / (options["lr"] * g.norm()))
    return ratio, losses[0], losses[-1]


def test_shampoo_with_a_stale_root_no_longer_diverges_on_rank_deficient_gradients():
    """precondition_frequency=10: the old code computed roots at step 1 from ``eps I + G G^T`` and
    multiplied step 2's gradient by 1.3e4 (loss 240 -> 1e52 in 200 steps). Now preconditioning starts at
    step 10 (Distributed Shampoo's default start): steps before it are gradient steps, and the run stays
    bounded; each other safeguard alone also prevents the blow-up."""
    ratio, first, last = _least_squares(lr=0.01, precondition_frequency=10)
    assert ratio == pytest.approx(1.0, abs=1e-12) and last < first              # was 1.3e4 and 1e52
    old_ratio, _, old_last = _least_squares(lr=0.01, precondition_frequency=10, start_preconditioning_step=1)
    assert old_ratio > 1e3 and old_last > 1e40                                   # the old behaviour, still there
    for safeguard in (dict(relative_eps=1e-6), dict(grafting="sgd"), dict(grafting="adagrad")):
        ratio, first, last = _least_squares(lr=0.01, precondition_frequency=10, start_preconditioning_step=1,
                                            **safeguard)
        assert ratio < 20 and last < first, safeguard
    _, first, last = _least_squares(lr=0.01, precondition_frequency=10, grafting="sgd")
    assert last < 0.05 * first                                                   # measured 7.0 from 240


def test_shampoo_grafting_gives_the_grafted_norm_and_shampoos_direction():
    from optbook.optim import Shampoo
    from optbook.optim.shampoo import inverse_root
    gen = torch.Generator().manual_seed(4)
    G = torch.randn(6, 9, generator=gen, dtype=F64)
    W = torch.nn.Parameter(torch.zeros(6, 9, dtype=F64))
    W.grad = G.clone()
    Shampoo([W], lr=1.0, eps=1e-3, grafting="sgd").step()
    eye = lambda k: torch.eye(k, dtype=F64)                                    # noqa: E731
    direction = inverse_root(1e-3 * eye(6) + G @ G.T) @ G @ inverse_root(1e-3 * eye(9) + G.T @ G)
    expected = -direction * (G.norm() / direction.norm())
    assert torch.allclose(W.detach(), expected, rtol=1e-12, atol=1e-14)


def test_shampoo_defaults_at_frequency_one_are_the_plain_algorithm_bitwise():
    from optbook.optim import Shampoo
    runs = []
    for options in ({}, dict(start_preconditioning_step=1, grafting=None, relative_eps=0.0)):
        gen = torch.Generator().manual_seed(5)
        W = torch.nn.Parameter(torch.randn(5, 7, generator=gen, dtype=F64))
        opt = Shampoo([W], lr=0.1, **options)
        for _ in range(4):
            W.grad = torch.randn(5, 7, generator=gen, dtype=F64)
            opt.step()
        runs.append(W.detach().clone())
    assert torch.equal(*runs)


@pytest.mark.parametrize("key, value, error", [("start_preconditioning_step", 0, ValueError),
                                               ("start_preconditioning_step", 2.0, TypeError),
                                               ("grafting", "adam", ValueError), ("relative_eps", -1.0, ValueError)])
def test_shampoo_safeguard_options_are_checked(key, value, error):
    from optbook.optim import Shampoo
    with pytest.raises(error, match=f"Invalid {key}"):
        Shampoo([torch.nn.Parameter(torch.zeros(3, 3))], **{key: value})


# --- SOAP's first step -------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 1e4])
@pytest.mark.parametrize("rank", [None, 4])
def test_soap_first_step_in_float32_is_bounded_by_lr_sqrt_mn(scale, rank):
    """|N| <= 1 entrywise at t = 1, so ||dW||_F <= lr sqrt(mn) (1e-6 for the rounding of m_hat). Before:
    up to 2.2 lr sqrt(mn) for entries near 1 and 126 near 1e4 over these seeds."""
    from optbook.optim import SOAP
    worst = 0.0
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        if rank:
            G = torch.randn(16, rank, generator=gen, dtype=F64) @ torch.randn(rank, 24, generator=gen, dtype=F64)
            G = G / G.abs().max()
        else:
            G = torch.rand(16, 24, generator=gen, dtype=F64) * 2 - 1
        W = torch.nn.Parameter(torch.zeros(16, 24))
        W.grad = (G * scale).float()
        SOAP([W], lr=0.5).step()
        worst = max(worst, float(W.detach().double().norm()) / (0.5 * math.sqrt(16 * 24)))
    assert worst <= 1 + 1e-6


def test_soap_first_step_in_float64_is_lr_times_the_polar_factor():
    """Unchanged by the fix (a property, not a regression): ``lr U V^T`` up to the eigenbases' rounding.

    In exact arithmetic the gradient rotated into SOAP's eigenbases is diagonal (its singular values), and
    Adam's first step maps each entry to its sign. In float64 the zero entries come out as rounding errors
    ``r`` of order ``u ||G||^2 / gap`` (up to 6e-14 for this ``G``: the Gram matrices square its scale),
    and the step maps each to ``r / (|r| + eps)``, about ``r / eps`` = 6e-6, times ``lr`` = 0.5. Measured:
    1.1e-6 on a 2-core AMD EPYC (2026-12-06; an earlier bound of 1e-6 passed on another CPU); the bound 1e-5 is the estimate's 3e-6
    with a margin, about 7000 times below the step's median entry (0.5 x the polar factor's: 0.066)."""
    from optbook.polar import polar_factor
    from optbook.optim import SOAP
    G = torch.randn(16, 24, generator=torch.Generator().manual_seed(0), dtype=F64)
    W = torch.nn.Parameter(torch.zeros(16, 24, dtype=F64))
    W.grad = G.clone()
    SOAP([W], lr=0.5).step()
    assert (W.detach() + 0.5 * polar_factor(G)).abs().max() < 1e-5


# --- polar_express_coefficients on NumPy scalars -------------------------------------------------------------

def test_polar_express_coefficients_reads_numpy_and_tensor_scalars_and_names_the_wrong_kind():
    """Before: ``steps=np.int64(5)`` raised "expected an int >= 1, got np.int64(5)" (a misleading message for
    a valid count), and ``input_scale=np.float32(1.02)`` "expected a finite number > 0"."""
    np = pytest.importorskip("numpy")
    from optbook.polar import POLAR_EXPRESS_SAFETY, polar_express_coefficients
    reference = polar_express_coefficients(5, 1e-3, input_scale=POLAR_EXPRESS_SAFETY)
    assert polar_express_coefficients(np.int64(5), np.float64(1e-3),
                                      input_scale=np.float64(POLAR_EXPRESS_SAFETY)) == reference
    assert polar_express_coefficients(torch.tensor(5), 1e-3, input_scale=torch.tensor(POLAR_EXPRESS_SAFETY,
                                                                                      dtype=F64)) == reference
    assert polar_express_coefficients(np.int32(3), cushion=np.float32(0.0)) == \
        polar_express_coefficients(3, cushion=0.0)
    with pytest.raises(TypeError, match=r"Invalid steps: expected an integer >= 1, got 5\.0 \(float\)"):
        polar_express_coefficients(5.0)
    with pytest.raises(TypeError, match=r"Invalid lower_bound: .*a real number.*got 'a' \(str\)"):
        polar_express_coefficients(5, "a")
    with pytest.raises(ValueError, match=r"Invalid input_scale: expected a finite number > 0, got -1\.0"):
        polar_express_coefficients(5, input_scale=np.float32(-1))


# --- compiled steps under hyperparameter schedules -----------------------------------------------------------

def _frames(step_fn, n_steps, counter):
    """Run ``step_fn(k)`` for k = 0 .. n_steps - 1 on a fresh Dynamo, with ``error_on_recompile`` from the
    second step on (any recompile raises); return how many frames ``counter`` (Dynamo's ``CompileCounter``
    backend: it counts the graphs and runs them eagerly, no Inductor) saw."""
    torch._dynamo.reset()
    try:
        for k in range(n_steps):
            with torch._dynamo.config.patch(error_on_recompile=k > 0):
                step_fn(k)
        return counter.frame_count
    finally:
        torch._dynamo.reset()


@pytest.mark.compile
def test_compiled_muon_step_is_one_graph_under_lr_momentum_and_weight_decay_schedules():
    """Before: lr only was a tensor; a momentum warm-up (0.85 -> 0.95) or a weight-decay schedule recompiled
    (error_on_recompile raised at step 2)."""
    from optbook.optim import Muon, compiled_muon_step
    shapes = [(16, 16), (32, 16)]
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(s, generator=gen) for s in shapes]
    eager = [b.clone().requires_grad_() for b in base]
    compiled = [b.clone().requires_grad_() for b in base]
    opts = [Muon(ps, lr=0.02, momentum=0.85, weight_decay=0.0, ns_dtype=torch.float32) for ps in (eager, compiled)]
    counter = CompileCounter()
    step = compiled_muon_step(opts[1], backend=counter)
    schedule = [(0.02, 0.85, 0.0), (0.015, 0.9, 0.1), (0.01, 0.95, 0.05), (0.005, 0.95, 0.2)]

    def one(k):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for ps, o in zip((eager, compiled), opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.param_groups[0].update(lr=schedule[k][0], momentum=schedule[k][1], weight_decay=schedule[k][2])
        opts[0].step()
        step()

    assert _frames(one, len(schedule), counter) == 1
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)   # the same ops run eagerly from the graph


@pytest.mark.compile
def test_compiled_adamw_step_is_one_graph_under_beta_eps_and_weight_decay_schedules():
    """Before: betas, eps and weight_decay were Python constants of the graph (recompiled at step 2)."""
    from optbook.optim import AdamW, compiled_step
    gen = torch.Generator().manual_seed(8)
    base = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    eager = [b.clone().requires_grad_() for b in base]
    compiled = [b.clone().requires_grad_() for b in base]
    opts = [AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0) for ps in (eager, compiled)]
    counter = CompileCounter()
    step = compiled_step(opts[1], backend=counter)
    schedule = [((0.9, 0.95), 1e-8, 0.0), ((0.85, 0.99), 1e-6, 0.1), ((0.95, 0.999), 1e-8, 0.01)]

    def one(k):
        grads = [torch.randn(b.shape, generator=gen) for b in base]
        for ps, o in zip((eager, compiled), opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.param_groups[0].update(betas=schedule[k][0], eps=schedule[k][1], weight_decay=schedule[k][2])
        opts[0].step()
        step()

    assert _frames(one, len(schedule), counter) == 1
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


# --- param groups that torch.distributed.checkpoint can save ------------------------------------------------

def test_every_class_gives_a_full_cpu_offloaded_dcp_optimizer_state_dict():
    """``ns_dtype`` was a ``torch.dtype`` in the Muon family's param groups, which
    ``get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))`` cannot
    handle; it is now stored as its name (a ``torch.dtype`` is still accepted at construction)."""
    from helpers import scaled_timeout
    from numerics_ranks import CLASSES, dcp_optimizer_state_dict_run

    from optbook.distributed import launch
    report = launch(dcp_optimizer_state_dict_run, 1, list(CLASSES), timeout=scaled_timeout(60.0))[0]
    assert report["results"] == {name: "ok" for name in CLASSES}
    allowed = {"int", "float", "bool", "str", "NoneType", "tuple", "list"}
    assert all(set(kinds) <= allowed for kinds in report["kinds"].values()), report["kinds"]


@pytest.mark.parametrize("name", ["Muon", "NorMuon", "AdaMuon", "Scion"])
def test_ns_dtype_is_stored_as_its_name_and_the_step_is_the_same(name):
    from optbook import optim
    cls = getattr(optim, name)
    runs = []
    for given in (torch.float32, "float32"):
        W = torch.nn.Parameter(torch.randn(6, 10, generator=torch.Generator().manual_seed(0)))
        opt = cls([{"params": [W], "ns_dtype": given}], lr=0.01, ns_dtype=torch.float64)
        assert opt.param_groups[0]["ns_dtype"] == "float32" and opt.defaults["ns_dtype"] == "float64"
        for k in range(2):
            W.grad = torch.randn(6, 10, generator=torch.Generator().manual_seed(k + 1))
            opt.step()
        runs.append(W.detach().clone())
    assert torch.equal(*runs)
    opt.param_groups[0]["ns_dtype"] = torch.bfloat16          # set later as a dtype: stored as its name at the step
    opt.step()
    assert opt.param_groups[0]["ns_dtype"] == "bfloat16"
    with pytest.raises(TypeError, match="Invalid ns_dtype"):
        cls([W], ns_dtype=torch.int32)
    with pytest.raises(TypeError, match="Invalid ns_dtype"):
        cls([W], ns_dtype="half")


# --- AdaMuon: the current version and the July 2025 one -----------------------------------------------------

def _adamuon_transcribed(W, grads, *, version, lr=0.02, momentum=0.95, beta2=0.95, eps=1e-8, wd=0.1):
    """Our float64 transcription of the two published versions (module docstring of optbook.optim.adamuon),
    with the exact polar factor for Newton–Schulz."""
    from optbook.polar import polar_factor
    W, M, v = W.clone(), torch.zeros_like(W), torch.zeros_like(W)
    m, n = W.shape
    for t, G in enumerate(grads, start=1):
        M = M + (1 - momentum) * (G - M)
        D = G + momentum * (M - G)
        O = polar_factor(torch.sign(D) if version == "2025-08" else D)
        v = beta2 * v + (1 - beta2) * O * O
        A = O / ((v if version == "2025-08" else v / (1 - beta2 ** t)).sqrt() + eps)
        W = W * (1 - lr * wd) - lr * 0.2 * math.sqrt(m * n) * A / (A.norm() + eps)
    return W


@pytest.mark.parametrize("version, beta2", [("2025-08", 0.95), ("2025-07", 0.999)])
def test_adamuon_versions_follow_their_published_algorithms(version, beta2):
    """The default is the current version (sign before Newton–Schulz, no bias correction); the July one is
    ``version="2025-07"``. Newton–Schulz converged in float64 (30 cubic steps) against the exact polar factor:
    measured agreement 1e-15; asserted 1e-10. On the old code the default was the July version (and
    ``version`` did not exist)."""
    from optbook.optim import AdaMuon
    gen = torch.Generator().manual_seed(11)
    W0 = torch.randn(6, 10, generator=gen, dtype=F64)
    grads = [torch.randn(6, 10, generator=gen, dtype=F64) for _ in range(4)]
    W = torch.nn.Parameter(W0.clone())
    options = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float64, coefficients="cubic", ns_steps=30)
    opt = AdaMuon([W], beta2=beta2, **options) if version == "2025-08" else \
        AdaMuon([W], beta2=beta2, version=version, **options)
    for g in grads:
        W.grad = g.clone()
        opt.step()
    expected = _adamuon_transcribed(W0, grads, version=version, beta2=beta2)
    assert (W.detach() - expected).abs().max() < 1e-10
    other = _adamuon_transcribed(W0, grads, version="2025-07" if version == "2025-08" else "2025-08", beta2=beta2)
    assert (W.detach() - other).abs().max() > 1e-4                      # the two versions differ
