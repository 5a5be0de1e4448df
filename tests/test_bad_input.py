"""Bad input raises a clear ValueError/TypeError naming the argument, before anything changes:
a failed step() leaves parameters and optimizer state exactly as they were."""

import copy

import pytest
import torch

from optbook.optim import SGD, Adam, AdamW

CLASSES = [SGD, Adam, AdamW]


def p64(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("kwargs, error, word", [
    (dict(lr=-1e-3), ValueError, "lr"),
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr="0.1"), TypeError, "lr"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
])
def test_bad_common_hyperparameters(cls, kwargs, error, word):
    with pytest.raises(error, match=word):
        cls([p64(2)], **{"lr": 0.1, **kwargs})


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("kwargs, error, word", [
    (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
    (dict(betas=(0.9, 1.5)), ValueError, r"betas\[1\]"),
    (dict(betas=0.9), TypeError, "betas"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(eps=-1e-8), ValueError, "eps"),
])
def test_bad_adam_hyperparameters(cls, kwargs, error, word):
    with pytest.raises(error, match=word):
        cls([p64(2)], **kwargs)


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 1.5])
def test_bad_momentum(momentum):
    with pytest.raises(ValueError, match="momentum"):
        SGD([p64(2)], lr=0.1, momentum=momentum)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("param", [torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.bool),
                                   torch.zeros(3, dtype=torch.complex64)])
def test_integer_bool_and_complex_parameters_are_refused(cls, param):
    with pytest.raises(TypeError, match="params"):
        cls([param], lr=0.1)


@pytest.mark.parametrize("cls", CLASSES)
def test_bad_param_group_added_later_is_refused_and_not_added(cls):
    opt = cls([p64(2)], lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [p64(3)], "lr": -1.0})
    assert len(opt.param_groups) == 1


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(opt, params, snap):
    values, state = snap
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    now = opt.state_dict()
    assert now["param_groups"] == state["param_groups"]
    assert now["state"].keys() == state["state"].keys()
    for k in state["state"]:
        for name, value in state["state"][k].items():
            other = now["state"][k][name]
            assert torch.equal(other, value) if torch.is_tensor(value) else other == value


def make_opt(cls, params):
    kwargs = dict(momentum=0.9) if cls is SGD else {}
    return cls(params, lr=0.1, weight_decay=0.1, **kwargs)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls", CLASSES)
def test_sparse_gradient_fails_before_any_change(cls, foreach):
    params = [p64(4), p64(3, 2)]
    opt = make_opt(cls, params)
    opt.param_groups[0]["foreach"] = foreach
    for p in params:  # one good step so that there is state to protect
        p.grad = torch.ones_like(p)
    opt.step()
    snap = snapshot(opt, params)
    params[0].grad = torch.ones_like(params[0])           # a good gradient first ...
    params[1].grad = torch.ones(3, 2, dtype=torch.float64).to_sparse()  # ... then a bad one
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("field, value, error", [("lr", -0.5, ValueError), ("weight_decay", -1.0, ValueError),
                                                  ("lr", float("inf"), ValueError)])
def test_bad_value_set_on_a_group_fails_at_step_before_any_change(cls, field, value, error):
    params = [p64(4), p64(2)]
    opt = cls([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    snap = snapshot(opt, params)
    opt.param_groups[1][field] = value  # e.g. a buggy scheduler; group 0 would be updated first
    with pytest.raises(error, match=field):
        opt.step()
    opt.param_groups[1][field] = snap[1]["param_groups"][1][field]
    assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("cls", CLASSES)
def test_gradient_of_wrong_shape_or_dtype_fails_before_any_change(cls):
    params = [p64(4), p64(2)]
    opt = make_opt(cls, params)
    params[0].grad = torch.ones(4, dtype=torch.float64)
    params[1].grad = torch.ones(2, dtype=torch.float64)
    opt.step()
    snap = snapshot(opt, params)
    params[1].grad_dtype = None  # torch refuses a float32 grad on a float64 tensor unless told otherwise
    params[1].grad = torch.ones(2, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        opt.step()
    assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("cls", ["Muon", "NorMuon", "AdaMuon", "Scion"])
@pytest.mark.parametrize("kwargs, word", [(dict(ns_steps=0), "Invalid ns_steps"),
                                          (dict(coefficients=3.0), "Invalid coefficients"),
                                          (dict(coefficients=None), "Invalid coefficients"),
                                          (dict(coefficients=(1, 2, 3)), "Invalid coefficients")])
def test_a_bad_newton_schulz_schedule_is_named_by_the_optimizers_argument(cls, kwargs, word):
    import optbook.optim

    with pytest.raises(ValueError, match=word):
        getattr(optbook.optim, cls)([torch.nn.Parameter(torch.randn(4, 4))], lr=0.01, **kwargs)


@pytest.mark.parametrize("cls", ["SGD", "AdamW", "Muon", "NorMuon", "Shampoo", "Dion"])
def test_a_set_of_parameters_is_refused_as_torch_refuses_it(cls):
    import optbook.optim

    opt = getattr(optbook.optim, cls)([torch.nn.Parameter(torch.randn(4, 4))], lr=0.01)
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {torch.nn.Parameter(torch.randn(4, 4))}})
    assert len(opt.param_groups) == 1


def test_muon_scale_refuses_a_scale_factor_that_is_not_a_finite_number():
    from optbook.optim import muon_scale

    with pytest.raises(ValueError, match="extra_scale_factor"):
        muon_scale((4, 4), "spectral", extra_scale_factor=float("nan"))
    with pytest.raises(ValueError, match="extra_scale_factor"):
        muon_scale((4, 4), "spectral", extra_scale_factor=-1.0)
    from optbook.optim import AdaMuon, Muon, NorMuon

    for cls in (Muon, NorMuon, AdaMuon):
        with pytest.raises(ValueError, match="extra_scale_factor"):
            cls([torch.nn.Parameter(torch.randn(4, 3))], extra_scale_factor=-0.2)
    with pytest.raises(TypeError, match="extra_scale_factor"):
        muon_scale((4, 4), "spectral", extra_scale_factor="2")
