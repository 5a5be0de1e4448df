"""FSDP2Muon and optbook's element-wise optimizers on DTensor parameters of 1-D and 2-D device meshes.

One gloo launch per world size (4, then 2, 3 and 1 processes) runs every case (``fsdp2_mesh_ranks.suite``):
FSDP2 on a 1-D mesh (uneven and empty shards), HSDP on ``("replicate", "shard")``, TP x FSDP on ``("dp",
"tp")`` (FSDP2's ``_StridedShard`` over column-parallel weights), dense weights on ``dp`` with a stack of
experts on ``ep`` in one optimizer, in float64 and float32: bitwise the single-process optimizer on whole
tensors with the same gradients. At 4 ranks the 2-D meshes are 2 x 2; at 2, ``(2, 1)``; at 3 and 1,
``(1, d)``. Also: the collectives of a step (at most 4 calls whatever the number of matrices, bytes as
predicted), the clip norm counting each replicated element once, DCP across mesh shapes, refusals.
"""

from __future__ import annotations

import pytest
from fsdp2_mesh_ranks import DENSE, STEPS, suite, two_d

from optbook.distributed import launch
from helpers import scaled_timeout

WORLD_SIZES = (4, 2, 3, 1)   # 4 first: it writes the checkpoint the 2-rank launch loads
MUON_CASES = [f"muon/{layout}/{dtype}" for layout in ("1d", "hsdp", "tp", "experts", "submesh")
              for dtype in ("float64", "float32")]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dcp_mesh"))
    return {d: launch(suite, d, ckpt_dir=ckpt, timeout=scaled_timeout(300.0)) for d in WORLD_SIZES}


def _rows(reports, case, sizes=WORLD_SIZES):
    for d in sizes:
        for rank, rep in enumerate(reports[d]):
            row = rep[case]
            assert "error" not in row, f"{case} at {d} ranks, rank {rank}:\n{row.get('error')}"
            yield d, rank, row


@pytest.mark.parametrize("case", MUON_CASES)
def test_fsdp2muon_mesh_is_bitwise_single_process_muon(reports, case):
    for d, rank, row in _rows(reports, case):
        assert row["layout"], (case, d, rank)     # the index map is the layout the parallel API made
        assert row["params"] and row["state"], (case, d, rank)
        assert row["ns_calls"] == STEPS * sum(o == rank for o in row["owners"]), (case, d, rank)
    for d in WORLD_SIZES:   # every matrix has one owner
        owners = reports[d][0][case]["owners"]
        assert all(rep[case]["owners"] == owners for rep in reports[d]) and set(owners) <= set(range(d))


def test_fsdp2muon_mesh_tp_fsdp_weights_carry_fsdp2s_strided_shards(reports):
    for d, rank, row in _rows(reports, "muon/tp/float64", (4,)):
        # colwise, then fully_shard; rowwise, then fully_shard
        assert row["placements"][0] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert row["placements"][1] == "(Shard(dim=0), Shard(dim=1))"
        assert row["layout"] and row["params"]


def test_fsdp2muon_mesh_expert_local_weights_stay_on_their_rank(reports):
    """On a 1-D ``ep`` mesh a rank holds whole experts and owns them: the stack moves no byte."""
    for d, rank, row in _rows(reports, "muon/experts/float64"):
        assert row["experts_here_owned_here"] and row["experts_bytes"] == 0, (d, rank)


def test_fsdp2muon_mesh_experts_replicated_over_dp_return_only_to_the_replicas(reports):
    """On the ``ep`` sub-mesh of a ``("dp", "ep")`` mesh each expert has a replica per ``dp`` rank: it is
    owned by one of its holders (nothing is sent to the owner), and a rank receives only the updates of the
    experts it holds but does not own (float64: 5 x 4 x 8 bytes each)."""
    for d in WORLD_SIZES:
        replicas = 0
        for _, rank, row in _rows(reports, "muon/submesh/float64", (d,)):
            first = next(u for u, (i, _, _) in enumerate(row["units"]) if i == len(DENSE))
            not_owned = [e for e in row["experts_held"] if row["owners"][first + e] != rank]
            for e in range(6):   # owned by a rank that holds it
                assert e in reports[d][row["owners"][first + e]]["muon/submesh/float64"]["experts_held"]
            assert row["experts_bytes"] == len(not_owned) * 20 * 8, (d, rank, not_owned)
            replicas += len(not_owned)
        assert replicas == 6 * (two_d(d)[0] - 1)   # every replica but the owner's receives the update


@pytest.mark.parametrize("case", ["adamw/hsdp", "adamw/tp", "sgd/hsdp", "sgd/tp"])
def test_elementwise_optimizers_on_mesh_params_are_bitwise_single_process(reports, case):
    for d, rank, row in _rows(reports, case):
        assert row["layout"] and row["params"] and row["state"], (case, d, rank)


def test_fsdp2muon_mesh_clip_counts_each_replicated_element_once(reports):
    for d, rank, row in _rows(reports, "clip/hsdp"):
        norm, ref_norm = row["norm"]
        # a replica counted twice would make it sqrt(2) times larger
        assert norm == pytest.approx(ref_norm, rel=1e-12, abs=0), (d, rank)
        assert row["diff"] < 1e-12 and row["layout"], (d, rank)


def test_fsdp2muon_mesh_collectives_per_step(reports):
    """2 and 40 HSDP matrices at 2 x 2: the same 4 calls per step (agreement, norm, two all-to-alls), and
    on every rank the bytes counted at the dispatcher are ``predicted_received_bytes()``."""
    for (_, rank, few), (_, _, many) in zip(_rows(reports, "collectives/2", (4,)),
                                            _rows(reports, "collectives/40", (4,))):
        assert few["calls"] == many["calls"] == 4, (few["names"], many["names"])
        assert sorted(few["names"]) == ["all_reduce", "all_reduce", "all_to_all", "all_to_all"]
        for row in (few, many):
            assert row["received"] == row["predicted"], (rank, row)
        assert many["received"]["all_to_all"] > few["received"]["all_to_all"] > 0


def test_fsdp2muon_mesh_dcp_saved_on_hsdp_2x2_resumes_on_a_1d_mesh_of_4(reports):
    """Parameters and momentum bitwise the uninterrupted single-process Muon's, after 2 steps on HSDP
    2 x 2, a DCP checkpoint, and 2 steps on a fresh 1-D mesh of 4 loaded from it."""
    for case in ("dcp/hsdp-save", "dcp/1d-load"):
        for d, rank, row in _rows(reports, case, (4,)):
            assert row["equal"] and row["momentum"], (case, d, rank)


def test_fsdp2muon_mesh_dcp_saved_on_4_ranks_resumes_on_hsdp_at_2_ranks(reports):
    """The same across world sizes: saved on a 1-D mesh of 4, resumed on a (1, 2) HSDP mesh of 2 ranks."""
    for case, sizes in (("dcp/1d-save", (4,)), ("dcp/hsdp-load", (2,))):
        for d, rank, row in _rows(reports, case, sizes):
            assert row["equal"] and row["momentum"], (case, d, rank)
            assert row["placements"] == ("(Replicate(), Shard(dim=0))" if d == 2 else "(Shard(dim=0),)")


def test_mesh_owners_are_lpt_unless_a_rank_holds_the_matrix_whole():
    """Without whole holders the owners are lpt_assign's; a matrix held whole goes to its least loaded
    holder, the others fill around it by LPT."""
    from optbook.distributed import lpt_assign
    from optbook.distributed.mesh_exchange import local_first_lpt

    costs = [7, 3, 9, 9, 1, 4, 4, 2]
    for d in (1, 2, 3, 4):
        assert local_first_lpt(costs, [[]] * len(costs), d) == lpt_assign(costs, d)
    holders = [[], [], [], [], [], [], [], []]
    holders[2] = [1, 3]   # the first 9 is held whole by ranks 1 and 3: it goes to rank 1 (both at 0)
    assert local_first_lpt(costs, holders, 4) == [2, 2, 1, 0, 0, 3, 3, 3]   # lpt_assign: [2, 2, 0, 1, ...]


def test_fsdp2muon_mesh_refuses_mixed_dtypes_and_partial_placements(reports):
    for d, rank, row in _rows(reports, "refusals", (2,)):
        dtypes, partial = row["dtypes"], row["partial"]
        assert dtypes.startswith("ValueError") and "float32" in dtypes and "parameter 1" in dtypes
        assert partial.startswith("TypeError") and "Partial" in partial and "parameter 1" in partial
