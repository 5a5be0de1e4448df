"""optbook.distributed.moe_demo, the model and rank functions of chapter 14c, on gloo.

The chapter prints and asserts these numbers; the tests check the same claims at other sizes, so that a
change in the package that breaks them fails here and not only in the notebook.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from helpers import scaled_timeout
from optbook.distributed import launch
from optbook.distributed.moe_demo import ConvMoENet, chapter14c, dyadic, demo_shape, mesh_model
from optbook.optim import muon_param_groups


def test_conv_moe_net_routes_its_kernel_flattened_and_its_experts_stacked():
    model = ConvMoENet()
    assert model(torch.randn(3, 2, 6, 6)).shape == (3, 3)
    routing = muon_param_groups(model, conv="flatten", stacked=[model.moe.w_in, model.moe.w_out])
    assert routing.treatments == {
        "moe.router.weight": "matrix", "conv.weight": "flattened conv", "moe.w_in": "stacked",
        "moe.w_out": "stacked", "head.weight": "AdamW", "conv.bias": "AdamW", "norm.weight": "AdamW",
        "norm.bias": "AdamW", "head.bias": "AdamW"}
    assert "flattened to (8, 18)" in routing.reasons["conv.weight"]


def test_dyadic_means_over_one_two_and_four_equal_copies_are_exact_and_shapes_are_distinct():
    g = dyadic((9, 7), 3)
    for d in (2, 4):
        total = torch.zeros_like(g)
        for _ in range(d):
            total += g
        assert torch.equal(total / d, g)
    shapes = [tuple(sorted(demo_shape(i))) for i in range(16)]
    assert len(set(shapes)) == 16   # no two equal up to a transpose: no batched Newton-Schulz
    assert [tuple(p.shape) for p in (mesh_model().up.weight, mesh_model().experts)] == [(10, 12), (8, 6, 5)]


def test_owner_designs_collectives_per_step_and_qk_clip_one_max_at_three_ranks():
    """3 ranks, 1 and 5 matrices: the per-matrix design 2 calls per matrix, FSDP2Muon and LayerWiseMuon 3
    whatever the number, all bitwise single-process Muon; QK-clip one all-reduce for 3 layers, bitwise the
    one-process clip."""
    reports = launch(chapter14c, 3, counts=(1, 5), layers=(3,), meshes=False, timeout=scaled_timeout(180.0))
    for rep in reports:
        for k in (1, 5):
            assert all(len(s["calls"]) == 2 * k for s in rep["per_matrix"][k]["steps"])
            assert rep["per_matrix"][k]["steps"][0]["calls"][:2] == ["gather", "scatter"]
            for key in ("fsdp2", "layerwise"):
                assert all(len(s["calls"]) == 3 for s in rep[key][k]["steps"]), (key, k)
            for key in ("per_matrix", "fsdp2", "layerwise"):
                assert rep[key][k]["equal"], (key, k)
        assert rep["fsdp2"][5]["steps"][-1]["calls"] == ["all_reduce", "all_to_all", "all_to_all"]
        clip = rep["qk_clip"][3]
        assert clip["calls"] == ["all_reduce"] and clip["dtypes"] == ["torch.float64"]
        assert clip["bytes"]["all_reduce"] == Fraction(2 * 2, 3) * (1 + 3 * 4) * 8   # 1 + L H values, ring
        assert clip["equal"] and clip["same_report"] and clip["clipped"] > 0


def test_fsdp2muon_on_hsdp_and_tp_fsdp_meshes_with_local_experts_is_bitwise_single_process_muon():
    reports = launch(chapter14c, 4, counts=(), layers=(), timeout=scaled_timeout(180.0))
    for rep in reports:
        for layout in ("hsdp", "tp_fsdp"):
            run = rep["mesh"][layout]
            assert run["equal"], layout
            assert all(s["calls"] == ["all_reduce", "all_to_all", "all_to_all"] for s in run["steps"])
            assert run["owners"][2:] == [0, 0, 1, 1, 2, 2, 3, 3]   # experts stay where they live
    assert reports[0]["mesh"]["hsdp"]["placements"][0] == "(Replicate(), Shard(dim=0))"
    assert reports[0]["mesh"]["tp_fsdp"]["placements"][:2] == [
        "(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))"]
