"""optbook.qk_clip.clipped_heads: the mask of the heads one qk_clip_ call clipped (MHA, GQA group and
per-head rule, MLA), the share-of-heads measures built from it, and its errors."""

import pytest
import torch

from optbook import qk_clip_
from optbook.models import TinyTransformer
from optbook.qk_clip import clipped_heads

TAU = 5.0
CONFIGS = {"mha": dict(n_heads=4), "gqa": dict(n_heads=4, n_kv_heads=2), "mla": dict(n_heads=4, attention="mla")}


def loud_model(kind):
    """Two layers of 4 heads; head 0 of every layer stays below TAU, the others go far above it."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=16, d_model=32, n_layers=2, max_seq_len=16, **CONFIGS[kind])
    with torch.no_grad():
        for attn in model.attention_layers():
            q = attn.q_c_proj.weight if kind == "mla" else attn.q_proj.weight
            k = attn.k_c_proj.weight if kind == "mla" else attn.k_proj.weight
            q.mul_(60.0)
            k.mul_(60.0)
            q[: attn.d_head].mul_(0.01)
    return model


def clip_once(kind, rule="group"):
    model = loud_model(kind)
    model.train()
    model(torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(1)))
    s_max = model.max_logits().clone()  # (layers, heads)
    return s_max, qk_clip_(model, TAU, gqa_rule=rule)


@pytest.mark.parametrize("kind,rule", [("mha", "group"), ("mla", "group"), ("gqa", "per_head"), ("gqa", "group")])
def test_triggered_heads_are_exactly_those_above_tau(kind, rule):
    s_max, report = clip_once(kind, rule)
    above = s_max > TAU
    assert above.any() and not above.all()  # the test model has clipped and quiet heads
    triggered = clipped_heads(report, 2, 4, triggered=True)
    assert triggered.dtype == torch.bool and triggered.shape == (2, 4)
    assert torch.equal(triggered, above)
    rescaled = clipped_heads(report, 2, 4)
    assert torch.equal(rescaled, torch.tensor([[(r["layer"], r["head"]) == (i, h) for r in report] for i in range(2)
                                               for h in range(4)]).any(-1).view(2, 4))
    if kind == "gqa":  # head 0 is quiet but shares its key head with head 1: both rules rescale its query rows
        assert not triggered[:, 0].any() and rescaled[:, 0].all()
        assert torch.equal(rescaled[:, 1:], triggered[:, 1:])
    else:
        assert torch.equal(rescaled, triggered)


def test_masks_over_steps_give_the_share_clipped_at_least_once_and_per_step():
    reports = [[], [dict(layer=0, head=1, gamma=0.5)], [dict(layer=0, head=1, gamma=0.9), dict(layer=1, head=3, gamma=0.8)]]
    masks = torch.stack([clipped_heads(r, 2, 4) for r in reports])  # (steps, layers, heads)
    assert masks.any(0).float().mean().item() == 2 / 8
    assert masks.float().mean((1, 2)).tolist() == [0.0, 1 / 8, 2 / 8]
    assert not clipped_heads([], 2, 4).any()


@pytest.mark.parametrize("report,n_layers,n_heads,match", [
    ([], 0, 4, "n_layers"),
    ([dict(layer=2, head=0, gamma=0.5)], 2, 4, "outside"),
    ([dict(layer=0, head=-1, gamma=0.5)], 2, 4, "outside"),
    ([dict(layer=0, head=1)], 2, 4, "gamma"),
    (["not a record"], 2, 4, "layer"),
    ([dict(layer=0, head=1, gamma=0.5), dict(layer=0, head=1, gamma=0.5)], 2, 4, "twice"),
])
def test_bad_input_raises_naming_the_argument(report, n_layers, n_heads, match):
    with pytest.raises(ValueError, match=match):
        clipped_heads(report, n_layers, n_heads)


@pytest.mark.parametrize("n_layers,n_heads,match", [(2, True, "n_heads"), (2.0, 4, "n_layers")])
def test_a_count_that_is_not_an_int_is_a_type_error_naming_it(n_layers, n_heads, match):
    with pytest.raises(TypeError, match=match):
        clipped_heads([], n_layers, n_heads)
