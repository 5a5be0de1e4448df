"""A constant number of collectives per step for the owner-based distributed Muon (LayerWiseMuon) and a count
that grows per bucket, not per matrix, for Moonlight's DistributedMuon; bytes received per rank equal to the
formula, counted at the dispatcher (:class:`optbook.distributed.wire.CommCounter`); owners balanced by
Newton–Schulz FLOPs against Megatron-LM core_v0.16.0's element-count ping-pong.

One launch of 4 gloo processes runs 3 and 60 matrices (mixed shapes; bfloat16, float32 and float64 for
LayerWiseMuon) on groups of 2 and 4 ranks (``tests/muon_rank_programs.py``, :func:`collectives_suite`); with 3
matrices on 4 ranks one rank owns nothing.
"""

import itertools

import pytest
import torch
from owner_collectives_ranks import COLLECTIVE_GROUPS, collectives_problem, collectives_reference, collectives_suite

from optbook.distributed import launch, lpt_assign, ns_cost, rank_loads
from optbook.distributed.assignment import owned_pack, owner_step_comm, pingpong_assign
from helpers import scaled_timeout

STEPS = 3
LAYERWISE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


@pytest.fixture(scope="module")
def runs():
    """{world size: [group rank 0's report, ...]} from one launch of 4 processes."""
    reports = launch(collectives_suite, 4, timeout=scaled_timeout(120.0), steps=STEPS)
    return {size: [reports[g][size] for g in ranks] for size, ranks in COLLECTIVE_GROUPS.items()}


def _bitwise(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("world_size", sorted(COLLECTIVE_GROUPS))
def test_layerwise_muon_collectives_per_step_are_at_most_4_whatever_the_number_of_matrices(runs, world_size):
    counts = set()
    for rank, rep in enumerate(runs[world_size]):
        for n in (3, 60):
            r = rep["layerwise", n]
            predicted = r["predicted"]
            for step in r["steps"]:
                assert step["calls"] == predicted["calls"], (rank, n)
                assert step["received"] == predicted["received"], (rank, n)   # exact: ints and Fractions
                assert step["other_calls"] == 0
                counts.add(len(step["calls"]))
            # the three dtypes: a status all-reduce, float32 and float64 gradient all-reduces, one byte gather
            assert predicted["calls"] == [("all_reduce", torch.float64), ("all_reduce", torch.float32),
                                          ("all_reduce", torch.float64), ("all_gather", torch.uint8)]
    assert counts == {4}


@pytest.mark.parametrize("world_size", sorted(COLLECTIVE_GROUPS))
def test_layerwise_received_bytes_equal_the_formula_written_out(runs, world_size):
    """The formula of ``owner_step_comm`` spelled out here, from the shapes alone."""
    from fractions import Fraction

    d = world_size
    for n in (3, 60):
        params = collectives_problem(n, LAYERWISE_DTYPES)
        owners = runs[world_size][0]["layerwise", n]["owners"]
        assert owners == lpt_assign([ns_cost(p.shape) for p in params], d)
        if n == 3 and d == 4:
            assert 3 not in owners   # a rank owning nothing
        grads32 = sum(4 * p.numel() for i, p in enumerate(params) if i != 1 and p.dtype != torch.float64)
        grads64 = sum(8 * p.numel() for i, p in enumerate(params) if i != 1 and p.dtype == torch.float64)
        owned = [sum(p.numel() * p.element_size() for p, o in zip(params, owners) if o == r) for r in range(d)]
        chunk = -(-max(owned) // 8) * 8
        expected = {"all_reduce": Fraction(2 * (d - 1), d) * (8 * (1 + n) + grads32 + grads64),
                    "all_gather": (d - 1) * chunk}
        for rep in runs[world_size]:
            assert rep["layerwise", n]["steps"][-1]["received"] == expected
        assert len(set(owned)) > 1   # uneven loads


@pytest.mark.parametrize("world_size", sorted(COLLECTIVE_GROUPS))
def test_layerwise_muon_with_one_byte_gather_still_equals_single_process_muon_bit_for_bit(runs, world_size):
    for n in (3, 60):
        ref = collectives_reference(n, LAYERWISE_DTYPES, STEPS)
        for rep in runs[world_size]:
            assert _bitwise(rep["layerwise", n]["params"], ref), n


@pytest.mark.parametrize("world_size", sorted(COLLECTIVE_GROUPS))
def test_distributed_muon_collectives_per_step_grow_per_bucket_not_per_matrix(runs, world_size):
    counts = set()
    for rep in runs[world_size]:
        for n in (3, 60):
            r = rep["moonlight", n]
            assert r["buckets"] == 2   # one bucket per dtype (bucket_size=None): float32 and float64
            for step in r["steps"]:
                assert step["calls"] == r["predicted"]["calls"]
                assert step["received"] == r["predicted"]["received"]
                counts.add(len(step["calls"]))
    assert counts == {2 + 3 * 2}
    for n in (3, 60):
        ref = collectives_reference(n, (torch.float32, torch.float64), STEPS)
        for rep in runs[world_size]:
            assert _bitwise(rep["moonlight", n]["params"], ref), n


# --- formulas and owners (single process) ------------------------------------------------------------------
def test_owned_pack_aligns_every_matrix_to_its_element_size_and_one_dtype_needs_no_padding():
    numels, dtypes = [3, 5, 2, 7], [torch.bfloat16, torch.float64, torch.float32, torch.bfloat16]
    chunk, plan = owned_pack(numels, dtypes, [0, 0, 0, 1], 2)
    assert plan == [[(1, 0), (2, 40), (0, 48)], [(3, 0)]]
    assert chunk == 56   # 40 + 8 + 6 = 54 bytes on rank 0, rounded up to 8
    chunk, plan = owned_pack([3, 5], [torch.float32] * 2, [0, 1], 2)
    assert chunk == 20 and plan == [[(0, 0)], [(1, 0)]]
    assert owned_pack([0, 0], [torch.float32] * 2, [0, 1], 2)[0] == 0
    comm = owner_step_comm([0, 0], [torch.float32] * 2, [0, 1], 2)
    assert comm["calls"] == [("all_reduce", torch.float64)] and "all_gather" not in comm["received"]
    with pytest.raises(ValueError, match="owners"):
        owned_pack([1], [torch.float32], [2], 2)


def test_pingpong_is_megatron_core_v0_16_rule():
    # its comment's example: 10 parameters p0..p9 (ascending numel) on 4 ranks
    owners = pingpong_assign(list(range(1, 11)), 4)
    assert [[i for i in range(10) if owners[i] == r] for r in range(4)] == [[0, 7, 8], [1, 6, 9], [2, 5], [3, 4]]


def test_lpt_on_ns_cost_is_within_grahams_bound_where_element_count_ping_pong_is_not():
    """Equal element counts, unequal Newton–Schulz work: ping-pong puts both square matrices on one rank."""
    shapes = [(256, 256), (4096, 16), (4096, 16), (256, 256)]
    costs = [ns_cost(s) for s in shapes]
    d = 2
    best = min(max(rank_loads(costs, list(a), d)) for a in itertools.product(range(d), repeat=len(costs)))
    lpt = max(rank_loads(costs, lpt_assign(costs, d), d))
    ping = max(rank_loads(costs, pingpong_assign([a * b for a, b in shapes], d), d))
    bound = 4 / 3 - 1 / (3 * d)
    assert lpt <= bound * best
    assert ping > bound * best and ping > 1.8 * lpt


@pytest.mark.parametrize("dtypes, calls", [((torch.float32,), 3), ((torch.bfloat16, torch.float32), 3),
                                           ((torch.float64,), 3), ((torch.bfloat16, torch.float64), 4)])
def test_owner_step_comm_collectives_per_step_by_dtype_mix(dtypes, calls):
    """One reduce dtype (float32 for bfloat16 and float32 gradients): 3 calls; two: 4; for any count."""
    for n in (2, 10, 200):
        comm = owner_step_comm([6] * n, [dtypes[i % len(dtypes)] for i in range(n)], [i % 4 for i in range(n)], 4)
        assert len(comm["calls"]) == calls and comm["calls"][-1] == ("all_gather", torch.uint8)
