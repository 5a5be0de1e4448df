"""optbook.memory: the predicted ledger (Megatron-LM's bytes-per-parameter table and worked example), bytes
measured from real optimizers (exact: byte counts are deterministic), and OffloadOptimizer (bitwise equal
to the step it offloads, one step count per parameter, no write on bad input).

References: Megatron-LM ``docs/source/api-guide/dist_optimizer.md`` (the table) and
``megatron/training/theoretical_memory_usage.py`` (the most-loaded model-parallel rank); single-process
``optbook.optim.AdamW`` / ``torch.optim.AdamW`` and ``MixedPrecisionOptimizer`` for the offloaded step.
"""

import copy

import pytest
import torch

from optbook.distributed import launch
from optbook.distributed.workers import memory_chapter
from optbook.memory import (MemoryConfig, OffloadOptimizer, ledger, measure, most_loaded_shard,
                            peak_device_bytes)
from optbook.optim import AdamW, ChainedOptimizer, Muon
from optbook.precision import MixedPrecisionOptimizer
from helpers import scaled_timeout

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


# --- the predicted ledger -------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 8, 64])   # powers of two: every 1/d below is exact in binary
def test_megatron_bytes_per_parameter_table(d):
    fp16 = dict(grad_dtype=torch.float16, param_dtype=torch.float16)
    rows = [(dict(), 18, 6 + 12 / d), (fp16, 20, 4 + 16 / d),
            (dict(param_dtype=F32), 16, 8 + 8 / d)]
    for cfg, ddp, zero1 in rows:
        assert ledger(1, dp=d, **cfg).bytes_per_param == ddp
        assert ledger(1, dp=d, sharding="zero1", **cfg).bytes_per_param == zero1


def test_components_of_bf16_adamw():
    led = ledger(1000, sharding="zero1", dp=4)
    assert [(c.name, c.bytes_per_param, c.divisor) for c in led.components] == [
        ("params", 2, 1), ("grads", 4, 1), ("master", 4, 4), ("main_grads", 0, 4), ("state", 8, 4)]
    assert led.total_bytes == 9000 and led.optimizer_state_bytes == 3000
    assert ledger(1, state_dtype=BF16).bytes_per_param == 2 + 4 + 4 + 4       # reduced-precision moments
    assert ledger(1, optimizer="muon").bytes_per_param == 2 + 4 + 4 + 4       # one momentum buffer
    # bfloat16 without masters: the state takes the parameters' dtype, there is no main gradient
    assert ledger(1, master_weights=False).bytes_per_param == 2 + 4 + 2 * 2
    assert ledger(1, master_weights=False, grad_dtype=BF16).bytes_per_param == 2 + 2 + 2 * 2
    assert ledger(1, param_dtype=F64).bytes_per_param == 8 + 8 + 2 * 8


def test_most_loaded_shard():
    # tied embedding on the first stage: ((7.5e9 - 0.5e9) / 2 + 0.5e9) / 2
    assert most_loaded_shard(7.5e9, tp=2, pp=2, embedding_params=0.5e9) == 2.0e9
    assert most_loaded_shard(7.5e9, tp=2, pp=2) == 1.875e9                    # uniform split
    assert most_loaded_shard(7.5e9, tp=2, pp=2, embedding_params=0.5e9, untied_embeddings=True) == 1.875e9
    assert most_loaded_shard(8e9, tp=2, pp=1, embedding_params=1e9, untied_embeddings=True) == 4e9


def test_megatron_worked_example():
    """P = 7.5e9, TP = 2, PP = 2, DP = 64; the fullest rank holds 2.0e9 parameters."""
    ex = dict(tp=2, pp=2, dp=64, embedding_params=0.5e9)
    assert ledger(7.5e9, **ex).optimizer_state_bytes == 24.0e9              # fp32 master + m + v, unsharded
    assert ledger(7.5e9, sharding="zero1", **ex).optimizer_state_bytes == 0.375e9
    assert ledger(7.5e9, optimizer="muon", **ex).optimizer_state_bytes == 16.0e9   # master + momentum
    assert ledger(7.5e9, optimizer="muon", adamw_fraction=0.125, **ex).optimizer_state_bytes == 17.0e9
    assert ledger(7.5e9, optimizer="muon", sharding="layerwise", **ex).optimizer_state_bytes == 0.25e9
    assert ledger(7.5e9, **ex).total_bytes == 36.0e9                         # 18 B x 2.0e9
    uniform = dict(tp=2, pp=2, dp=64)
    assert ledger(7.5e9, **uniform).optimizer_state_bytes == 22.5e9
    assert ledger(7.5e9, sharding="zero1", **uniform).optimizer_state_bytes == 0.3515625e9
    assert ledger(7.5e9, optimizer="muon", **uniform).optimizer_state_bytes == 15.0e9


def test_offload_moves_optimizer_rows_to_the_host():
    full = ledger(1000, offload_fraction=1.0)
    assert full.device_bytes == 6000 and full.host_bytes == 12000
    half = ledger(1000, offload_fraction=0.5, sharding="zero1", dp=2)
    assert half.device_bytes == 6000 + 3000 and half.host_bytes == 3000


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(optimizer="lamb"), ValueError, "optimizer"),
    (dict(sharding="zero2"), ValueError, "sharding"),
    (dict(optimizer="muon", sharding="zero1"), ValueError, "sharding"),
    (dict(dp=0), ValueError, "dp"),
    (dict(dp=2.0), TypeError, "dp"),
    (dict(param_dtype=torch.int32), ValueError, "param_dtype"),
    (dict(grad_dtype="bf16"), TypeError, "grad_dtype"),
    (dict(param_dtype=F32, master_weights=True), ValueError, "master_weights"),
    (dict(adamw_fraction=0.1), ValueError, "adamw_fraction"),
    (dict(optimizer="muon", adamw_fraction=1.5), ValueError, "adamw_fraction"),
    (dict(offload_fraction=-0.1), ValueError, "offload_fraction"),
])
def test_bad_configuration_is_named(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        ledger(10, **kwargs)


def test_bad_ledger_arguments():
    with pytest.raises(TypeError, match="config"):
        ledger(10, MemoryConfig(), dp=2)
    with pytest.raises(ValueError, match="embedding_params"):
        most_loaded_shard(1e9, embedding_params=0.6e9, untied_embeddings=True)
    with pytest.raises(ValueError, match="tp"):
        ledger(10, tp=0)
    with pytest.raises(TypeError, match="optimizer"):
        measure(torch.zeros(3))


# --- measured vs predicted --------------------------------------------------------------------------------
def mlp(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return model


def batch(t, dtype):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(16, 8, generator=g, dtype=F64).to(dtype), torch.randn(16, 4, generator=g, dtype=F64)


def backward(model, t):
    x, y = batch(t, next(model.parameters()).dtype)
    torch.nn.functional.mse_loss(model(x).to(F64), y).backward()


def predicted_roles(led):
    return {c.name: c.bytes for c in led.components}


def measured_roles(opt):
    b = measure(opt).bytes
    return {k: b[k] for k in ("params", "grads", "master", "main_grads", "state")}


def test_measured_equals_predicted_single_process():
    n = sum(p.numel() for p in mlp(F32).parameters())
    assert n == 484
    model = mlp(F32)
    opt = AdamW(model.parameters())
    backward(model, 0)
    opt.step()
    assert measured_roles(opt) == predicted_roles(ledger(n, param_dtype=F32))
    assert measure(opt).bytes["step"] == 0                                   # optbook: a Python int

    model = mlp(F32)
    opt = torch.optim.AdamW(model.parameters())
    backward(model, 0)
    opt.step()
    assert measured_roles(opt) == predicted_roles(ledger(n, param_dtype=F32))
    assert measure(opt).bytes["step"] == 6 * 4                               # one float32 scalar per tensor

    for state_dtype, cfg in ((None, {}), (BF16, dict(state_dtype=BF16))):
        model = mlp(BF16)
        opt = MixedPrecisionOptimizer(AdamW(model.parameters()), state_dtype=state_dtype)
        backward(model, 0)
        opt.step()   # the model's bfloat16 .grad plus the masters' float32 .grad: 20 bytes per parameter
        assert measured_roles(opt) == predicted_roles(ledger(n, grad_dtype=BF16, **cfg))


@pytest.mark.parametrize("state_dtype, per_param", [(None, 20), (BF16, 16)])
def test_mixed_precision_keeps_both_gradients_until_zero_grad(state_dtype, per_param):
    """Chapters 11 and 16 state these counts: 2 + 2 (bf16 weight and gradient) + 4 + 4 (float32 master and
    main gradient) + 8 or 4 (AdamW's moments); the main gradient is reused by the next step; zero_grad()
    frees both gradients (6 bytes per parameter)."""
    model = mlp(BF16)
    n = sum(p.numel() for p in model.parameters())
    opt = MixedPrecisionOptimizer(AdamW(model.parameters()), state_dtype=state_dtype)
    backward(model, 0)
    opt.step()
    first = measure(opt)
    assert first.total == per_param * n and first.bytes["main_grads"] == 4 * n and first.bytes["grads"] == 2 * n
    main = [m.grad.data_ptr() for m in opt.master_params()]
    backward(model, 1)   # accumulates into the same bf16 .grad
    opt.step()
    assert measure(opt).total == per_param * n
    assert [m.grad.data_ptr() for m in opt.master_params()] == main        # copied into, not reallocated
    opt.zero_grad()
    freed = measure(opt)
    assert freed.bytes["grads"] == freed.bytes["main_grads"] == 0 and freed.total == (per_param - 6) * n
    assert all(p.grad is None for p in model.parameters())


def test_measured_muon_and_chained():
    model = mlp(BF16)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    n = sum(p.numel() for p in matrices)
    opt = MixedPrecisionOptimizer(Muon(matrices, lr=0.02))
    backward(model, 0)
    opt.step()
    # the wrapper holds the matrices only (the biases' gradients are not its tensors)
    assert measured_roles(opt) == predicted_roles(ledger(n, optimizer="muon", grad_dtype=BF16))

    model = mlp(F32)
    others = [p for p in model.parameters() if p.ndim != 2]
    matrices = [p for p in model.parameters() if p.ndim == 2]
    chain = ChainedOptimizer([Muon(matrices, lr=0.02), AdamW(others)])
    backward(model, 0)
    chain.step()
    n_muon, n_adam = sum(p.numel() for p in matrices), sum(p.numel() for p in others)
    assert measure(chain).bytes["state"] == 4 * n_muon + 8 * n_adam
    assert measure(chain).bytes["params"] == 4 * (n_muon + n_adam)


def test_measured_distributed_optimizer_two_ranks():
    reports = launch(memory_chapter, 2, timeout=scaled_timeout(90.0))
    for rep in reports:
        exact, megatron = rep["unpadded"], rep["megatron"]
        assert exact["applied"] and megatron["applied"]
        n = exact["numel"]
        assert n == 85002 and exact["buffer_numel"] == n                        # no padding at d = 2
        expected = predicted_roles(ledger(n, sharding="zero1", dp=2))
        assert {k: exact["bytes"][k] for k in expected} == expected
        # Megatron's alignments: the prediction on the padded buffer and this rank's shard
        b = megatron["bytes"]
        B, S = megatron["buffer_numel"], megatron["shard_numel"]
        assert (b["params"], b["grads"], b["master"]) == (2 * B, 4 * B, 4 * S)
        assert b["state"] == 8 * megatron["state_numel"]
    assert reports[0]["megatron"]["state_numel"] + reports[1]["megatron"]["state_numel"] == 85002


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_peak_device_bytes_without_cuda():
    assert peak_device_bytes() is None


# --- OffloadOptimizer -------------------------------------------------------------------------------------
def run(model, opt, steps, sched=None, drop=(2, 5)):
    """``steps`` steps; at step ``drop[0]`` parameter ``drop[1]`` has no gradient (its count lags by one)."""
    for t in range(steps):
        backward(model, t)
        if t == drop[0]:
            list(model.parameters())[drop[1]].grad = None
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def offloaded(model, cls=AdamW, **kw):
    kw = {"offload_fraction": 0.6, "sub_group_numel": 100, "lr": 0.01, "weight_decay": 0.1, **kw}
    return OffloadOptimizer(model.parameters(), cls, **kw)


@pytest.mark.parametrize("cls", [AdamW, torch.optim.AdamW])
def test_offload_equals_plain_adamw_bitwise_in_float64(cls):
    ref_model, model = mlp(F64), mlp(F64)
    ref = cls(ref_model.parameters(), lr=0.01, weight_decay=0.1)
    opt = offloaded(model, cls)
    assert opt.device_optimizer is not None and len(opt.host_optimizers) >= 2    # both paths, sub-groups
    assert opt.offloaded == [True, True, True, False, False, False]   # 128 + 16 + 256 >= 0.6 x 484
    half = lambda t: 0.5 if t >= 3 else 1.0                                       # noqa: E731
    run(ref_model, ref, 6, torch.optim.lr_scheduler.LambdaLR(ref, half))
    run(model, opt, 6, torch.optim.lr_scheduler.LambdaLR(opt, half))
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
        assert int(ref.state[p]["step"]) == int(opt.state[q]["step"])
        assert torch.equal(ref.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])
    steps = [int(opt.state[q]["step"]) for q in model.parameters()]
    assert steps == [6, 6, 6, 6, 6, 5]
    # the one state dict per parameter is the one its inner optimizer uses
    host_param = opt.master_params()[0]
    owner = next(o for o in opt.host_optimizers
                 if any(host_param is x for g in o.param_groups for x in g["params"]))
    assert owner.state[host_param] is opt.state[next(model.parameters())]


@pytest.mark.parametrize("fraction", [1.0, 0.4])
def test_offload_bf16_equals_mixed_precision_bitwise(fraction):
    ref_model, model = mlp(BF16), mlp(BF16)
    ref = MixedPrecisionOptimizer(AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.1))
    opt = offloaded(model, offload_fraction=fraction)
    run(ref_model, ref, 5)
    run(model, opt, 5)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    for m, q in zip(ref.master_params(), opt.master_params()):
        assert q.dtype == F32 and torch.equal(m, q)


def test_offload_bytes_moved_and_measured():
    model = mlp(BF16)
    n = sum(p.numel() for p in model.parameters())
    opt = offloaded(model, offload_fraction=1.0)
    backward(model, 0)
    opt.step()
    assert opt.last_bytes == {"d2h": 2 * n, "h2d": 2 * n}                    # bfloat16 both ways
    roles = measure(opt).bytes
    # device: bf16 params and grads; host: float32 master, its grad, m, v, and two bf16 staging buffers
    assert measured_roles(opt) == predicted_roles(ledger(n, grad_dtype=BF16, offload_fraction=1.0))
    assert roles["staging"] == 4 * n
    opt.zero_grad()
    backward(model, 1)
    list(model.parameters())[0].grad = None
    opt.step()
    first = next(model.parameters()).numel()
    assert opt.last_bytes == {"d2h": 2 * (n - first), "h2d": 2 * (n - first)}
    assert opt.total_bytes["d2h"] == 2 * n + 2 * (n - first)


def snapshot(model, opt):
    return copy.deepcopy(([p.detach() for p in model.parameters()], [t.detach() for t in opt.master_params()],
                          {i: dict(s) for i, s in enumerate(opt.state.values())}, opt.total_bytes))


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("cls", [AdamW, torch.optim.AdamW])
def test_offload_bad_input_changes_nothing(cls):
    model = mlp(F64)
    opt = offloaded(model, cls)
    run(model, opt, 2)
    before = snapshot(model, opt)
    params = list(model.parameters())
    backward(model, 3)
    good = params[-1].grad
    params[-1].grad = torch.zeros_like(good).to_sparse()                      # sparse, a device parameter
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    params[-1].grad = good
    good = params[0].grad
    params[0].grad = torch.zeros_like(good).to_sparse()                       # sparse, a host parameter
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    params[0].grad = good
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr|learning rate"):                  # optbook's or torch's wording
        opt.step()
    opt.param_groups[0]["lr"] = 1e-3
    opt.param_groups[-1]["betas"] = (0.9, 1.5)                                 # the last group: host and device
    with pytest.raises(ValueError, match="beta"):
        opt.step()
    assert same(before, snapshot(model, opt))

    model = mlp(F64)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    opt = OffloadOptimizer(matrices, Muon, offload_fraction=0.5, lr=0.02)
    backward(model, 0)
    opt.step()
    before = snapshot(model, opt)
    backward(model, 1)
    matrices[-1].grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="Non-finite"):
        opt.step()
    assert same(before, snapshot(model, opt))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(offload_fraction=1.5), ValueError, "offload_fraction"),
    (dict(sub_group_numel=0), ValueError, "sub_group_numel"),
    (dict(sub_group_numel=2.0), TypeError, "sub_group_numel"),
    (dict(host=3.5), TypeError, "host"),
    (dict(lr=-1.0), ValueError, "lr"),
])
def test_offload_bad_construction_is_named(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        OffloadOptimizer(mlp(F32).parameters(), AdamW, **kwargs)
    with pytest.raises(TypeError, match="optimizer_class"):
        OffloadOptimizer(mlp(F32).parameters(), dict)
    opt = OffloadOptimizer(mlp(F32).parameters(), AdamW)
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_offload_state_dict_resumes_bitwise(dtype):
    straight_model = mlp(dtype)
    straight = offloaded(straight_model)
    run(straight_model, straight, 5, drop=(1, 5))
    model = mlp(dtype)
    opt = offloaded(model)
    run(model, opt, 3, drop=(1, 5))
    saved = copy.deepcopy(opt.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = offloaded(resumed_model)
    resumed.load_state_dict(saved)
    for t in range(3, 5):
        backward(resumed_model, t)
        resumed.step()
        resumed.zero_grad()
    for p, q in zip(straight_model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
    host = resumed.master_params()[0]
    assert resumed.state[next(resumed_model.parameters())]["exp_avg"].dtype == host.dtype
    owner = next(o for o in resumed.host_optimizers
                 if any(host is x for g in o.param_groups for x in g["params"]))
    assert owner.state[host] is resumed.state[next(resumed_model.parameters())]
    bad = copy.deepcopy(saved)   # the masters' layout of optbook.masters: each copy in its parameter's state
    bad["state"][0]["master_param"] = bad["state"][0]["master_param"][:1]
    with pytest.raises(ValueError, match="master_param"):
        resumed.load_state_dict(bad)
