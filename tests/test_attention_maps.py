"""optbook.diagnostics.attention_logits / attention_entropy against an oracle computed by hand."""

import copy
import math

import pytest
import torch

from optbook.diagnostics import attention_entropy, attention_logits
from optbook.models import TinyTransformer


def _oracle_logits(model, idx):
    """Capture each attention layer's input and recompute q k^T / sqrt(d) (MHA, float64)."""
    inputs = []
    hooks = [a.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for a in model.attention_layers()]
    with torch.no_grad():
        model.eval()
        model(idx)
    for h in hooks:
        h.remove()
    out = []
    for a, x in zip(model.attention_layers(), inputs):
        B, T, _ = x.shape
        q = (x @ a.q_proj.weight.T).view(B, T, a.n_heads, a.d_head).transpose(1, 2)
        k = (x @ a.k_proj.weight.T).view(B, T, a.n_kv_heads, a.d_head).transpose(1, 2)
        k = k.repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        s = q @ k.transpose(-2, -1) / math.sqrt(a.d_head)
        out.append(s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf))
    return torch.stack(out)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_attention_logits_match_a_hand_computation_and_record_nothing(n_kv_heads):
    torch.manual_seed(0)
    model = TinyTransformer(11, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=8).double()
    idx = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    model.train()
    model(idx)                                     # a training forward records the maxima
    recorded = model.max_logits().clone()
    logits = attention_logits(model, idx)
    assert logits.shape == (2, 3, 4, 8, 8) and logits.dtype == torch.float64
    oracle = _oracle_logits(copy.deepcopy(model), idx)
    finite = torch.isfinite(oracle)
    assert torch.equal(finite, torch.isfinite(logits)) and int((~finite).sum()) == 2 * 3 * 4 * 28  # 28 masked per 8x8
    torch.testing.assert_close(logits[finite], oracle[finite], rtol=1e-12, atol=1e-14)  # float64 rounding only
    # the training forward's maxima are exactly the maxima of these logits, and were left untouched
    torch.testing.assert_close(logits.amax(dim=(1, 3, 4)), recorded, rtol=1e-12, atol=0)
    assert model.training and torch.equal(model.max_logits(), recorded)


def test_attention_logits_of_mla_give_its_recorded_maxima():
    torch.manual_seed(2)
    model = TinyTransformer(11, d_model=32, n_layers=1, n_heads=4, max_seq_len=8, attention="mla").double()
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(3))
    model.eval()
    logits = attention_logits(model, idx)
    assert not model.training
    model.train()
    model(idx)
    torch.testing.assert_close(logits.amax(dim=(1, 3, 4)), model.max_logits(), rtol=1e-12, atol=0)


def test_attention_logits_rejects_a_model_without_attention_layers():
    with pytest.raises(TypeError, match="attention_layers"):
        attention_logits(torch.nn.Linear(2, 2), torch.zeros(1, 2))


def test_attention_entropy_closed_forms():
    rows = torch.tensor([[0.0, 0.0, 0.0, 0.0],                       # uniform over 4: log 4
                         [0.0, 0.0, -math.inf, -math.inf],           # uniform over 2 unmasked keys: log 2
                         [1000.0, 0.0, 0.0, -math.inf],              # one-hot to float64 precision: 0
                         [math.log(3.0), 0.0, -math.inf, -math.inf]],  # p = (3/4, 1/4)
                        dtype=torch.float64)
    expected = torch.tensor([math.log(4), math.log(2), 0.0,
                             -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))], dtype=torch.float64)
    torch.testing.assert_close(attention_entropy(rows), expected, rtol=1e-14, atol=1e-300)
    with pytest.raises(TypeError, match="logits"):
        attention_entropy(torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_an_empty_batch_passes_through_and_records_nothing(attention):
    """B = 0 (a rank without data this micro-batch) or T = 0: the output is empty of the right shape, the
    recorded maxima stay as they were (None before any data), and a later batch records as usual."""
    from optbook.models.transformer import CausalSelfAttention, MultiHeadLatentAttention
    torch.manual_seed(0)
    layer = CausalSelfAttention(16, 4, 2) if attention == "mha" else MultiHeadLatentAttention(16, 4)
    assert layer(torch.zeros(0, 5, 16)).shape == (0, 5, 16)
    assert layer(torch.zeros(2, 0, 16)).shape == (2, 0, 16)
    assert layer.max_logits is None
    x = torch.randn(2, 5, 16)
    layer(x)
    before = layer.max_logits.clone()
    assert layer(torch.zeros(0, 5, 16)).shape == (0, 5, 16)
    assert torch.equal(layer.max_logits, before)
