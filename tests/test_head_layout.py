"""One head layout: the attention modules describe their heads once, and per-head Muon
(muon_param_groups(split=...)) and qk_clip_ both read it, so they cut the same row blocks."""

import dataclasses

import pytest
import torch
from torch import nn

from optbook import newton_schulz, qk_clip_
from optbook.models import HeadLayout, HeadRows, MultiHeadLatentAttention, TinyTransformer, attention_modules
from optbook.optim import Muon, muon_param_groups, muon_scale, split_rows
from optbook.qk_clip import clipped_blocks

KINDS = {
    "mha": dict(n_heads=4),
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mqa": dict(n_heads=4, n_kv_heads=1),
    "mla": dict(n_heads=4, attention="mla"),
}


def model_of(kind, d_model=32, n_layers=2, seed=0):
    torch.manual_seed(seed)
    return TinyTransformer(vocab_size=16, d_model=d_model, n_layers=n_layers, max_seq_len=16, **KINDS[kind])


def muon_blocks(routing, model):
    """{parameter name: [row slices Muon orthogonalises one by one]} for every Muon parameter."""
    blocks = {}
    for group in routing.muon:
        for name, p in zip(group["param_names"], group["params"]):
            bounds = [0]
            for rows in split_rows(p.shape[0], group.get("head_split")):
                bounds.append(bounds[-1] + rows)
            blocks[name] = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    return blocks


@pytest.mark.parametrize("kind", KINDS)
def test_the_layout_matches_the_weights_and_the_module_reads_its_shape_from_it(kind):
    model = model_of(kind)
    for attn in model.attention_layers():
        layout = attn.head_layout
        assert isinstance(layout, HeadLayout)
        assert attn.n_heads == layout.n_heads and attn.n_kv_heads == layout.n_kv_heads
        assert attn.d_head == layout.d_head
        for weight in layout.weights():
            assert attn.get_parameter(weight).shape[0] == layout.rows(weight)
        with pytest.raises(dataclasses.FrozenInstanceError):
            layout.n_heads = 8  # a frozen value: the one description cannot drift
    layout = model.layers[0].attn.head_layout
    assert layout.n_heads == 4 and layout.d_head == 8
    if kind == "mla":
        assert (layout.n_kv_heads, layout.d_rope, layout.kv_rank) == (4, 8, 16)
        assert {p.role for p in layout.parts} == {"query", "rotary_query", "latent", "key", "value",
                                                  "rotary_key"}
        shared = [p.blocks for p in layout.parts if p.role in ("latent", "rotary_key")]
        assert shared == [1, 1]  # one block every head reads
    else:
        assert layout.n_kv_heads == KINDS[kind].get("n_kv_heads", 4) and layout.d_rope == layout.kv_rank == 0
        assert [layout.kv_head(h) for h in range(4)] == [h // layout.group for h in range(4)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_per_head_muon_blocks_are_exactly_the_blocks_qk_clip_scales(kind):
    model = model_of(kind)
    blocks = muon_blocks(muon_param_groups(model, split="head"), model)
    scaled = 0
    for li, attn in enumerate(model.attention_layers()):
        for weight, slices in clipped_blocks(attn).items():
            assert blocks[f"layers.{li}.attn.{weight}"] == slices
            scaled += 1
    assert scaled == 2 * (3 if kind == "mla" else 2)  # W_q, W_k (MLA: W_qc, W_kc, W_qr) of each layer

    # and qk_clip_ really scales by those blocks: every head clipped, so each block's ratio after/before
    # is one factor below 1
    x = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for attn in model.attention_layers():
            for weight in clipped_blocks(attn):
                attn.get_parameter(weight).mul_(40.0)
    model.train()
    model(x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = model.max_logits().clone()
    tau = 0.5 * float(s.min())  # every head above tau
    qk_clip_(model, tau)
    for li, attn in enumerate(model.attention_layers()):
        for weight, slices in clipped_blocks(attn).items():
            name = f"layers.{li}.attn.{weight}"
            ratio = (model.get_parameter(name).detach() / before[name]).double()
            per_block = [ratio[rows] for rows in slices]
            for r in per_block:  # one factor per block (a float32 product rounds: 1e-6)
                torch.testing.assert_close(r, torch.full_like(r, float(r.mean())), rtol=1e-6, atol=0)
            assert all(float(r.mean()) < 1 for r in per_block)


@pytest.mark.parametrize("kind", KINDS)
def test_split_head_gives_muon_one_newton_schulz_per_head_block(kind):
    # reference: each block of the gradient orthogonalised on its own by newton_schulz in float64 and
    # scaled for its own shape; tolerance 1e-12 because Muon batches equal blocks (bmm vs mm rounding)
    model = model_of(kind, n_layers=1).double()
    routing = muon_param_groups(model, split="head")
    opt = Muon(routing.muon, lr=1.0, momentum=0.0, nesterov=False, ns_dtype=torch.float64)
    blocks = muon_blocks(routing, model)
    params = dict(model.named_parameters())
    before, grads = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name in blocks:
        before[name] = params[name].detach().clone()
        grads[name] = params[name].grad = torch.randn(params[name].shape, generator=gen, dtype=torch.float64)
    opt.step()
    cut = 0
    for name, slices in blocks.items():
        update = before[name] - params[name].detach()
        cut += len(slices) > 1
        for rows in slices:
            G = grads[name][rows]
            expected = muon_scale(G.shape) * newton_schulz(G, dtype=torch.float64)
            torch.testing.assert_close(update[rows], expected, rtol=0, atol=1e-12)
    assert cut == {"mha": 3, "gqa": 3, "mqa": 1, "mla": 4}[kind]  # MQA: K and V are one head already


def test_split_none_is_todays_single_muon_group_and_qkv_cuts_nothing_on_separate_projections():
    model = model_of("gqa")
    plain = muon_param_groups(model, weight_decay=0.1)
    assert len(plain.muon) == 1 and "head_split" not in plain.muon[0]
    qkv = muon_param_groups(model, weight_decay=0.1, split="qkv")
    assert [g["head_split"] for g in qkv.muon] == [None]
    assert qkv.muon[0]["param_names"] == plain.muon[0]["param_names"]
    head = muon_param_groups(model, weight_decay=0.1, split="head")
    assert [g["head_split"] for g in head.muon] == [None, (8, 8, 8, 8), (8, 8)]
    reason = head.reasons["layers.0.attn.k_proj.weight"]
    assert reason == "2-D hidden weight, Newton-Schulz per head: 2 x 8 rows"
    assert all(g["weight_decay"] == 0.1 for g in head.muon)
    assert sorted(n for g in head.muon for n in g["param_names"]) == sorted(plain.muon[0]["param_names"])


class FusedQKV(nn.Module):
    """A fused QKV projection (GQA, 4 query heads, 2 KV heads of 4 rows): the layout lists three parts
    of one weight at their row offsets."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, (4 + 2 + 2) * 4, bias=False)
        self.head_layout = HeadLayout(4, 2, 4, parts=(HeadRows("qkv.weight", "query", 4, 4),
                                                      HeadRows("qkv.weight", "key", 2, 4, offset=16),
                                                      HeadRows("qkv.weight", "value", 2, 4, offset=24)))


def test_a_fused_projection_is_cut_per_qkv_part_or_per_head_from_its_layout():
    model = nn.Sequential(FusedQKV(), nn.Linear(32, 8))
    for split, want in (("qkv", (16, 8, 8)), ("head", (4,) * 8)):
        routing = muon_param_groups(model, split=split)
        (group,) = [g for g in routing.muon if g["head_split"] is not None]
        assert group["param_names"] == ["0.qkv.weight"] and group["head_split"] == want
        Muon(routing.muon)  # Muon accepts the cut
    assert clipped_blocks(model[0]) == {"qkv.weight": [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16),
                                                       slice(16, 20), slice(20, 24)]}


def test_bad_split_input_raises_naming_the_argument():
    model = model_of("mha")
    with pytest.raises(ValueError, match="Invalid split"):
        muon_param_groups(model, split="heads")
    with pytest.raises(ValueError, match="Invalid split.*Sequential has none"):
        muon_param_groups(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), split="head")
    with pytest.raises(ValueError, match="Invalid muon_options: 'head_split'"):
        muon_param_groups(model, split="head", muon_options={"head_split": 4})
    model.layers[0].attn.q_proj = nn.Linear(32, 24, bias=False)  # no longer what the layout says
    with pytest.raises(ValueError, match=r"q_proj.weight .* \(24, 32\), its head layout describes 32 rows"):
        muon_param_groups(model, split="head")


def test_head_layout_refuses_an_inconsistent_description():
    with pytest.raises(ValueError, match="n_kv_heads"):
        HeadLayout(4, 3, 8)
    with pytest.raises(ValueError, match="n_heads"):
        HeadLayout(0, 1, 8)
    with pytest.raises(ValueError, match="blocks, expected 4"):
        HeadLayout(4, 2, 8, parts=(HeadRows("q.weight", "query", 2, 8),))
    with pytest.raises(ValueError, match="tile its rows"):
        HeadLayout(4, 2, 8, parts=(HeadRows("w", "query", 4, 8), HeadRows("w", "key", 2, 8, offset=40)))
    with pytest.raises(ValueError, match="role"):
        HeadRows("w", "queries", 4, 8)
    with pytest.raises(ValueError, match="per"):
        HeadLayout.multi_head(4, 2, 8).head_split("q_proj.weight", per="rows")
    with pytest.raises(ValueError, match="weight"):
        HeadLayout.multi_head(4, 2, 8).head_split("o_proj.weight")


def test_mla_arguments_that_would_be_ignored_are_refused():
    with pytest.raises(ValueError, match="n_kv_heads"):
        TinyTransformer(16, n_heads=4, n_kv_heads=2, attention="mla")
    with pytest.raises(ValueError, match="qk_norm"):
        TinyTransformer(16, n_heads=4, qk_norm=True, attention="mla")
    with pytest.raises(ValueError, match="kv_rank"):
        MultiHeadLatentAttention(32, 4, kv_rank=0)
    assert len(attention_modules(TinyTransformer(16, n_heads=4, n_kv_heads=4, attention="mla"))) == 2


def test_split_rows_of_a_layout_sum_to_the_weight():
    layout = HeadLayout.latent(4, 8, 6, 12)
    assert layout.head_split("q_r_proj.weight") == (6,) * 4
    assert layout.head_split("kv_down.weight") == (12,)
    assert layout.head_split("q_c_proj.weight", per="qkv") == (32,)
    assert layout.head_split("k_r_proj.weight") == (6,)  # the rotary key every head shares: one block
