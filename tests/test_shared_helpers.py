"""One helper per shared idea: the classes that use it agree because they call the same function."""

import pytest
import torch
from torch import nn

from optbook.diagnostics import parameter_kind
from optbook.models import MLP, TinyTransformer
from optbook.optim import SOAP, BookOptimizer, Muon, Shampoo, muon_param_groups
from optbook.optim._functional import momentum_directions, use_foreach
from optbook.optim.param_groups import output_head


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_momentum_directions_loop_and_foreach_agree_bitwise_and_follow_the_lerp_form(nesterov, dtype):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g).to(dtype) for s in ((3, 4), (5,), ())]
    loop = [torch.randn(gr.shape, generator=g).to(dtype) for gr in grads]
    each = [m.clone() for m in loop]
    expected_m = [m.lerp(gr, 1 - 0.9) for m, gr in zip(loop, grads)]
    d_loop = momentum_directions(loop, grads, 0.9, nesterov)
    d_each = momentum_directions(each, grads, 0.9, nesterov, foreach=True)
    for a, b, m, e, gr in zip(d_loop, d_each, loop, expected_m, grads):
        assert torch.equal(a, b) and torch.equal(m, e)
        assert torch.equal(a, gr.lerp(m, 0.9) if nesterov else m)


def test_momentum_directions_case_3_lerp_nesterov():
    # cases/README.md case 3: p = 1, grads 1 then -2, mu = 0.9, lr 1.0 gives 0.81 then 1.109
    p, m = torch.tensor(1.0, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for grad, want in ((1.0, 0.81), (-2.0, 1.109)):
        (d,) = momentum_directions([m], [torch.tensor(grad, dtype=torch.float64)], 0.9, True)
        p -= d
        assert float(p) == pytest.approx(want, abs=1e-12)


def test_use_foreach_keeps_an_explicit_choice_and_picks_the_foreach_path_for_none():
    cpu = [torch.zeros(2)]
    assert use_foreach(True, cpu) is True and use_foreach(False, cpu) is False
    # None: the whole-tensor foreach path on the CPU too (the default CPU step); never for an empty list
    assert use_foreach(None, cpu) is True and use_foreach(None, []) is False
    assert use_foreach(None, [torch.zeros(2, device="meta")]) is False   # no foreach kernels there


class _NoHeadMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.classifier = nn.Linear(8, 3)


@pytest.mark.parametrize("model", [MLP(6, 8, 3, depth=2), _NoHeadMethod(),
                                   TinyTransformer(vocab_size=10, d_model=16, n_layers=1, n_heads=2)],
                         ids=["mlp", "no-get_output_embeddings", "transformer"])
def test_routing_and_diagnostics_agree_on_the_output_head(model):
    head = output_head(model)
    head_names = {n for n, p in model.named_parameters() if any(p is q for q in head.parameters())}
    kinds = parameter_kind(model)
    reasons = muon_param_groups(model).reasons
    assert head_names and {n for n, k in kinds.items() if k == "output"} == head_names
    # routing sends the head's matrix to AdamW as "output head" (its bias goes with the other biases)
    assert {n for n, r in reasons.items() if r == "output head"} == {n for n in head_names if n.endswith("weight")}


def test_output_head_is_the_last_linear_without_get_output_embeddings():
    model = _NoHeadMethod()
    assert output_head(model) is model.classifier
    assert output_head(nn.Sequential(nn.ReLU())) is None
    with pytest.raises(TypeError, match="model"):
        output_head("not a model")


def test_soap_stands_on_its_own_and_keeps_the_matrix_and_finite_checks():
    assert not issubclass(SOAP, Shampoo) and issubclass(SOAP, BookOptimizer)
    assert SOAP.refuse_nonfinite_grads and Shampoo.refuse_nonfinite_grads and Muon.refuse_nonfinite_grads
    for cls in (SOAP, Shampoo, Muon):
        with pytest.raises(ValueError, match=rf"{cls.__name__} updates 2-D matrices only.*parameter 1.*\(3,\)"):
            cls([torch.zeros(2, 2, requires_grad=True), torch.zeros(3, requires_grad=True)])
