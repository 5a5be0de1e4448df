"""torch.optim's conventions on every optbook class: named parameters, an empty state for momentum-free
SGD, torch's arguments (supported, or refused naming the argument and why), one-element tensor
hyperparameters, Adafactor's ``d >= 1``, and no non-finite or impossible optimizer state at load."""

import copy

import pytest
import torch
from torch import nn

from optbook.optim import SGD, Adafactor, Adam, AdamW, Lion
from optbook.optim._torch_arguments import TORCH_ARGUMENTS
from test_every_optimizer import FACTORIES, assert_bitwise_equal, drive, matrices

NAMES = sorted(FACTORIES)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 5, bias=False)).double()


@pytest.mark.parametrize("name", NAMES)
def test_named_parameters_are_accepted_and_their_names_kept_as_torch_does(name):
    net = model()
    opt = FACTORIES[name](net.named_parameters())
    assert opt.param_groups[0]["param_names"] == ["0.weight", "2.weight"]
    assert opt.param_groups[0]["params"] == list(net.parameters())
    params = list(net.parameters())
    drive(opt, params, 2)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"] == ["0.weight", "2.weight"]
    # a fresh optimizer over the same model loads it and steps as the original does
    twin = model()
    twin.load_state_dict(net.state_dict())
    other = FACTORIES[name](twin.named_parameters())
    other.load_state_dict(saved)
    assert other.param_groups[0]["param_names"] == ["0.weight", "2.weight"]
    drive(opt, params, 1, seed=5)
    drive(other, list(twin.parameters()), 1, seed=5)
    for p, q in zip(params, twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", NAMES)
def test_a_non_finite_gradient_is_reported_with_the_parameters_name(name):
    from optbook.contract import NonFiniteGradientError
    net = model()
    opt = FACTORIES[name](net.named_parameters())
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    net[2].weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[1\] \('2.weight'\)"):
        opt.step()


def test_named_and_unnamed_parameters_are_not_mixed_as_in_torch():
    net = model()
    (n0, p0), (_, p1) = net.named_parameters()
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        AdamW([(n0, p0), p1])
    opt = AdamW([(n0, p0)])
    with pytest.raises(ValueError, match="with/without names"):
        opt.add_param_group({"params": [p1]})


@pytest.mark.parametrize("options", [dict(), dict(foreach=True), dict(foreach=False), dict(fused=True)])
def test_sgd_without_momentum_leaves_state_empty_as_torch(options):
    params = matrices()
    opt = SGD(params, lr=0.1, **options)
    ref = torch.optim.SGD([p.detach().clone().requires_grad_() for p in params], lr=0.1)
    drive(opt, params, 3)
    drive(ref, ref.param_groups[0]["params"], 3)
    assert len(opt.state) == 0 == len(ref.state)
    assert opt.state_dict()["state"] == {} == ref.state_dict()["state"]


# ---------------------------------------------------------------- torch's arguments

def takes(name, argument):
    import inspect
    return argument in inspect.signature(type(FACTORIES[name](matrices())).__init__).parameters


REFUSED = {"maximize": True, "dampening": 0.5, "fused": True, "foreach": True, "differentiable": True,
           "capturable": True}


# (class, torch argument it does not take); the ones it takes (SGD's maximize, Adam's fused...) are tested on their own
NOT_TAKEN = [(name, argument) for name in NAMES for argument in sorted(TORCH_ARGUMENTS) if not takes(name, argument)]


@pytest.mark.parametrize("name, argument", NOT_TAKEN)
def test_a_torch_argument_a_class_lacks_is_accepted_as_a_no_op_or_refused_naming_it(name, argument):
    for ok in TORCH_ARGUMENTS[argument][0]:
        FACTORIES[name](matrices(), **{argument: ok})   # asks for what the class does anyway: accepted
    with pytest.raises(ValueError, match=rf"Invalid {argument}=.*{name}"):
        FACTORIES[name](matrices(), **{argument: REFUSED[argument]})


def test_which_torch_arguments_each_twin_class_supports():
    assert all(takes("SGD", a) for a in ("maximize", "dampening", "fused", "foreach"))
    assert all(takes(n, a) for n in ("Adam", "AdamW") for a in ("maximize", "fused", "foreach"))
    assert takes("Adafactor", "maximize")
    for name in NAMES:   # autograd through the step and CUDA-graph capture: no class
        assert not takes(name, "differentiable") and not takes(name, "capturable")


@pytest.mark.parametrize("cls, kw", [(SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
                                     (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, foreach=True)),
                                     (Adam, dict(lr=0.01, weight_decay=0.1)),
                                     (Adafactor, dict(lr=0.01, weight_decay=0.1))],
                         ids=["SGD", "SGD-nesterov", "Adam", "Adafactor"])
def test_maximize_is_the_step_of_the_negated_gradient(cls, kw):
    ascend, descend = matrices(), matrices()
    a, d = cls(ascend, maximize=True, **kw), cls(descend, **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, q in zip(ascend, descend):
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
            q.grad = -p.grad
        a.step()
        d.step()
    for p, q in zip(ascend, descend):
        assert torch.equal(p, q)


def test_sgd_maximize_matches_torch_with_the_lr_mapping():
    mu = 0.9
    ours = matrices()
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt = SGD(ours, lr=0.1, momentum=mu, maximize=True)
    ref = torch.optim.SGD(theirs, lr=0.1 * (1 - mu), momentum=mu, maximize=True)
    drive(opt, ours, 5)
    drive(ref, theirs, 5)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15)


@pytest.mark.parametrize("dampening", [0.5, 0.9, -1.0])
def test_sgd_refuses_a_dampening_other_than_zero_saying_why(dampening):
    with pytest.raises(ValueError, match=r"Invalid dampening=.*dampening=0"):
        SGD(matrices(), lr=0.1, momentum=0.9, dampening=dampening)
    SGD(matrices(), lr=0.1, momentum=0.9, dampening=0)


@pytest.mark.parametrize("name", NAMES)
def test_a_two_element_tensor_lr_raises_value_error_as_torch(name):
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        FACTORIES[name](matrices(), lr=torch.tensor([0.1, 0.2]))
    params = matrices()
    opt = FACTORIES[name](params)
    drive(opt, params, 1)
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])   # a scheduler's mistake: refused before any write
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        drive(opt, params, 1)
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    assert_bitwise_equal(opt.state_dict()["state"], before[1]["state"])
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        torch.optim.Adam(matrices(), lr=torch.tensor([0.1, 0.2]))   # torch's own message, for reference


@pytest.mark.parametrize("d", [0.5, 0.999, 0.0, -1.0])
def test_adafactor_refuses_a_clipping_threshold_below_one_as_torch(d):
    with pytest.raises(ValueError, match="Invalid d"):
        Adafactor(matrices(), d=d)
    with pytest.raises(ValueError, match="d should be >= 1"):
        torch.optim.Adafactor(matrices(), d=d)
    Adafactor(matrices(), d=1.0)
    Adafactor(matrices(), d=2.0)


# ---------------------------------------------------------------- impossible state at load

NONNEGATIVE = {"Adam": ("exp_avg_sq", "max_exp_avg_sq"), "AdamW": ("exp_avg_sq", "max_exp_avg_sq"),
               "Adafactor": ("row_var", "col_var", "variance")}


def stepped(name, **kw):
    params = matrices(shapes=((4, 3), (3, 5), (5,))) if FACTORIES[name](matrices()).elementwise or \
        name == "Adafactor" else matrices()
    opt = FACTORIES[name](params, **kw)
    drive(opt, params, 3)
    return opt, params


def tensor_keys(state):
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and v.numel()]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_state_is_refused_at_load_naming_the_entry_and_nothing_is_written(name, bad):
    source, _ = stepped(name, **({"amsgrad": True} if name in ("Adam", "AdamW") else {}))
    target, params = stepped(name, **({"amsgrad": True} if name in ("Adam", "AdamW") else {}))
    drive(target, params, 1, seed=9)   # target differs from source: a partial load would show
    keys = tensor_keys(source.state_dict()["state"][1])
    assert keys
    for key in keys:
        saved = copy.deepcopy(source.state_dict())
        t = saved["state"][1][key]
        t[tuple(n - 1 for n in t.shape)] = bad
        before = copy.deepcopy(target.state_dict())
        with pytest.raises(ValueError, match=rf"state\[1\]\['{key}'\] \(param_groups\[0\]\['params'\]\[1\].*holds "
                                             rf"{'NaN' if bad != bad else 'inf'}.*Nothing was loaded"):
            target.load_state_dict(saved)
        assert_bitwise_equal(target.state_dict(), before)


@pytest.mark.parametrize("name", sorted(NONNEGATIVE))
def test_a_negative_second_moment_is_refused_at_load_naming_the_entry(name):
    source, _ = stepped(name, **({"amsgrad": True} if name != "Adafactor" else {}))
    target, _ = stepped(name, **({"amsgrad": True} if name != "Adafactor" else {}))
    assert type(target).nonnegative_state == NONNEGATIVE[name]
    seen = set()
    for index, state in source.state_dict()["state"].items():
        for key in NONNEGATIVE[name]:
            if key not in state:
                continue
            seen.add(key)
            saved = copy.deepcopy(source.state_dict())
            t = saved["state"][index][key]
            t[tuple(0 for _ in t.shape)] = -1e-3
            before = copy.deepcopy(target.state_dict())
            with pytest.raises(ValueError, match=rf"state\[{index}\]\['{key}'\].*negative entry.*Nothing was loaded"):
                target.load_state_dict(saved)
            assert_bitwise_equal(target.state_dict(), before)
    assert seen == set(NONNEGATIVE[name])


@pytest.mark.parametrize("cls", [SGD, Lion, AdamW])
def test_negative_momentum_is_a_valid_state(cls):
    # only second moments must be >= 0: a first moment of any sign loads
    kw = dict(lr=0.1, momentum=0.9) if cls is SGD else dict(lr=0.01)
    params = matrices()
    opt = cls(params, **kw)
    drive(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())
    key = "momentum_buffer" if cls is SGD else "exp_avg"
    saved["state"][0][key].fill_(-1.0)
    opt.load_state_dict(saved)
    assert float(opt.state[params[0]][key].max()) == -1.0


def test_adams_decoupled_weight_decay_points_to_adamw():
    Adam(matrices(), decoupled_weight_decay=False)
    with pytest.raises(ValueError, match=r"Invalid decoupled_weight_decay=True: .*AdamW"):
        Adam(matrices(), decoupled_weight_decay=True)
