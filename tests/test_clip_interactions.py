"""What a global clip does beyond one gradient: Muon's momentum, the other tensors' steps, torch's float16 norm.

These pin the claims of the docstrings of :mod:`optbook.clipping` and ``Muon``'s ``eps`` (chapter 12).
"""

import pytest
import torch

from optbook.clipping import clip_grad_norm_, get_grad_norm
from optbook.optim import AdamW, ChainedOptimizer, Muon

f64 = torch.float64


def cosine(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


def muon_updates(grads, factors, momentum=0.95):
    W = torch.zeros(grads[0].shape, dtype=f64, requires_grad=True)
    opt = Muon([W], lr=1.0, momentum=momentum, nesterov=momentum > 0, ns_dtype=f64)
    updates = []
    for G, c in zip(grads, factors):
        before = W.detach().clone()
        W.grad = c * G
        opt.step()
        updates.append(W.detach() - before)
    return updates


def test_a_clip_on_one_step_changes_muons_later_updates():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(32, 16, generator=gen, dtype=f64) for _ in range(5)]
    plain = muon_updates(grads, [1.0] * 5)
    once = muon_updates(grads, [1.0, 0.01, 1.0, 1.0, 1.0])
    every = muon_updates(grads, [0.01] * 5)
    assert cosine(plain[0], once[0]) == pytest.approx(1.0, abs=1e-12)  # before the clip
    assert round(cosine(plain[1], once[1]), 2) == 0.40                 # the value the eps docstring quotes
    assert all(cosine(a, b) < 0.99 for a, b in zip(plain[2:], once[2:]))
    assert all(cosine(a, b) == pytest.approx(1.0, abs=1e-12) for a, b in zip(plain, every))


def test_without_momentum_a_clip_on_one_step_changes_no_update():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(8, 4, generator=gen, dtype=f64) for _ in range(3)]
    plain = muon_updates(grads, [1.0, 1.0, 1.0], momentum=0.0)
    once = muon_updates(grads, [1.0, 1e-3, 1.0], momentum=0.0)  # no memory: each update its own gradient's
    for a, b in zip(plain, once):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-14)


def adamw_first_step(spike, per_group):
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(8, 8, generator=gen, dtype=f64, requires_grad=True)
    v = torch.randn(16, generator=gen, dtype=f64, requires_grad=True)
    W.grad = torch.randn(8, 8, generator=gen, dtype=f64)
    v.grad = torch.randn(16, generator=gen, dtype=f64)
    if spike is not None:
        W.grad[0, 0] = spike
    before = v.detach().clone()
    if per_group:
        clip_grad_norm_([W], 1.0)
        clip_grad_norm_([v], 1.0)
        opt = ChainedOptimizer([Muon([W], ns_dtype=f64), AdamW([v], lr=1e-3, weight_decay=0.0)])
    else:
        opt = ChainedOptimizer([Muon([W], ns_dtype=f64), AdamW([v], lr=1e-3, weight_decay=0.0)], max_grad_norm=1.0)
    opt.step()
    return float(((v.detach() - before).abs() / 1e-3).median())


def test_one_spike_shrinks_the_other_tensors_step_unless_groups_are_clipped_apart():
    assert adamw_first_step(None, per_group=False) == pytest.approx(1.0, abs=1e-3)
    assert adamw_first_step(1e9, per_group=False) < 0.05
    assert adamw_first_step(1e9, per_group=True) == pytest.approx(1.0, abs=1e-3)


def test_a_per_tensor_norm_finds_the_spiked_tensor():
    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(4, 4, dtype=f64, requires_grad=True) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(4, 4, generator=gen, dtype=f64)
    history = [float(get_grad_norm(p)) for p in params]
    params[1].grad[2, 3] = 1e9
    jumps = [float(get_grad_norm(p)) / h for p, h in zip(params, history)]
    assert [i for i, j in enumerate(jumps) if j > 10] == [1]


@pytest.mark.parametrize("value, finite", [(6e3, True), (7e3, False)])
def test_torch_float16_norm_overflows_only_above_65504(value, finite):
    # 100 entries: the sum of squares (3.6e9, 4.9e9) is far above 65504 in both cases; only the norm
    # (60000, 70000) decides, because torch accumulates float16 squares in float32 (the clipping docstring)
    g = torch.full((100,), value, dtype=torch.float16)
    norm = float(torch.linalg.vector_norm(g))
    assert (norm == pytest.approx(10 * value)) if finite else norm == float("inf")
    p = torch.zeros(100, dtype=torch.float16, requires_grad=True)
    p.grad = g.clone()
    assert float(get_grad_norm([p])) == pytest.approx(10 * value)  # optbook: float64, never inf here
