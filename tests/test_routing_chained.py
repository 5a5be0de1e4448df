"""Muon/AdamW routing by module type and role, and the chained optimizer."""

import copy

import pytest
import torch
import torch.nn.functional as F

from optbook.models import MLP, TinyTransformer
from optbook.optim import AdamW, ChainedOptimizer, Muon, muon_param_groups


def routed(model):
    r = muon_param_groups(model, weight_decay=0.1)
    muon = {n for g in r.muon for n in g["param_names"]}
    adamw = {n for g in r.adamw for n in g["param_names"]}
    return r, muon, adamw


def test_transformer_routing_hidden_matrices_to_muon_rest_to_adamw():
    model = TinyTransformer(vocab_size=20, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2)
    r, muon, adamw = routed(model)
    assert muon == {n for n, p in model.named_parameters() if ".attn." in n and "proj" in n or ".mlp." in n}
    assert {"embed_tokens.weight", "embed_positions.weight", "lm_head.weight", "norm.weight"} <= adamw
    assert not muon & adamw and len(muon | adamw) == len(list(model.parameters()))
    assert r.reasons["lm_head.weight"] == "output head"
    assert "layers.0.attn.q_proj.weight" in r.table()


def test_tied_embedding_is_routed_once_to_adamw_without_decay():
    model = TinyTransformer(vocab_size=20, d_model=16, n_layers=1, n_heads=2, tie_embeddings=True)
    r, muon, adamw = routed(model)
    assert "embed_tokens.weight" in adamw and "lm_head.weight" not in muon | adamw
    plain = [g for g in r.adamw if g["weight_decay"] == 0.0][0]
    assert "embed_tokens.weight" in plain["param_names"]
    assert sum(len(g["params"]) for g in r.muon + r.adamw) == len(list(model.parameters()))


def test_mlp_classifier_head_goes_to_adamw():
    _, muon, adamw = routed(MLP(64, 32, 10, depth=2, norm=True))
    assert muon == {"0.weight", "3.weight"}
    assert "6.weight" in adamw and "0.bias" in adamw and "1.weight" in adamw


def test_chained_optimizer_one_step_one_state_dict_one_scheduler_one_norm():
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=20, d_model=16, n_layers=1, n_heads=2)
    r = muon_param_groups(model, weight_decay=0.1, adamw_options={"lr": 1e-3})

    def build(m):
        rr = muon_param_groups(m, weight_decay=0.1, adamw_options={"lr": 1e-3})
        return ChainedOptimizer([Muon(rr.muon, lr=0.02), AdamW(rr.adamw)], max_grad_norm=1.0)

    twin = copy.deepcopy(model)
    opt, opt_twin = build(model), build(twin)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    x = torch.randint(0, 20, (3, 8))

    def closure(m, o):
        o.zero_grad()
        loss = F.cross_entropy(m(x).flatten(0, 1), x.flatten())
        loss.backward()
        return loss

    closure(model, opt)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.0005, 0.0005]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(total) <= 1.0 + 1e-5 and float(opt.last_grad_norm) > 1.0  # clipped by the global norm

    # one state_dict restores both children
    saved = copy.deepcopy(opt.state_dict())
    twin.load_state_dict(model.state_dict())
    opt_twin.load_state_dict(saved)
    for g_twin, g in zip(opt_twin.param_groups, opt.param_groups):
        g_twin["lr"] = g["lr"]
    closure(model, opt)
    opt.step()
    closure(twin, opt_twin)
    opt_twin.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_chained_optimizer_refuses_bad_input():
    p = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(ValueError, match="optimizers"):
        ChainedOptimizer([])
    with pytest.raises(ValueError, match="two"):
        ChainedOptimizer([AdamW([p]), Muon([p])])
    with pytest.raises(TypeError, match="optimizers"):
        ChainedOptimizer([object()])
    with pytest.raises(ValueError, match="max_grad_norm"):
        ChainedOptimizer([AdamW([p])], max_grad_norm=0.0)
    with pytest.raises(ValueError, match="state_dict"):
        ChainedOptimizer([AdamW([p])]).load_state_dict({"optimizers": []})


def test_transformer_records_per_head_max_logits_in_training_mode_only():
    model = TinyTransformer(vocab_size=20, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2)
    with pytest.raises(RuntimeError, match="max logits"):
        model.max_logits()
    x = torch.randint(0, 20, (2, 8))
    model.eval()
    model(x)
    assert model.layers[0].attn.max_logits is None
    model.train()
    model(x)
    S = model.max_logits()
    assert S.shape == (2, 4)
    # recompute layer 0's logits by hand: the recorded value is the max over batch and causal positions
    attn, block = model.layers[0].attn, model.layers[0]
    h = block.attn_norm(model.embed_tokens(x) + model.embed_positions(torch.arange(8)))
    q = attn.q_proj(h).view(2, 8, 4, 4).transpose(1, 2)
    k = attn.k_proj(h).view(2, 8, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1)
    logits = (q @ k.transpose(-2, -1)) / 2.0
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    expected = logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(S[0], expected.detach())
