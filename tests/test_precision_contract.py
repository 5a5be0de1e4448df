"""MixedPrecisionOptimizer under the step contract: it owns the masters (QK-clip and outside writes are kept),
loads all-or-nothing, is a full torch.optim.Optimizer, and its loss scale stays in float32's range."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from optbook import contract, qk_clip_
from optbook.models import TinyTransformer
from optbook.optim import SGD, AdamW, ChainedOptimizer, Muon
from optbook.precision import (FLOAT32_MAX, ConstantLossScaler, DynamicLossScaler, MixedPrecisionOptimizer,
                               unscale_grads_)
from helpers import scaled_timeout

TAU = 5.0


def loud_bf16_model(seed=0):
    """A bfloat16 TinyTransformer whose attention logits exceed TAU in every head but head 0 of each layer."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab_size=16, d_model=32, n_layers=2, max_seq_len=16, n_heads=4)
    with torch.no_grad():
        for attn in model.attention_layers():
            attn.q_proj.weight.mul_(60.0)
            attn.k_proj.weight.mul_(60.0)
            attn.q_proj.weight[: attn.d_head].mul_(0.01)
    return model.to(torch.bfloat16)


def tokens(k):
    return torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(100 + k))


def backward(model, opt, k):
    model.train()
    x = tokens(k)
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    opt.scale_loss(loss).backward()
    return loss


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# --- QK-clip and outside writes are not undone ------------------------------------------------------------

def test_qk_clip_is_kept_by_the_next_step_with_lr_0():
    model = loud_bf16_model()
    opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=0.0, weight_decay=0.0))
    backward(model, opt, 0)
    before = model.max_logits().clone()
    assert (before > TAU).any()
    opt.step()
    report = qk_clip_(model, tau=TAU)
    assert report
    clipped = params_of(model)
    # the clip scaled the float32 masters; the model holds them rounded
    masters = dict(zip((id(p) for p, _ in opt._pairs), opt.master_params()))
    assert all(torch.equal(p.detach(), masters[id(p)].bfloat16()) for p in model.parameters())
    opt.zero_grad()
    backward(model, opt, 0)                 # the forward after the clip sees clipped logits
    after_clip = model.max_logits().clone()
    opt.step()                              # lr = 0: nothing may move, the clip included
    assert same(params_of(model), clipped)
    opt.zero_grad()
    backward(model, opt, 0)
    after_step = model.max_logits().clone()
    assert torch.equal(after_step, after_clip)
    # layer 0 sees the same input as before the clip: its heads are at most tau (layer 1's input moved)
    assert after_step[0].max() <= TAU * (1 + 2**-6) < before[0].max()


@pytest.mark.parametrize("model_first", [True, False])
def test_resume_with_qk_clip_is_bit_identical(model_first):
    def build(seed):
        model = loud_bf16_model(seed)
        opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                      DynamicLossScaler(initial_scale=2.0**8, growth_interval=2, hysteresis=2))
        return model, opt

    def run(model, opt, ks):
        for k in ks:
            opt.zero_grad()
            backward(model, opt, k)
            opt.step()
            qk_clip_(model, tau=TAU)

    model, opt = build(0)
    run(model, opt, range(6))

    model_a, opt_a = build(0)
    run(model_a, opt_a, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "optimizer": opt_a.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer)
    model_b, opt_b = build(1)   # other initial weights: everything must come from the checkpoint
    if model_first:
        model_b.load_state_dict(ckpt["model"])
        opt_b.load_state_dict(ckpt["optimizer"])
    else:                       # the weights-only load after the optimizer's rewrites the same values
        opt_b.load_state_dict(ckpt["optimizer"])
        model_b.load_state_dict(ckpt["model"])
    run(model_b, opt_b, range(3, 6))

    assert same(params_of(model_b), params_of(model))
    assert same(opt_b.master_params(), opt.master_params())
    assert opt_b.loss_scaler.state_dict() == opt.loss_scaler.state_dict()


def test_weights_loaded_after_construction_are_kept_by_the_step():
    lin = torch.nn.Linear(3, 2, bias=False).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(SGD(lin.parameters(), lr=0.5))
    lin.load_state_dict({"weight": torch.full((2, 3), 5.0, dtype=torch.bfloat16)})
    lin.weight.grad = torch.ones(2, 3, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(lin.weight.detach(), torch.full((2, 3), 4.5, dtype=torch.bfloat16))
    assert torch.equal(opt.master_params()[0], torch.full((2, 3), 4.5))


def test_an_in_place_edit_is_taken_up_element_by_element():
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([p], lr=1e-3))
    p.grad = torch.full((3,), -1.0, dtype=torch.bfloat16)
    opt.step()                                      # master 1e-3, model 1e-3 rounded to bf16
    master = opt.master_params()[0]
    low_bits = master[0].item()
    with torch.no_grad():
        p[2] = 7.0                                  # an edit of one element
    opt.step()
    # untouched elements keep the master's low bits; the edited one starts from 7.0
    assert master[0].item() == pytest.approx(low_bits + 1e-3, rel=1e-6) and master[1].item() == master[0].item()
    assert master[2].item() == pytest.approx(7.0 + 1e-3, rel=1e-6)


def test_scale_weights_goes_through_the_master():
    p = torch.ones(2, 2, dtype=torch.bfloat16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([p], lr=1e-3))
    assert contract.owner_of(p) is opt
    p.grad = torch.full((2, 2), -1.0, dtype=torch.bfloat16)
    opt.step()
    m = opt.master_params()[0].clone()
    contract.scale_weights_(p, torch.tensor([[0.5], [1.0]]))
    assert torch.equal(opt.master_params()[0], m * torch.tensor([[0.5], [1.0]]))
    assert torch.equal(p.detach(), opt.master_params()[0].bfloat16())


# --- loads are all-or-nothing ----------------------------------------------------------------------------------

def _run_a_bit(params, opt, steps=2):
    for k in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (i + k + 1))
        opt.step()


def _frozen(params, opt):
    return ([p.detach().clone() for p in params], [m.detach().clone() for m in opt.master_params()],
            copy.deepcopy(opt.optimizer.state_dict()), opt.skipped_steps)


def _assert_frozen(params, opt, before):
    after = _frozen(params, opt)
    assert same(after[0], before[0]) and same(after[1], before[1]) and after[3] == before[3]
    a, b = after[2], before[2]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w


def _mp(shapes, dtype=torch.bfloat16, groups=1):
    params = [torch.ones(s, dtype=dtype, requires_grad=True) for s in shapes]
    spec = [{"params": params}] if groups == 1 else [{"params": params[:1]}, {"params": params[1:]}]
    return params, MixedPrecisionOptimizer(AdamW(spec, lr=0.1, weight_decay=0.1))


def _wrong_dtype(sd):
    sd = copy.deepcopy(sd)
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].long()
    return sd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("other, edit, match", [
    (dict(shapes=[(3, 2), (3,)]), None, "shape"),                     # a model of other shapes
    (dict(shapes=[(2, 3)]), None, "master parameters|has 1 parameters"),  # another parameter count
    (dict(shapes=[(2, 3), (3,)], groups=2), None, "param_groups"),       # another group layout
    (dict(shapes=[(2, 3), (3,)]), _wrong_dtype, "dtype torch.int64"),   # a state tensor of the wrong dtype
])
def test_a_load_that_does_not_fit_raises_before_anything_is_written(dtype, other, edit, match):
    params, opt = _mp([(2, 3), (3,)], dtype)
    _run_a_bit(params, opt)
    src_params, src = _mp(other["shapes"], dtype, other.get("groups", 1))
    _run_a_bit(src_params, src, 3)
    sd = src.state_dict()
    if edit is not None:
        params_b, opt_b = _mp([(2, 3), (3,)], dtype)
        _run_a_bit(params_b, opt_b, 3)
        sd = edit(opt_b.state_dict())
    before = _frozen(params, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    _assert_frozen(params, opt, before)
    _run_a_bit(params, opt, 1)  # and it still steps: the step count is 3, not 4 of a half-loaded state
    assert all(s["step"] == 3 for s in opt.state.values())


def test_a_state_dict_without_skipped_steps_loads():
    params, opt = _mp([(2,)])
    _run_a_bit(params, opt)
    sd = opt.state_dict()
    del sd["skipped_steps"]
    params2, opt2 = _mp([(2,)])
    opt2.load_state_dict(sd)
    assert opt2.skipped_steps == 0 and same(opt2.master_params(), opt.master_params())


# --- a full torch.optim.Optimizer ------------------------------------------------------------------------------

def test_state_dict_and_load_hooks_run():
    params, opt = _mp([(2,)])
    _run_a_bit(params, opt)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "note": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load-pre", sd.get("note"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    sd = opt.state_dict()
    assert sd["note"] == 1 and calls == ["pre"]
    opt.load_state_dict(sd)
    assert calls == ["pre", ("load-pre", 1), "load-post"]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_steps_like_the_original_and_owns_its_own_parameters(how):
    params, opt = _mp([(2, 3), (3,)])
    opt.loss_scaler = DynamicLossScaler(initial_scale=2.0**4)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)  # it wraps opt.step: the copy must step itself
    _run_a_bit(params, opt)
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    twin_params = [p for p, _ in twin._pairs]
    assert all(a is not b for a, b in zip(twin_params, params))
    assert all(contract.owner_of(p) is twin for p in twin_params) and contract.owner_of(params[0]) is opt
    _run_a_bit(params, opt, 2)
    _run_a_bit(twin_params, twin, 2)
    assert same([p.detach() for p in twin_params], [p.detach() for p in params])
    assert same(twin.master_params(), opt.master_params())
    assert twin.loss_scaler.state_dict() == opt.loss_scaler.state_dict()


def test_add_param_group_over_a_chain_routes_to_the_named_member():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 3, generator=g).bfloat16().requires_grad_()
    v = torch.randn(3, generator=g).bfloat16().requires_grad_()
    new = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    chain = ChainedOptimizer([Muon([W], lr=0.02, ns_dtype=torch.float32), AdamW([v], lr=0.1, weight_decay=0.0)])
    opt = MixedPrecisionOptimizer(chain)
    with pytest.raises(ValueError, match="pass optimizer="):
        opt.add_param_group({"params": [new]})
    assert len(opt.master_params()) == 2 and len(opt.param_groups) == 2
    opt.add_param_group({"params": [new]}, optimizer=1)
    assert len(chain.optimizers[1].param_groups) == 2 and len(opt.master_params()) == 3
    for p in (W, v, new):
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(new.detach(), torch.full((3,), 0.8984375, dtype=torch.bfloat16))  # 1 - 0.1, in bf16
    plain = MixedPrecisionOptimizer(SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(ValueError, match="Invalid optimizer: it names the member of a ChainedOptimizer"):
        plain.add_param_group({"params": [torch.ones(1, requires_grad=True)]}, optimizer=0)


# --- a step with no gradient and the loss scale -------------------------------------------------------------

def test_a_step_without_any_gradient_does_not_grow_the_scale():
    p = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([p], lr=0.1), DynamicLossScaler(initial_scale=4.0, growth_interval=1))
    for _ in range(3):
        assert opt.step() is None
    assert opt.loss_scale == 4.0 and opt.loss_scaler.growth_tracker == 0
    assert opt.found_inf is False and opt.skipped_steps == 0 and torch.equal(p, torch.ones(2, dtype=torch.bfloat16))
    p.grad = torch.ones(2, dtype=torch.bfloat16) * 4
    opt.step()
    assert opt.loss_scale == 8.0  # one clean step with growth_interval=1


def test_the_loss_scale_stops_at_float32s_range_as_torch_grad_scaler():
    # torch.amp.GradScaler's kernel (_amp_update_scale_) on a float32 scale: the same sequence of scales
    ref = torch.tensor([2.0**124], dtype=torch.float32)
    tracker, found = torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    scaler = DynamicLossScaler(initial_scale=2.0**124, growth_interval=1)
    p = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([p], lr=0.0), scaler)
    scales = []
    for _ in range(8):
        opt.zero_grad()
        opt.scale_loss((p.float() * 0.25).sum()).backward()  # gradient 0.25 S: finite up to S = 2**129
        opt.step()
        torch._amp_update_scale_(ref, tracker, found, 2.0, 0.5, 1)
        scales.append(opt.loss_scale)
        assert opt.loss_scale == ref.item()
    assert scales == [2.0**125, 2.0**126, 2.0**127] + [2.0**127] * 5
    assert opt.skipped_steps == 0 and opt.loss_scale <= FLOAT32_MAX


@pytest.mark.parametrize("make", [lambda s: DynamicLossScaler(initial_scale=s), lambda s: ConstantLossScaler(s)])
def test_a_scale_beyond_float32_is_refused(make):
    with pytest.raises(ValueError, match="scale"):
        make(2.0**128)
    with pytest.raises(ValueError, match="state_dict\\['scale'\\]"):
        DynamicLossScaler().load_state_dict({"scale": 2.0**200, "growth_tracker": 0, "hysteresis_tracker": 2})


def test_unscale_grads_divides_and_reports_in_one_pass():
    grads = [torch.full((3,), 8.0), torch.full((2, 2), 4.0, dtype=torch.float64), torch.empty(0)]
    assert unscale_grads_(grads, 4.0) is False
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[1], torch.ones(2, 2, dtype=torch.float64))
    bad = [torch.tensor([1.0, float("nan")])]
    assert unscale_grads_(bad, 2.0) is True
    assert unscale_grads_([], 2.0) is False


def test_without_a_scaler_a_nonfinite_float32_gradient_is_named():
    a = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    c = torch.ones(3, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([{"params": [a]}, {"params": [c]}], lr=0.1))
    a.grad = torch.ones(2, dtype=torch.bfloat16)
    c.grad = torch.tensor([1.0, float("inf"), 0.0])
    with pytest.raises(contract.NonFiniteGradientError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(3,\)"):
        opt.step()
    assert torch.equal(c.detach(), torch.ones(3)) and torch.equal(a, torch.ones(2, dtype=torch.bfloat16))
    assert opt.master_params()[0].grad is None


@pytest.mark.parametrize("wrap", ["mixed precision", "offload"])
def test_replacing_a_parameters_data_is_taken_up(wrap):
    # `p.data = other` bumps no version counter; the owner sees the new data address
    from optbook.memory import OffloadOptimizer

    lin = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    opt = (MixedPrecisionOptimizer(SGD(lin.parameters(), lr=0.5)) if wrap == "mixed precision"
           else OffloadOptimizer(lin.parameters(), SGD, lr=0.5))
    lin.weight.grad = torch.zeros(4, 4, dtype=torch.bfloat16)
    opt.step()
    lin.weight.data = torch.full((4, 4), 7.0, dtype=torch.bfloat16)
    lin.weight.grad = torch.ones(4, 4, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(lin.weight.detach(), torch.full((4, 4), 6.5, dtype=torch.bfloat16))


def test_a_bad_option_of_a_chain_member_is_refused_before_the_scaler_moves():
    from optbook.optim import AdamW, ChainedOptimizer
    from optbook.precision import DynamicLossScaler

    w, b = (torch.ones(4, 4, dtype=torch.bfloat16, requires_grad=True),
            torch.ones(4, dtype=torch.bfloat16, requires_grad=True))
    mp = MixedPrecisionOptimizer(ChainedOptimizer([SGD([w], lr=0.1), AdamW([b], lr=0.1)]), DynamicLossScaler())
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    mp.step()
    mp.param_groups[1]["lr"] = float("nan")
    before = (copy.deepcopy(mp.loss_scaler.state_dict()), w.detach().clone(), b.detach().clone())
    for _ in range(3):
        with pytest.raises(ValueError, match="lr"):
            mp.step()
    assert mp.loss_scaler.state_dict() == before[0]
    assert torch.equal(w.detach(), before[1]) and torch.equal(b.detach(), before[2])


@pytest.mark.parametrize("chain", [False, True])
def test_add_param_group_refuses_a_parameter_the_wrapper_already_steps(chain):
    from optbook.optim import ChainedOptimizer

    w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    inner = ChainedOptimizer([SGD([w], lr=0.5)]) if chain else SGD([w], lr=0.5)
    mp = MixedPrecisionOptimizer(inner)
    with pytest.raises(ValueError, match="already stepped by this wrapper"):
        mp.add_param_group({"params": [w]}, **({"optimizer": 0} if chain else {}))
    assert len(mp.master_params()) == 1 and len(mp.param_groups) == 1


def test_an_optimizer_is_wrapped_once():
    w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    inner = SGD([w], lr=0.5)
    MixedPrecisionOptimizer(inner)
    with pytest.raises(ValueError, match="another MixedPrecisionOptimizer already wraps it"):
        MixedPrecisionOptimizer(inner)


@pytest.mark.parametrize("bad, words", [(lambda m: m.to(torch.bfloat16), "expected a torch.float32"),
                                        (lambda m: m.double(), "expected a torch.float32"),
                                        (lambda m: torch.full_like(m, float("nan")), "inf or NaN")])
def test_a_master_of_another_dtype_or_not_finite_is_refused_on_load(bad, words):
    w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    opt = MixedPrecisionOptimizer(SGD([w], lr=0.5))
    w.grad = torch.ones_like(w)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["master_param"] = bad(saved["state"][0]["master_param"])   # optbook.masters' layout
    before = opt.master_params()[0].clone()
    with pytest.raises(ValueError, match=words):
        opt.load_state_dict(saved)
    assert torch.equal(opt.master_params()[0], before)


def test_an_inner_optimizer_that_steps_its_own_copy_of_the_weights_is_refused():
    # its step would leave the float32 masters as they were, and the wrapper would write them back over
    # the update (OffloadOptimizer: weights moved 0 instead of the plain run's step)
    from optbook.memory import OffloadOptimizer

    W = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    for inner in (lambda: OffloadOptimizer([W], AdamW, lr=0.1),
                  lambda: ChainedOptimizer([OffloadOptimizer([W], AdamW, lr=0.1)])):
        with pytest.raises(TypeError, match="OffloadOptimizer keeps its own copy of the weights"):
            MixedPrecisionOptimizer(inner())
    MixedPrecisionOptimizer(AdamW([W]))   # wrapping the same model again with a fresh optimizer is fine
    MixedPrecisionOptimizer(AdamW([W]))


def test_distributed_optimizers_are_refused_inside_mixed_precision_and_a_chain():
    from contract_workers import refused_compositions
    from optbook.distributed import launch

    out = launch(refused_compositions, 1, timeout=scaled_timeout(60.0))[0]
    for name in ("LayerWiseMuon", "DistributedOptimizer"):
        assert f"Invalid optimizer: {name} " in out[f"MixedPrecisionOptimizer({name})"]
        assert "instead of the tensors in its param_groups" in out[f"MixedPrecisionOptimizer({name})"]
        assert "DistributedChain" in out[f"ChainedOptimizer({name})"]


def test_a_float64_parameter_with_state_dtype_resumes_from_the_wrappers_own_state_dict():
    # the stored state went back to float32 for every parameter; the float64 one's check then refused it
    for state_dtype in (torch.bfloat16, torch.float32):
        def build():
            torch.manual_seed(0)
            a = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
            b = torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))
            return [a, b], MixedPrecisionOptimizer(AdamW([a, b], lr=0.1), state_dtype=state_dtype)

        g = torch.Generator().manual_seed(1)
        grads = [[torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g).bfloat16()]
                 for _ in range(4)]
        ps, opt = build()
        for t in range(4):
            if t == 2:
                saved, weights = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in ps]
            for p, gr in zip(ps, grads[t]):
                p.grad = gr.clone()
            opt.step()
        ps2, opt2 = build()
        with torch.no_grad():
            ps2[0].copy_(weights[0])   # the float64 parameter is the model's own (no master)
        opt2.load_state_dict(saved)
        assert all(v.dtype == state_dtype for s in opt2.state.values() for k, v in s.items()
                   if torch.is_tensor(v) and k != "step")
        for t in (2, 3):
            for p, gr in zip(ps2, grads[t]):
                p.grad = gr.clone()
            opt2.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, ps2))


@pytest.mark.parametrize("scaler", [None, DynamicLossScaler])
def test_a_float32_parameters_sparse_gradient_is_named_before_anything_changes(scaler):
    # was an unnamed NotImplementedError from the norm kernel (the check looked at bfloat16 parameters only)
    emb = torch.nn.Embedding(5, 3, sparse=True)
    lin = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(AdamW([*emb.parameters(), *lin.parameters()]),
                                  scaler() if scaler else None)
    out = lin(emb(torch.tensor([1, 2])).to(torch.bfloat16)).float().sum()
    out.backward()
    before = [p.detach().clone() for p in (*emb.parameters(), *lin.parameters())]
    scale = opt.loss_scale
    with pytest.raises(TypeError, match=r"model parameter 0 \(float32\) \(shape \(5, 3\)\): sparse"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip((*emb.parameters(), *lin.parameters()), before))
    assert opt.loss_scale == scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 3.0, 65536.0, 0.125])
def test_the_unfused_unscale_for_bfloat16_on_gpus_equals_torchs_fused_kernel(dtype, scale):
    """bfloat16 gradients on a GPU cannot use torch's fused unscale (no CUDA bfloat16 kernel); the plain
    operations that replace it give the fused kernel's bits and flag, compared here on the CPU."""
    from optbook.precision import _unscale_unfused_

    gen = torch.Generator().manual_seed(0)
    cases = [[(torch.randn(70000, generator=gen) * 300).to(dtype), torch.randn(3, 5, generator=gen).to(dtype)],
             [torch.randn(9, generator=gen).to(dtype), torch.tensor([1.0, float("inf"), float("nan")]).to(dtype)],
             [torch.empty(0, dtype=dtype)]]
    for grads in cases:
        fused, plain = [g.clone() for g in grads], [g.clone() for g in grads]
        found_fused, found_plain = torch.zeros(1), torch.zeros(1)
        inv = torch.full((1,), 1.0 / scale)
        torch._amp_foreach_non_finite_check_and_unscale_(fused, found_fused, inv)
        _unscale_unfused_(plain, found_plain, inv)
        assert torch.equal(found_fused, found_plain)
        for a, b in zip(fused, plain):
            assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
