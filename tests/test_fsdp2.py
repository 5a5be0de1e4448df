"""optbook's element-wise optimizers on parameters sharded by FSDP2 (``fully_shard``: ``DTensor``, ``Shard(0)``).

Each optimizer steps the sharded copy of a float64 model with the reference's own gradients, distributed:
the parameters after every step and the state after the last are bitwise those of the single-process run,
at 2, 3 and 4 gloo processes (uneven shards; empty shards at 3 and 4). A NaN in one rank's shard stops every
rank before anything is written; optimizers that need whole matrices refuse sharded parameters.
"""

from __future__ import annotations

import pytest
from fsdp2_ranks import ELEMENTWISE, elementwise_run, nonfinite_run, refusal_run

from optbook.distributed import launch
from helpers import scaled_timeout


@pytest.fixture(scope="module", params=[2, 3, 4])
def elementwise_reports(request):
    return request.param, launch(elementwise_run, request.param, timeout=scaled_timeout(240.0))


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_optimizer_on_shards_is_bitwise_the_single_process_run(elementwise_reports, name):
    world_size, reports = elementwise_reports
    for rank, report in enumerate(reports):
        row = report[name]
        assert row["params"], f"{name}: parameters differ at {world_size} ranks (rank {rank})"
        assert row["state"], f"{name}: state differs at {world_size} ranks (rank {rank})"
        assert row.get("eval", True), f"{name}: eval-mode weights differ at {world_size} ranks (rank {rank})"


def test_the_problem_has_empty_shards_at_3_and_4_ranks(elementwise_reports):
    world_size, reports = elementwise_reports
    empty = sum(r["empty_shards"] for r in reports)
    assert (empty > 0) == (world_size > 2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_nan_in_one_shard_stops_every_rank_before_any_write(world_size):
    reports = launch(nonfinite_run, world_size, timeout=scaled_timeout(120.0))
    assert [r["holds_nan_locally"] for r in reports] == [False] * (world_size - 1) + [True]
    for r in reports:
        assert r["message"] is not None and "param_groups[0]['params'][0]" in r["message"]
        assert "NaN" in r["message"]
        assert r["unchanged"] and r["state"] == 0


def test_whole_matrix_optimizers_refuse_sharded_parameters():
    for report in launch(refusal_run, 2, timeout=scaled_timeout(120.0)):
        for name in ("Muon", "Adafactor"):
            assert report[name] is not None and "DTensor" in report[name] and name in report[name]


# --- Muon through owners -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fsdp2_muon_is_bitwise_single_process_muon(world_size):
    from fsdp2_ranks import muon_run

    reports = launch(muon_run, world_size, timeout=scaled_timeout(240.0))
    for r in reports:
        assert r["diff"] == 0.0 and r["state"], r
        assert r["ns_calls"] == 3 * r["owned"]   # each owned matrix once per step
    assert sum(r["owned"] for r in reports) == 3


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fsdp2_muon_is_bitwise_muon_with_even_shards_and_a_batched_tall_and_wide_pair(world_size):
    """Even shards take the in-place path (received into the matrix, scattered as row views); the tall
    matrix's update, a transposed view, is copied into shards."""
    from fsdp2_ranks import muon_run

    reports = launch(muon_run, world_size, pairs=True, timeout=scaled_timeout(240.0))
    for r in reports:
        assert r["diff"] == 0.0 and r["state"], r
        assert r["ns_calls"] == 3 * r["owned"]
    assert sum(r["owned"] for r in reports) == 4


def test_fsdp2_muon_orthogonalises_once_per_step_whatever_the_accumulation():
    from fsdp2_ranks import muon_run

    reports = launch(muon_run, 3, accumulate=4, timeout=scaled_timeout(240.0))
    assert [r["ns_calls"] for r in reports] == [3 * r["owned"] for r in reports]
    assert all(r["diff"] == 0.0 for r in reports)


def test_fsdp2_muon_clips_by_the_norm_of_the_unsharded_gradient():
    from fsdp2_ranks import muon_run

    reports = launch(muon_run, 3, max_grad_norm=0.05, timeout=scaled_timeout(240.0))
    norms = {r["last_grad_norm"] for r in reports}
    assert len(norms) == 1 and next(iter(norms)) > 0.05   # the clip acted, the same norm on every rank
    # the norm is summed over shards in another order than the reference's: equal to rounding
    assert all(r["diff"] < 1e-12 for r in reports)


def test_fsdp2_muon_refuses_plain_tensors_and_stops_every_rank_on_a_nan():
    from fsdp2_ranks import muon_refusals

    for r in launch(muon_refusals, 2, timeout=scaled_timeout(120.0)):
        assert r["plain"] is not None and "not a DTensor" in r["plain"]
        assert r["nonfinite"] is not None and "inf" in r["nonfinite"] and r["unchanged"]


def test_fsdp2_muon_agrees_on_inputs_over_the_mesh_and_reads_tensor_hyperparameters_as_muon_does():
    from fsdp2_ranks import muon_input_agreement

    # a short collective timeout: a rank left waiting in a gather would fail the launch, not hang the test
    reports = launch(muon_input_agreement, 2, timeout=scaled_timeout(20.0))
    for rank, r in enumerate(reports):
        assert r["tensor_hyperparameters"] == 0.0  # one-element tensor lr, momentum, weight_decay: as plain Muon
        err, unchanged = r["bad_lr_on_last_rank"]
        assert err is not None and err[0] == "ValueError" and unchanged, err
        assert ("lr" in err[1]) if rank == 1 else ("rank 1 of the mesh" in err[1])
        err, unchanged = r["grad_none_on_last_rank"]
        assert err is not None and err[0] == "ValueError" and unchanged, err
        assert "parameter 1 " in err[1] and "on mesh ranks [0] and none on mesh ranks [1]" in err[1]
        assert r["after"] == 0.0  # the refused steps changed nothing: the run continues as plain Muon's
        assert r["all_reduce_bytes"] == 12  # the agreement: three int32, which also carry the non-finite verdict


@pytest.mark.parametrize("world_size", [2, 3])
def test_qk_clip_on_sharded_attention_weights_is_the_single_process_clip(world_size):
    from fsdp2_ranks import qk_clip_run

    for r in launch(qk_clip_run, world_size, timeout=scaled_timeout(240.0)):
        assert r["maxima_diff"] < 1e-12      # the per-rank maxima, reduced, are the whole batch's
        assert r["clipped"] > 0 and r["weights_equal"], r


# --- DCP checkpoints -----------------------------------------------------------------------------------------------
def test_dcp_checkpoint_resumes_at_another_world_size_and_in_one_process(tmp_path):
    """Saved with torch.distributed.checkpoint at 2 ranks after 2 steps of FSDP2Muon + AdamW; resumed at 3 ranks
    and, into a plain model with optbook's Muon + AdamW, in one process: 2 more steps bitwise the uninterrupted
    single-process run (parameters and momentum)."""
    from fsdp2_ranks import dcp_run

    ckpt = str(tmp_path / "ckpt")
    for phase, world_size in (("save", 2), ("resume", 3), ("single", 1)):
        for r in launch(dcp_run, world_size, ckpt_dir=ckpt, phase=phase, timeout=scaled_timeout(240.0)):
            assert r["equal"] and r["momentum"], (phase, world_size, r)
            assert r["steps"] == (2 if phase == "save" else 4)
