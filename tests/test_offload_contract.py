"""OffloadOptimizer under the step contract: it owns its host copies (outside writes and QK-clip are kept),
raises on a non-finite gradient, and loads all-or-nothing."""

import copy

import pytest
import torch

from optbook import contract, qk_clip_
from optbook.memory import OffloadOptimizer
from optbook.optim import SGD, AdamW

from test_precision_contract import TAU, backward, loud_bf16_model, params_of, same

BF16, F32 = torch.bfloat16, torch.float32


def mlp(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def grads(model, k=0):
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.25 * (i + 1 + k))


def frozen(model, opt):
    return (params_of(model), [m.detach().clone() for m in opt.master_params()], copy.deepcopy(opt.state_dict()))


def assert_frozen(model, opt, before):
    after = frozen(model, opt)
    assert same(after[0], before[0]) and same(after[1], before[1])
    a, b = after[2], before[2]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_weights_loaded_after_construction_are_kept(dtype, fraction):
    model = mlp(dtype)
    opt = OffloadOptimizer(model.parameters(), SGD, offload_fraction=fraction, lr=0.5)
    assert all(contract.owner_of(p) is opt for p in opt._inner)
    model.load_state_dict({k: torch.full_like(v, 5.0) for k, v in model.state_dict().items()})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for p in model.parameters():
        assert torch.equal(p.detach(), torch.full_like(p, 4.5))


def test_qk_clip_is_not_undone_by_the_next_step():
    model = loud_bf16_model()
    opt = OffloadOptimizer(model.parameters(), AdamW, offload_fraction=0.5, lr=0.0, weight_decay=0.0)
    backward(model, _Unscaled, 0)
    opt.step()
    assert qk_clip_(model, tau=TAU)
    clipped = params_of(model)
    for p, copy_ in opt._inner.items():   # the copies were scaled, the model written from them
        assert torch.equal(p.detach(), copy_.to(p.dtype))
    opt.zero_grad()
    backward(model, _Unscaled, 0)
    opt.step()
    assert same(params_of(model), clipped)


class _Unscaled:
    """``backward`` of test_precision_contract wants an object with ``scale_loss``: no scaling here."""

    @staticmethod
    def scale_loss(loss):
        return loss


def test_a_nonfinite_gradient_raises_naming_the_parameter_and_writes_nothing():
    model = mlp(BF16)
    opt = OffloadOptimizer(model.parameters(), AdamW, offload_fraction=0.5, lr=0.1)
    grads(model)
    assert opt.step() is None and opt.found_inf is False and opt.skipped_steps == 0 and opt.last_grad_norm is None
    before = frozen(model, opt)
    grads(model, 1)
    list(model.parameters())[3].grad[1] = float("nan")
    with pytest.raises(contract.NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[3\] \(shape \(3,\)\)"):
        opt.step()
    assert_frozen(model, opt, before)


def _wrong_dtype(sd):
    sd = copy.deepcopy(sd)
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].to(torch.int64)
    return sd


def _other_groups(model):
    ps = list(model.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:]}]


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("source, edit, match", [
    (lambda d: torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)).to(d).parameters(), None,
     "shape"),                                                                   # a model of other shapes
    (lambda d: torch.nn.Linear(4, 8).to(d).parameters(), None, "param_groups"),  # another parameter count
    (lambda d: _other_groups(mlp(d)), None, "param_groups"),                     # another group layout
    (lambda d: mlp(d).parameters(), _wrong_dtype, "dtype torch.int64"),          # a state tensor's dtype
])
def test_a_load_that_does_not_fit_raises_before_anything_is_written(dtype, source, edit, match):
    model = mlp(dtype)
    opt = OffloadOptimizer(model.parameters(), AdamW, offload_fraction=0.5, lr=0.1, weight_decay=0.1)
    grads(model)
    opt.step()
    src_params = list(source(dtype))
    src = OffloadOptimizer(src_params, AdamW, offload_fraction=0.5, lr=0.1)
    for p in (q for g in src.param_groups for q in g["params"]):
        p.grad = torch.ones_like(p)
    src.step()
    src.step()
    sd = src.state_dict() if edit is None else edit(opt.state_dict())
    before = frozen(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_frozen(model, opt, before)
    grads(model, 1)
    opt.step()   # still steps from its own state: the step count is 2, not 3 of a half-loaded state
    assert all(int(s["step"]) == 2 for s in opt.state.values())


def test_skipped_steps_is_saved_and_an_old_dict_loads():
    model = mlp(F32)
    opt = OffloadOptimizer(model.parameters(), AdamW, offload_fraction=0.5, lr=0.1)
    grads(model)
    opt.step()
    sd = opt.state_dict()
    assert sd["skipped_steps"] == 0
    del sd["skipped_steps"]
    model2 = mlp(F32, seed=1)
    opt2 = OffloadOptimizer(model2.parameters(), AdamW, offload_fraction=0.5, lr=0.1)
    opt2.load_state_dict(sd)
    copied = [p is not q for p, q in zip(model.parameters(), [opt.copy_of(p) for p in model.parameters()])]
    assert opt2.skipped_steps == 0 and any(copied)   # the copies load (the other weights are the model's own)
    assert same([p for p, c in zip(params_of(model2), copied) if c], [p for p, c in zip(params_of(model), copied) if c])


@pytest.mark.parametrize("key, value", [("lr", float("nan")), ("betas", (0.9, 1.5))])
def test_a_state_dict_with_bad_hyperparameters_is_refused_before_anything_is_written(key, value):
    model = mlp(F32)
    opt = OffloadOptimizer(model.parameters(), AdamW, lr=1e-2)
    grads(model)
    opt.step()
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0][key] = value
    before = frozen(model, opt)
    with pytest.raises(ValueError, match=f"param_groups\\[0\\].*{key}"):
        opt.load_state_dict(bad)
    after = frozen(model, opt)
    assert same(before[0], after[0]) and same(before[1], after[1])
    assert opt.param_groups[0][key] != value
