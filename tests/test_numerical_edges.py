"""The optimizers' numerical edges (issue 40, second half): each test fails on the code before its fix.

Dion after an all-zero gradient and under a strided layout; Muon, NorMuon and AdaMuon on rounding-noise
gradients; Shampoo before its statistics are ready; SOAP's first step in float32; the compiled Muon step
under hyperparameter schedules; AdaMuon's two versions; ``polar_express_coefficients`` on numpy scalars;
param groups that torch.distributed.checkpoint can save.
"""

from __future__ import annotations

import math

import pytest
import torch

from optbook.optim import Dion

F64 = torch.float64


# --- Dion ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_dion_after_an_all_zero_gradient_keeps_q_and_continues_as_if_it_never_happened(dtype):
    """A zero gradient on a zero buffer leaves ``Q`` and the weights alone; the next steps are bitwise the
    steps of an optimizer that never saw it. Before the guard ``Q`` became exactly zero and the next update
    had singular values from 0.05 to 1.86 (float64, seed 0) instead of Dion's usual ones."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(16, 12, generator=gen, dtype=dtype)
    grads = [torch.randn(16, 12, generator=gen, dtype=dtype) for _ in range(4)]
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_a, opt_b = Dion([a], lr=0.1, momentum=0.9), Dion([b], lr=0.1, momentum=0.9)
    a.grad = torch.zeros_like(a)
    opt_a.step()
    assert torch.equal(a.detach(), w0)                                   # no update from a zero buffer
    q = opt_a.state[a]["right_factor"]
    assert torch.linalg.vector_norm(q) > 1                               # Q kept (was exactly zero)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        assert torch.equal(a.detach(), b.detach())
    assert torch.equal(opt_a.state[a]["right_factor"], opt_b.state[b]["right_factor"])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("rank_fraction", [1.0, 0.5])
def test_dion_update_does_not_depend_on_the_parameters_memory_layout(dtype, rank_fraction):
    """A parameter stored as the transpose of a contiguous tensor (strides (1, m)) gets bitwise the
    update of its contiguous twin (before: up to 2.4e-7 apart in float32, from strided GEMMs)."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(24, 40, generator=gen, dtype=dtype)
    grads = [torch.randn(24, 40, generator=gen, dtype=dtype) for _ in range(5)]
    dense = torch.nn.Parameter(w0.clone())
    strided = torch.nn.Parameter(w0.T.contiguous().T)                    # same values, column-major
    assert not strided.is_contiguous()
    opts = [Dion([p], lr=0.05, weight_decay=0.1, rank_fraction=rank_fraction) for p in (dense, strided)]
    for g in grads:
        dense.grad = g.clone()
        strided.grad = g.T.contiguous().T
        for o in opts:
            o.step()
        assert torch.equal(dense.detach(), strided.detach())
