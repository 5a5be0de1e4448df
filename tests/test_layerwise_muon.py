"""optbook.distributed.LayerWiseMuon, DistributedMuon (Moonlight), DistributedChain and the tensor-parallel
Newton–Schulz modes on 2, 3 and 4 gloo processes.

Reference: single-process ``optbook.optim.Muon`` with float64 Newton–Schulz on the mean gradient. The per-rank
gradients are dyadic and their mean is exact in any summation order
(``optbook.distributed.muon_workers.muon_grads``), and every matrix is orthogonalised by the same functional
core on the same numbers (the rank programs only the tests run are in ``tests/muon_rank_programs.py``), so the distributed runs must equal the reference **bit for bit**; the shared clip
norm (summed in another order) is compared with a tolerance. One launch of 4 processes runs every check on
process groups of 2, 3 and 4 of them (the smaller groups do not start at global rank 0); the 3-rank run
resumes from the 2-rank checkpoint and the 4-rank run from the 3-rank one.
"""

import itertools
import math
import multiprocessing

import pytest
import torch
from muon_rank_programs import (
    MUON_SUITE_GROUPS,
    bfloat16_layout_both_ways,
    checkpoint_acceptance,
    layerwise_raise_mid_run,
    muon_suite,
)

from optbook import newton_schulz
from optbook.distributed import (
    LayerWiseMuon,
    launch,
    lpt_assign,
    ns_cost,
    rank_loads,
    round_robin_assign,
    zero1_comm_bytes,
)
from optbook.distributed.muon_workers import chain_reference, muon_mean_grads, muon_problem, muon_reference
from optbook.distributed.wire import all_reduce_received
from helpers import scaled_timeout


@pytest.fixture(scope="module")
def runs():
    """{world size: [group rank 0's report, rank 1's, ...]} from one launch of 4 processes."""
    reports = launch(muon_suite, 4, timeout=scaled_timeout(60.0))
    return {size: [reports[g][size] for g in ranks] for size, ranks in MUON_SUITE_GROUPS.items()}


@pytest.fixture(scope="module")
def reference():
    return muon_reference(4)


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --- assignment (single process) ---------------------------------------------------------------------------
def test_ns_cost_is_max_times_min_squared_and_adds_over_head_blocks():
    assert ns_cost((96, 32)) == 96 * 32**2 == ns_cost((32, 96))
    assert ns_cost((6144, 4096), head_split=(4096, 1024, 1024)) == 4096**3 + 2 * 4096 * 1024**2
    assert ns_cost((0, 5)) == 0
    with pytest.raises(ValueError, match="shape"):
        ns_cost((3, 4, 5))


def test_lpt_and_round_robin_on_known_costs():
    costs = [5, 4, 3, 3, 3]
    assert lpt_assign(costs, 2) == [0, 1, 1, 0, 1]
    assert rank_loads(costs, lpt_assign(costs, 2), 2) == [8, 10]
    assert round_robin_assign(5, 2) == [0, 1, 0, 1, 0]
    assert rank_loads(costs, round_robin_assign(5, 2), 2) == [11, 7]
    # Graham's tight instance for d = 2: LPT 7, optimum 6 = (3 + 3 | 2 + 2 + 2), ratio 4/3 - 1/6
    tight = [3, 3, 2, 2, 2]
    assert lpt_assign(tight, 2) == [0, 1, 0, 1, 0] and max(rank_loads(tight, lpt_assign(tight, 2), 2)) == 7
    # ties go to the lower rank; more ranks than items leaves ranks empty
    assert lpt_assign([1, 1, 1], 5) == [0, 1, 2] and rank_loads([1, 1, 1], [0, 1, 2], 5) == [1, 1, 1, 0, 0]


def test_lpt_stays_within_grahams_bound_of_the_brute_force_optimum():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        d = 2 + trial % 2
        costs = torch.randint(1, 50, (7,), generator=gen).tolist()
        best = min(max(rank_loads(costs, list(a), d)) for a in itertools.product(range(d), repeat=len(costs)))
        lpt = max(rank_loads(costs, lpt_assign(costs, d), d))
        assert best <= lpt <= (4 / 3 - 1 / (3 * d)) * best + 1e-9


@pytest.mark.parametrize("call, word", [(lambda: lpt_assign([1, -1], 2), "costs"),
                                        (lambda: lpt_assign([1, float("nan")], 2), "costs"),
                                        (lambda: lpt_assign([1], 0), "world_size"),
                                        (lambda: round_robin_assign(-1, 2), "n_items"),
                                        (lambda: rank_loads([1, 2], [0], 2), "owners"),
                                        (lambda: rank_loads([1, 2], [0, 2], 2), "owners")])
def test_bad_assignment_arguments_are_named(call, word):
    with pytest.raises((TypeError, ValueError), match=word):
        call()


def test_constructing_without_a_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="launch"):
        LayerWiseMuon([torch.zeros(2, 2, requires_grad=True)])


# --- multi-process -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_layerwise_muon_equals_single_process_muon_bit_for_bit(runs, reference, world_size):
    params, _ = muon_problem()
    costs = [ns_cost(p.shape, None if i < 5 else 2) for i, p in enumerate(params)]
    for rank, rep in enumerate(runs[world_size]):
        for kind in ("layerwise", "round_robin"):
            assert _bitwise(rep[kind]["params"], reference), (world_size, rank, kind)
        lw = rep["layerwise"]
        assert lw["owners"] == lpt_assign(costs, world_size)
        assert rep["round_robin"]["owners"] == round_robin_assign(len(costs), world_size)
        assert max(lw["loads"]) <= max(rep["round_robin"]["loads"])
        # momentum only for the matrices this rank owns, and they partition the model
        owned = sum(p.numel() for i, (p, o) in enumerate(zip(params, lw["owners"])) if o == rank and i != 4)
        assert lw["state_numel"] == owned
    total = sum(r["layerwise"]["state_numel"] for r in runs[world_size])
    assert total == sum(p.numel() for i, p in enumerate(params) if i != 4)  # params[4] never has a gradient


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["moonlight", "moonlight_touched"])
def test_moonlight_variant_equals_full_newton_schulz_muon_bit_for_bit(runs, reference, world_size, kind):
    for rep in runs[world_size]:
        mo = rep[kind]
        assert _bitwise(mo["params"], reference)
        assert mo["split"], "some matrix must be cut across ranks for the test to mean something"
    params, _ = muon_problem()
    assert sum(r[kind]["state_numel"] for r in runs[world_size]) == sum(
        p.numel() for i, p in enumerate(params) if i != 4)


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
@pytest.mark.parametrize("alignment", [1, 64])
def test_touched_ranges_pair_up_and_cover_each_ranks_matrices(world_size, alignment):
    """What rank q sends rank r is what r expects from q; r's own shard plus what it receives is exactly the
    union of the matrices with a piece in its shard (every element once, padding between them included)."""
    from optbook.distributed import shard_layout
    from optbook.distributed.distributed_muon import received_bytes, touched_ranges, zero1_comm_bytes

    params, _ = muon_problem()
    layout = shard_layout(params, world_size, param_alignment=alignment, bucket_alignment=4, bucket_size=400)
    for b, bucket in enumerate(layout.buckets):
        plans = [touched_ranges(layout, b, r) for r in range(world_size)]
        for q in range(world_size):
            for r in range(world_size):
                assert plans[q][0][r] == plans[r][1][q]
        for r, (_, recv, (t_lo, t_hi)) in enumerate(plans):
            lo, hi = bucket.shard(r)
            covered = sorted([(s, e) for s, e in recv if e > s] + [(max(lo, t_lo), min(hi, t_hi))])
            covered = [(s, e) for s, e in covered if e > s]
            mine = [layout.params[p.index] for p in layout.pieces(r) if p.bucket == b]
            if not mine:
                assert not covered and t_lo == t_hi
                continue
            assert (t_lo, t_hi) == (min(m.start for m in mine), max(m.end for m in mine))
            assert covered[0][0] == t_lo and covered[-1][1] == t_hi
            assert all(a[1] == c[0] for a, c in zip(covered, covered[1:]))  # contiguous, no overlap
    for r in range(world_size):
        got = received_bytes(layout, r, torch.bfloat16, gather="touched")["gather"]
        assert got == 2 * sum(e - s for b in range(len(layout.buckets)) for s, e in touched_ranges(layout, b, r)[1])
        assert got < received_bytes(layout, r, torch.bfloat16)["gather"]
        m_max = max(p.numel() for p in params)
        for b in range(len(layout.buckets)):                         # T_r < 2 m_max per bucket (eq-dmuon-touched)
            assert sum(e - s for s, e in touched_ranges(layout, b, r)[1]) < 2 * m_max
    with pytest.raises(ValueError, match="Invalid gather"):
        received_bytes(layout, 0, torch.bfloat16, gather="some")
    with pytest.raises(ValueError, match="Invalid rank"):
        zero1_comm_bytes(layout, torch.bfloat16, gather="touched")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_counted_at_the_dispatcher_equal_the_formulas(runs, world_size):
    """CommCounter (what the collectives delivered) against received_bytes / LayerWiseMuon's prediction."""
    from fractions import Fraction

    from optbook.distributed import shard_layout
    from optbook.distributed.distributed_muon import touched_ranges

    params, _ = muon_problem()
    layout = shard_layout(params, world_size, param_alignment=1, bucket_alignment=4)
    (bucket,) = layout.buckets
    steps, shard = 4, bucket.shard_numel
    for rank, rep in enumerate(runs[world_size]):
        full, touched = rep["moonlight"], rep["moonlight_touched"]
        assert full["received"] == full["received_predicted"]
        assert touched["received"] == touched["received_predicted"]
        # the full gather: every other rank's shard of the float64 directions, once per step
        assert full["received"]["all_gather"] == steps * 2 * 8 * (world_size - 1) * shard
        # the touched gather: the interval of this rank's matrices less its own shard
        t_lo, t_hi = touched_ranges(layout, 0, rank)[2]
        lo, hi = bucket.shard(rank)
        own = max(0, min(hi, t_hi) - max(lo, t_lo))      # the shard's part of the interval (not the tail padding)
        assert t_lo <= lo and (own == hi - lo or t_hi < hi)
        assert touched["received"]["all_to_all"] == steps * 8 * ((t_hi - t_lo) - own)
        assert touched["received"]["all_to_all"] < steps * 8 * (world_size - 1) * shard
        lw = rep["layerwise"]
        f = Fraction(world_size - 1, world_size)
        assert lw["received"] == {"all_reduce": f * (lw["predicted"]["all_reduce"] + 2 * lw["predicted"]["control"]),
                                  "all_gather": f * lw["predicted"]["all_gather"]}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_byte_counters_equal_the_formulas_exactly(runs, world_size):
    from optbook.distributed import shard_layout

    params, _ = muon_problem()
    layout = shard_layout(params, world_size, param_alignment=1, bucket_alignment=4)
    (bucket,) = layout.buckets
    padded = -(-sum(p.numel() for p in params) // math.lcm(world_size, 4)) * math.lcm(world_size, 4)
    assert bucket.numel == padded
    steps = 4
    for rep in runs[world_size]:
        mo = rep["moonlight"]
        assert {k: mo["comm_bytes"][k] for k in ("reduce_scatter", "gather", "all_gather")} == mo["predicted"]
        assert mo["predicted"] == {"reduce_scatter": steps * 8 * padded, "all_gather": steps * 8 * padded,
                                   "gather": steps * 8 * padded}
        assert mo["comm_bytes"]["control"] == steps * (8 * (1 + len(params)) + 16)
        lw = rep["layerwise"]
        assert lw["comm_bytes"] == lw["predicted"]
        with_grad = sum(p.numel() for i, p in enumerate(params) if i != 4)
        largest = max(sum(p.numel() for p, o in zip(params, lw["owners"]) if o == r) for r in range(world_size))
        assert lw["predicted"]["all_reduce"] == steps * 2 * 8 * with_grad
        assert lw["predicted"]["all_gather"] == steps * world_size * 8 * largest
    # with a bfloat16 gather, Moonlight moves 4 + 4 + 2 bytes per element where ZeRO-1 AdamW moves 4 + 4
    f32 = shard_layout([p.float() for p in params], world_size)
    adamw, moon = zero1_comm_bytes(f32), zero1_comm_bytes(f32, torch.bfloat16)
    assert moon["total"] * 4 == adamw["total"] * 5


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_chain_clips_muon_and_adamw_by_one_global_norm_of_the_raw_mean_gradients(runs, world_size):
    ref = chain_reference()
    for rep in runs[world_size]:
        ch = rep["chain"]
        assert abs(ch["norms"][0] - ch["raw_norm_check"]) < 1e-12 * ch["raw_norm_check"]
        assert max(abs(a - b) / b for a, b in zip(ch["norms"], ref["norms"])) < 1e-12
        assert min(ref["norms"]) > 3.0  # the clip (max norm 3) acted on every step
        assert max(float((a - b).abs().max()) for a, b in zip(ch["params"], ref["params"])) < 1e-12
        assert ch["lrs"] == [0.01, 0.005]  # Muon's group (0.02) and AdamW's (0.01), halved by one scheduler
        assert "max_grad_norm=None" in ch["errors"]["own_norm"][1]
        assert ch["errors"]["not_layerwise"][0] == "TypeError"
        assert "max_grad_norm" in ch["errors"]["max_grad_norm"][1]


@pytest.mark.parametrize("kind", ["resumed", "resumed_moonlight"])
@pytest.mark.parametrize("world_size", [3, 4])
def test_a_checkpoint_from_another_world_size_continues_bit_for_bit(runs, world_size, kind):
    ref6 = muon_reference(6)
    for rep in runs[world_size]:
        assert _bitwise(rep[kind], ref6)


@pytest.mark.parametrize("kind", ["layerwise", "moonlight"])
def test_the_consolidated_checkpoint_loads_into_single_process_muon(runs, kind):
    from optbook.distributed.muon_workers import MUON_OPTIONS, set_grads
    from optbook.optim import Muon

    checkpoint = runs[2][-1][kind]["checkpoint"]
    assert all(r[kind]["checkpoint"] is None for r in runs[2][:-1])  # only the consolidating rank has it
    assert sorted(checkpoint["state"]) == [i for i, g in enumerate(muon_mean_grads(muon_reference(4), 0))
                                           if g is not None]
    params = [p.clone().requires_grad_() for p in muon_reference(4)]
    groups = [{**g, "params": params[:5] if i == 0 else params[5:]} for i, g in enumerate(muon_problem()[1])]
    opt = Muon(groups, **MUON_OPTIONS)
    opt.load_state_dict(checkpoint)
    for t in (4, 5):
        set_grads(params, muon_mean_grads(params, t))
        opt.step()
    assert _bitwise([p.detach() for p in params], muon_reference(6))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["bad_layerwise", "bad_moonlight"])
def test_bad_input_on_one_rank_makes_every_rank_raise_before_any_write(runs, reference, world_size, kind):
    name = "LayerWiseMuon" if kind == "bad_layerwise" else "DistributedMuon"
    last = world_size - 1
    for rank, rep in enumerate(runs[world_size]):
        bad = rep[kind]
        assert all(e is not None for e in bad["errors"]), bad["errors"]
        assert all(bad["untouched"]) and bad["grads_untouched"]
        sparse, lr, nan, momentum = bad["errors"]
        if rank == last:
            assert sparse[0] == "TypeError" and "sparse" in sparse[1]
        else:
            assert sparse[0] == "ValueError" and f"rank {last} of the group" in sparse[1]
        assert ("Invalid lr" in lr[1]) if rank == 0 else (f"{name}.step: rank 0 of the group" in lr[1])
        assert nan[0] == "NonFiniteGradientError" and "inf or NaN" in nan[1] and "parameter 2" in nan[1]
        assert "Invalid momentum" in momentum[1]
        for case, err in bad["constructor_errors"].items():
            assert err is not None, case
        assert "same parameters" in bad["constructor_errors"]["differs"][1]
        if kind == "bad_moonlight":
            assert bad["constructor_errors"]["gather"] == (
                "ValueError", "Invalid gather: expected one of ('all', 'touched'), got 'some'")
        ckpt = bad["checkpoint_errors"]
        # state_dict() with nothing consolidated: the same dict on every rank; after consolidate_state_dict(to=0),
        # only on rank 0 (the others are told where it is)
        assert ckpt["everywhere_equal"]
        if rank == 0:
            assert ckpt["elsewhere"] is None
        else:
            assert ckpt["elsewhere"][0] == "RuntimeError" and "consolidated on rank 0" in ckpt["elsewhere"][1]
        assert ckpt["shape"][0] == "ValueError" and "momentum_buffer of parameter" in ckpt["shape"][1]
        assert ckpt["untouched"]
    afters = [rep[kind]["after"] for rep in runs[world_size]]
    assert all(_bitwise(a, afters[0]) for a in afters)  # the ranks stayed in step after the errors


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("partition_dim", [0, 1])
def test_tensor_parallel_modes_blockwise_differs_duplicated_and_distributed_equal_full_ns(runs, world_size,
                                                                                       partition_dim):
    G = torch.randn(96, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    full = newton_schulz(G, dtype=torch.float64)
    key = "tp_rows" if partition_dim == 0 else "tp_cols"
    got = {mode: torch.cat([rep[key][mode] for rep in runs[world_size]], dim=partition_dim)
           for mode in ("blockwise", "duplicated", "distributed")}
    assert torch.equal(got["duplicated"], full)
    assert float((got["distributed"] - full).abs().max()) < 1e-12
    assert float((got["blockwise"] - full).norm() / full.norm()) > 0.1
    comm = runs[world_size][0][key]["comm_bytes"]
    assert comm["blockwise"] == 0 and comm["duplicated"] == 96 * 48 * 8
    gram = 48 if partition_dim == 0 else 96   # the split dimension decides which Gram matrix is summed
    assert comm["distributed"] == 2 * 8 * (1 + 5 * gram * gram)
    # counted at the dispatcher, bytes received per rank: the all-gather's exact, the all-reduces' by the ring
    # model; the two shape-check all-reduces (2 float64 each) run in both modes
    received = runs[world_size][0][key]["received"]
    assert received["blockwise"] == {}
    assert received["duplicated"] == {"all_reduce": all_reduce_received(2 * 16, world_size),
                                      "all_gather": (world_size - 1) * 96 * 48 * 8 // world_size}
    assert received["distributed"] == {"all_reduce": all_reduce_received(8 * (4 + 1 + 5 * gram * gram), world_size)}


def test_a_rank_that_raises_mid_run_fails_every_rank_quickly():
    with pytest.raises(RuntimeError, match="rank 1 of 2 raised") as info:
        launch(layerwise_raise_mid_run, 2, bad_rank=1, at_step=2, timeout=scaled_timeout(120.0))
    assert "fails on purpose at step 2" in str(info.value)
    # Rank 0, left waiting in the all-reduce, was stopped by the launch as soon as rank 1's
    # error arrived: the report has no timeout of its own (nor the launch's "did not finish"),
    # and no process of the launch is left.
    assert "Timed out" not in str(info.value) and "did not finish" not in str(info.value)
    assert not multiprocessing.active_children()


def test_the_chapter_workers_draw_their_problem_through_the_runtime_seed_offset(monkeypatch):
    from optbook.distributed.muon_workers import chain_problem, muon_chapter

    monkeypatch.delenv("OPTBOOK_SEED_OFFSET", raising=False)
    unshifted = muon_reference(2, seed=5)
    moved = muon_problem(1014)[0]
    monkeypatch.setenv("OPTBOOK_SEED_OFFSET", "1009")   # inherited by the spawned workers
    assert _bitwise(muon_problem(5)[0], moved)          # shifted once, before any mixing
    assert _bitwise(chain_problem(5)[0], moved)
    reports = launch(muon_chapter, 2, sizes=(2,), steps=2, seed=5, timeout=scaled_timeout(120.0))
    reference = muon_reference(2, seed=5)               # shifted by the same offset in this process
    assert not _bitwise(reference, unshifted)
    chain = chain_reference(seed=5)
    G = torch.randn(96, 32, generator=torch.Generator().manual_seed(5 + 1009), dtype=torch.float64)
    for rep in (r[2] for r in reports):
        assert _bitwise(rep["layerwise"]["params"], reference)      # the offset reached the worker processes
        assert _bitwise(rep["moonlight"]["params"], reference)
        assert torch.equal(rep["tp_rows"]["G"], G) and torch.equal(rep["tp_cols"]["G"], G)
        assert all(abs(a - b) <= 1e-12 * b for a, b in zip(rep["chain"]["norms"], chain["norms"]))
    with pytest.raises(ValueError, match="seed"):       # before any collective: no process group here
        muon_chapter(0, 1, seed=-1)


@pytest.fixture(scope="module")
def acceptance():
    return launch(checkpoint_acceptance, 2, timeout=scaled_timeout(60.0))


@pytest.mark.parametrize("which", ["consolidated", "sharded"])
def test_a_chain_checkpoint_the_muon_member_refuses_loads_nothing_into_the_adamw_member(acceptance, which):
    # float32 momentum for float64 matrices: only the full check (dtype too) finds it, and it must find it
    # before the DistributedOptimizer member has loaded its part
    for rep in acceptance:
        err, untouched = rep["chain_" + which]
        assert err is not None and err[0] == "ValueError" and "float32" in err[1], err
        assert untouched


def test_a_plain_muon_checkpoint_with_scheduler_keys_loads_into_the_distributed_muons(acceptance):
    for rep in acceptance:
        keys = rep["scheduler_keys"]
        for name in ("Muon", "LayerWiseMuon", "DistributedMuon"):
            assert keys[name] is None, (name, keys[name])
            assert keys[name + " lr"] == rep["scheduled_lr"] != 0.02  # the scheduled lr was loaded
        # an optimizer without Muon's hyperparameters (AdamW, before any step: no state to tell) is refused
        for name, err in rep["adamw_empty_state"].items():
            assert err is not None and err[0] == "ValueError" and "another optimizer" in err[1], (name, err)


def test_the_chain_dict_is_torch_layout_over_both_members_and_the_older_layout_still_loads(acceptance):
    for rep in acceptance:
        keys, indices, groups, entries, resumed = rep["chain_layout"]
        assert keys == ["param_groups", "skipped_steps", "state"]
        assert indices == [0, 1, 2] and groups == [[0, 1], [2]]
        assert entries == [["momentum_buffer"], ["momentum_buffer"], ["exp_avg", "exp_avg_sq", "step"]]
        assert resumed == [True, True]   # the new layout and the older one resume bitwise


def test_a_bfloat16_layerwise_checkpoint_is_mixed_precision_layout_and_loads_both_ways():
    # the masters travel in each parameter's state (DCP keeps only "state" and "param_groups"), as
    # MixedPrecisionOptimizer writes them, so either dict resumes the other bitwise
    (rep,) = launch(bfloat16_layout_both_ways, 1, timeout=scaled_timeout(60.0))
    both = [["master_param", "momentum_buffer"]] * 2
    assert rep["keys"] == (both, both)
    assert rep["equal"] == [True, True]
