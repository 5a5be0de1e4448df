"""The diagrams of chapters 13 and 14 (optbook.plotting) report what they draw, read from the package's own
layout and owner assignment: the values a chapter cell asserts."""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from optbook import plotting  # noqa: E402
from optbook.distributed import lpt_assign, ns_cost, shard_layout  # noqa: E402


def test_zero1_timeline_holds_the_full_buffer_then_one_shard_then_the_full_parameters():
    layout = shard_layout([torch.empty(40, 30), torch.empty(30), torch.empty(20, 40), torch.empty(20)], 3)
    fig, ax = plotting.subplots(1, 1, width=8, height=3)
    drawn = plotting.zero1_step_timeline(ax, layout)
    total = sum(b.numel for b in layout.buckets)
    assert total == layout.buffer_numel[torch.float32] and total >= 40 * 30 + 30 + 20 * 40 + 20
    assert [m for m, _ in drawn] == ["local gradient (full)", "its shard, summed", "shard stepped (master, m, v)",
                                     "parameters (full)"]
    assert drawn[0][1] == drawn[3][1] == [total] * 3
    assert drawn[1][1] == drawn[2][1] == [total // 3] * 3
    matplotlib.pyplot.close(fig)


def test_muon_ownership_owners_do_each_matrix_once_moonlight_repeats_the_cut_ones():
    shapes = [(64, 64)] * 4 + [(256, 64), (64, 256)]
    fig, axes = plotting.subplots(2, 1, width=7, height=2)
    work = plotting.muon_ownership(axes, shapes, 4)
    costs = [ns_cost(s) for s in shapes]
    owners = lpt_assign(costs, 4)
    assert work["owners"] == [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    assert sum(work["owners"]) == sum(costs)
    layout = shard_layout([torch.empty(s) for s in shapes], 4)
    cut = [i for i in range(len(shapes)) if sum(any(p.index == i for p in layout.pieces(r)) for r in range(4)) > 1]
    assert cut and sum(work["moonlight"]) == sum(costs) + sum(
        costs[i] * (sum(any(p.index == i for p in layout.pieces(r)) for r in range(4)) - 1) for i in cut)
    matplotlib.pyplot.close(fig)
