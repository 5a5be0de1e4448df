"""optbook.optim.functional.muon batches blocks of one shape up to a transpose: the result is each block's own.

Reference: the same step run on each parameter alone (one ``newton_schulz`` call per matrix), in float64,
where batching changes nothing but the order of independent products.
"""

import torch

from optbook.optim.functional import muon


def _step(params, grads, **hyper):
    bufs = [torch.zeros_like(p) for p in params]
    muon(params, grads, bufs, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, ns_dtype=torch.float64,
         **hyper)
    return params


def test_tall_and_wide_blocks_in_one_batch_equal_each_block_alone():
    # (48, 12) and (12, 48) go into one batch of the wide orientation; shape_scaling gives the tall one
    # sqrt(4) = 2 and the wide one 1, so a mixed-up scale would show. Tolerance: float64 products of
    # values ~1, the same arithmetic in another batch layout: a few ulps.
    g = torch.Generator().manual_seed(0)
    shapes = [(48, 12), (12, 48), (48, 12), (12, 12)]
    base = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    for algorithm in ("standard", "gram", "auto"):
        together = _step([b.clone() for b in base], grads, ns_algorithm=algorithm, scale_mode="shape_scaling")
        alone = [_step([b.clone()], [gr], ns_algorithm=algorithm, scale_mode="shape_scaling")[0]
                 for b, gr in zip(base, grads)]
        for a, b in zip(together, alone):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
        assert (together[0] - base[0]).abs().max() > 1e-3       # it moved


def test_the_tall_blocks_update_has_the_tall_scale():
    # one tall matrix: its update is 0.05 * 2 * (an orthogonal-ish 48 x 12 matrix), singular values ~0.1
    g = torch.Generator().manual_seed(1)
    p0 = torch.zeros(48, 12, dtype=torch.float64)
    (p,) = _step([p0.clone()], [torch.randn(48, 12, generator=g, dtype=torch.float64)], coefficients="polar_express",
                 ns_steps=8, scale_mode="shape_scaling")
    s = torch.linalg.svdvals(p)
    assert 0.09 < float(s.min()) and float(s.max()) < 0.11
