"""No-decay groups are decided by module type and tensor role, not by name (case 7)."""

import pytest
import torch
from torch import nn

from optbook.optim import AdamW, classify_parameters, format_param_groups, weight_decay_param_groups


class CustomRMSNorm(nn.Module):
    """A home-made RMSNorm: unknown module type, 1-D gain."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Case7(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.embed_tokens = nn.Embedding(10, 4)
        self.attn = nn.Linear(4, 4)
        self.LayerNorm = nn.LayerNorm(4)
        self.layer_norm = nn.LayerNorm(4)
        self.norm = CustomRMSNorm(4)
        self.torch_rms = nn.RMSNorm(4)
        self.ln_f = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def names(group):
    return set(group["param_names"])


def test_every_norm_gain_bias_and_scale_is_not_decayed_whatever_its_name():
    decay, plain = weight_decay_param_groups(Case7(), 0.1)
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert names(decay) == {"attn.weight", "lm_head.weight"}
    assert names(plain) == {"scale", "embed_tokens.weight", "attn.bias", "LayerNorm.weight", "LayerNorm.bias",
                            "layer_norm.weight", "layer_norm.bias", "norm.weight", "torch_rms.weight",
                            "ln_f.weight", "ln_f.bias"}


def test_name_lists_miss_what_roles_catch():
    # the common name rule misses layer_norm, norm and ln_f
    model = Case7()
    by_name = {n for n, _ in model.named_parameters() if "bias" in n or "LayerNorm" in n}
    missed = {"layer_norm.weight", "norm.weight", "ln_f.weight"}
    assert not missed & by_name
    _, plain = weight_decay_param_groups(model, 0.1)
    assert missed <= names(plain)


def test_embeddings_can_be_decayed_on_request():
    decay, plain = weight_decay_param_groups(Case7(), 0.1, decay_embeddings=True)
    assert "embed_tokens.weight" in names(decay)


def test_tied_output_head_is_listed_once_as_an_embedding():
    model = Case7(tied=True)
    infos = classify_parameters(model)
    assert len(infos) == len({id(p) for p in model.parameters()})
    roles = {i.name: i.role for i in infos}
    assert roles["embed_tokens.weight"] == "embedding" and "lm_head.weight" not in roles
    groups = weight_decay_param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_groups_feed_an_optimizer_and_report_the_split():
    groups = weight_decay_param_groups(Case7(), 0.1, lr=3e-4)
    opt = AdamW(groups)
    assert [g["lr"] for g in opt.param_groups] == [3e-4, 3e-4]
    assert [g["param_names"] for g in opt.param_groups] == [g["param_names"] for g in groups]
    table = format_param_groups(groups)
    assert "weight_decay=0.1, 2 tensors" in table and "ln_f.weight" in table


def test_frozen_parameters_are_left_out_and_bad_input_is_refused():
    model = Case7()
    model.attn.weight.requires_grad_(False)
    decay, _ = weight_decay_param_groups(model, 0.1)
    assert "attn.weight" not in names(decay)
    with pytest.raises(ValueError, match="weight_decay"):
        weight_decay_param_groups(model, -1.0)
    with pytest.raises(TypeError, match="model"):
        weight_decay_param_groups([torch.zeros(2)], 0.1)
