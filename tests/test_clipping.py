"""optbook.clipping: global-norm clipping without overflow, without writing NaN, each tensor counted once.

Reference: ``torch.nn.utils.clip_grad_norm_`` (the same coefficient ``max_norm / (norm + 1e-6)``, below 1).
"""

import math

import pytest
import torch

from optbook.clipping import (
    REPLICATED,
    clip_coefficient,
    clip_grad_norm_,
    get_grad_norm,
    grad_sumsq,
    scale_grads_,
)


def with_grad(values, dtype=torch.float32):
    g = torch.as_tensor(values, dtype=dtype)
    p = torch.zeros_like(g, requires_grad=True)
    p.grad = g.clone()
    return p


def grads_of(params):
    return [p.grad.clone() for p in params]


def assert_bitwise_equal(params, before):
    for p, g in zip(params, before):
        assert p.grad.dtype == g.dtype and torch.equal(p.grad.view(-1).view(torch.uint8),
                                                       g.view(-1).view(torch.uint8))


def test_three_four_twelve_has_norm_thirteen_and_is_scaled_to_one():
    a, b = with_grad([3.0, 4.0]), with_grad([12.0])
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.dtype == torch.float64 and norm.shape == () and norm.item() == 13.0
    torch.testing.assert_close(a.grad, torch.tensor([3 / 13, 4 / 13]), rtol=0, atol=1e-6)
    torch.testing.assert_close(b.grad, torch.tensor([12 / 13]), rtol=0, atol=1e-6)
    torch.testing.assert_close(b.grad, torch.tensor([0.923077]), rtol=0, atol=1e-6)


def test_a_single_tensor_and_no_gradients_are_accepted():
    p = with_grad([3.0, 4.0])
    assert get_grad_norm(p).item() == 5.0
    q = torch.zeros(3, requires_grad=True)
    norm = clip_grad_norm_([q], max_norm=1.0)
    assert norm.item() == 0.0 and norm.dtype == torch.float64 and norm.device.type == "cpu" and q.grad is None


def test_float32_gradient_of_1e20_does_not_overflow():
    p = with_grad(1e20 * torch.ones(100))
    norm = clip_grad_norm_([p], max_norm=1.0)
    assert math.isfinite(norm.item())
    # float32 holds 1e20 as 100000002004087734272 (relative error 2e-8): the exact norm is 10 times that.
    assert norm.item() == pytest.approx(10 * torch.tensor(1e20).item(), rel=1e-12)
    assert norm.item() == pytest.approx(1e21, rel=1e-7)
    assert torch.isfinite(p.grad).all() and (p.grad != 0).all()
    torch.testing.assert_close(p.grad, torch.full((100,), 0.1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_neither_overflow_nor_underflow(dtype):
    # 60000^2 overflows float16 (max 65504) and the coefficient 1 / 6e7 is below float16's smallest number.
    values = torch.full((1_000_000,), 60000.0).to(dtype)
    p = with_grad(values, dtype=dtype)
    norm = clip_grad_norm_([p], max_norm=1.0)
    ref = torch.linalg.vector_norm(values.double())
    assert norm.item() == pytest.approx(ref.item(), rel=1e-12)
    expected = (values.double() * (1.0 / (ref + 1e-6))).to(dtype)
    assert p.grad.dtype == dtype and torch.equal(p.grad, expected) and (p.grad != 0).all()


def test_float64_gradients_beyond_the_squared_range_have_a_finite_norm():
    # 1e200^2 overflows float64; the norm is recomputed as amax * ||g / amax||.
    p = with_grad([1e200, -1e200, 1e200], dtype=torch.float64)
    empty = with_grad(torch.zeros(0, 3), dtype=torch.float64)
    norm = clip_grad_norm_([p, empty], max_norm=1.0)
    assert norm.item() == pytest.approx(math.sqrt(3) * 1e200, rel=1e-15)
    torch.testing.assert_close(p.grad, torch.tensor([1, -1, 1], dtype=torch.float64) / math.sqrt(3))


@pytest.mark.parametrize("bad, expected", [(math.inf, math.inf), (-math.inf, math.inf), (math.nan, math.nan)])
def test_nonfinite_gradient_reports_the_norm_and_leaves_grads_untouched(bad, expected):
    params = [with_grad([1.0, bad, 3.0]), with_grad([100.0])]
    before = grads_of(params)
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert norm.dtype == torch.float64
    assert (math.isnan(norm.item()) if math.isnan(expected) else norm.item() == expected)
    assert_bitwise_equal(params, before)
    with pytest.raises(RuntimeError, match="[Nn]on-finite"):
        clip_grad_norm_(params, max_norm=1.0, error_if_nonfinite=True)
    assert_bitwise_equal(params, before)


def test_nan_wins_over_inf():
    assert math.isnan(get_grad_norm([with_grad([math.inf]), with_grad([math.nan])]).item())


def test_coefficient_at_least_one_leaves_grads_bitwise_untouched():
    params = [with_grad([0.1, -0.2, 0.3]), with_grad([[1e-3, 2e-3]], dtype=torch.bfloat16)]
    before = grads_of(params)
    norm = clip_grad_norm_(params, max_norm=10.0)
    assert norm.item() < 10.0
    assert_bitwise_equal(params, before)


@pytest.mark.parametrize("max_norm, error", [(0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                                             (math.inf, ValueError), (True, TypeError), ("1.0", TypeError),
                                             (None, TypeError)])
def test_bad_max_norm_is_refused_before_any_write(max_norm, error):
    params = [with_grad([3.0, 4.0])]
    before = grads_of(params)
    with pytest.raises(error, match="max_norm"):
        clip_grad_norm_(params, max_norm=max_norm)
    assert_bitwise_equal(params, before)


def test_bad_error_if_nonfinite_and_non_tensor_params_are_refused():
    with pytest.raises(TypeError, match="error_if_nonfinite"):
        clip_grad_norm_([with_grad([1.0])], 1.0, error_if_nonfinite="yes")
    with pytest.raises(TypeError, match="params"):
        get_grad_norm([with_grad([1.0]), [1.0]])


def test_a_tensor_listed_twice_is_counted_and_scaled_once():
    tied, other = with_grad([3.0, 4.0]), with_grad([12.0])
    assert get_grad_norm([tied, other, tied]).item() == 13.0
    norm = clip_grad_norm_([tied, other, tied], max_norm=1.0)
    assert norm.item() == 13.0
    torch.testing.assert_close(tied.grad, torch.tensor([3 / 13, 4 / 13]), rtol=0, atol=1e-6)


def test_without_a_group_the_replicated_mark_is_ignored():
    p = with_grad([3.0, 4.0])
    setattr(p, REPLICATED, True)
    assert get_grad_norm([p]).item() == 5.0


def test_a_group_without_torch_distributed_initialised_is_refused():
    with pytest.raises(RuntimeError, match="not initialised"):
        get_grad_norm([with_grad([1.0])], group=object())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e3])
def test_parity_with_torch_nn_utils_clip_grad_norm_(dtype, max_norm):
    gen = torch.Generator().manual_seed(1)
    shapes = [(5, 3), (7,), (2, 3, 4), (1,)]
    ours = [with_grad(torch.randn(s, generator=gen, dtype=dtype), dtype=dtype) for s in shapes]
    ref = [with_grad(p.grad, dtype=dtype) for p in ours]
    norm = clip_grad_norm_(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    tol = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-14, atol=0)
    torch.testing.assert_close(norm, ref_norm.double(), **tol)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad, **tol)


def test_train_sequence_model_clips_and_skips_the_step_when_the_norm_is_not_finite():
    from optbook.training import train_sequence_model

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
    calls = []

    def poison_once(grad):  # the second backward pass sees a NaN gradient
        calls.append(1)
        return torch.full_like(grad, math.nan) if len(calls) == 2 else grad

    model[1].weight.register_hook(poison_once)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(0))
    weights = []
    log = train_sequence_model(model, opt, lambda step: (tokens, tokens), steps=3, max_grad_norm=1e-3,
                               after_step=lambda step, m, o: weights.append(m[1].weight.detach().clone()))
    assert log.skipped_steps == [1]
    assert torch.equal(weights[1], weights[0]) and not torch.equal(weights[2], weights[1])
    assert all(torch.isfinite(w).all() for w in weights)
    # the steps taken were clipped: the SGD update lr * g has norm at most lr * max_norm over all parameters
    assert (weights[2] - weights[1]).norm() <= 0.1 * 1e-3 * (1 + 1e-5)


def test_clip_coefficient_is_max_norm_over_norm_plus_eps_capped_at_one():
    assert clip_coefficient(13.0, 1.0) == 1.0 / (13.0 + 1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(13.0, None) == 1.0
    assert clip_coefficient(math.inf, 1.0) == 1.0 and clip_coefficient(math.nan, 1.0) == 1.0


def test_scale_grads_multiplies_in_float64_with_one_rounding_and_never_scales_up():
    g16 = torch.tensor([1e-4, 3.0], dtype=torch.float16)
    expected = (g16.double() * 1e-3).half()
    scale_grads_([g16], 1e-3)
    assert torch.equal(g16, expected)
    g = torch.tensor([2.0, -4.0])
    scale_grads_([g], 2.0)
    assert torch.equal(g, torch.tensor([2.0, -4.0]))
    g64 = torch.tensor([2.0], dtype=torch.float64)
    scale_grads_([g64], 0.25)
    assert g64.item() == 0.5


def test_grad_sumsq_is_the_float64_sum_of_squares_without_overflow():
    s = grad_sumsq([torch.tensor([3.0, 4.0]), torch.tensor([[12.0]], dtype=torch.bfloat16)])
    assert s.dtype == torch.float64 and s.shape == () and s.item() == 169.0
    big = grad_sumsq([torch.full((100,), 1e20)])  # float32 squares would overflow
    assert big.item() == pytest.approx(1e42, rel=1e-6)
    assert grad_sumsq([]).item() == 0.0
