"""QK-clip invariants for MHA, GQA and MQA (both rules) and MLA; bad input changes nothing; MAX across
ranks."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optbook import qk_clip_
from optbook.models import TinyTransformer
from optbook.qk_clip import qk_clip_factors

TAU = 5.0
CONFIGS = {
    "mha": dict(n_heads=4),
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mla": dict(n_heads=4, attention="mla"),
}


def loud_model(kind, seed=0):
    """A model whose attention logits exceed TAU in some heads and not in others."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab_size=16, d_model=32, n_layers=2, max_seq_len=16, **CONFIGS[kind])
    with torch.no_grad():
        for i, attn in enumerate(model.attention_layers()):
            q = attn.q_c_proj.weight if kind == "mla" else attn.q_proj.weight
            k = attn.k_c_proj.weight if kind == "mla" else attn.k_proj.weight
            q.mul_(60.0)
            k.mul_(60.0)
            q[: attn.d_head].mul_(0.01)  # head 0 stays quiet
    return model


def batch():
    return torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(1))


def recorded(model, x):
    model.train()
    model(x)
    return model.max_logits().clone()


def recorded_with_inputs(model, x):
    """Forward, keeping each attention layer's input: a layer's logits after clipping are compared on
    the same input (clipping layer 0 changes what layer 1 sees, so a full forward would not be)."""
    inputs = []
    hooks = [a.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach())) for a in model.attention_layers()]
    s = recorded(model, x)
    for h in hooks:
        h.remove()
    return s, inputs


def relogits(model, inputs):
    for attn, inp in zip(model.attention_layers(), inputs):
        attn(inp)
    return model.max_logits().clone()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind, rule", [("mha", "group"), ("gqa", "group"), ("gqa", "per_head"), ("mla", "group")])
def test_after_clip_every_head_is_at_most_tau_and_nothing_else_moved(kind, rule):
    model, x = loud_model(kind), batch()
    before_s, inputs = recorded_with_inputs(model, x)
    assert (before_s > TAU).any() and (before_s <= TAU).any()
    before = snapshot(model)
    report = qk_clip_(model, tau=TAU, gqa_rule=rule)
    after_s = relogits(model, inputs)
    assert (after_s <= TAU * (1 + 1e-5)).all()
    clipped = before_s > TAU
    # clipped heads land on tau (MHA, MLA, and GQA per-head: exactly their own gamma)
    if kind != "gqa" or rule == "per_head":
        torch.testing.assert_close(after_s[clipped], torch.full_like(after_s[clipped], TAU), rtol=1e-4, atol=0)
        torch.testing.assert_close(after_s[~clipped], before_s[~clipped], rtol=1e-5, atol=0)
    assert {(r["layer"], r["head"]) for r in report if r["s_max"] > TAU} == set(map(tuple, clipped.nonzero().tolist()))
    after = snapshot(model)
    for name, value in before.items():
        if not any(key in name for key in ("q_proj", "k_proj", "q_c_proj", "k_c_proj", "q_r_proj")):
            assert torch.equal(after[name], value), f"{name} changed"
    for li, attn in enumerate(model.attention_layers()):
        group = attn.n_heads // getattr(attn, "n_kv_heads", attn.n_heads)
        d = attn.d_head
        for h in range(attn.n_heads):
            group_clipped = bool(clipped[li, (h // group) * group:(h // group + 1) * group].any())
            prefix = f"layers.{li}.attn."
            q_name = prefix + ("q_c_proj.weight" if kind == "mla" else "q_proj.weight")
            if not group_clipped:  # untouched bit for bit
                assert torch.equal(after[q_name][h * d:(h + 1) * d], before[q_name][h * d:(h + 1) * d])
    if kind == "mla":  # the shared rotary key is never touched
        for li in range(2):
            assert torch.equal(after[f"layers.{li}.attn.k_r_proj.weight"], before[f"layers.{li}.attn.k_r_proj.weight"])


def test_gqa_group_rule_overclips_and_per_head_rule_does_not():
    s = torch.tensor([200.0, 50.0, 80.0, 20.0])  # groups {0, 1} and {2, 3} with tau 100
    q, k = qk_clip_factors(s, 100.0, n_kv_heads=2, gqa_rule="group")
    torch.testing.assert_close((q * k.repeat_interleave(2)), torch.tensor([0.5, 0.5, 1.0, 1.0], dtype=torch.float64))
    q, k = qk_clip_factors(s, 100.0, n_kv_heads=2, gqa_rule="per_head")
    torch.testing.assert_close((q * k.repeat_interleave(2)), torch.tensor([0.5, 1.0, 1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(k, torch.tensor([0.5 ** 0.5, 1.0], dtype=torch.float64))


def test_mla_factors_are_sqrt_gamma_on_content_and_gamma_on_rotary_query():
    model, x = loud_model("mla"), batch()
    s = recorded(model, x)
    attn = model.layers[0].attn
    h = int(s[0].argmax())
    gamma = TAU / float(s[0, h])
    before = snapshot(model)
    qk_clip_(model, tau=TAU)
    rows = slice(h * attn.d_head, (h + 1) * attn.d_head)
    rrows = slice(h * attn.d_rope, (h + 1) * attn.d_rope)
    p = "layers.0.attn."
    torch.testing.assert_close(attn.q_c_proj.weight[rows], before[p + "q_c_proj.weight"][rows] * gamma ** 0.5)
    torch.testing.assert_close(attn.k_c_proj.weight[rows], before[p + "k_c_proj.weight"][rows] * gamma ** 0.5)
    torch.testing.assert_close(attn.q_r_proj.weight[rrows], before[p + "q_r_proj.weight"][rrows] * gamma)


def test_bad_input_raises_and_changes_no_weight():
    model, x = loud_model("mha"), batch()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="recorded no max logits"):
        qk_clip_(model, tau=TAU)  # no forward yet
    recorded(model, x)
    for tau in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="tau"):
            qk_clip_(model, tau=tau)
    model.layers[1].attn.max_logits = torch.ones(3)  # does not match 4 heads; layer 0 is valid and would clip
    with pytest.raises(ValueError, match="3 recorded maxima for 4 heads"):
        qk_clip_(model, tau=TAU)
    after = snapshot(model)
    assert all(torch.equal(after[n], v) for n, v in before.items())
    with pytest.raises(RuntimeError, match="no attention layer"):
        qk_clip_(torch.nn.Linear(2, 2))


def test_maxima_are_consumed_so_a_second_call_cannot_clip_twice():
    model, x = loud_model("mha"), batch()
    recorded(model, x)
    qk_clip_(model, tau=TAU)
    with pytest.raises(RuntimeError, match="recorded no max logits"):
        qk_clip_(model, tau=TAU)


def _worker(rank, world, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    # rank 1 saw a much larger logit in head 1 than rank 0: both must clip head 1 by rank 1's value
    model.layers[0].attn.max_logits = torch.tensor([1.0, 10.0 if rank == 0 else 40.0])
    report = qk_clip_(model, tau=20.0)
    results[rank] = ([(r["head"], r["s_max"]) for r in report], model.layers[0].attn.q_proj.weight.detach().clone())
    dist.destroy_process_group()


def test_per_head_maxima_are_max_reduced_across_data_parallel_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        assert results[0][0] == results[1][0] == [(1, 40.0)]
        assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("order", ["big-first", "big-last"])
def test_max_logit_is_a_running_max_over_every_micro_batch_until_qk_clip_consumes_it(order):
    # two micro-batches with max logits 50 and 0.5, tau 10: recording only the last forward clipped
    # nothing when the big one came first, and the logit stayed 50
    from optbook.models.transformer import CausalSelfAttention
    attn = CausalSelfAttention(d_model=4, n_heads=1).double().train()
    with torch.no_grad():
        attn.q_proj.weight.copy_(torch.eye(4))
        attn.k_proj.weight.copy_(torch.eye(4))
    e1 = torch.zeros(1, 2, 4, dtype=torch.float64)
    e1[..., 0] = 1.0
    big, small = 10.0 * e1, 1.0 * e1  # logits a^2 / sqrt(d_head) = a^2 / 2: 50 and 0.5
    batches = [big, small] if order == "big-first" else [small, big]
    for x in batches:
        attn(x)
    assert float(attn.max_logits) == pytest.approx(50.0)
    report = qk_clip_(attn, tau=10.0)
    assert attn.max_logits is None and len(report) == 1 and report[0]["s_max"] == pytest.approx(50.0)
    attn(big)  # recompute on the micro-batch with the largest logit
    assert float(attn.max_logits) <= 10.0 * (1 + 1e-12)


def test_reset_max_logits_starts_a_new_running_max():
    model = TinyTransformer(vocab_size=10, d_model=16, n_layers=1, n_heads=2).train()
    idx = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(0))
    model(idx)
    first = model.max_logits().clone()
    model(idx)
    assert torch.equal(model.max_logits(), first)
    model.reset_max_logits()
    with pytest.raises(RuntimeError, match="No max logits"):
        model.max_logits()


VARIANTS = {  # every attention the package's models offer, with the GQA rules where they differ
    "mha": dict(n_heads=4),
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mqa": dict(n_heads=4, n_kv_heads=1),
    "mla": dict(n_heads=4, attention="mla"),
}
# the recomputed logit is gamma * S_max up to the rounding of the scaled weights and of the logit's
# own dot products (a few ulps): 1e-5 in float32, 1e-12 in float64 (maxima recorded in float32 for a
# float64 model left it 1e-7 above tau)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def variant_model(kind, dtype, n_layers, seed):
    torch.manual_seed(seed)
    model = TinyTransformer(vocab_size=16, d_model=32, n_layers=n_layers, max_seq_len=16, **VARIANTS[kind])
    model = model.to(dtype)
    with torch.no_grad():  # loud: every weight qk_clip_ scales (and the shared rotary key) times 40
        for attn in model.attention_layers():
            for part in attn.head_layout.parts:
                if part.role in ("query", "key", "rotary_query", "rotary_key"):
                    attn.get_parameter(part.weight).mul_(40.0)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind, rule", [("mha", "group"), ("gqa", "group"), ("gqa", "per_head"),
                                        ("mqa", "group"), ("mqa", "per_head"), ("mla", "group")])
def test_after_qk_clip_the_recomputed_logits_are_at_most_tau_in_every_head(kind, rule, dtype):
    for seed in range(3):
        model = variant_model(kind, dtype, n_layers=2, seed=seed)
        x = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(seed))
        before_s, inputs = recorded_with_inputs(model, x)
        assert before_s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        tau = float(before_s.median())
        assert (before_s > tau).any()
        qk_clip_(model, tau, gqa_rule=rule)
        after_s = relogits(model, inputs)  # each layer on the input it saw
        assert (after_s <= tau * (1 + RTOL[dtype])).all(), (after_s.max() / tau - 1).item()
        clipped = before_s > tau
        if kind != "gqa" and kind != "mqa" or rule == "per_head":  # each clipped head lands on tau
            torch.testing.assert_close(after_s[clipped], torch.full_like(after_s[clipped], tau),
                                       rtol=RTOL[dtype], atol=0)

    # one layer: a full forward on the same batch sees the same layer input, so it is bounded too
    model = variant_model(kind, dtype, n_layers=1, seed=0)
    x = batch()
    tau = float(recorded(model, x).median())
    qk_clip_(model, tau, gqa_rule=rule)
    assert (recorded(model, x) <= tau * (1 + RTOL[dtype])).all()


def test_qk_norm_logits_do_not_follow_the_weights_qk_clip_scales_so_it_refuses_them():
    # with per-head QK RMSNorm, W_q and W_k scaled by 0.1 leave the logits as they were: reporting
    # heads as clipped would be false, so qk_clip_ raises before any write
    for n_kv in (4, 2):
        model = TinyTransformer(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv,
                                max_seq_len=16, qk_norm=True)
        s, inputs = recorded_with_inputs(model, batch())
        scaled = copy.deepcopy(model)
        with torch.no_grad():
            for attn in scaled.attention_layers():
                attn.q_proj.weight.mul_(0.1)
                attn.k_proj.weight.mul_(0.1)
        torch.testing.assert_close(relogits(scaled, inputs), s, rtol=1e-3, atol=0)  # RMSNorm eps: not exact
        before = snapshot(model)
        with pytest.raises(ValueError, match="qk_norm=True"):
            qk_clip_(model, tau=0.1 * float(s.min()))
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert all(a.max_logits is not None for a in model.attention_layers())  # not consumed


def test_a_bias_on_a_query_or_key_projection_is_refused_before_any_write():
    model, x = loud_model("gqa"), batch()
    with torch.no_grad():
        k_proj = model.layers[1].attn.k_proj
        biased = torch.nn.Linear(k_proj.in_features, k_proj.out_features, bias=True)
        biased.weight.copy_(k_proj.weight)
        model.layers[1].attn.k_proj = biased
    recorded(model, x)
    before = snapshot(model)
    with pytest.raises(ValueError, match="k_proj of attention layer 1 has a bias"):
        qk_clip_(model, tau=TAU)  # layer 0 would clip; nothing may have moved
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_non_finite_maxima_bool_tau_and_unknown_rules_raise_before_any_write():
    model, x = loud_model("mla"), batch()
    recorded(model, x)
    before = snapshot(model)
    model.layers[1].attn.max_logits = torch.tensor([1.0, float("inf"), 2.0, 3.0])  # gamma 0 would zero W_qc
    with pytest.raises(ValueError, match="non-finite"):
        qk_clip_(model, tau=TAU)
    model.layers[1].attn.max_logits = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    with pytest.raises(ValueError, match="non-finite"):
        qk_clip_(model, tau=TAU)
    with pytest.raises(ValueError, match="tau"):
        qk_clip_(model, tau=True)
    with pytest.raises(ValueError, match="gqa_rule"):
        qk_clip_(model, tau=TAU, gqa_rule="mean")  # MLA ignored the rule: a typo passed silently
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
