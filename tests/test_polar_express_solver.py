"""The Polar Express coefficient procedure: the published tuples, other schedules, the predicted band."""

import math

import pytest
import torch

from optbook import newton_schulz
from optbook.polar import (
    POLAR_EXPRESS,
    POLAR_EXPRESS_PUBLISHED,
    POLAR_EXPRESS_SAFETY,
    optimal_odd_quintic,
    polar_express_band,
    polar_express_coefficients,
)

#: Dao-AILab gram-newton-schulz (commit f08f25e), ``coefficients.py``: the paper's schedule without a
#: safety factor, cushion 0.02407327424182761.
UNMODIFIED = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
              (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
              (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
              (3.3184196573706015, -2.488488024314874, 0.51004894012372),
              (2.300652019954817, -1.6689039845747493, 0.4188073119525673))


def assert_triples_close(got, want, tol):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert max(abs(x - y) for x, y in zip(g, w)) <= tol, (g, w)


def composite(x, schedule):
    for a, b, c in schedule:
        x = a * x + b * x ** 3 + c * x ** 5
    return x


def test_reproduces_the_published_tuples():
    assert_triples_close(polar_express_coefficients(), POLAR_EXPRESS_PUBLISHED, 1e-4)
    assert_triples_close(polar_express_coefficients(), POLAR_EXPRESS_PUBLISHED, 1e-12)   # measured: 3e-14
    assert_triples_close(polar_express_coefficients(input_scale=POLAR_EXPRESS_SAFETY), POLAR_EXPRESS, 1e-12)
    assert_triples_close(polar_express_coefficients(5, 1e-3, 1.0, cushion=0.02407327424182761), UNMODIFIED, 1e-12)


def test_the_published_schedule_run_by_newton_schulz_matches_the_computed_one():
    G = torch.randn(8, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz(G, 5, polar_express_coefficients(input_scale=POLAR_EXPRESS_SAFETY), dtype=torch.float64)
    torch.testing.assert_close(ours, newton_schulz(G, 5, "polar_express", dtype=torch.float64), rtol=0, atol=1e-12)


def test_one_quintic_equioscillates_on_its_interval():
    lower, upper = 0.05, 1.0
    abc = optimal_odd_quintic(lower, upper)
    x = torch.linspace(lower, upper, 200001, dtype=torch.float64)
    err = composite(x, [abc]) - 1
    E = float(err.abs().max())
    # the error reaches +-E at lower (-), q (+), r (-), upper (+): four alternating extremes
    assert float(err[0]) == pytest.approx(-E, rel=1e-9) and float(err[-1]) == pytest.approx(E, rel=1e-9)
    inner = err[1:-1]
    assert float(inner.max()) == pytest.approx(E, rel=1e-6) and float(inner.min()) == pytest.approx(-E, rel=1e-6)
    # and the minimax is no worse than the limit polynomial or the simple triple, scaled to the interval
    for other in [(15 / 8, -10 / 8, 3 / 8), (3.4445, -4.7750, 2.0315)]:
        assert E < float((composite(x, [other]) - 1).abs().max())
    assert optimal_odd_quintic(0.5, 0.5) == (15 / 8 / 0.5, -10 / 8 / 0.5 ** 3, 3 / 8 / 0.5 ** 5)


@pytest.mark.parametrize("steps, lower_bound, safety", [(5, 1e-3, 1.02), (3, 1e-2, 1.0), (4, 1e-3, 1.01),
                                                         (8, 1e-4, 1.02), (6, 1e-5, 1.05)])
def test_composite_maps_the_interval_into_the_predicted_band(steps, lower_bound, safety):
    schedule = polar_express_coefficients(steps, lower_bound, safety)
    low, high = polar_express_band(steps, lower_bound, safety)
    assert len(schedule) == steps and 0 < low < 1 < high == pytest.approx(2 - low)
    # float64 on a dense grid: log-spaced over [lower_bound, 1] and linear near the top
    x = torch.cat([torch.logspace(math.log10(lower_bound), 0, 100001, dtype=torch.float64),
                   torch.linspace(0.5, 1.0, 100001, dtype=torch.float64)])
    y = composite(x, schedule)
    assert float(y.min()) >= low - 1e-12 and float(y.max()) <= high + 1e-12
    assert float(y[0]) == pytest.approx(low, abs=1e-12)     # the lower end is attained at lower_bound


def test_more_steps_narrow_the_band_and_a_lower_bound_costs_steps():
    widths = [polar_express_band(k, 1e-3) for k in (3, 4, 5, 6, 8)]
    lows = [lo for lo, _ in widths]
    assert lows == sorted(lows) and lows[-1] > 0.99
    assert polar_express_band(5, 1e-4)[0] < polar_express_band(5, 1e-3)[0]


def test_a_step_count_that_is_not_an_int_is_a_type_error():
    with pytest.raises(TypeError, match="steps"):
        polar_express_coefficients(steps=2.0)


@pytest.mark.parametrize("kwargs, word", [
    ({"steps": 0}, "steps"), ({"lower_bound": 0}, "lower_bound"),
    ({"lower_bound": 1.5}, "lower_bound"), ({"safety": 0.99}, "safety"), ({"safety": math.inf}, "safety"),
    ({"cushion": 1.0}, "cushion"), ({"input_scale": 0}, "input_scale")])
def test_bad_arguments_raise_naming_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        polar_express_coefficients(**kwargs)
    with pytest.raises(ValueError, match="interval"):
        optimal_odd_quintic(0.5, 0.2)
