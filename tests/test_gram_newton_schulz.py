"""Gram Newton–Schulz and AOL preconditioning: the scalar-polynomial oracle per dtype, the FLOP model,
and the failure the restart prevents."""

import importlib.util
import math
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optbook.bench import ns_flops
from optbook.polar import GRAM_RESTARTS, newton_schulz, ns_schedule

#: The iteration variants checked against the oracle: (algorithm, precondition).
VARIANTS = [("standard", None), ("gram", None), ("standard", "aol"), ("gram", "aol")]

#: Per-dtype tolerance on |sv(output) - phi(sv(input))| for 5 steps (4 after AOL) on 16 x 64, 64 x 16 and
#: 24 x 24 inputs whose normalised singular values span a 25-fold range (``spectrum`` below). Each product
#: rounded to the iteration dtype errs by about u ||.|| (u the unit roundoff: 2^-53, 2^-24, 2^-8,
#: 2^-11), and every later step multiplies an error in a singular value by the polynomial's slope there:
#: up to 8 (polar_express) or 3.4 (simple) while the values are small, below 1 in the converged band. So
#: the error is a dtype-independent multiple of u. Measured worst (torch 2.13 CPU, over the 4 variants
#: and 2 schedules): standard 8-13 u in bf16/fp16, 90-200 u in fp32/fp64 (whose roundings are smaller
#: than the amplified ones of the first steps); Gram 22-32 u in bf16/fp16 (it keeps R and Q through
#: more roundings: the three m x m products of a step), 130-260 u in fp32/fp64. Tolerances: about 3x the
#: worst measured, as multiples of u (fp64: a fixed 1e-12, 4500 u).
TOLERANCES = {torch.float64: 1e-12, torch.float32: 400 * 2.0 ** -24, torch.bfloat16: 64 * 2.0 ** -8,
              torch.float16: 100 * 2.0 ** -11}


def phi_composed(s, schedule):
    for a, b, c in schedule:
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def with_singular_values(m, n, s, generator):
    """``U diag(s) V^T`` in float64 with Haar-random ``U`` (m x k) and ``V`` (n x k), ``k = len(s)``."""
    U = torch.linalg.qr(torch.randn(m, m, generator=generator, dtype=torch.float64))[0][:, : len(s)]
    V = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))[0][:, : len(s)]
    return (U * s) @ V.T


def spectrum(k):
    s = torch.linspace(0.04, 1.0, k, dtype=torch.float64)
    return s / s.norm()       # pre-normalised: newton_schulz divides by ||G||_F = ||s||_2


def aol_rows(G):
    """The float64 AOL rescaling of the wide orientation, ``diag(1/sqrt(sum_j |G G^T|_ij)) G``."""
    W = G if G.shape[-2] <= G.shape[-1] else G.mT
    W = W / torch.linalg.matrix_norm(W, keepdim=True)
    return W * (W @ W.mT).abs().sum(-1, keepdim=True).rsqrt()


def run_and_expect(G, dtype, algorithm, precondition, coefficients):
    """``newton_schulz``'s output and the oracle: the composite polynomial on the singular values the
    iteration starts from (those of ``G``, or of the AOL-rescaled ``G``). With AOL the schedule drops its
    first triple and runs 4 steps, as Turbo-Muon does (the rescaled input is closer to orthogonal)."""
    schedule = ns_schedule(coefficients, 5)
    if precondition == "aol":
        schedule = schedule[1:]
    out = newton_schulz(G, len(schedule), schedule, dtype=dtype, algorithm=algorithm, precondition=precondition)
    G = G.double()
    s_in = torch.linalg.svdvals(aol_rows(G) if precondition == "aol" else G)
    expected = phi_composed(s_in, schedule).sort().values
    return torch.linalg.svdvals(out.double()).sort().values, expected


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("algorithm, precondition", VARIANTS)
@pytest.mark.parametrize("m, n", [(16, 64), (64, 16), (24, 24)])
@pytest.mark.parametrize("coefficients", ["simple", "polar_express"])
def test_singular_values_follow_the_scalar_polynomial(dtype, algorithm, precondition, m, n, coefficients):
    G = with_singular_values(m, n, spectrum(min(m, n)), torch.Generator().manual_seed(m * 100 + n))
    torch.testing.assert_close(torch.linalg.svdvals(G), spectrum(min(m, n)).flip(0), rtol=0, atol=1e-14)
    got, expected = run_and_expect(G if dtype == torch.float64 else G.float(), dtype, algorithm, precondition,
                                   coefficients)
    err = float((got - expected).abs().max())
    assert err <= TOLERANCES[dtype], f"{dtype} {algorithm} {precondition}: {err:.3g}"


def test_aol_bounds_the_spectral_norm_and_lifts_the_small_singular_values():
    g = torch.Generator().manual_seed(1)
    s = torch.logspace(0, -3, 16, dtype=torch.float64)
    G = with_singular_values(16, 64, s, g)
    D_X = aol_rows(G)
    sv = torch.linalg.svdvals(D_X)
    assert float(sv.max()) <= 1 + 1e-12                  # Prach & Lampert's bound
    assert float(sv.min()) > float(s.min() / s.norm())   # the smallest one moves up (here ~4x)


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("precondition", [None, "aol"])
@pytest.mark.parametrize("aspect", [1, 2, 4, 8])
@pytest.mark.parametrize("coefficients, steps", [("simple", 5), ("cubic", 3), ("polar_express", 6)])
def test_flops_counted_by_torch_equal_the_closed_form(algorithm, precondition, aspect, coefficients, steps):
    m = 16
    for shape in [(m, aspect * m), (aspect * m, m), (3, m, aspect * m)]:
        G = torch.randn(shape)
        with FlopCounterMode(display=False) as counter:
            newton_schulz(G, steps, coefficients, dtype=torch.float32, algorithm=algorithm,
                          precondition=precondition)
        assert counter.get_total_flops() == ns_flops(shape, steps, coefficients, algorithm=algorithm)


def test_gram_needs_fewer_flops_from_aspect_ratio_two():
    def ratio(aspect):
        return ns_flops((64, 64 * aspect), algorithm="standard") / ns_flops((64, 64 * aspect), algorithm="gram")
    # 5 steps, restarts (1, 3): 12 m^2 n + 22 m^3 against 20 m^2 n + 10 m^3
    assert ratio(1) == pytest.approx(30 / 34)
    assert ratio(4) == pytest.approx(90 / 70) and ratio(8) == pytest.approx(170 / 118)
    one_restart = ns_flops((64, 256), algorithm="gram", restarts=(2,))
    assert ns_flops((64, 256)) / one_restart == pytest.approx(1.5)


def _spectra(count, m, n):
    """``count`` float32 matrices with singular values log-spaced from 1 down to 1e-4..1e-5 (seeded)."""
    for seed in range(count):
        g = torch.Generator().manual_seed(seed)
        low = -4.0 - float(torch.rand(1, generator=g))
        yield with_singular_values(m, n, torch.logspace(0, low, m, dtype=torch.float64), g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("coefficients", ["polar_express", "simple"])
def test_restarts_prevent_the_blow_up_of_spurious_negative_eigenvalues(dtype, coefficients):
    """In half precision, ``R <- h(R) R h(R)`` rounds its tiny eigenvalues (~1e-8 to 1e-10 here, below
    ``u ||R||``) to values of either sign; a negative one grows at every step (for ``x < 0`` the step's
    factor ``h(x)^2`` exceeds ``a^2``), and the output gains singular values far above 1. Restarting
    (recomputing ``R = X X^T`` from ``X <- Q X``) keeps the error at the standard iteration's."""
    worst = {"standard": 0.0, "no restart": 0.0, "restarts": 0.0}
    top = 0.0
    for G in _spectra(50, 16, 64):
        exact = torch.linalg.svdvals(newton_schulz(G, 5, coefficients, dtype=torch.float64))
        runs = {"standard": newton_schulz(G.float(), 5, coefficients, dtype=dtype),
                "no restart": newton_schulz(G.float(), 5, coefficients, dtype=dtype, algorithm="gram", restarts=()),
                "restarts": newton_schulz(G.float(), 5, coefficients, dtype=dtype, algorithm="gram")}
        for name, out in runs.items():
            if not torch.isfinite(out).all():       # float16 overflows (max 65504): as wrong as it gets
                worst[name], top = (math.inf, math.inf) if name == "no restart" else (math.inf, top)
                continue
            sv = torch.linalg.svdvals(out.double())
            worst[name] = max(worst[name], float((sv - exact).abs().max()))
            if name == "no restart":
                top = max(top, float(sv.max()))
    assert GRAM_RESTARTS == (1, 3)
    assert top > 2.0 and worst["no restart"] > 1.0, worst       # a wrong result: exact values are <= 1.2
    assert worst["restarts"] <= 1.25 * worst["standard"], worst  # measured: within 1.1x


def test_gram_equals_standard_in_float64_for_any_restarts():
    G = torch.randn(2, 12, 50, dtype=torch.float64)
    ref = newton_schulz(G, 7, "polar_express", dtype=torch.float64)
    for restarts in [(), (1,), (2,), (1, 3), (1, 2, 3, 4, 5, 6), (9,)]:
        out = newton_schulz(G, 7, "polar_express", dtype=torch.float64, algorithm="gram", restarts=restarts)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_zero_matrix_and_degenerate_shapes():
    for algorithm in ("standard", "gram"):
        for precondition in (None, "aol"):
            out = newton_schulz(torch.zeros(3, 5), algorithm=algorithm, precondition=precondition)
            assert torch.equal(out, torch.zeros(3, 5))
            one = newton_schulz(torch.tensor([[3.0, 4.0]]), 12, "cubic", dtype=torch.float64,
                                algorithm=algorithm, precondition=precondition)
            torch.testing.assert_close(one, torch.tensor([[0.6, 0.8]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs, word", [
    ({"algorithm": "fast"}, "algorithm"), ({"precondition": "jacobi"}, "precondition"),
    ({"restarts": (0,)}, "restarts"), ({"restarts": 2}, "restarts")])
def test_bad_arguments_raise_naming_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        newton_schulz(torch.randn(4, 6), **kwargs)
    if "precondition" not in kwargs:   # ns_flops takes the same algorithm and restarts
        with pytest.raises(ValueError, match=word):
            ns_flops((4, 6), **kwargs)


@pytest.mark.parametrize("kwargs", [{"restarts": (1.5,)}, {"algorithm": "gram", "restarts": (True,)}])
def test_a_restart_that_is_not_an_int_is_a_type_error_naming_restarts(kwargs):
    with pytest.raises(TypeError, match="restarts"):
        newton_schulz(torch.randn(4, 6), **kwargs)
    with pytest.raises(TypeError, match="restarts"):
        ns_flops((4, 6), **{k: v for k, v in kwargs.items() if k != "precondition"})



#: Where ``pip install --target DIR --no-deps gram-newton-schulz==0.1.6`` put Dao-AILab's package (its declared
#: dependencies, quack-kernels and nvidia-cutlass-dsl, are only for its GPU kernels, which the test does not use;
#: it is not a dependency of this project). ``make conformance`` installs it into ``_build/extpkgs`` and sets
#: ``OPTBOOK_EXTERNAL_PACKAGES`` and ``OPTBOOK_REQUIRE_EXTERNAL=1``, under which a missing package fails the
#: test instead of skipping it.
EXTERNAL = os.environ.get("OPTBOOK_EXTERNAL_PACKAGES", "/tmp/extpkgs")
REQUIRE_EXTERNAL = os.environ.get("OPTBOOK_REQUIRE_EXTERNAL") == "1"


def _external(name):
    if EXTERNAL not in sys.path:
        sys.path.append(EXTERNAL)
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


@pytest.mark.skipif(_external("gram_newton_schulz") is None and not REQUIRE_EXTERNAL,
                    reason="gram-newton-schulz is not installed (pip install --target /tmp/extpkgs --no-deps "
                           "gram-newton-schulz); the comparison with Dao-AILab's implementation is skipped")
@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (2, 16, 96)])
def test_matches_dao_ailab_gram_newton_schulz(shape):
    from gram_newton_schulz import POLAR_EXPRESS_COEFFICIENTS, GramNewtonSchulz
    theirs_fn = GramNewtonSchulz(ns_use_kernels=False, ns_coefficients=POLAR_EXPRESS_COEFFICIENTS,
                                 gram_newton_schulz_reset_iterations=[2], compile_kwargs=None)
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    theirs = theirs_fn(G).double()
    ours = newton_schulz(G, 5, POLAR_EXPRESS_COEFFICIENTS, dtype=torch.float16, algorithm="gram",
                         restarts=(2,)).double()
    exact = newton_schulz(G.double(), 5, POLAR_EXPRESS_COEFFICIENTS, dtype=torch.float64)
    # both float16 (theirs always is): each within ~8 float16 ulps of 1 of the float64 iteration, and of
    # each other (different rounding orders: their b R + c R^2 is one baddbmm, so is ours)
    for out in (ours, theirs):
        torch.testing.assert_close(out, exact, rtol=0, atol=4e-3)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=4e-3)


@pytest.mark.parametrize("ns_algorithm", ["gram", "auto"])
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (24, 24)])
def test_muon_with_gram_newton_schulz_stays_within_the_torch_muon_parity_tolerance(ns_algorithm, shape):
    from optbook.optim import Muon
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    ours, ref = W.clone().requires_grad_(), W.clone().requires_grad_()
    opt = Muon([ours], lr=0.02, weight_decay=0.1, ns_algorithm=ns_algorithm)
    torch_opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        grad = torch.randn(*shape, generator=g)
        for o, p in ((opt, ours), (torch_opt, ref)):
            p.grad = grad.clone()
            o.step()
    moved = float((ref - W).detach().abs().max())
    # the bound of tests/test_muon.py's parity test: both iterate in bf16 with different roundings
    assert moved > 0.3 and float((ours - ref).detach().abs().max()) <= 0.01 * moved


def test_muon_refuses_an_unknown_ns_algorithm_before_any_write():
    from optbook.optim import Muon
    with pytest.raises(ValueError, match="ns_algorithm"):
        Muon([torch.randn(4, 4, requires_grad=True)], ns_algorithm="fast")
    p = torch.randn(4, 8, requires_grad=True)
    opt = Muon([p], ns_algorithm="auto")
    p.grad = torch.randn(4, 8)
    opt.param_groups[0]["ns_algorithm"] = "fast"
    before = p.detach().clone()
    with pytest.raises(ValueError, match="ns_algorithm"):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state[p]
