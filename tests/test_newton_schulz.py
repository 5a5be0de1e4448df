"""Newton–Schulz against its scalar oracle and the exact polar factor (cases 1 and 2)."""

import pytest
import torch

from optbook import newton_schulz, ns_schedule, polar_factor
from optbook.polar import POLAR_EXPRESS_PUBLISHED, POLAR_EXPRESS_SAFETY

SCHEDULES = [("simple", 5), ("quintic", 5), ("deepseek_v4", 10), ("cubic", 12), ("polar_express", 5)]


def phi_composed(s, schedule):
    for a, b, c in schedule:
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def random_svd(m, n, singular_values, seed=0):
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))[0][:, : len(singular_values)]
    V = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0][:, : len(singular_values)]
    return U, V, U @ torch.diag(singular_values) @ V.T


@pytest.mark.parametrize("name, steps", SCHEDULES)
@pytest.mark.parametrize("m, n", [(6, 10), (10, 6), (7, 7)])
def test_matrix_iteration_equals_the_scalar_polynomial_on_each_singular_value(name, steps, m, n):
    s = torch.linspace(0.05, 1.0, min(m, n), dtype=torch.float64)
    s = s / s.norm()  # the input is normalised by its Frobenius norm = ||s||_2, so pass it pre-normalised
    U, V, G = random_svd(m, n, s)
    out = newton_schulz(G, steps=steps, coefficients=name, dtype=torch.float64)
    expected = U @ torch.diag(phi_composed(s, ns_schedule(name, steps))) @ V.T
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)  # float64, ~steps * 1e-15 rounding


def test_orientation_case():
    G = torch.tensor([[1.0, 2], [3, 4], [5, 6], [7, 8]])
    X = newton_schulz(G, dtype=torch.float32)
    assert X.shape == (4, 2)
    torch.testing.assert_close(X, newton_schulz(G.T, dtype=torch.float32).T, rtol=0, atol=1e-6)
    expected = torch.tensor([[-0.447072, 0.512406], [-0.107401, 0.407904], [0.232271, 0.303401], [0.571942, 0.198899]])
    torch.testing.assert_close(X, expected, rtol=0, atol=2e-6)  # values given to 6 decimals
    torch.testing.assert_close(torch.linalg.svdvals(X), torch.tensor([0.816458, 0.697446]), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_zero_matrix_gives_zeros_never_nan(dtype):
    out = newton_schulz(torch.zeros(3, 2, dtype=dtype))
    assert out.dtype == dtype and torch.equal(out, torch.zeros(3, 2, dtype=dtype))
    assert torch.equal(polar_factor(torch.zeros(3, 2, dtype=dtype)), torch.zeros(3, 2, dtype=dtype))


def test_scale_invariance_down_to_eps():
    eye = torch.eye(4, dtype=torch.float64)
    ref = newton_schulz(eye, dtype=torch.float64)
    torch.testing.assert_close(ref.diagonal(), torch.full((4,), 0.765439, dtype=torch.float64), rtol=0, atol=1e-6)
    for s in (1e-3, 1e-2, 0.5, 1.0):
        torch.testing.assert_close(newton_schulz(s * eye, dtype=torch.float64), ref, rtol=0, atol=1e-12)
        # fp32 agrees to its own precision
        torch.testing.assert_close(newton_schulz((s * eye).float(), dtype=torch.float32), ref.float(), rtol=0, atol=1e-5)


def test_large_gradient_is_normalised_before_the_low_precision_cast():
    G = 1e5 * torch.randn(8, 16)
    out = newton_schulz(G, dtype=torch.float16)  # casting first would overflow fp16 (max 65504)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, newton_schulz(G / 1e5, dtype=torch.float16), rtol=0, atol=1e-6)


def test_rank_deficient_input_keeps_its_rank_and_matches_the_partial_isometry():
    s = torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64)
    U, V, G = random_svd(6, 9, s)
    exact = polar_factor(G)
    torch.testing.assert_close(exact, U[:, :2] @ V[:, :2].T, rtol=0, atol=1e-12)
    approx = newton_schulz(G, steps=10, coefficients="deepseek_v4", dtype=torch.float64)
    # round-off directions (~1e-16) grow by at most phi'(0)^10 ~ 1e5: still far below the kept ones
    sv = torch.linalg.svdvals(approx)
    assert float(sv[1]) > 0.99 and float(sv[2]) < 1e-9
    assert float((approx - exact).norm() / exact.norm()) < 1e-3


@pytest.mark.parametrize("shape", [(1, 7), (7, 1), (5, 3, 4, 6), (2, 6, 4)])
def test_batched_and_degenerate_shapes(shape):
    G = torch.randn(*shape, dtype=torch.float64)
    out = newton_schulz(G, dtype=torch.float64)
    assert out.shape == G.shape
    flat_in, flat_out = G.reshape(-1, *shape[-2:]), out.reshape(-1, *shape[-2:])
    for a, b in zip(flat_in, flat_out):
        torch.testing.assert_close(b, newton_schulz(a, dtype=torch.float64), rtol=0, atol=1e-12)


def test_one_by_n_input_is_its_unit_vector_direction():
    # a 1 x n matrix has one singular value: 5 simple steps map 1 to phi^5(1) (0.7654 for the simple schedule)
    g = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    out = newton_schulz(g, dtype=torch.float64)
    torch.testing.assert_close(out, phi_composed(torch.tensor(1.0, dtype=torch.float64),
                                                 ns_schedule("simple", 5)) * g / 5.0, rtol=0, atol=1e-12)


def test_polar_factor_is_the_exact_oracle():
    G = torch.randn(5, 8, dtype=torch.float64)
    P = polar_factor(G)
    torch.testing.assert_close(P @ P.T, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float((newton_schulz(G, steps=10, coefficients="deepseek_v4", dtype=torch.float64) - P).norm()) < 1e-2


@pytest.mark.parametrize("kwargs, word", [
    (dict(coefficients="sextic"), "coefficients"), (dict(steps=0), "steps"),
    (dict(coefficients="deepseek_v4", steps=5), "steps=10"), (dict(coefficients=[(1.0, 2.0)]), "coefficients"),
    (dict(eps=0.0), "eps"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        newton_schulz(torch.randn(3, 4), **kwargs)


@pytest.mark.parametrize("steps", [2.5, True, "5", None])
def test_a_step_count_that_is_not_an_int_is_a_type_error_naming_steps(steps):
    with pytest.raises(TypeError, match="steps"):
        newton_schulz(torch.randn(3, 4), steps=steps)


def test_non_matrix_and_integer_input_is_refused():
    with pytest.raises(ValueError, match="G"):
        newton_schulz(torch.randn(4))
    with pytest.raises(TypeError, match="G"):
        newton_schulz(torch.ones(2, 2, dtype=torch.int64))


def test_a_schedule_run_past_its_end_repeats_its_last_triple():
    assert ns_schedule("quintic", 7)[5:] == [ns_schedule("quintic", 5)[-1]] * 2
    assert ns_schedule([(1, 2, 3), (4, 5, 6)], 3) == [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0), (4.0, 5.0, 6.0)]


@pytest.mark.parametrize("steps", [6, 8])
def test_quintic_run_for_more_steps_than_it_has_ends_with_singular_values_near_one(steps):
    # cycling to the first triple (Megatron-LM) maps 1 to 0.117: singular values 0.07-0.14 after 6 steps
    G = torch.randn(32, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sv = torch.linalg.svdvals(newton_schulz(G, steps=steps, coefficients="quintic", dtype=torch.float64))
    five = torch.linalg.svdvals(newton_schulz(G, steps=5, coefficients="quintic", dtype=torch.float64))
    assert float(sv.min()) > 0.9 and float(sv.max()) < 1.1, sv  # the 5-step band is [0.978, 1.032]
    assert float((sv - 1).abs().max()) <= float((five - 1).abs().max()) + 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cubic_schedule_in_low_precision_stays_finite_and_converges(dtype):
    # guards against torch's CPU baddbmm ignoring beta when alpha == 0 in bf16/fp16 (n >= 32)
    G = torch.randn(48, 64)
    out = newton_schulz(G, steps=16, coefficients="cubic", dtype=dtype).float()
    assert torch.isfinite(out).all()
    sv = torch.linalg.svdvals(out)
    assert float(sv.min()) > 0.95 and float(sv.max()) < 1.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40), (24, 40)])
def test_low_precision_cpu_path_matches_the_plain_iteration(dtype, shape):
    # On a CPU the low-precision iteration passes its right operands column-major (a faster bmm);
    # it must compute the same iteration: compare with the plain loop in the same dtype. Tolerance:
    # both round every product to bf16/fp16, in possibly different orders, over 5 steps.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    X = G / torch.linalg.matrix_norm(G, keepdim=True)
    tall = shape[-2] > shape[-1]
    X = (X.mT if tall else X).to(dtype)
    for a, b, c in ns_schedule("simple", 5):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    plain = (X.mT if tall else X).float()
    ours = newton_schulz(G, dtype=dtype).float()
    assert (ours - plain).abs().max() < 0.05
    reference = newton_schulz(G, dtype=torch.float64).float()
    assert (ours - reference).abs().max() <= 1.5 * (plain - reference).abs().max() + 1e-3


def test_polar_express_holds_the_published_triples():
    # Amsel et al. 2025 (arXiv:2505.16932) as published in modded-nanogpt / microsoft/dion polar_express
    assert POLAR_EXPRESS_PUBLISHED[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    assert POLAR_EXPRESS_PUBLISHED[-1] == (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)
    assert POLAR_EXPRESS_SAFETY == 1.02
    schedule = ns_schedule("polar_express", 5)
    assert schedule[1:] == list(POLAR_EXPRESS_PUBLISHED[1:])
    a, b, c = POLAR_EXPRESS_PUBLISHED[0]  # the first polynomial absorbs the 1/1.02 input normalisation
    assert schedule[0] == pytest.approx((a / 1.02, b / 1.02 ** 3, c / 1.02 ** 5), rel=1e-15)


@pytest.mark.parametrize("m, n", [(12, 20), (20, 12)])
def test_polar_express_equals_the_published_iteration(m, n):
    # the reference code: X = G / (1.02 ||G||_F), then X <- a X + (b A + c A^2) X with the five published
    # triples, on the wide orientation. float64: only the order of rounding differs (~1e-15 per step).
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    X = G.T if m > n else G
    X = X / (POLAR_EXPRESS_SAFETY * X.norm())
    for a, b, c in POLAR_EXPRESS_PUBLISHED:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    reference = X.T if m > n else X
    torch.testing.assert_close(newton_schulz(G, coefficients="polar_express", dtype=torch.float64), reference,
                               rtol=0, atol=1e-12)


def test_polar_express_five_steps_cover_a_thousandfold_range_of_singular_values():
    # scalar map of the 5-step schedule on s in [1e-3, 1] (after G / ||G||_F): about [0.847, 1.141];
    # the quintic schedule leaves s = 1e-3 at 0.475
    s = torch.logspace(-3, 0, 20001, dtype=torch.float64)
    out = phi_composed(s, ns_schedule("polar_express", 5))
    assert 0.84 < float(out.min()) and float(out.max()) < 1.15, (float(out.min()), float(out.max()))
    assert float(phi_composed(s, ns_schedule("quintic", 5)).min()) < 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_polar_express_in_low_precision_stays_in_its_band(dtype):
    # singular values spread over [1e-2, 1] x const: the float64 band is about [0.859, 1.141]; bf16
    # rounding (~4e-3 relative per product, 5 steps) may widen it by a few hundredths
    s = torch.logspace(-2, 0, 32, dtype=torch.float64)
    U, V, G = random_svd(32, 48, s, seed=2)
    sv = torch.linalg.svdvals(newton_schulz(G.float(), coefficients="polar_express", dtype=dtype).double())
    assert float(sv.min()) > 0.83 and float(sv.max()) < 1.17, sv  # seen: [0.859, 1.142]


def test_empty_matrices_map_to_empty_and_integer_inputs_are_refused():
    from optbook import newton_schulz, polar_factor

    for shape in ((0, 4), (3, 0), (2, 0, 5)):
        out = newton_schulz(torch.zeros(shape, dtype=torch.float64))
        assert out.shape == shape and out.dtype == torch.float64
    with pytest.raises(TypeError, match="Invalid dtype"):
        newton_schulz(torch.randn(3, 4), dtype=torch.int32)
    with pytest.raises(TypeError, match="Invalid G"):
        polar_factor(torch.ones(3, 3, dtype=torch.int64))
