"""optbook.precision: loss scalers, fp32 master weights, skipped steps, resume."""

import copy
import io
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from optbook.contract import NonFiniteGradientError
from optbook.optim import SGD, Adam, AdamW, Lion
from optbook.precision import ConstantLossScaler, DynamicLossScaler, MixedPrecisionOptimizer
from helpers import scaled_timeout

INF = math.inf


def scales_over(scaler, found_infs):
    out = []
    for f in found_infs:
        scaler.update(f)
        out.append(scaler.scale)
    return out


# --- scalers -----------------------------------------------------------------------------------------------

def test_constant_scaler_never_changes():
    s = ConstantLossScaler(2.0**16)
    assert scales_over(s, [True, False, True, True]) == [65536.0] * 4
    assert isinstance(s.scale, float) and s.state_dict() == {}


def test_dynamic_scaler_grows_after_growth_interval_clean_steps():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3)
    assert scales_over(s, [False] * 7) == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    assert isinstance(s.scale, float)


def test_dynamic_scaler_backs_off_on_every_overflow_with_hysteresis_1():
    s = DynamicLossScaler(initial_scale=1024.0, hysteresis=1)
    assert scales_over(s, [True, False, True, True]) == [512.0, 512.0, 256.0, 128.0]


def test_dynamic_scaler_hysteresis_counts_overflows_since_the_last_growth_not_in_a_row():
    # hysteresis 2: the tracker starts at 2, every overflow decrements it, the scale backs off whenever it is
    # <= 0, and only a growth resets it to 2. Clean steps in between reset only the growth tracker.
    s = DynamicLossScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    found = [False, False, True,   # 1st overflow: tracker 2 -> 1, scale kept (growth tracker 2 -> 0)
             False, True,          # 2nd overflow, not in a row: tracker 0 -> back off to 512
             True,                 # 3rd: tracker -1 -> back off again to 256
             False, False, False,  # 3 clean steps: grow to 512, hysteresis tracker reset to 2
             True,                 # tracker 1: kept
             False, True]          # tracker 0: back off to 256
    expected = [1024.0, 1024.0, 1024.0, 1024.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0, 512.0, 256.0]
    assert scales_over(s, found) == expected
    assert (s.growth_tracker, s.hysteresis_tracker) == (0, 0)
    # A scaler whose hysteresis tracker were reset by each clean step would have kept 1024 at iteration 4.


def test_dynamic_scaler_floor_at_min_scale():
    s = DynamicLossScaler(initial_scale=4.0, min_scale=1.0, hysteresis=1)
    assert scales_over(s, [True] * 5) == [2.0, 1.0, 1.0, 1.0, 1.0]
    s = DynamicLossScaler(initial_scale=3.0, min_scale=1.0, hysteresis=1)
    assert scales_over(s, [True] * 3) == [1.5, 1.0, 1.0]  # floored, not 0.75


def test_dynamic_scaler_never_grows_past_float32():
    s = DynamicLossScaler(initial_scale=2.0**126, growth_interval=1)
    assert scales_over(s, [False, False, False]) == [2.0**127, 2.0**127, 2.0**127]


def test_dynamic_scaler_state_dict_round_trip_mid_sequence():
    found = [False, True, False, False, True, False, False, False, True, True, False, False, False, False]
    kw = dict(initial_scale=2.0**10, growth_interval=3, hysteresis=2)
    straight = DynamicLossScaler(**kw)
    expected = scales_over(straight, found)
    first = DynamicLossScaler(**kw)
    scales_over(first, found[:7])
    saved = copy.deepcopy(first.state_dict())
    assert set(saved) == {"scale", "growth_tracker", "hysteresis_tracker"}
    resumed = DynamicLossScaler(**{**kw, "initial_scale": 2.0**20})
    resumed.load_state_dict(saved)
    assert scales_over(resumed, found[7:]) == expected[7:]
    assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize("kw, name, exc", [
    (dict(initial_scale=0.0), "initial_scale", ValueError),
    (dict(initial_scale=-1.0), "initial_scale", ValueError),
    (dict(initial_scale=INF), "initial_scale", ValueError),
    (dict(initial_scale=math.nan), "initial_scale", ValueError),
    (dict(growth_factor=1.0), "growth_factor", ValueError),
    (dict(backoff_factor=0.0), "backoff_factor", ValueError),
    (dict(backoff_factor=1.0), "backoff_factor", ValueError),
    (dict(growth_interval=0), "growth_interval", ValueError),
    (dict(growth_interval=2.0), "growth_interval", TypeError),
    (dict(hysteresis=0), "hysteresis", ValueError),
    (dict(hysteresis=True), "hysteresis", TypeError),
    (dict(min_scale=0.0), "min_scale", ValueError),
    (dict(initial_scale=1.0, min_scale=2.0), "min_scale", ValueError),
])
def test_dynamic_scaler_bad_arguments(kw, name, exc):
    with pytest.raises(exc, match=f"Invalid {name}"):
        DynamicLossScaler(**kw)


@pytest.mark.parametrize("scale", [0.0, -2.0, INF, math.nan])
def test_constant_scaler_bad_scale(scale):
    with pytest.raises(ValueError, match="Invalid scale"):
        ConstantLossScaler(scale)


def test_scaler_update_wants_a_bool_and_load_checks_before_writing():
    s = DynamicLossScaler()
    with pytest.raises(TypeError, match="found_inf"):
        s.update(torch.tensor(True))
    with pytest.raises(ValueError, match="scale"):
        s.load_state_dict({"scale": -1.0, "growth_tracker": 0, "hysteresis_tracker": 2})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"scale": 1.0})
    assert s.state_dict() == {"scale": 2.0**32, "growth_tracker": 0, "hysteresis_tracker": 2}


# --- the skip on overflow ------------------------------------------------------------------------------------

def test_skipped_iterations_keep_the_parameter_and_the_schedule():
    p = torch.nn.Parameter(torch.tensor(1.0))  # float32: used directly, no master
    opt = MixedPrecisionOptimizer(Adam([p], lr=0.1),
                                  DynamicLossScaler(initial_scale=1024, growth_interval=2, hysteresis=1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    values, applied, lrs = [], [], []
    for it in range(5):
        opt.zero_grad()
        opt.scale_loss(p * 1.0).backward()
        assert p.grad.item() == opt.loss_scale
        if it in (0, 2):
            p.grad.fill_(INF)
        lrs.append(opt.param_groups[0]["lr"])
        assert opt.step() is None
        ok = not opt.found_inf
        applied.append(ok)
        if ok:
            sched.step()
        values.append(p.item())
    assert applied == [False, True, False, True, True]
    assert [lr for lr, ok in zip(lrs, applied) if ok] == pytest.approx([0.1, 0.05, 1 / 30])
    assert values == pytest.approx([1.0, 0.9, 0.9, 0.85, 0.816667], abs=1e-6)
    assert opt.state[p]["step"] == 3 and opt.skipped_steps == 2 and opt.found_inf is False


def snapshot(opt, model_params, sched):
    sd = opt.state_dict()   # the wrapper's groups hold the hyperparameters (optbook.masters); the scaler moves
    state = copy.deepcopy({"state": sd["state"], "param_groups": sd["param_groups"]})
    return ([t.detach().clone() for t in model_params], [m.detach().clone() for m in opt.master_params()], state,
            sched.state_dict(), [g["lr"] for g in opt.param_groups])


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def bf16_pair():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(4, 3, generator=g).bfloat16().requires_grad_()
    b = torch.randn(4, generator=g).bfloat16().requires_grad_()
    return W, b


def loss_of(W, b, k):
    x = torch.linspace(-1, 1, 6 * 3).reshape(6, 3).bfloat16() * (1 + 0.1 * k)
    return torch.tanh(x @ W.T + b).float().pow(2).mean()


@pytest.mark.parametrize("nonfinite", [INF, math.nan])
def test_a_skip_leaves_params_masters_state_and_schedule_bitwise_untouched(nonfinite):
    W, b = bf16_pair()
    opt = MixedPrecisionOptimizer(AdamW([W, b], lr=1e-2, weight_decay=0.1), DynamicLossScaler(initial_scale=2.0**8))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    for k in range(3):
        opt.zero_grad()
        opt.scale_loss(loss_of(W, b, k)).backward()
        opt.step()
        assert not opt.found_inf
        sched.step()
    before = snapshot(opt, [W, b], sched)
    opt.zero_grad()
    opt.scale_loss(loss_of(W, b, 3)).backward()
    W.grad[1, 2] = nonfinite
    assert opt.step() is None and opt.found_inf is True and opt.skipped_steps == 1
    assert_same(snapshot(opt, [W, b], sched), before)
    assert all(s["step"] == 3 for s in opt.state.values())


def test_nan_loss_without_a_scaler_raises_before_any_write_in_bf16():
    W, b = bf16_pair()
    W0, b0 = W.detach().clone(), b.detach().clone()
    opt = MixedPrecisionOptimizer(SGD([W, b], lr=0.1, momentum=0.9))
    masters0 = [m.detach().clone() for m in opt.master_params()]
    opt.scale_loss(loss_of(W, b, 0) * math.nan).backward()
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(4, 3\)"):
        opt.step()
    assert opt.skipped_steps == 0 and opt.found_inf is False
    assert torch.equal(W, W0) and torch.equal(b, b0) and not any(opt.state.values())
    assert all(torch.equal(m, m0) for m, m0 in zip(opt.master_params(), masters0))
    assert all(m.grad is None for m in opt.master_params())
    # check_for_nonfinite=False around an optimizer that does not look (torch.optim): the NaN goes through
    W2, b2 = bf16_pair()
    opt = MixedPrecisionOptimizer(torch.optim.SGD([W2, b2], lr=0.1), check_for_nonfinite=False)
    opt.scale_loss(loss_of(W2, b2, 0) * math.nan).backward()
    assert opt.step() is None and not opt.found_inf and torch.isnan(W2).all()


# --- precision: underflow and stalls ----------------------------------------------------------------------

def test_fp16_gradient_underflow_and_loss_scaling():
    w = torch.full((4,), 1e-4, dtype=torch.float16)

    def main_grad(scale):
        p = torch.ones(4, dtype=torch.float16, requires_grad=True)
        opt = MixedPrecisionOptimizer(SGD([p], lr=0.0), ConstantLossScaler(scale))
        loss = (p * w).float().sum() * 1e-4  # d loss / d p = 1e-4 * w = 1e-8: below fp16's smallest subnormal
        opt.scale_loss(loss).backward()
        assert opt.step() is None and not opt.found_inf
        return p.grad, opt.master_params()[0].grad

    model_grad, main = main_grad(1.0)
    assert torch.equal(model_grad, torch.zeros(4, dtype=torch.float16)) and torch.equal(main, torch.zeros(4))
    model_grad, main = main_grad(2.0**16)
    reference = 1e-4 * w.double()  # 1e-8 (to fp16's rounding of w)
    assert main.dtype == torch.float32
    assert ((main.double() - reference).abs() / reference).max() <= 2.0**-10


def test_bf16_update_below_half_an_ulp_stalls_without_masters():
    # next to 1.0 the bf16 spacing is 2**-7 above (2**-8 below): +1e-3 rounds back to 1.0
    bare = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    model = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    bare_opt = SGD([bare], lr=1e-3)
    opt = MixedPrecisionOptimizer(SGD([model], lr=1e-3))
    for _ in range(10):
        for p in (bare, model):
            p.grad = torch.full((1,), -1.0, dtype=torch.bfloat16)
        bare_opt.step()
        assert opt.step() is None and not opt.found_inf
    assert bare.item() == 1.0
    master = opt.master_params()[0]
    assert master.item() == pytest.approx(1.01, abs=1e-6)
    assert torch.equal(model.detach(), master.detach().bfloat16()) and model.item() == 1.0078125


def test_lion_weight_decay_on_bf16_decays_only_with_masters():
    bare = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    model = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    bare_opt = Lion([bare], lr=1e-3, weight_decay=0.1)
    opt = MixedPrecisionOptimizer(Lion([model], lr=1e-3, weight_decay=0.1))
    for _ in range(1000):
        bare.grad = torch.zeros(1, dtype=torch.bfloat16)
        model.grad = torch.zeros(1, dtype=torch.bfloat16)
        bare_opt.step()
        opt.step()
    assert bare.item() == 1.0  # 1 - 1e-4 rounds to 1 in bf16: the decay never happens
    expected = (1 - 1e-4) ** 1000  # 0.904833 (float64)
    master = opt.master_params()[0].item()
    # float32 holds the factor 1 - 1e-4 as 0.99989998: 1000 steps land 1.7e-5 (relative) below float64
    assert master == pytest.approx(float(torch.tensor(1 - 1e-4)) ** 1000, rel=1e-6)
    assert master == pytest.approx(expected, rel=2e-5)
    assert torch.equal(model.detach(), torch.tensor([expected], dtype=torch.float64).bfloat16())


# --- structure: masters, groups, schedulers, clipping ------------------------------------------------------

def test_masters_replace_low_precision_params_in_the_inner_groups():
    h = torch.zeros(3, dtype=torch.float16, requires_grad=True)
    b = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    f = torch.zeros(2, requires_grad=True)
    inner = AdamW([{"params": [h, f]}, {"params": [b], "weight_decay": 0.0}])
    opt = MixedPrecisionOptimizer(inner, ConstantLossScaler(8.0))
    # the wrapper's groups hold the model's parameters (what schedulers and DCP see), the inner ones the masters
    assert opt.param_groups[0]["params"] == [h, f] and opt.param_groups[1]["params"] == [b]
    assert opt.defaults is inner.defaults
    g0, g1 = inner.param_groups[0]["params"], inner.param_groups[1]["params"]
    assert g0[0] is not h and g0[0].dtype == torch.float32 and g0[1] is f and g1[0].dtype == torch.float32
    assert [m.dtype for m in opt.master_params()] == [torch.float32] * 2
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for p in (h, b, f):
        p.grad = torch.ones_like(p) * 8
    assert opt.step() is None and not opt.found_inf
    sched.step()
    assert opt.param_groups[0]["lr"] == 5e-4 and inner.param_groups[0]["lr"] == 1e-3   # the inner's at the next step
    assert set(inner.state) == {g0[0], g0[1], g1[0]} and f.grad.eq(1).all()  # fp32 grad unscaled in place
    assert set(map(id, opt.state)) == {id(h), id(f), id(b)} and opt.state[h] is inner.state[g0[0]]
    for p in (h, b, f):
        p.grad = torch.ones_like(p) * 8
    opt.step()
    assert inner.param_groups[0]["lr"] == 5e-4
    opt.zero_grad()
    assert all(p.grad is None for p in (h, b, f, *opt.master_params()))


def test_add_param_group_gives_the_new_low_precision_params_masters():
    a = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    h = torch.ones(2, dtype=torch.float16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(ValueError, match="Invalid loss_scaler: .*float16"):
        opt.add_param_group({"params": [h]})
    with pytest.raises(ValueError):  # the inner optimizer refuses lr < 0: nothing is recorded
        opt.add_param_group({"params": [a], "lr": -1.0})
    assert opt.master_params() == [] and len(opt.param_groups) == 1
    opt.add_param_group({"params": [a], "lr": 2**-4})
    master = opt.optimizer.param_groups[1]["params"][0]
    assert opt.param_groups[1]["params"][0] is a
    assert len(opt.master_params()) == 1 and opt.master_params()[0] is master and master.dtype == torch.float32
    a.grad = torch.ones(2, dtype=torch.bfloat16)
    assert opt.step() is None and not opt.found_inf and torch.equal(a, torch.full((2,), 1 - 2**-4, dtype=torch.bfloat16))


def test_step_hooks_and_closure_run():
    p = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([p], lr=0.5))
    seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(o.found_inf))

    def closure():
        opt.zero_grad()
        loss = (p.float() - 1).pow(2).sum()
        opt.scale_loss(loss).backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() == 2.0 and seen == [False]
    assert torch.equal(p, torch.ones(2, dtype=torch.bfloat16))


def _clip_with_torch(params, max_norm, group=None, error_if_nonfinite=False):
    return torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=error_if_nonfinite).double()


def test_global_clip_runs_on_unscaled_main_grads(monkeypatch):
    calls = []

    def fake(params, max_norm, group=None, error_if_nonfinite=False):
        calls.append(([p.dtype for p in params], max_norm))
        return _clip_with_torch(params, max_norm)

    import optbook.clipping
    import optbook.wrapper
    real = optbook.clipping.get_grad_norm

    def fake(params, group=None):   # the wrapper takes the norm once, then scales (optbook.wrapper.clip_grads)
        calls.append(([p.grad.dtype for p in params], 1.0))
        return real(params, group)

    monkeypatch.setattr(optbook.wrapper, "get_grad_norm", fake)
    a = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    c = torch.zeros(1, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([a, c], lr=1.0), ConstantLossScaler(4.0), max_grad_norm=1.0)
    a.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16) * 4
    c.grad = torch.tensor([12.0]) * 4
    assert opt.step() is None and not opt.found_inf
    assert calls == [([torch.float32, torch.float32], 1.0)]
    assert opt.last_grad_norm == pytest.approx(13.0)
    assert opt.master_params()[0].tolist() == pytest.approx([-3 / 13, -4 / 13], rel=1e-6)
    assert c.item() == pytest.approx(-12 / 13, rel=1e-6)
    # a skipped step does not clip
    a.grad = torch.tensor([INF, 0.0], dtype=torch.bfloat16)
    assert opt.step() is None and opt.found_inf and len(calls) == 1


def test_global_clip_with_optbook_clipping():
    clipping = pytest.importorskip("optbook.clipping", reason="optbook.clipping (chapter 12) is not in this branch")
    a = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([a], lr=1.0), max_grad_norm=1.0)
    a.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    assert opt.step() is None and not opt.found_inf and clipping is not None
    assert opt.last_grad_norm == pytest.approx(5.0)
    assert opt.master_params()[0].tolist() == pytest.approx([-0.6, -0.8], rel=1e-6)


# --- bad input -------------------------------------------------------------------------------------------------

class _BadScaler:
    scale = 0.0

    def update(self, found_inf):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


@pytest.mark.parametrize("scaler, kw, exc, match", [
    (None, {}, ValueError, "Invalid loss_scaler: .*float16"),
    (_BadScaler(), {}, ValueError, "Invalid loss_scaler.scale"),
    (object(), {}, TypeError, "Invalid loss_scaler"),
    (ConstantLossScaler(8.0), dict(max_grad_norm=0.0), ValueError, "Invalid max_grad_norm"),
    (ConstantLossScaler(8.0), dict(max_grad_norm=-1), ValueError, "Invalid max_grad_norm"),
    (ConstantLossScaler(8.0), dict(check_for_nonfinite=False), ValueError, "Invalid check_for_nonfinite"),
    (ConstantLossScaler(8.0), dict(check_for_nonfinite=1), TypeError, "Invalid check_for_nonfinite"),
])
def test_bad_input_is_refused_before_anything_is_written(scaler, kw, exc, match):
    h = torch.ones(2, dtype=torch.float16, requires_grad=True)
    f = torch.ones(2, requires_grad=True)
    inner = SGD([h, f], lr=0.1)
    with pytest.raises(exc, match=match):
        MixedPrecisionOptimizer(inner, scaler, **kw)
    assert inner.param_groups[0]["params"][0] is h  # no master was put in its place


def test_a_non_optimizer_is_refused():
    p = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(TypeError, match="Invalid optimizer: expected a torch.optim.Optimizer, got list"):
        MixedPrecisionOptimizer([p])
    with pytest.raises(TypeError, match="Invalid optimizer: it is already"):
        MixedPrecisionOptimizer(MixedPrecisionOptimizer(SGD([p], lr=0.1)))


def test_an_optimizer_with_state_is_refused():
    p = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    inner = AdamW([p])
    p.grad = torch.ones_like(p)
    inner.step()
    with pytest.raises(ValueError, match="Invalid optimizer: it already has state"):
        MixedPrecisionOptimizer(inner)
    assert inner.param_groups[0]["params"][0] is p


def test_bad_gradient_or_scale_is_refused_before_anything_moves():
    p = torch.ones(2, dtype=torch.float16, requires_grad=True)
    scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=1)
    opt = MixedPrecisionOptimizer(SGD([p], lr=0.1), scaler)
    p.grad_dtype = None  # torch refuses a gradient of another dtype unless told not to
    p.grad = torch.ones(2, dtype=torch.float32)
    with pytest.raises(TypeError, match="Invalid grad of model parameter 0.*dtype"):
        opt.step()
    assert scaler.state_dict() == {"scale": 8.0, "growth_tracker": 0, "hysteresis_tracker": 1}
    assert opt.master_params()[0].grad is None
    p.grad = None
    p.grad_dtype = torch.float16
    p.grad = torch.ones(2, dtype=torch.float16)
    scaler._scale = 0.0  # e.g. a custom scaler that broke
    with pytest.raises(ValueError, match="Invalid loss_scaler.scale"):
        opt.step()
    assert opt.master_params()[0].grad is None and torch.equal(p, torch.ones(2, dtype=torch.float16))


# --- resume -----------------------------------------------------------------------------------------------

def _run(opt, sched, W, b, iterations):
    applied = []
    for k in iterations:
        opt.zero_grad()
        opt.scale_loss(loss_of(W, b, k)).backward()
        if k in (2, 3, 6):  # scripted overflows
            b.grad[0] = INF
        assert opt.step() is None
        ok = not opt.found_inf
        applied.append(ok)
        if ok:
            sched.step()
    return applied


def _build(W, b, state_dtype=None):
    opt = MixedPrecisionOptimizer(AdamW([W, b], lr=3e-2, weight_decay=0.1),
                                  DynamicLossScaler(initial_scale=2.0**12, growth_interval=2, hysteresis=2),
                                  state_dtype=state_dtype)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_resume_is_bit_identical(state_dtype):
    W, b = bf16_pair()
    opt, sched = _build(W, b, state_dtype)
    straight = _run(opt, sched, W, b, range(10))
    assert straight == [True, True, False, False, True, True, False, True, True, True]
    # scale: 4096, grows to 8192 after 2 clean steps; overflow at 2 kept by hysteresis, 3 backs off to 4096,
    # grows at 5, 6 is the first overflow since the growth (kept), grows again at 8
    assert opt.loss_scale == 2.0**14

    W1, b1 = bf16_pair()
    opt1, sched1 = _build(W1, b1, state_dtype)
    first = _run(opt1, sched1, W1, b1, range(5))
    buffer = io.BytesIO()
    torch.save({"model": [W1.detach(), b1.detach()], "opt": opt1.state_dict(), "sched": sched1.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer)
    W2, b2 = (t.clone().requires_grad_() for t in ckpt["model"])
    opt2, sched2 = _build(W2, b2, state_dtype)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    second = _run(opt2, sched2, W2, b2, range(5, 10))

    assert first + second == straight
    assert torch.equal(W2, W) and torch.equal(b2, b)
    assert_same(opt2.master_params(), opt.master_params())
    assert_same(opt2.optimizer.state_dict(), opt.optimizer.state_dict())
    assert opt2.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
    assert opt2.skipped_steps == opt.skipped_steps == 3
    assert sched2.state_dict() == sched.state_dict()
    moments = [v for st in opt2.state.values() for k, v in st.items() if k != "step"]
    assert len(moments) == 4 and {v.dtype for v in moments} == {state_dtype or torch.float32}


def test_state_dtype_stores_bf16_moments_and_computes_in_fp32():
    W, b = bf16_pair()
    opt, _ = _build(W, b, torch.bfloat16)
    W_ref, b_ref = bf16_pair()
    ref = AdamW([W_ref.detach().float().requires_grad_(), b_ref.detach().float().requires_grad_()], lr=3e-2,
                weight_decay=0.1)
    for k in range(3):
        opt.zero_grad()
        opt.scale_loss(loss_of(W, b, k)).backward()
        assert opt.step() is None and not opt.found_inf
        for p_ref, m in zip(ref.param_groups[0]["params"], opt.master_params()):
            p_ref.grad = m.grad.clone()
        ref.step()
        for st in ref.state.values():  # what state_dtype does: round the moments to bf16 after each step
            st["exp_avg"] = st["exp_avg"].bfloat16().float()
            st["exp_avg_sq"] = st["exp_avg_sq"].bfloat16().float()
    for p_ref, m in zip(ref.param_groups[0]["params"], opt.master_params()):
        assert torch.equal(p_ref, m)
    assert all(st["exp_avg"].dtype == torch.bfloat16 and st["step"] == 3 for st in opt.state.values())
    with pytest.raises(TypeError, match="Invalid state_dtype"):
        MixedPrecisionOptimizer(SGD([torch.zeros(1, requires_grad=True)], lr=0.1), state_dtype=torch.int8)


def test_load_state_dict_checks_before_writing():
    W, b = bf16_pair()
    opt, _ = _build(W, b)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["master_param"] = sd["state"][0]["master_param"][:1]   # the masters' layout: optbook.masters
    W0 = W.detach().clone()
    with pytest.raises(ValueError, match=r"master_param.*shape"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["loss_scaler"] = None
    with pytest.raises(ValueError, match="no loss scaler"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["loss_scaler"]["scale"] = -1.0
    sd["param_groups"][0]["lr"] = 123.0
    with pytest.raises(ValueError, match="scale"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] != 123.0 and opt.loss_scale == 2.0**12
    assert torch.equal(W, W0)


def test_import_needs_torch_only():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "import optbook.precision, sys; assert not {'matplotlib', 'sklearn'} & set(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=scaled_timeout(120))
    assert done.returncode == 0, done.stderr
