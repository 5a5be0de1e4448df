"""NorMuon, AdaMuon, Dion, Scion and Schedule-Free AdamW: the step contract, the functional twins, and the
exact special cases (Dion at full rank is Muon with the exact polar factor; Scion's spectral, sign and
Frobenius oracles are Muon, Lion and normalised SGD)."""

import copy

import pytest
import torch

from optbook.contract import NonFiniteGradientError, elementwise
from optbook.optim import (
    SGD,
    AdaMuon,
    Dion,
    Lion,
    Muon,
    NorMuon,
    ScheduleFreeAdamW,
    Scion,
)
from optbook.optim.functional import adamuon, dion, normuon, schedule_free_adamw, scion
from optbook.optim.dion import dion_rank
from optbook.optim.schedule_free import schedule_free_weight

F64 = torch.float64
NS64 = dict(ns_dtype=F64)

#: name -> (class, float64 keyword arguments, parameter shapes)
CASES = {
    "NorMuon": (NorMuon, dict(lr=0.02, weight_decay=0.1, **NS64), [(6, 4), (3, 5)]),
    "AdaMuon": (AdaMuon, dict(lr=0.02, weight_decay=0.1, **NS64), [(6, 4), (3, 5)]),
    "Dion": (Dion, dict(lr=0.02, weight_decay=0.1, rank_fraction=0.5), [(6, 4), (3, 5)]),
    "Scion": (Scion, dict(lr=0.02, weight_decay=0.1, norm="sign"), [(6, 4), (3,)]),
    "ScheduleFreeAdamW": (ScheduleFreeAdamW, dict(lr=0.02, weight_decay=0.1, warmup_steps=2), [(6, 4), (3,)]),
}

#: name -> [(argument, bad value, exception)]: each must be refused, naming the argument
BAD = {
    "NorMuon": [("lr", -1.0, ValueError), ("momentum", 1.0, ValueError), ("beta2", -0.1, ValueError),
                ("eps", 0.0, ValueError), ("weight_decay", float("nan"), ValueError), ("nesterov", 1, TypeError),
                ("ns_steps", 0, ValueError), ("scale_mode", "huge", ValueError), ("ns_dtype", torch.int32, TypeError)],
    "AdaMuon": [("lr", -1.0, ValueError), ("beta2", 1.0, ValueError), ("eps", -1e-8, ValueError),
                ("extra_scale_factor", "x", TypeError), ("coefficients", "nope", ValueError)],
    "Dion": [("lr", -1.0, ValueError), ("momentum", 1.5, ValueError), ("rank_fraction", 0.0, ValueError),
             ("rank_fraction", 1.5, ValueError), ("q_update", "svd", ValueError), ("eps", 0.0, ValueError),
             ("seed", -1, ValueError), ("seed", 1.5, TypeError)],
    "Scion": [("lr", -1.0, ValueError), ("momentum", -0.5, ValueError), ("norm", "nuclear", ValueError),
              ("radius", 0.0, ValueError), ("weight_decay", -1.0, ValueError)],
    "ScheduleFreeAdamW": [("lr", -1.0, ValueError), ("betas", (0.0, 0.999), ValueError),
                          ("betas", (0.9, 1.0), ValueError), ("eps", 0.0, ValueError),
                          ("warmup_steps", -1, ValueError), ("r", -1.0, ValueError),
                          ("weight_lr_power", float("inf"), ValueError)],
}


def make(name, data_seed=0, dtype=F64, **over):
    cls, kw, shapes = CASES[name]
    g = torch.Generator().manual_seed(data_seed)
    params = [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]
    return cls(params, **{**kw, **over}), params


def set_grads(params, t, seed=1):
    g = torch.Generator().manual_seed(1000 * seed + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=F64).to(p.dtype)


def run(opt, params, steps, start=0):
    for t in range(start, start + steps):
        set_grads(params, t)
        opt.step()


def snapshot(opt, params):
    """The parameters and the optimizer's per-parameter state (not the hyperparameters a test edits)."""
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def assert_same(a, b):
    """Bitwise equality of two ``snapshot``s (tensors) or nested values."""
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


@pytest.mark.parametrize("name", CASES)
def test_elementwise_flag(name):
    assert elementwise(CASES[name][0]) is (name == "ScheduleFreeAdamW")


@pytest.mark.parametrize("name,arg,value,exc", [(n, *b) for n, bads in BAD.items() for b in bads])
def test_bad_argument_is_named_at_construction_and_at_step(name, arg, value, exc):
    with pytest.raises(exc, match=arg.split("[")[0]):
        make(name, **{arg: value})
    opt, params = make(name)
    run(opt, params, 2)
    before = snapshot(opt, params)
    opt.param_groups[0][arg] = value
    set_grads(params, 5)
    with pytest.raises(exc, match=arg.split("[")[0]):
        opt.step()
    assert_same(before, snapshot(opt, params))


@pytest.mark.parametrize("name", ["NorMuon", "AdaMuon", "Dion"])
def test_matrix_optimizers_refuse_vectors(name):
    with pytest.raises(ValueError, match=r"2-D matrices only.*\(3,\)"):
        CASES[name][0]([torch.zeros(3, dtype=F64, requires_grad=True)])


def test_scion_spectral_needs_matrices_also_when_edited():
    with pytest.raises(ValueError, match="Invalid norm: 'spectral'.*shape \\(3,\\)"):
        Scion([torch.zeros(3, requires_grad=True)], norm="spectral")
    opt, params = make("Scion")
    run(opt, params, 1)
    before = snapshot(opt, params)
    opt.param_groups[0]["norm"] = "spectral"
    set_grads(params, 1)
    with pytest.raises(ValueError, match="Invalid norm"):
        opt.step()
    assert_same(before, snapshot(opt, params))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_raises_and_writes_nothing(name, bad):
    opt, params = make(name)
    run(opt, params, 2)
    before = snapshot(opt, params)
    set_grads(params, 7)
    params[-1].grad.view(-1)[1] = bad
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[1\]"):
        opt.step()
    assert_same(before, snapshot(opt, params))


@pytest.mark.parametrize("name", CASES)
def test_state_dict_round_trip_continues_bitwise(name):
    opt, params = make(name)
    run(opt, params, 3)
    other, copies = make(name, data_seed=5)
    with torch.no_grad():
        for c, p in zip(copies, params):
            c.copy_(p)
    other.load_state_dict(opt.state_dict())
    run(opt, params, 3, start=3)
    run(other, copies, 3, start=3)
    assert_same(snapshot(opt, params), snapshot(other, copies))


@pytest.mark.parametrize("name", CASES)
def test_bad_state_dict_is_refused_whole(name):
    opt, params = make(name)
    run(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    key = next(k for k, v in sd["state"][0].items() if isinstance(v, torch.Tensor))
    sd["state"][0][key] = sd["state"][0][key][:1]
    fresh, fparams = make(name)
    run(fresh, fparams, 1)
    before = snapshot(fresh, fparams)
    with pytest.raises(ValueError, match=f"state\\[0\\]\\['{key}'\\].*has shape"):
        fresh.load_state_dict(sd)
    assert_same(before, snapshot(fresh, fparams))


# --- the functional twins ------------------------------------------------------------------------------------
def twin_run(name, params, steps):
    """Drive the functional twin of ``name`` by hand, with state made here (the class's hyperparameters)."""
    cls, kw, _ = CASES[name]
    opt = cls([torch.zeros(1, 1, dtype=F64, requires_grad=True)], **kw)  # for its defaults only
    d = opt.defaults
    like = [torch.zeros_like(p) for p in params]
    if name == "NorMuon":
        var = [p.new_zeros(p.shape[0], 1) for p in params]
    elif name == "AdaMuon":
        var = [torch.zeros_like(p) for p in params]
    elif name == "Dion":
        var = [torch.randn((p.shape[1], dion_rank(p.shape, d["rank_fraction"])),
                           generator=torch.Generator().manual_seed(d["seed"]), dtype=F64) for p in params]
    elif name == "ScheduleFreeAdamW":
        zs = [p.detach().clone() for p in params]
        scal = [dict(lr_max=-1.0, weight_sum=0.0) for _ in params]
    for t in range(steps):
        set_grads(params, t)
        ps, gs = [p.detach() for p in params], [p.grad for p in params]
        common = {k: d[k] for k in ("lr", "weight_decay")}
        if name == "NorMuon":
            normuon(ps, gs, like, var, momentum=d["momentum"], nesterov=d["nesterov"], beta2=d["beta2"],
                    eps=d["eps"], ns_steps=d["ns_steps"], coefficients=d["coefficients"], ns_dtype=d["ns_dtype"],
                    scale_mode=d["scale_mode"], extra_scale_factor=d["extra_scale_factor"], **common)
        elif name == "AdaMuon":
            adamuon(ps, gs, like, var, [t + 1] * len(ps), momentum=d["momentum"], nesterov=d["nesterov"],
                    beta2=d["beta2"], eps=d["eps"], ns_steps=d["ns_steps"], coefficients=d["coefficients"],
                    ns_dtype=d["ns_dtype"], scale_mode=d["scale_mode"],
                    extra_scale_factor=d["extra_scale_factor"], **common)
        elif name == "Dion":
            dion(ps, gs, like, var, momentum=d["momentum"], eps=d["eps"], q_update=d["q_update"], **common)
        elif name == "Scion":
            scion(ps[:1], gs[:1], like[:1], momentum=d["momentum"], nesterov=d["nesterov"], norm=d["norm"],
                  radius=d["radius"], **common)
            scion(ps[1:], gs[1:], like[1:], momentum=d["momentum"], nesterov=d["nesterov"], norm=d["norm"],
                  radius=d["radius"], **common)
        else:
            lrs, cs = [], []
            for s in scal:
                lr_t, s["lr_max"], s["weight_sum"], c = schedule_free_weight(
                    t + 1, d["lr"], warmup_steps=d["warmup_steps"], r=d["r"], weight_lr_power=d["weight_lr_power"],
                    lr_max=s["lr_max"], weight_sum=s["weight_sum"])
                lrs.append(lr_t)
                cs.append(c)
            schedule_free_adamw(ps, gs, zs, like, [t + 1] * len(ps), lrs, cs, beta1=d["betas"][0],
                                beta2=d["betas"][1], eps=d["eps"], weight_decay=d["weight_decay"])


@pytest.mark.parametrize("name", CASES)
def test_functional_twin_equals_class(name):
    opt, params = make(name)
    _, twins = make(name)
    run(opt, params, 4)
    twin_run(name, twins, 4)
    for p, q in zip(params, twins):
        assert torch.equal(p, q), (p - q).abs().max()


# --- Dion and Muon ------------------------------------------------------------------------------------------
def drive(cls, shape, steps, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g, dtype=F64).requires_grad_()
    opt = cls([p], **kw)
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=g, dtype=F64)
        opt.step()
    return p.detach()


#: Muon with its Newton-Schulz iteration run to convergence in float64: the exact polar factor to rounding
EXACT_MUON = dict(nesterov=False, scale_mode="unit_rms_norm", coefficients="cubic", ns_steps=60, ns_dtype=F64)


@pytest.mark.parametrize("shape", [(8, 5), (5, 8), (6, 6)])
def test_dion_full_rank_polar_is_muon(shape):
    dion_x = drive(Dion, shape, 10, lr=0.05, momentum=0.9, weight_decay=0.1, rank_fraction=1.0, q_update="polar")
    muon_x = drive(Muon, shape, 10, lr=0.05, momentum=0.9, weight_decay=0.1, **EXACT_MUON)
    assert (dion_x - muon_x).abs().max() < 1e-12
    # the paper's column normalisation is not the polar factor at a given step: a visible difference
    paper = drive(Dion, shape, 10, lr=0.05, momentum=0.9, weight_decay=0.1, rank_fraction=1.0)
    assert (paper - muon_x).abs().max() > 1e-3


def test_dion_low_rank_update_has_rank_r():
    g = torch.Generator().manual_seed(3)
    p = torch.randn(8, 6, dtype=F64, generator=g).requires_grad_()
    opt = Dion([p], lr=0.1, rank_fraction=0.5)
    p.grad = torch.randn(8, 6, dtype=F64, generator=g)
    before = p.detach().clone()
    opt.step()
    assert opt.state[p]["right_factor"].shape == (6, 3)
    assert torch.linalg.matrix_rank(p.detach() - before).item() == 3
    # error feedback: what was not applied stays in the buffer, (1 - mu) of what was applied leaves it
    assert torch.linalg.matrix_rank(opt.state[p]["momentum_buffer"]).item() == 6


# --- Scion's special cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("shape", [(8, 5), (5, 8)])
def test_scion_spectral_is_muon(shape, nesterov):
    a = drive(Scion, shape, 50, lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1, norm="spectral",
              scale_mode="shape_scaling", **NS64)
    b = drive(Muon, shape, 50, lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1,
              scale_mode="shape_scaling", **NS64)
    assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("shape", [(8, 5), (7,)])
def test_scion_sign_is_lion_with_equal_betas(shape):
    a = drive(Scion, shape, 50, lr=0.05, momentum=0.9, weight_decay=0.1, norm="sign")
    b = drive(Lion, shape, 50, lr=0.05, betas=(0.9, 0.9), weight_decay=0.1)
    assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("shape", [(8, 5), (7,)])
def test_scion_frobenius_is_normalised_sgd(shape):
    a = drive(Scion, shape, 50, lr=0.05, momentum=0.9, weight_decay=0.1, norm="frobenius", radius=2.0)
    # normalised SGD from optbook's SGD: an lr=0 shadow keeps SGD's EMA buffer, the step divides it by its norm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=F64)
    shadow = torch.zeros(shape, dtype=F64, requires_grad=True)
    sgd = SGD([shadow], lr=0.0, momentum=0.9)
    for _ in range(50):
        shadow.grad = torch.randn(shape, generator=g, dtype=F64)
        sgd.step()
        m = sgd.state[shadow]["momentum_buffer"]
        x = x * (1 - 0.05 * 0.1) - 0.05 * 2.0 * m / m.norm()
    assert (a - x).abs().max() < 1e-12


# --- Schedule-Free: train and eval ----------------------------------------------------------------------------
def test_schedule_free_eval_gives_the_average_and_train_returns():
    opt, params = make("ScheduleFreeAdamW")
    run(opt, params, 5)
    y = [p.detach().clone() for p in params]
    beta1 = opt.param_groups[0]["betas"][0]
    x_expected = [(yy - (1 - beta1) * opt.state[p]["z"]) / beta1 for yy, p in zip(y, params)]
    opt.eval()
    assert opt.param_groups[0]["train_mode"] is False
    for p, x in zip(params, x_expected):
        assert (p.detach() - x).abs().max() < 1e-14
    opt.eval()  # a second eval() changes nothing
    for p, x in zip(params, x_expected):
        assert (p.detach() - x).abs().max() < 1e-14
    before = snapshot(opt, params)
    set_grads(params, 9)
    with pytest.raises(RuntimeError, match="eval mode.*train\\(\\)"):
        opt.step()
    assert_same(before, snapshot(opt, params))
    opt.train()
    for p, yy in zip(params, y):
        assert (p.detach() - yy).abs().max() < 1e-14


def test_schedule_free_mode_survives_state_dict_round_trip():
    opt, params = make("ScheduleFreeAdamW")
    run(opt, params, 4)
    opt.eval()
    saved = copy.deepcopy(opt.state_dict())
    other, copies = make("ScheduleFreeAdamW", data_seed=3)
    with torch.no_grad():  # a checkpoint taken in eval mode holds x
        for c, p in zip(copies, params):
            c.copy_(p)
    other.load_state_dict(saved)
    assert other.param_groups[0]["train_mode"] is False
    for o in (opt, other):
        o.train()
    run(opt, params, 3, start=4)
    run(other, copies, 3, start=4)
    assert_same(snapshot(opt, params), snapshot(other, copies))
    assert_same(opt.state_dict()["param_groups"], other.state_dict()["param_groups"])


def test_schedule_free_new_group_joins_in_current_mode():
    opt, params = make("ScheduleFreeAdamW")
    run(opt, params, 1)
    opt.eval()
    opt.add_param_group({"params": [torch.zeros(2, dtype=F64, requires_grad=True)]})
    assert opt.param_groups[1]["train_mode"] is False


# --- low precision: float32 math, rounded once ----------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_bfloat16_params_step_in_float32(name):
    cls, kw, shapes = CASES[name]
    kw = {k: v for k, v in kw.items() if k != "ns_dtype"}
    g = torch.Generator().manual_seed(0)
    p16 = [torch.randn(s, generator=g).to(torch.bfloat16).requires_grad_() for s in shapes]
    p32 = [p.detach().float().requires_grad_() for p in p16]
    o16, o32 = cls(p16, **kw), cls(p32, **kw)
    if name == "Dion":  # the same start of Q: the bfloat16 run rounds its Gaussian draw
        for p in p32:
            q = torch.randn((p.shape[1], dion_rank(p.shape, kw["rank_fraction"])), dtype=F64,
                            generator=torch.Generator().manual_seed(0))
            o32.state[p] = {"momentum_buffer": torch.zeros_like(p), "right_factor": q.bfloat16().float()}
    for t in range(2):
        set_grads(p16, t)
        for a, b in zip(p32, p16):
            a.grad = b.grad.float()
        o16.step()
        o32.step()
        with torch.no_grad():  # the reference rounds its parameters and state as the bfloat16 run does
            for p in p32:
                p.copy_(p.bfloat16().float())
            for st in o32.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        v.copy_(v.bfloat16().float())
    for a, b in zip(p16, p32):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a.float(), b), (a.float() - b).abs().max()
    for p in p16:
        assert all(v.dtype == torch.bfloat16 for v in o16.state[p].values() if isinstance(v, torch.Tensor))
