"""Contracts every optimizer of :mod:`optbook.optim` keeps, run over all fourteen classes.

A ``step()`` that raises leaves parameters, state and step counts bitwise as they were; a tensor ``lr``
gives bitwise the float-``lr`` result; a zero-element parameter is skipped; an old state dict without a
newer option loads and steps; ``load_state_dict`` copies instead of aliasing the source's tensors.
"""

import copy

import pytest
import torch

from optbook.optim import (SGD, SOAP, Adafactor, Adam, AdaMuon, AdamW, Dion, Dion2, Lion, Muon, NorMuon,
                           ScheduleFreeAdamW, Scion, Shampoo)

# one configuration per class that exercises momentum, decay and every state tensor
FACTORIES = {
    "SGD": lambda ps, **kw: SGD(ps, **{"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, **kw}),
    "Adam": lambda ps, **kw: Adam(ps, **{"lr": 0.01, "weight_decay": 0.1, **kw}),
    "AdamW": lambda ps, **kw: AdamW(ps, **{"lr": 0.01, "weight_decay": 0.1, **kw}),
    "Lion": lambda ps, **kw: Lion(ps, **{"lr": 0.01, "weight_decay": 0.1, **kw}),
    "Adafactor": lambda ps, **kw: Adafactor(ps, **{"lr": 0.01, "weight_decay": 0.1, **kw}),
    "Shampoo": lambda ps, **kw: Shampoo(ps, **{"lr": 0.01, "momentum": 0.5, "weight_decay": 0.1, **kw}),
    "SOAP": lambda ps, **kw: SOAP(ps, **{"lr": 0.01, "weight_decay": 0.1, "precondition_frequency": 2, **kw}),
    "Muon": lambda ps, **kw: Muon(ps, **{"lr": 0.02, "weight_decay": 0.1, **kw}),
    "NorMuon": lambda ps, **kw: NorMuon(ps, **{"lr": 0.02, "weight_decay": 0.1, **kw}),
    "AdaMuon": lambda ps, **kw: AdaMuon(ps, **{"lr": 0.02, "weight_decay": 0.1, **kw}),
    "Dion": lambda ps, **kw: Dion(ps, **{"lr": 0.02, "weight_decay": 0.1, **kw}),
    "Dion2": lambda ps, **kw: Dion2(ps, **{"lr": 0.02, "weight_decay": 0.1, "fraction": 0.5, **kw}),
    "Scion": lambda ps, **kw: Scion(ps, **{"lr": 0.02, "weight_decay": 0.1, **kw}),
    "ScheduleFreeAdamW": lambda ps, **kw: ScheduleFreeAdamW(ps, **{"lr": 0.01, "weight_decay": 0.1,
                                                                   "warmup_steps": 2, **kw}),
}
FOREACH = {"SGD", "Adam", "AdamW"}  # the classes with a foreach path
CASES = [(name, fe) for name in FACTORIES for fe in ((False, True) if name in FOREACH else (None,))]
CASE_IDS = [name if fe is None else f"{name}-foreach={fe}" for name, fe in CASES]


def make(name, params, foreach=None, **kw):
    if foreach is not None:
        kw["foreach"] = foreach
    return FACTORIES[name](params, **kw)


def matrices(dtype=torch.float64, seed=0, shapes=((4, 3), (3, 5))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def drive(opt, params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_bitwise_equal(a, b):
    """Equal nested state: tensors bitwise (same dtype and shape), everything else with ==."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    else:
        assert a == b


def assert_unchanged(opt, params, snap):
    values, state = snap
    for p, v in zip(params, values):
        assert_bitwise_equal(p.detach(), v)
    assert_bitwise_equal(opt.state_dict(), state)  # state tensors, step counts and hyperparameters


# ---------------------------------------------------------------- tensor lr

@pytest.mark.parametrize("lr", [torch.tensor(0.02), torch.tensor([0.02]), torch.tensor(0.02, dtype=torch.float64),
                                torch.tensor([[0.3]], dtype=torch.bfloat16)],
                         ids=["0-dim-fp32", "1-D-fp32", "0-dim-fp64", "2-D-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_tensor_lr_gives_bitwise_the_float_lr_result(name, foreach, dtype, lr):
    with_tensor, with_float = matrices(dtype), matrices(dtype)
    opt_t = make(name, with_tensor, foreach, lr=lr.clone())
    opt_f = make(name, with_float, foreach, lr=float(lr))
    drive(opt_t, with_tensor, 3)
    drive(opt_f, with_float, 3)
    for a, b in zip(with_tensor, with_float):
        assert torch.equal(a, b)
    assert torch.is_tensor(opt_t.param_groups[0]["lr"])  # the group keeps the tensor (a scheduler may fill_ it)


def test_tensor_lr_follows_a_torch_scheduler():
    # torch's schedulers write a tensor lr with fill_(); each step reads the value then in force
    a, b = matrices(), matrices()
    opt_t, opt_f = make("AdamW", a, lr=torch.tensor(0.01, dtype=torch.float64)), make("AdamW", b)
    sched_t = torch.optim.lr_scheduler.LambdaLR(opt_t, lambda s: 1 / (s + 1))
    sched_f = torch.optim.lr_scheduler.LambdaLR(opt_f, lambda s: 1 / (s + 1))
    for _ in range(4):
        drive(opt_t, a, 1)
        drive(opt_f, b, 1)
        sched_t.step()
        sched_f.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("lr", [torch.tensor([0.1, 0.2]), torch.tensor(0.1 + 0j), torch.tensor(True),
                                torch.tensor(float("nan")), torch.tensor([-0.1])])
@pytest.mark.parametrize("name", FACTORIES)
def test_bad_tensor_lr_is_refused_in_the_constructor(name, lr):
    with pytest.raises((TypeError, ValueError), match="lr"):
        make(name, matrices(), lr=lr)


# every real-valued hyperparameter besides lr, with a value each class accepts
FLOAT_OPTIONS = {
    "SGD": dict(momentum=0.9, weight_decay=0.1),
    "Adam": dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "AdamW": dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "Lion": dict(betas=(0.8, 0.99), weight_decay=0.1),
    "Adafactor": dict(beta2_decay=-0.7, eps=(1e-30, 1e-3), d=1.5, weight_decay=0.1),
    "Shampoo": dict(beta2=0.9, eps=1e-6, momentum=0.5, weight_decay=0.1),
    "SOAP": dict(betas=(0.8, 0.99), shampoo_beta=0.9, eps=1e-6, weight_decay=0.1),
    "Muon": dict(momentum=0.9, weight_decay=0.1, extra_scale_factor=0.2, eps=1e-6),
    "NorMuon": dict(momentum=0.9, beta2=0.9, weight_decay=0.1, eps=1e-6, extra_scale_factor=0.5),
    "AdaMuon": dict(momentum=0.9, beta2=0.99, weight_decay=0.1, eps=1e-6, extra_scale_factor=0.3),
    "Dion": dict(momentum=0.9, weight_decay=0.1, eps=1e-6),
    "Dion2": dict(ef_decay=0.9, weight_decay=0.1, eps=1e-6),
    "Scion": dict(momentum=0.8, weight_decay=0.1, radius=2.0),
    "ScheduleFreeAdamW": dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, r=0.5, weight_lr_power=1.5),
}


def _as_tensors(value, make_tensor):
    if isinstance(value, tuple):
        return tuple(make_tensor(x) for x in value)
    return make_tensor(value)


@pytest.mark.parametrize("make_tensor", [lambda x: torch.tensor(x), lambda x: torch.tensor([x], dtype=torch.float64)],
                         ids=["0-dim-fp32", "1-D-fp64"])
@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_every_real_hyperparameter_given_as_a_tensor_gives_bitwise_the_float_result(name, foreach, make_tensor):
    for key, value in FLOAT_OPTIONS[name].items():
        tensor_value = _as_tensors(value, make_tensor)
        float_value = tuple(map(float, tensor_value)) if isinstance(value, tuple) else float(tensor_value)
        with_tensor, with_float = matrices(), matrices()
        opt_t = make(name, with_tensor, foreach, **{key: tensor_value})
        opt_f = make(name, with_float, foreach, **{key: float_value})
        drive(opt_t, with_tensor, 3)
        drive(opt_f, with_float, 3)
        for a, b in zip(with_tensor, with_float):
            assert torch.equal(a, b), key
        kept = opt_t.param_groups[0][key]  # the group keeps what it was given
        assert all(map(torch.is_tensor, kept)) if isinstance(value, tuple) else torch.is_tensor(kept)


@pytest.mark.parametrize("name", FACTORIES)
def test_a_tensor_hyperparameter_with_several_elements_is_refused_in_the_constructor_by_name(name):
    for key, value in FLOAT_OPTIONS[name].items():
        bad = (torch.tensor([value[0]] * 2),) + value[1:] if isinstance(value, tuple) else torch.tensor([value] * 2)
        # ValueError with torch.optim's words, as torch raises it (TypeError before)
        with pytest.raises(ValueError, match=rf"Invalid {key}.*Tensor {key}(\[0\])? must be 1-element"):
            make(name, matrices(), **{key: bad})


# ---------------------------------------------------------------- zero-element parameters

@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_a_zero_element_parameter_is_skipped_and_the_others_are_stepped(name, foreach):
    empty, full = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True), matrices(shapes=((4, 3),))[0]
    alone = full.detach().clone().requires_grad_()
    opt = make(name, [empty, full], foreach)
    ref = make(name, [alone], foreach)
    drive(opt, [empty, full], 3)
    drive(ref, [alone], 3)
    assert torch.equal(full, alone)
    assert empty.shape == (0, 3) and len(opt.state[empty]) == 0
    assert_bitwise_equal(opt.state_dict()["state"][1], ref.state_dict()["state"][0])


# ---------------------------------------------------------------- validation before any write

COMMON_BAD = [("lr", -0.5, "lr"), ("lr", float("nan"), "lr"), ("lr", torch.tensor([0.1, 0.2]), "lr"),
              ("weight_decay", -1.0, "weight_decay")]
BAD_EDITS = {
    "SGD": [("momentum", 1.0, "momentum"), ("nesterov", "yes", "nesterov"), ("foreach", "yes", "foreach")],
    "Adam": [("betas", (0.9, 1.0), "betas"), ("eps", 0.0, "eps"), ("foreach", 1, "foreach")],
    "AdamW": [("betas", 0.9, "betas"), ("eps", -1.0, "eps"), ("foreach", "no", "foreach")],
    "Lion": [("betas", (1.0, 0.9), "betas")],
    "Adafactor": [("beta2_decay", 0.5, "beta2_decay"), ("d", 0.0, "d"), ("eps", (None, -1.0), "eps")],
    "Shampoo": [("beta2", 1.5, "beta2"), ("precondition_frequency", 0, "precondition_frequency"),
                ("momentum", 1.0, "momentum"), ("eps", 0.0, "eps")],
    "SOAP": [("shampoo_beta", 1.0, "shampoo_beta"), ("betas", (0.9, 2.0), "betas"),
             ("precondition_frequency", 0.5, "precondition_frequency")],
    "Muon": [("head_split", 3, "head_split"), ("head_split", (2, 1), "head_split"), ("head_split", "x", "head_split"),
             ("ns_dtype", torch.int32, "ns_dtype"), ("ns_dtype", "bf16", "ns_dtype"), ("ns_steps", 0, "steps"),
             ("coefficients", "nope", "coefficients"), ("scale_mode", "big", "scale_mode"), ("eps", 0.0, "eps"),
             ("momentum", -0.1, "momentum"), ("nesterov", 1, "nesterov"), ("gram", "triangular", "gram"),
             ("gram", None, "gram")],
    "NorMuon": [("beta2", 1.0, "beta2"), ("momentum", 1.0, "momentum"), ("eps", 0.0, "eps")],
    "AdaMuon": [("beta2", -0.1, "beta2"), ("eps", 0.0, "eps"), ("ns_steps", 0, "steps")],
    "Dion": [("rank_fraction", 0.0, "rank_fraction"), ("q_update", "qr", "q_update"),
             ("momentum", 1.0, "momentum")],
    "Dion2": [("fraction", 0.0, "fraction"), ("fraction", 1.5, "fraction"), ("ef_decay", 1.5, "ef_decay"),
              ("ns_dtype", "bf16", "ns_dtype"), ("scale_mode", "big", "scale_mode"), ("ns_steps", 0, "ns_steps"),
              ("coefficients", "nope", "coefficients")],
    "Scion": [("norm", "nuclear", "norm"), ("radius", 0.0, "radius"), ("momentum", 1.5, "momentum")],
    "ScheduleFreeAdamW": [("betas", (1.0, 0.9), "betas"), ("warmup_steps", -1, "warmup_steps"),
                          ("eps", 0.0, "eps")],
}
EDITS = [(name, *edit) for name in FACTORIES for edit in COMMON_BAD + BAD_EDITS[name]]


@pytest.mark.parametrize("name, field, value, word", EDITS,
                         ids=[f"{n}-{f}={v!r}" for n, f, v, _ in EDITS])
def test_a_bad_value_written_into_a_group_raises_before_any_change(name, field, value, word):
    # group 0 would be stepped first: the check of group 1 must come before any write
    params = matrices(shapes=((4, 3), (4, 3)))
    opt = make(name, [{"params": [params[0]]}, {"params": [params[1]]}])
    drive(opt, params, 2)
    snap = snapshot(opt, params)
    good = opt.param_groups[1][field]
    opt.param_groups[1][field] = value  # e.g. a buggy scheduler or a hand edit
    with pytest.raises((ValueError, TypeError), match=word):
        opt.step()
    opt.param_groups[1][field] = good
    assert_unchanged(opt, params, snap)


def test_editing_head_split_to_a_non_divisor_raises_before_the_momentum_buffer_is_written():
    W = matrices(shapes=((6, 4),))[0]
    opt = Muon([{"params": [W], "head_split": 3}], lr=0.02)
    drive(opt, [W], 1)
    snap = snapshot(opt, [W])
    opt.param_groups[0]["head_split"] = 4
    with pytest.raises(ValueError, match="head_split: 4 heads do not divide the 6 rows"):
        opt.step()
    opt.param_groups[0]["head_split"] = 3
    assert_unchanged(opt, [W], snap)


@pytest.mark.parametrize("ns_dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_muon_refuses_a_non_floating_ns_dtype(ns_dtype):
    with pytest.raises(TypeError, match="ns_dtype"):
        Muon(matrices(), ns_dtype=ns_dtype)


def test_shampoo_momentum_switched_on_mid_run_starts_its_buffer_at_zero():
    W = matrices(shapes=((4, 3),))[0]
    opt = Shampoo([W], lr=0.1, momentum=0.0, weight_decay=0.1)
    drive(opt, [W], 2)
    assert "momentum_buffer" not in opt.state[W]
    opt.param_groups[0]["momentum"] = 0.5
    before = W.detach().clone()
    G = torch.randn(4, 3, dtype=torch.float64)
    W.grad = G.clone()
    opt.step()
    st = opt.state[W]
    assert st["step"] == 3
    U = st["L_inv_root"] @ G @ st["R_inv_root"]
    assert torch.equal(st["momentum_buffer"], torch.zeros_like(U).lerp_(U, 0.5))  # lerp from zero: 0.5 U
    assert torch.equal(W.detach(), before.mul(1 - 0.1 * 0.1).sub_(st["momentum_buffer"], alpha=0.1))


@pytest.mark.parametrize("name", ["SGD", "Muon"])
def test_nesterov_without_momentum_is_refused_like_torch_sgd(name):
    with pytest.raises(ValueError, match="nesterov"):
        make(name, matrices(), momentum=0.0, nesterov=True)
    opt = make(name, matrices(), momentum=0.0, nesterov=False)  # the plain method is still there
    opt.param_groups[0]["nesterov"] = True                      # ... and an edit is caught at step()
    with pytest.raises(ValueError, match="nesterov"):
        opt.step()


# ---------------------------------------------------------------- state dicts

# options added after the first release
NEWER_OPTIONS = ("foreach", "head_split", "amsgrad", "maximize", "gram")


@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_a_state_dict_without_newer_options_loads_and_steps(name, foreach):
    straight, first = matrices(), matrices()
    run = make(name, straight)
    drive(run, straight, 5)
    opt = make(name, first)
    drive(opt, first, 2)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in NEWER_OPTIONS:
            group.pop(key, None)
    second = [p.detach().clone().requires_grad_() for p in first]
    opt2 = make(name, second, foreach)
    opt2.load_state_dict(saved)
    for key in NEWER_OPTIONS:
        if key in opt2.defaults:  # filled with the constructor's default (the old behaviour)
            default = {"foreach": None, "head_split": None, "gram": "plain"}.get(key, False)
            assert opt2.param_groups[0][key] == default
    assert "differentiable" not in opt2.param_groups[0]  # torch's own default is not pushed into the groups
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # replay the first run's two gradients, then three more
        for p in second:
            torch.randn(p.shape, generator=g, dtype=p.dtype)
    for _ in range(3):
        for p in second:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt2.step()
    for a, b in zip(straight, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_load_state_dict_copies_instead_of_aliasing_the_source(name, foreach):
    source_params = matrices()
    source = make(name, source_params, foreach)
    drive(source, source_params, 2)
    params = [p.detach().clone().requires_grad_() for p in source_params]
    loaded = make(name, params, foreach)
    loaded.load_state_dict(source.state_dict())  # same process, same dtype and device
    snap = snapshot(source, source_params)
    drive(loaded, params, 3)  # stepping the loaded optimizer ...
    assert_unchanged(source, source_params, snap)  # ... leaves the source's state as it was
    for p, q in zip(source_params, params):
        for key, value in source.state[p].items():
            if torch.is_tensor(value):
                assert value.untyped_storage().data_ptr() != loaded.state[q][key].untyped_storage().data_ptr()


@pytest.mark.parametrize("name", FACTORIES)
def test_pickled_optimizer_without_newer_options_unpickles_with_defaults(name):
    import pickle

    opt = make(name, matrices())
    for group in opt.param_groups:
        for key in NEWER_OPTIONS:
            group.pop(key, None)
    clone = pickle.loads(pickle.dumps(opt))
    for key in NEWER_OPTIONS:
        if key in clone.defaults:
            assert key in clone.param_groups[0]


# ---------------------------------------------------------------- functional twins

def _twin_run(name):
    """Drive the class and, by hand, its functional twin on the same gradients; return both parameter lists."""
    from optbook.optim.functional import adafactor, lion, muon, shampoo, soap

    ours, theirs = matrices(shapes=((4, 3), (3, 5))), matrices(shapes=((4, 3), (3, 5)))
    hp = {"Lion": dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
          "Adafactor": dict(lr=0.01, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.1),
          "Shampoo": dict(lr=0.01, beta2=0.9, eps=1e-12, momentum=0.5, precondition_frequency=2, weight_decay=0.1),
          "SOAP": dict(lr=0.01, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, precondition_frequency=2,
                       weight_decay=0.1),
          "Muon": dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, ns_dtype=torch.float64)}[name]
    opt = {"Lion": Lion, "Adafactor": Adafactor, "Shampoo": Shampoo, "SOAP": SOAP, "Muon": Muon}[name](ours, **hp)
    z = [torch.zeros_like(p) for p in theirs]
    n = len(theirs)
    L = [torch.eye(p.shape[0], dtype=p.dtype) * 1e-12 for p in theirs]
    R = [torch.eye(p.shape[1], dtype=p.dtype) * 1e-12 for p in theirs]
    if name == "SOAP":
        L, R = [torch.zeros(p.shape[0], p.shape[0], dtype=p.dtype) for p in theirs], \
               [torch.zeros(p.shape[1], p.shape[1], dtype=p.dtype) for p in theirs]
    Li, Ri = [None] * n, [None] * n
    rows = [p.new_zeros(p.shape[0], 1) for p in theirs]
    cols = [p.new_zeros(1, p.shape[1]) for p in theirs]
    v = [torch.zeros_like(p) for p in theirs]
    g = torch.Generator().manual_seed(1)
    for t in range(1, 6):
        grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in ours]
        for p, G in zip(ours, grads):
            p.grad = G.clone()
        opt.step()
        if name == "Lion":
            lion(theirs, grads, z, lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1)
        elif name == "Adafactor":
            adafactor(theirs, grads, rows, cols, [None] * n, [t] * n, lr=0.01, beta2_decay=-0.8, eps1=None,
                      eps2=1e-3, d=1.0, weight_decay=0.1)
        elif name == "Shampoo":
            shampoo(theirs, grads, L, R, Li, Ri, z, [t] * n, **{k: hp[k] for k in hp})
        elif name == "SOAP":
            soap(theirs, grads, z, v, L, R, Li, Ri, [t] * n, lr=0.01, beta1=0.9, beta2=0.95, shampoo_beta=0.9,
                 eps=1e-8, precondition_frequency=2, weight_decay=0.1)
        else:
            muon(theirs, grads, z, **hp)
    return ours, theirs


@pytest.mark.parametrize("name", ["Lion", "Adafactor", "Shampoo", "SOAP", "Muon"])
def test_each_class_equals_its_functional_twin_bit_for_bit(name):
    ours, theirs = _twin_run(name)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the step contract: non-finite, load

@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_a_nonfinite_gradient_raises_naming_the_parameter_before_any_write(name, foreach, bad):
    from optbook.contract import NonFiniteGradientError

    params = matrices()
    opt = make(name, params, foreach)
    drive(opt, params, 2)
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[2, 4] = bad
    snap = snapshot(opt, params)
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(3, 5\)"):
        opt.step()
    assert isinstance(NonFiniteGradientError("x"), ValueError)
    assert_unchanged(opt, params, snap)
    params[1].grad[2, 4] = 0.0
    assert opt.step() is None   # the same step with the value fixed goes through
    assert not torch.equal(params[1].detach(), snap[0][1])


@pytest.mark.parametrize("dtype, huge", [(torch.float32, 1e20), (torch.float32, 3e38), (torch.bfloat16, 1e30),
                                         (torch.float64, 1e200)])
@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_a_huge_finite_gradient_is_stepped_or_refused_before_any_write(name, foreach, dtype, huge):
    # finite, but its square overflows: element-wise classes step (as torch.optim does: v becomes inf and
    # the update 0); Shampoo and SOAP, whose G G^T would become inf and fail in eigh halfway through the
    # step, refuse it before any write, naming the parameter
    params = matrices(dtype=dtype)
    opt = make(name, params, foreach)
    drive(opt, params, 2)
    for _ in range(2):
        for p in params:
            p.grad = torch.full_like(p, huge)
        snap = snapshot(opt, params)
        if name in ("Shampoo", "SOAP"):
            with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[0\].*{name}'s statistics.*"
                                                 r"nothing was written"):
                opt.step()
            assert_unchanged(opt, params, snap)
        else:
            assert opt.step() is None


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_a_nan_gradient_in_a_chain_member_is_the_chains_nonfinite_error_not_an_overflow(name):
    from optbook.contract import NonFiniteGradientError
    from optbook.optim import ChainedOptimizer

    params = matrices()
    opt = ChainedOptimizer([make(name, params[:1]), make("AdamW", params[1:])])
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_shampoo_and_soap_step_gradients_up_to_their_statistics_limit(name, dtype):
    # ||G||_F^2 = 0.35 x the working dtype's largest value: stepped, everything stays finite; Shampoo, which
    # sums G G^T (largest element, on the diagonal, 1/3 of ||G||_F^2 for these shapes and equal magnitudes),
    # refuses the third step: 2/3 x 0.35 + 0.35 > 0.5, past half the range, before any write
    params = matrices(dtype=dtype)
    opt = make(name, params, **({"momentum": 0.0} if name == "Shampoo" else {}))
    big = torch.finfo(torch.promote_types(dtype, torch.float32)).max
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        for p in params:
            signs = torch.randn(p.shape, generator=g, dtype=torch.float64).sign()
            p.grad = (signs * (0.35 * big / p.numel()) ** 0.5).to(dtype)
        snap = snapshot(opt, params)
        if name == "Shampoo" and step == 2:
            with pytest.raises(ValueError, match=r"at most .* would overflow .* \(limit"):
                opt.step()
            assert_unchanged(opt, params, snap)
            continue
        opt.step()
        held = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        assert all(bool(torch.isfinite(t).all()) for t in held + params)


@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_a_parameter_listed_twice_in_a_group_is_refused(name, foreach):
    # torch.optim only warns; stepped twice by some classes, once by others, and the wrappers (one copy per
    # entry) disagreed with the optimizer they wrap
    W, V = matrices()
    with pytest.raises(ValueError, match=r"parameter 2 \(shape \(4, 3\)\) is the same tensor as parameter 0"):
        make(name, [W, V, W], foreach)
    opt = make(name, [W], foreach)
    with pytest.raises(ValueError, match="same tensor"):
        opt.add_param_group({"params": [V, V]})
    assert len(opt.param_groups) == 1


def test_wrappers_refuse_a_parameter_listed_twice_by_a_torch_optimizer():
    import warnings

    from optbook.memory import OffloadOptimizer
    from optbook.precision import MixedPrecisionOptimizer

    W = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's own "duplicate parameters" warning
        with pytest.raises(ValueError, match=r"same tensor as parameter 0.*param_groups\[0\]"):
            MixedPrecisionOptimizer(torch.optim.AdamW([W, W]))
        with pytest.raises(ValueError, match="same tensor as parameter 0"):
            OffloadOptimizer([W, W], torch.optim.AdamW, lr=0.1)


def _bad_dicts(name, saved):
    """(bad dict, error, words of the message) for one class's state dict of two (4, 3), (3, 5) matrices."""
    key = next(k for k, v in saved["state"][1].items() if torch.is_tensor(v) and v.ndim)
    short = copy.deepcopy(saved)
    short["state"][1][key] = short["state"][1][key][:1]
    wrong_dtype = copy.deepcopy(saved)
    wrong_dtype["state"][1][key] = wrong_dtype["state"][1][key].float()
    missing = copy.deepcopy(saved)
    del missing["state"][0][key]
    bad_group = copy.deepcopy(saved)
    bad_group["param_groups"][0]["lr"] = -1.0
    two_groups = {**saved, "param_groups": saved["param_groups"] * 2}
    one_param = copy.deepcopy(saved)
    one_param["param_groups"][0]["params"] = [0]
    cases = [({"param_groups": saved["param_groups"]}, ValueError, "no 'state'"),
             (two_groups, ValueError, "2 param_groups"), (one_param, ValueError, "1 parameters"),
             (short, ValueError, rf"state\[1\]\['{key}'\] \(param_groups\[0\]\['params'\]\[1\], shape \(3, 5\)\) has shape"), (wrong_dtype, ValueError, "float32"),
             (bad_group, ValueError, "lr"), ("state", TypeError, "dict")]
    if name not in ("Muon", "SGD", "Lion", "Scion", "Dion2"):   # their one state tensor: without it the state is empty
        cases.append((missing, ValueError, f"no '{key}'"))
    # a step count or running sum that is missing, not a number or negative used to load and make the next
    # step fail halfway; a key the class does not keep means a state dict of another optimizer
    for scalar, kind in FACTORIES[name]([torch.zeros(2, 2, requires_grad=True)]).state_scalars.items():
        for value, words in ((None, "missing"), ("junk", "expected"), (-5, "expected"), (float("nan"), "expected")):
            if kind == "float" and value == -5:
                continue   # a negative running maximum is a value, not a kind error
            bad = copy.deepcopy(saved)
            if value is None:
                del bad["state"][1][scalar]
            else:
                bad["state"][1][scalar] = value
            cases.append((bad, ValueError, rf"state\[1\]\['{scalar}'\].*{words}"))
    if "Q_R" not in saved["state"][0]:
        foreign = copy.deepcopy(saved)
        foreign["state"][1]["Q_R"] = torch.zeros(5, 5, dtype=torch.float64)
        cases.append((foreign, ValueError, r"state\[1\].*(keys .* does not keep: Q_R|only one of 'Q_L' and 'Q_R')"))
    return cases


@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
def test_a_bad_state_dict_raises_and_writes_nothing(name, foreach):
    source_params = matrices()
    source = make(name, source_params, foreach)
    drive(source, source_params, 2)
    saved = source.state_dict()
    params = matrices(seed=3)
    opt = make(name, params, foreach)
    drive(opt, params, 1, seed=4)
    for bad, error, words in _bad_dicts(name, saved):
        snap = snapshot(opt, params)
        with pytest.raises(error, match=words):
            opt.load_state_dict(bad)
        assert_unchanged(opt, params, snap)
    opt.load_state_dict(saved)
    assert_bitwise_equal(opt.state_dict()["state"], saved["state"])


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_a_bfloat16_parameters_float32_statistics_round_trip_through_a_state_dict(name):
    # torch.optim.Optimizer.load_state_dict would cast L and R to the parameter's bfloat16
    params = matrices(dtype=torch.bfloat16)
    opt = make(name, params)
    drive(opt, params, 2)
    loaded = make(name, [p.detach().clone().requires_grad_() for p in params])
    loaded.load_state_dict(opt.state_dict())
    assert loaded.state[loaded.param_groups[0]["params"][0]]["L"].dtype == torch.float32
    assert_bitwise_equal(loaded.state_dict()["state"], opt.state_dict()["state"])


def test_soap_refuses_a_state_with_one_basis_only():
    params = matrices()
    opt = make("SOAP", params)
    drive(opt, params, 3)   # precondition_frequency 2: the bases exist
    bad = opt.state_dict()
    del bad["state"][1]["Q_R"]
    snap = snapshot(opt, params)
    with pytest.raises(ValueError, match="only one of 'Q_L' and 'Q_R'"):
        opt.load_state_dict(bad)
    assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_a_torch_optim_checkpoint_loads_and_continues_as_torch_does(name):
    # torch.optim keeps `step` as a 0-dim float tensor; it is read as the int it holds
    params = matrices()
    theirs = getattr(torch.optim, name)(params, lr=0.01, weight_decay=0.1, foreach=False)
    drive(theirs, params, 3)
    ours_params = [p.detach().clone().requires_grad_() for p in params]
    ours = make(name, ours_params)
    ours.load_state_dict(theirs.state_dict())
    assert all(type(ours.state[p]["step"]) is int and ours.state[p]["step"] == 3 for p in ours_params)
    drive(theirs, params, 3, seed=9)
    drive(ours, ours_params, 3, seed=9)
    for a, b in zip(params, ours_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name, foreach", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("key, value", [("lr", 1e300), ("lr", 10**30), ("weight_decay", 1e300)])
def test_a_scalar_torch_cannot_take_is_refused_before_the_first_group_is_written(name, foreach, key, value):
    # finite in float64 but not a float32 (or int64) scalar: torch used to refuse it in the second group's
    # kernel, after the first group had been stepped
    params = matrices()
    opt = make(name, params[:1], foreach)
    opt.add_param_group({"params": params[1:]})
    drive(opt, params, 1)
    opt.param_groups[1][key] = value
    snap = snapshot(opt, params)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=key):
        opt.step()
    assert_unchanged(opt, params, snap)


def test_schedule_free_refuses_an_averaging_weight_that_overflows_before_any_write():
    params = matrices()
    opt = ScheduleFreeAdamW([{"params": params[:1]}, {"params": params[1:], "r": 1000.0}], lr=0.01)
    drive(opt, params, 2)   # 2**1000 is still a float
    snap = snapshot(opt, params)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"r or weight_lr_power of param_groups\[1\].*step 3"):
        opt.step()
    assert_unchanged(opt, params, snap)
