"""Muon: parity with torch.optim.Muon, scale conventions, head splitting, bad input, resume."""

import copy

import pytest
import torch

from optbook import newton_schulz, polar_factor
from optbook.optim import Muon, muon_scale, split_rows
from optbook.optim.functional import muon


def drive(opts_and_params, shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grad = torch.randn(*shape, generator=g)
        for opt, p in opts_and_params:
            p.grad = grad.clone()
            opt.step()


@pytest.mark.parametrize("scale_mode, extra, adjust", [("shape_scaling", 1.0, "original"),
                                                         ("spectral", 0.2, "match_rms_adamw")])
@pytest.mark.parametrize("shape", [(32, 16), (16, 48)])
def test_equals_torch_muon_within_bf16_tolerance(scale_mode, extra, adjust, shape):
    W = torch.randn(*shape)
    ours, ref = W.clone().requires_grad_(), W.clone().requires_grad_()
    opt = Muon([ours], lr=0.02, weight_decay=0.1, scale_mode=scale_mode, extra_scale_factor=extra)
    torch_opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    drive([(opt, ours), (torch_opt, ref)], shape, 100)
    moved = float((ref - W).detach().abs().max())
    # both iterate in bf16 (8 bits of mantissa); rounding differs per step, so the trajectories agree to
    # about 1% of how far the weights moved
    assert moved > 0.3
    assert float((ours - ref).detach().abs().max()) <= 0.01 * moved


def test_float64_iteration_matches_the_formula_exactly():
    W = torch.randn(6, 4, dtype=torch.float64)
    p = W.clone().requires_grad_()
    opt = Muon([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.5, ns_dtype=torch.float64)
    G1, G2 = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    w, m = W.clone(), torch.zeros_like(W)
    for G in (G1, G2):
        p.grad = G.clone()
        opt.step()
        m = m.lerp(G, 0.1)
        O = newton_schulz(G.lerp(m, 0.9), dtype=torch.float64)
        w = w - 0.1 * (muon_scale((6, 4)) * O + 0.5 * w)
    torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-14)


def test_scale_conventions_case():
    assert muon_scale((4, 2)) == pytest.approx(1.414214, abs=1e-6)
    assert muon_scale((2, 4)) == 1.0
    assert muon_scale((4, 2), "spectral", 0.2) == pytest.approx(0.4)
    assert muon_scale((2, 4), "spectral", 0.2) == pytest.approx(0.4)
    assert muon_scale((2, 8), "unit_rms_norm") == pytest.approx(0.5)
    assert muon_scale((2, 8), "none") == 1.0


def test_zero_gradient_only_decays():
    # case 2: ones(3, 2), zero gradient, lr 0.02, wd 0.1 -> 0.998 everywhere
    p = torch.ones(3, 2, requires_grad=True)
    opt = Muon([p], lr=0.02, weight_decay=0.1)
    p.grad = torch.zeros(3, 2)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3, 2), 0.998))


def test_lerp_and_sum_momentum_forms_give_the_same_orthogonalised_direction():
    # case 3: the lerp buffer is (1 - mu) times the sum buffer; NS normalises the scale away
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 7, generator=g, dtype=torch.float64) for _ in range(4)]
    mu, lerp_buf, sum_buf = 0.9, torch.zeros(5, 7, dtype=torch.float64), torch.zeros(5, 7, dtype=torch.float64)
    for G in grads:
        lerp_buf.lerp_(G, 1 - mu)
        sum_buf.mul_(mu).add_(G)
        a = newton_schulz(G.lerp(lerp_buf, mu), dtype=torch.float64)
        b = newton_schulz(G + mu * sum_buf, dtype=torch.float64)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_per_head_split_orthogonalises_each_head():
    heads, d_head, d_in = 3, 4, 8
    p = torch.zeros(heads * d_head, d_in, dtype=torch.float64, requires_grad=True)
    opt = Muon([{"params": [p], "head_split": heads}], lr=1.0, momentum=0.0, nesterov=False,
               scale_mode="none", ns_dtype=torch.float64, ns_steps=10, coefficients="deepseek_v4")
    G = torch.randn(heads * d_head, d_in, dtype=torch.float64)
    G[:d_head] *= 100.0  # one loud head
    p.grad = G
    opt.step()
    update = -p.detach()
    for h in range(heads):
        block = update[h * d_head:(h + 1) * d_head]
        torch.testing.assert_close(block, polar_factor(G[h * d_head:(h + 1) * d_head]), rtol=0, atol=2e-3)


def test_gqa_unequal_blocks_and_bad_splits():
    assert split_rows(12, (8, 2, 2)) == [8, 2, 2]
    assert split_rows(12, 3) == [4, 4, 4]
    with pytest.raises(ValueError, match="head_split"):
        split_rows(10, 3)
    with pytest.raises(ValueError, match="head_split"):
        Muon([{"params": [torch.zeros(10, 4)], "head_split": 3}])
    with pytest.raises(ValueError, match="head_split"):
        Muon([{"params": [torch.zeros(10, 4)], "head_split": (4, 4)}])
    # row counts must be integers: a float used to be truncated (2.5 -> 2) without a word
    assert split_rows(6, [torch.tensor(3), 3]) == [3, 3]
    for bad in ((2.5, 3.5), (2.0, 4.0), (True, 5), "ab"):
        with pytest.raises(TypeError, match="head_split"):
            split_rows(6, bad)


def test_non_matrix_parameter_is_refused_with_its_shape_and_the_routing_hint():
    with pytest.raises(ValueError, match=r"\(4,\).*muon_param_groups"):
        Muon([torch.zeros(4)])
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        Muon([torch.zeros(2, 3, 4)])


@pytest.mark.parametrize("kwargs, word", [
    (dict(coefficients="sextic"), "coefficients"), (dict(ns_steps=0), "steps"), (dict(lr=-1.0), "lr"),
    (dict(momentum=1.0), "momentum"), (dict(scale_mode="mup"), "scale_mode"), (dict(weight_decay=-1.0), "weight_decay"),
])
def test_bad_hyperparameters(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Muon([torch.zeros(3, 4, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_raises_and_changes_nothing(bad):
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    opt = Muon([a, b])
    a.grad, b.grad = torch.randn(4, 3), torch.randn(4, 3)
    opt.step()
    before = [a.detach().clone(), b.detach().clone()], copy.deepcopy(opt.state_dict())
    a.grad = torch.randn(4, 3)
    b.grad = torch.randn(4, 3)
    b.grad[1, 1] = bad
    with pytest.raises(ValueError, match="Non-finite gradient"):
        opt.step()
    assert torch.equal(a, before[0][0]) and torch.equal(b, before[0][1])
    for k, st in before[1]["state"].items():
        assert torch.equal(opt.state_dict()["state"][k]["momentum_buffer"], st["momentum_buffer"])


def test_same_shapes_are_batched_and_give_the_unbatched_result():
    params = [torch.randn(8, 6, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    singles = [p.detach().clone().requires_grad_() for p in params]
    opt = Muon(params, ns_dtype=torch.float64)
    opts = [Muon([q], ns_dtype=torch.float64) for q in singles]
    for _ in range(3):
        grads = [torch.randn(8, 6, dtype=torch.float64) for _ in params]
        for p, q, g, o in zip(params, singles, grads, opts):
            p.grad, q.grad = g.clone(), g.clone()
            o.step()
        opt.step()
    for p, q in zip(params, singles):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-14)


def test_resume_is_bit_identical():
    W = torch.randn(6, 10)
    straight = W.clone().requires_grad_()
    opt = Muon([straight], weight_decay=0.1)
    drive([(opt, straight)], (6, 10), 10)
    first = W.clone().requires_grad_()
    opt1 = Muon([first], weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(6, 10, generator=g) for _ in range(10)]
    for G in grads[:4]:
        first.grad = G.clone()
        opt1.step()
    saved = copy.deepcopy(opt1.state_dict())
    second = first.detach().clone().requires_grad_()
    opt2 = Muon([second], weight_decay=0.1)
    opt2.load_state_dict(saved)
    for G in grads[4:]:
        second.grad = G.clone()
        opt2.step()
    assert torch.equal(second, straight)


def _counting(monkeypatch, name):
    calls, real = [], getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("head_split, batches", [(None, 0), (2, 1), ((1, 3), 0)])
def test_a_block_whose_shape_no_other_block_shares_is_neither_stacked_nor_concatenated(monkeypatch, head_split,
                                                                                         batches):
    # (4, 3) and (6, 5) alone; head_split=2 cuts (4, 3) into two (2, 3) blocks: one stacked batch
    params = [torch.randn(4, 3, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)]
    params = params[:1] if head_split else params
    grads, bufs = [torch.randn_like(p) for p in params], [torch.zeros_like(p) for p in params]
    stacks, cats = _counting(monkeypatch, "stack"), _counting(monkeypatch, "cat")
    muon(params, grads, bufs, lr=0.02, momentum=0.95, nesterov=True,
         weight_decay=0.1, ns_dtype=torch.float64, head_split=head_split)
    assert cats == [] and len(stacks) == batches


def test_block_rows_are_written_back_in_place_as_the_concatenated_update():
    W = torch.randn(6, 4, dtype=torch.float64)
    G = torch.randn(6, 4, dtype=torch.float64)
    expected = W * (1 - 0.02 * 0.1) - 0.02 * torch.cat(
        [newton_schulz(b, dtype=torch.float64) * muon_scale(b.shape) for b in G.split([2, 4])])
    muon([W], [G], [torch.zeros_like(W)], lr=0.02, momentum=0.0, nesterov=False, weight_decay=0.1,
         ns_dtype=torch.float64, head_split=(2, 4))
    torch.testing.assert_close(W, expected, rtol=0, atol=1e-15)  # lerp(0, G, 1) = G: same inputs, same ops


def test_non_finite_check_is_one_reduction_over_every_gradient_of_the_step(monkeypatch):
    params = [torch.randn(4, 3, requires_grad=True) for _ in range(3)] + [torch.randn(5, 2, requires_grad=True)]
    opt = Muon([{"params": params[:2]}, {"params": params[2:], "momentum": 0.5}])
    for p in params:
        p.grad = torch.randn_like(p)
    norms = _counting(monkeypatch, "_foreach_norm")
    opt.step()
    assert len(norms) == 1
    params[3].grad[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"Non-finite gradient in param_groups\[1\]\['params'\]\[1\]"):
        opt.step()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_sees_every_non_finite_value_and_no_large_finite_one(bad):
    from optbook.optim.optimizer import all_finite
    ok = [torch.full((3,), 6e4, dtype=torch.float16), torch.ones(2, 2, dtype=torch.bfloat16),
          torch.tensor(1e300, dtype=torch.float64), torch.ones(4)]
    assert all_finite(ok)
    for i in range(len(ok)):
        broken = [t.clone() for t in ok]
        broken[i].view(-1)[-1] = bad
        assert not all_finite(broken)


@pytest.mark.parametrize("ns_dtype", [torch.float64, torch.bfloat16])
def test_a_global_clip_does_not_change_muons_update(ns_dtype):
    # A clip multiplies every gradient by c; Muon's update must not depend on c. Newton-Schulz's
    # eps floor used to shrink it once ||M||_F < eps (0.77x at c = 1e-6, 0.068x at 1e-8).
    g = torch.Generator().manual_seed(0)
    G = torch.randn(16, 8, generator=g, dtype=torch.float64) * 0.05

    def update(scale):
        W = torch.zeros(16, 8, dtype=torch.float64, requires_grad=True)
        opt = Muon([W], lr=1.0, ns_dtype=ns_dtype)
        W.grad = G * scale
        opt.step()
        return -W.detach()

    reference = update(1.0)
    for c in (1e-6, 1e-8, 1e-9, 1e-12, 1e-30):
        ratio = float(torch.linalg.matrix_norm(update(c)) / torch.linalg.matrix_norm(reference))
        tol = 1e-12 if ns_dtype == torch.float64 else 0.02  # bf16: the cast rounds c*G differently
        assert abs(ratio - 1) <= tol, (c, ratio)
        torch.testing.assert_close(update(c), reference, rtol=0, atol=tol * 10)
    assert torch.equal(update(2.0 ** -40), reference)  # a power of two: bit for bit
    assert torch.equal(update(0.0), torch.zeros(16, 8, dtype=torch.float64))  # zero stays zero


def test_aol_preconditioned_muon_is_newton_schulz_with_aol_and_refuses_an_unknown_preconditioner():
    from optbook.polar import newton_schulz
    from optbook.optim import TURBO_SCHEDULE
    from optbook.optim.muon import exact_rescale, muon_scale

    torch.manual_seed(0)
    w0, g = torch.randn(12, 20, dtype=torch.float64), torch.randn(12, 20, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    opt = Muon([p], lr=0.1, momentum=0.0, nesterov=False, ns_steps=4, coefficients=TURBO_SCHEDULE,
               ns_dtype=torch.float64, ns_precondition="aol")
    opt.step()
    o = newton_schulz(exact_rescale(g), steps=4, coefficients=TURBO_SCHEDULE, dtype=torch.float64,
                      precondition="aol")
    torch.testing.assert_close(p.detach(), w0 - 0.1 * muon_scale((12, 20)) * o, rtol=0, atol=1e-15)
    before = p.detach().clone()
    opt.param_groups[0]["ns_precondition"] = "diag"
    with pytest.raises(ValueError, match="Invalid ns_precondition"):
        opt.step()
    assert torch.equal(p.detach(), before)
    with pytest.raises(ValueError, match="Invalid ns_precondition"):
        Muon([p], ns_precondition="diag")


def test_aol_with_four_steps_is_at_least_as_close_to_the_polar_factor_as_the_five_step_default():
    """bfloat16, random Gaussian matrices of the benchmark's shapes: the Turbo-Muon schedule (AOL, 4 steps)
    lands closer to U V^T than torch.optim.Muon's 5 steps of (3.4445, -4.7750, 2.0315), with 4/5 of the products."""
    from optbook.polar import newton_schulz
    from optbook.optim import TURBO_SCHEDULE

    gen = torch.Generator().manual_seed(0)
    for shape in [(192, 192), (192, 768)] * 3:
        G = torch.randn(shape, generator=gen)
        U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
        polar = U @ Vh
        err = {}
        for name, kw in {"default": dict(steps=5),
                         "turbo": dict(steps=4, coefficients=TURBO_SCHEDULE, precondition="aol")}.items():
            O = newton_schulz(G, dtype=torch.bfloat16, **kw).double()
            err[name] = float((O - polar).norm() / polar.norm())
        assert err["turbo"] < 0.8 * err["default"], (shape, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_exact_rescale_overwrite_gives_the_same_bits_in_place_only_where_the_dtype_allows(dtype):
    from optbook.optim.muon import exact_rescale
    D = torch.randn(3, 8, 5, dtype=torch.float64).mul_(torch.tensor([1e-9, 1.0, 3e4]).view(3, 1, 1)).to(dtype)
    D[0, 0, 0] = -D.abs().max() * 2   # the largest magnitude negative: max |D| is -min D
    expected = exact_rescale(D)
    out = exact_rescale(D.clone())
    assert torch.equal(out, expected)
    mine = D.clone()
    got = exact_rescale(mine, overwrite=True)
    assert torch.equal(got, expected)
    assert (got is mine) == (dtype != torch.bfloat16)   # bfloat16 goes to a new float32 tensor
    amax = expected.abs().amax(dim=(-2, -1))
    assert bool(((amax >= 0.5) & (amax < 1)).all())


@pytest.mark.parametrize("dtype, ns_dtype", [(torch.float32, torch.bfloat16), (torch.float64, torch.float64),
                                             (torch.float32, torch.float32)])
def test_newton_schulz_overwrite_gives_the_same_result(dtype, ns_dtype):
    G = torch.randn(2, 12, 20, dtype=dtype)
    expected = newton_schulz(G, dtype=ns_dtype)
    scratch = G.clone()
    assert torch.equal(newton_schulz(scratch, dtype=ns_dtype, overwrite=True), expected)
    assert torch.equal(newton_schulz(G, dtype=ns_dtype), expected)   # without overwrite G is untouched


@pytest.mark.parametrize("head_split", [None, 2])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float64])
def test_orthogonalized_blocks_is_what_muon_subtracts_and_leaves_the_directions_alone(head_split, ns_dtype):
    """muon() on zero parameters with lr = 1 and no momentum subtracts exactly orthogonalized_blocks' updates;
    the directions are only read (the distributed Muons send them while the owner orthogonalises), whether a
    shape is alone (as it is or transposed) or stacked with others (tall and wide of the same shape)."""
    from optbook.distributed._muon_common import scaled_orthogonal
    from optbook.optim.muon import orthogonalized_blocks
    g = torch.Generator().manual_seed(3)
    shapes = [(8, 8), (16, 4), (4, 16), (12, 4), (6, 10), (8, 8)]
    D = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    kept = [d.clone() for d in D]
    options = dict(ns_steps=5, coefficients="simple", scale_mode="shape_scaling", extra_scale_factor=1.0,
                   eps=1e-7, ns_dtype=ns_dtype, head_split=head_split)
    updates = orthogonalized_blocks(D, **options)
    assert all(torch.equal(d, k) for d, k in zip(D, kept))
    params = [torch.zeros_like(d) for d in D]
    muon(params, [d.clone() for d in D], [torch.zeros_like(d) for d in D], lr=1.0, momentum=0.0, nesterov=False,
         weight_decay=0.0, **options)
    for p, blocks, d in zip(params, updates, D):
        assert [b.shape[0] for b in blocks] == split_rows(d.shape[0], head_split)
        assert torch.equal(-p, torch.cat(blocks))
    group = {"lr": 0.5, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, **options}
    for full, blocks in zip(scaled_orthogonal(D, group), updates):
        assert torch.equal(full, torch.cat(blocks))
    assert all(torch.equal(d, k) for d, k in zip(D, kept))
