"""Schedules (cases 11-13): boundary values for every style, sample counting, resume order."""

import math

import pytest
import torch

from optbook.diagnostics import relative_update, snapshot
from optbook.models import TinyTransformer
from optbook.schedules import STYLES, WSD_DECAY_STYLES, LRSchedule, SampleScheduler, WeightDecaySchedule


def values(schedule, n):
    return [round(schedule(k + 1), 6) for k in range(n)]


def test_warmup_then_cosine_case():
    s = LRSchedule(1.0, total=12, warmup=4, style="cosine")
    assert values(s, 12) == [0.25, 0.5, 0.75, 1.0, 0.96194, 0.853553, 0.691342, 0.5, 0.308658, 0.146447, 0.03806, 0.0]


def test_inverse_sqrt_case_and_no_division_by_zero_without_warmup():
    s = LRSchedule(1.0, total=100, warmup=4, style="inverse_sqrt")
    assert values(s, 10) == [0.25, 0.5, 0.75, 1.0, 0.894427, 0.816497, 0.755929, 0.707107, 0.666667, 0.632456]
    s0 = LRSchedule(1.0, total=100, warmup=0, style="inverse_sqrt")
    assert [s0(k + 1) for k in range(4)] == pytest.approx([1 / math.sqrt(k + 1) for k in range(4)])


def test_cosine_floor_rescales_not_clamps():
    s = LRSchedule(1.0, total=10, warmup=0, style="cosine", min_lr=0.1)
    assert [round(s(k), 6) for k in (0, 2, 5, 8, 9, 10, 11, 1000)] == [1.0, 0.914058, 0.55, 0.185942, 0.122025, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("style", STYLES)
def test_boundaries_of_every_style(style):
    kw = dict(wsd_decay=40) if style == "wsd" else {}
    s = LRSchedule(2.0, total=100, warmup=10, style=style, min_lr=0.2, init_lr=0.1, **kw)
    assert s(0) == pytest.approx(0.1)                      # warmup starts at init_lr
    assert s(1) == pytest.approx(0.1 + 1.9 / 10) and s(1) > 0
    assert s(10) == 2.0                                    # the peak, exactly
    end = {"constant": 2.0, "inverse_sqrt": max(0.2, 2.0 * math.sqrt(10 / 100))}.get(style, 0.2)
    assert s(100) == pytest.approx(end)                    # decays end exactly at min_lr
    assert s(10_000) >= 0.2 and all(0.2 - 1e-12 <= s(n) <= 2.0 for n in range(10, 300))
    mid = {"constant": 2.0, "linear": 0.2 + 1.8 * 0.5, "cosine": 0.2 + 1.8 * 0.5, "wsd": 2.0,
           "inverse_sqrt": 2.0 * math.sqrt(10 / 55)}[style]
    assert s(55) == pytest.approx(mid)                     # mid-decay


@pytest.mark.parametrize("decay_style, half", [("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1),
                                               ("minus_sqrt", 1 - math.sqrt(0.5))])
def test_wsd_decay_styles(decay_style, half):
    s = LRSchedule(1.0, total=100, warmup=0, style="wsd", wsd_decay=20, wsd_decay_style=decay_style)
    assert s(80) == 1.0 and s(100) == pytest.approx(0.0, abs=1e-15)
    assert s(90) == pytest.approx(half)
    assert decay_style in WSD_DECAY_STYLES


def test_wsd_branch_at_any_point_follows_the_stable_run_until_it_decays():
    stable = LRSchedule(1.0, total=10**9, warmup=10, style="constant")
    for n0 in (100, 250, 400):
        branch = LRSchedule(1.0, total=n0 + 50, warmup=10, style="wsd", wsd_decay=50)
        assert all(branch(n) == stable(n) for n in range(1, n0 + 1))
        assert branch(n0 + 50) == 0.0


@pytest.mark.parametrize("kwargs, word", [
    (dict(total=10, warmup=20), "warmup"), (dict(total=10, min_lr=2.0), "min_lr"), (dict(total=10, style="step"), "style"),
    (dict(total=-5), "total"), (dict(total=10, warmup=-1), "warmup"), (dict(total=10, style="wsd"), "wsd_decay"),
    (dict(total=10, style="wsd", wsd_decay=20), "wsd_decay"), (dict(total=10, style="wsd", wsd_decay=5, wsd_decay_style="x"),
                                                               "wsd_decay_style"),
])
def test_bad_schedules(kwargs, word):
    with pytest.raises(ValueError, match=word):
        LRSchedule(1.0, **kwargs)


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="n"):
        LRSchedule(1.0, total=10)(-1)
    with pytest.raises(ValueError, match="n"):
        WeightDecaySchedule(0.0, 0.1, total=10)(-1)


def test_lambda_lr_multiplier_gives_the_same_values():
    s = LRSchedule(0.5, total=12, warmup=4, style="cosine")
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, s.lr_lambda())
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([s(k + 1) for k in range(12)])


def test_schedule_is_unchanged_in_samples_when_the_batch_size_changes():
    s = LRSchedule(1.0, total=4096, warmup=512, style="cosine")
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    sched = SampleScheduler(opt, s, batch_size=32)
    consumed, seen = 0, []
    for k in range(60):
        batch = 32 if k < 20 else 64
        seen.append((consumed + batch, opt.param_groups[0]["lr"]))
        consumed += batch
        sched.step(batch, next_batch_size=32 if k + 1 < 20 else 64)
    assert all(lr == pytest.approx(s(n)) for n, lr in seen)
    assert sched.state_dict() == {"samples": consumed, "batch_size": 64}


def test_weight_decay_schedule_and_multipliers():
    wd = WeightDecaySchedule(0.0, 0.1, total=100, style="cosine")
    assert wd(0) == 0.0 and wd(50) == pytest.approx(0.05) and wd(100) == pytest.approx(0.1) and wd(500) == pytest.approx(0.1)
    assert WeightDecaySchedule(0.0, 0.1, total=100, style="linear")(25) == pytest.approx(0.025)
    p, q = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [p]}, {"params": [q], "wd_mult": 0.0, "lr_mult": 0.5}])
    SampleScheduler(opt, LRSchedule(1.0, total=10), batch_size=5, wd_schedule=wd)
    assert [g["weight_decay"] for g in opt.param_groups] == [pytest.approx(wd(5)), 0.0]
    assert opt.param_groups[1]["lr"] == pytest.approx(0.5 * opt.param_groups[0]["lr"])


def test_resume_order_case():
    # case 13: 50 steps, save optimizer and schedule, rebuild and load both (optimizer first)
    lam = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 100) / 100))  # noqa: E731

    def build():
        p = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([p], lr=1.0)
        return p, opt, torch.optim.lr_scheduler.LambdaLR(opt, lam)

    p, opt, sched = build()
    for _ in range(50):
        p.grad = torch.ones(1)
        opt.step()
        sched.step()
    saved = (opt.state_dict(), sched.state_dict())
    p2, opt2, sched2 = build()
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    lrs = []
    for _ in range(2):
        lrs.append(opt2.param_groups[0]["lr"])
        p2.grad = torch.ones(1)
        opt2.step()
        sched2.step()
    assert lrs == pytest.approx([0.5, 0.48429462], abs=1e-8)


def test_relative_update_groups_by_role():
    model = TinyTransformer(vocab_size=10, d_model=16, n_layers=1, n_heads=2)
    before = snapshot(model)
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.mul_(1.1)
        model.norm.weight.mul_(0.5)
    rho = relative_update(model, before, snapshot(model))
    assert set(rho) == {"attention", "mlp", "embedding", "norm", "output"}
    assert rho["attention"]["layers.0.attn.q_proj.weight"] == pytest.approx(0.1)
    assert rho["norm"]["norm.weight"] == pytest.approx(0.5)
    assert rho["mlp"]["layers.0.mlp.0.weight"] == 0.0


def test_sample_scheduler_scales_each_groups_own_lr_in_a_muon_adamw_chain():
    # one schedule over a chain: Muon keeps 0.02 times the schedule's shape, AdamW 3e-3 times it, as
    # torch's LambdaLR does with each group's initial_lr (one absolute lr would give AdamW's groups 0.02)
    from optbook.optim import AdamW, ChainedOptimizer, Muon

    W = torch.zeros(4, 3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    chain = ChainedOptimizer([Muon([W], lr=0.02), AdamW([b], lr=3e-3)])
    s = LRSchedule(0.02, total=400, warmup=40, style="cosine", min_lr=0.002)
    sched = SampleScheduler(chain, s, batch_size=4)
    p = torch.zeros(1, requires_grad=True)
    twin = torch.optim.SGD([{"params": [W.detach().clone()], "lr": 0.02}, {"params": [p], "lr": 3e-3}])
    torch_sched = torch.optim.lr_scheduler.LambdaLR(twin, s.lr_lambda(batch_size=4))
    for k in range(120):
        muon_lr, adamw_lr = (g["lr"] for g in chain.param_groups)
        assert muon_lr == s(4 * (k + 1))                         # the base equals max_lr: exactly the schedule
        assert adamw_lr == pytest.approx(3e-3 * s(4 * (k + 1)) / 0.02, rel=1e-15)
        assert [muon_lr, adamw_lr] == pytest.approx([g["lr"] for g in twin.param_groups], rel=1e-15)
        twin.step()
        torch_sched.step()
        sched.step()
    assert [g["initial_lr"] for g in chain.param_groups] == [0.02, 3e-3]
    assert [g["lr"] for g in chain.param_groups] == pytest.approx([0.002, 3e-4], rel=1e-15)  # the floor, scaled


def test_sample_scheduler_single_group_is_the_absolute_schedule_bit_for_bit():
    s = LRSchedule(0.5, total=100, warmup=10, style="wsd", wsd_decay=30, min_lr=0.05)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.5)
    sched = SampleScheduler(opt, s, batch_size=3)
    for k in range(40):
        assert opt.param_groups[0]["lr"] == s(3 * (k + 1))     # == : bitwise
        sched.step()
