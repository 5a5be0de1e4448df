"""An interrupt (Ctrl-C: ``KeyboardInterrupt``) while an optimizer creates a parameter's state leaves no
half-made state behind: the entries are built first and stored by one ``dict.update``, so the next step
starts the state afresh and equals an uninterrupted first step. (Before, Adam stored ``step`` and then
allocated its moments: an interrupt in between left ``{"step": 0}``, and every later step raised
``KeyError: 'exp_avg'``.)"""

import pytest
import torch

from optbook.optim import SOAP, AdaMuon, Adafactor, Adam, AdamW, Dion, Shampoo

# (class, options, what to interrupt: an attribute of torch or of torch.Tensor, and on which call)
CASES = [
    (Adam, dict(lr=1e-2, foreach=False), (torch, "zeros_like"), 2),
    (AdamW, dict(lr=1e-2, foreach=True), (torch, "zeros_like"), 2),
    (AdaMuon, dict(lr=1e-2), (torch, "zeros_like"), 2),
    (Adafactor, dict(lr=1e-2), (torch.Tensor, "new_zeros"), 2),
    (SOAP, dict(lr=1e-2), (torch.Tensor, "new_zeros"), 1),
    (Shampoo, dict(lr=1e-2), (torch, "eye"), 2),
    (Dion, dict(lr=1e-2), (torch, "randn"), 1),
]


@pytest.mark.parametrize("cls, options, target, call", CASES, ids=[c[0].__name__ for c in CASES])
def test_an_interrupt_while_creating_the_state_leaves_none(cls, options, target, call, monkeypatch):
    torch.manual_seed(0)
    W, G = torch.randn(6, 4), torch.randn(6, 4)
    p = torch.nn.Parameter(W.clone())
    p.grad = G.clone()
    opt = cls([p], **options)
    owner, name = target
    real = getattr(owner, name)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(name)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.setattr(owner, name, real)
    assert len(calls) == call   # the interrupt came while the state was being made
    assert not opt.state[p], dict(opt.state[p])
    assert torch.equal(p.detach(), W)
    opt.step()   # starts the state afresh: the same as an uninterrupted first step
    q = torch.nn.Parameter(W.clone())
    q.grad = G.clone()
    fresh = cls([q], **options)
    fresh.step()
    assert torch.equal(p.detach(), q.detach())
    assert opt.state[p].keys() == fresh.state[q].keys()
