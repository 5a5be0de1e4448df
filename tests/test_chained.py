"""ChainedOptimizer is a whole torch.optim.Optimizer, and its step is atomic across members."""

import copy

import pytest
import torch

from optbook.contract import NonFiniteGradientError
from optbook.optim import SGD, AdamW, ChainedOptimizer, Muon


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    matrices = [torch.randn(4, 3, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2)]
    vectors = [torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()]
    for p in matrices + vectors:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
    return matrices, vectors


def chain_of(matrices, vectors, **kwargs):
    return ChainedOptimizer([Muon(matrices, lr=0.02, ns_dtype=torch.float64),
                             AdamW(vectors, lr=1e-2, weight_decay=0.1)], **kwargs)


def snapshot(opt, params):
    return copy.deepcopy(([p.detach().clone() for p in params], opt.state_dict()))


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for key, value in sa["state"][k].items():
            other = sb["state"][k][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def test_step_and_state_dict_hooks_run():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd_post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd_pre", "sd_post", "load_pre", "load_post"]


def test_state_dict_has_torch_layout_and_resumes_bit_identically():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    opt.step()
    saved = opt.state_dict()
    assert set(saved) == {"state", "param_groups"}
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2]]  # one numbering over all groups
    assert set(saved["state"][0]) == {"momentum_buffer"} and set(saved["state"][2]) >= {"exp_avg", "exp_avg_sq"}
    m2, v2 = problem()
    for a, b in zip(m2 + v2, matrices + vectors):
        a.data.copy_(b.detach())
    resumed = chain_of(m2, v2)
    resumed.load_state_dict(saved)
    opt.step()
    resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(m2 + v2, matrices + vectors))
    resumed.step()  # the loaded state is a copy: stepping one chain leaves the other's state alone
    assert not torch.equal(opt.state[matrices[0]]["momentum_buffer"], resumed.state[m2[0]]["momentum_buffer"])
    with pytest.raises(ValueError, match="param_groups"):
        opt.load_state_dict({"state": {}, "param_groups": saved["param_groups"][:1]})


def test_state_view_reads_and_writes_the_owning_member():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    opt.state[vectors[0]]["note"] = 1
    assert opt.optimizers[1].state[vectors[0]]["note"] == 1
    opt.state[matrices[0]] = {"momentum_buffer": torch.ones(4, 3, dtype=torch.float64)}
    assert torch.equal(opt.optimizers[0].state[matrices[0]]["momentum_buffer"], torch.ones(4, 3, dtype=torch.float64))
    assert len(opt.state) == 2 and set(map(id, opt.state)) == {id(vectors[0]), id(matrices[0])}
    with pytest.raises(KeyError):
        opt.state[torch.zeros(1)]


def test_add_param_group_goes_to_the_named_member_and_is_stepped():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    extra_matrix = torch.ones(3, 3, dtype=torch.float64, requires_grad=True)
    extra_vector = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="optimizer"):
        opt.add_param_group({"params": [extra_vector]})  # two members: which one?
    with pytest.raises(ValueError, match="already"):
        opt.add_param_group({"params": [vectors[0]]}, optimizer=1)
    opt.add_param_group({"params": [extra_matrix]}, optimizer=0)
    opt.add_param_group({"params": [extra_vector], "lr": 0.5}, optimizer=opt.optimizers[1])
    assert len(opt.param_groups) == 4 and opt.optimizers[1].param_groups[-1]["lr"] == 0.5
    extra_matrix.grad = torch.eye(3, dtype=torch.float64)
    extra_vector.grad = torch.ones(2, dtype=torch.float64)
    opt.step()
    assert not torch.equal(extra_matrix.detach(), torch.ones(3, 3, dtype=torch.float64))
    assert not torch.equal(extra_vector.detach(), torch.ones(2, dtype=torch.float64))


def test_one_cycle_lr_with_momentum_cycling_drives_every_member():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    assert "momentum" in opt.defaults and "betas" not in opt.defaults  # members mix the two keys
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 1e-2], total_steps=10)
    for _ in range(3):
        opt.step()
        sched.step()
    muon_group, adamw_group = opt.param_groups
    assert muon_group["momentum"] == adamw_group["momentum"] < 0.95  # cycled down from max_momentum
    opt.step()  # the chain copies the cycled momentum into AdamW's beta1 before stepping
    assert adamw_group["betas"] == (adamw_group["momentum"], 0.999)
    same = ChainedOptimizer([AdamW(vectors), AdamW([matrices[0]])])  # one key: torch's usual behaviour
    assert "betas" in same.defaults
    torch.optim.lr_scheduler.OneCycleLR(same, max_lr=0.01, total_steps=10)
    assert all(g["betas"][0] == 0.95 for g in same.param_groups)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_nonfinite_gradient_in_any_member_raises_naming_it_before_any_member_writes(max_grad_norm):
    for bad, kind in ((float("inf"), "inf"), (float("nan"), "NaN")):
        matrices, vectors = problem()
        opt = chain_of(matrices, vectors, max_grad_norm=max_grad_norm)
        opt.step()
        vectors[0].grad[1] = bad  # in the second member: the first (Muon) must not step either
        grads = [p.grad.clone() for p in matrices + vectors]
        before = snapshot(opt, matrices + vectors)
        norm = opt.last_grad_norm
        with pytest.raises(NonFiniteGradientError, match=rf"param_groups\[1\]\['params'\]\[0\] .*{kind}"):
            opt.step()
        assert_same(before, snapshot(opt, matrices + vectors))
        assert all(torch.equal(p.grad.nan_to_num(), g.nan_to_num()) for p, g in zip(matrices + vectors, grads))   # gradients not clipped either
        assert opt.last_grad_norm == norm and not opt.found_inf and opt.skipped_steps == 0
        vectors[0].grad[1] = 0.0
        assert opt.step() is None
        assert not torch.equal(matrices[0].detach(), before[0][0])
    # a torch.optim member is covered by the same check
    matrices, vectors = problem()
    opt = ChainedOptimizer([Muon(matrices, ns_dtype=torch.float64), torch.optim.AdamW(vectors)])
    vectors[0].grad[0] = float("inf")
    before = snapshot(opt, matrices + vectors)
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[1\]"):
        opt.step()
    assert_same(before, snapshot(opt, matrices + vectors))


def test_the_members_do_not_check_again_and_their_own_check_is_back_after_the_step():
    matrices, vectors = problem()
    muon, adamw = Muon(matrices, ns_dtype=torch.float64), AdamW(vectors)
    opt = ChainedOptimizer([muon, adamw])
    seen = []
    for member in (muon, adamw):   # the chain validated each member once before any stepped (optbook.wrapper)
        member.register_step_pre_hook(lambda o, a, k: seen.append(getattr(o, "_validated_by_caller", False)))
    opt.step()
    assert seen == [True, True] and muon.refuse_nonfinite_grads and adamw.refuse_nonfinite_grads
    assert not hasattr(muon, "_validated_by_caller") and not hasattr(adamw, "_validated_by_caller")
    vectors[0].grad[0] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        adamw.step()   # stepped alone, a member checks for itself


def test_step_returns_the_closures_loss_and_reports_the_norm_as_a_float():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    assert opt.last_grad_norm is None and opt.found_inf is False and opt.skipped_steps == 0
    assert opt.step(lambda: torch.tensor(2.5)).item() == 2.5
    total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in matrices + vectors])).item()
    assert isinstance(opt.last_grad_norm, float) and opt.last_grad_norm == pytest.approx(total, rel=1e-12)


def _bad_chain_dicts(saved):
    no_state = {"param_groups": saved["param_groups"]}
    fewer_groups = {**saved, "param_groups": saved["param_groups"][:1]}
    fewer_params = copy.deepcopy(saved)
    fewer_params["param_groups"][0]["params"] = [0]
    short = copy.deepcopy(saved)
    short["state"][2]["exp_avg"] = short["state"][2]["exp_avg"][:2]       # the last member's state
    wrong_dtype = copy.deepcopy(saved)
    wrong_dtype["state"][0]["momentum_buffer"] = wrong_dtype["state"][0]["momentum_buffer"].float()
    bad_lr = copy.deepcopy(saved)
    bad_lr["param_groups"][1]["lr"] = -1.0
    stray = copy.deepcopy(saved)
    stray["state"][7] = {"momentum_buffer": torch.zeros(4, 3, dtype=torch.float64)}
    missing = copy.deepcopy(saved)
    del missing["state"][2]["exp_avg_sq"]
    return [(no_state, ValueError, "no 'state'"), (fewer_groups, ValueError, "param_groups"),
            (fewer_params, ValueError, "parameters"), (short, ValueError, r"state\[2\]\['exp_avg'\] \(param_groups\[1\]\['params'\]\[0\].*shape \(2,\).*member 1"),
            (wrong_dtype, ValueError, r"momentum_buffer.*float32.*member 0"), (bad_lr, ValueError, r"param_groups\[1\]: Invalid lr.*member 1"),
            (stray, ValueError, "no group lists"), (missing, ValueError, "exp_avg_sq"),
            ([1, 2], TypeError, "dict")]


def test_a_bad_load_raises_and_leaves_every_member_untouched():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    opt.step()
    saved = opt.state_dict()
    m2, v2 = problem(1)
    other = chain_of(m2, v2)
    other.step()
    for bad, error, words in _bad_chain_dicts(saved):
        before = snapshot(other, m2 + v2)
        with pytest.raises(error, match=words):
            other.load_state_dict(bad)
        assert_same(before, snapshot(other, m2 + v2))
    other.load_state_dict(saved)   # the good dict still loads
    assert_same(snapshot(other, []), snapshot(opt, []))


def test_a_bad_load_into_a_chain_with_a_torch_member_leaves_it_untouched():
    matrices, vectors = problem()
    opt = ChainedOptimizer([Muon(matrices, ns_dtype=torch.float64), torch.optim.AdamW(vectors)])
    opt.step()
    saved = opt.state_dict()
    bad = copy.deepcopy(saved)
    bad["state"][2]["exp_avg"] = torch.zeros(5, dtype=torch.float64)
    before = snapshot(opt, matrices + vectors)
    # named by the chain dict's indices (the member's own would be state[0])
    with pytest.raises(ValueError, match=r"state\[2\]\['exp_avg'\].*member 1"):
        opt.load_state_dict(bad)
    assert_same(before, snapshot(opt, matrices + vectors))


def test_bad_hyperparameter_in_a_later_member_raises_before_the_first_member_writes():
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    opt.step()
    before = snapshot(opt, matrices + vectors)
    opt.optimizers[1].param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    after = snapshot(opt, matrices + vectors)
    after[1]["param_groups"][1]["lr"] = before[1]["param_groups"][1]["lr"]
    assert_same(before, after)


def test_an_invalid_gradient_in_a_later_member_is_named_by_the_chains_index_and_member():
    # the member's own message says param_groups[0]; the chain's param_groups[0] is Muon's group
    matrices, vectors = problem()
    opt = chain_of(matrices, vectors)
    opt.step()
    before = snapshot(opt, matrices + vectors)
    grad = vectors[0].grad
    vectors[0].grad.data = grad.float()   # autograd refuses to assign a gradient of another dtype
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[0\].*\(member 1, AdamW, of the chain\)"):
        opt.step()
    vectors[0].grad.data = grad
    assert_same(before, snapshot(opt, matrices + vectors))
    opt.optimizers[1].param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"lr.*\(member 1, AdamW, of the chain\)"):
        opt.step()


def test_global_clip_is_one_norm_over_all_members():
    matrices, vectors = problem()
    grads = [p.grad.clone() for p in matrices + vectors]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    opt = ChainedOptimizer([SGD(matrices, lr=0.0), SGD(vectors, lr=0.0)], max_grad_norm=1.0)
    opt.step()
    assert opt.last_grad_norm == pytest.approx(float(total), rel=1e-12)
    for p, g in zip(matrices + vectors, grads):  # every member's gradients scaled by the same factor
        torch.testing.assert_close(p.grad, g / (float(total) + 1e-6), rtol=1e-12, atol=0)


def test_a_mixed_precision_member_is_refused_and_an_offload_member_validates_before_any_member_writes():
    from optbook.memory import OffloadOptimizer
    from optbook.precision import MixedPrecisionOptimizer

    W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    # the masters' gradients exist only inside the member's own step: the chain could not check them
    with pytest.raises(TypeError, match="element 1 is a MixedPrecisionOptimizer.*wrap the chain instead"):
        ChainedOptimizer([Muon([W], ns_dtype=torch.float64), MixedPrecisionOptimizer(AdamW([b]))])
    offload = OffloadOptimizer([b], AdamW, lr=0.1)
    opt = ChainedOptimizer([Muon([W], lr=0.02, ns_dtype=torch.float64), offload])
    W.grad, b.grad = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    opt.step()
    before = snapshot(opt, [W, b])
    offload.param_groups[0]["lr"] = -1.0     # the second member's option: Muon used to step first
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    b.grad[0] = float("nan")                   # the second member's gradient
    offload.param_groups[0]["lr"] = 0.1
    with pytest.raises(ValueError, match="Non-finite"):
        opt.step()
    assert_same(before, snapshot(opt, [W, b]))
