"""optbook.distributed.DistributedOptimizer (ZeRO-1) on 2, 3 and 4 gloo processes.

Reference: single-process ``optbook.optim.AdamW`` (float64) and ``MixedPrecisionOptimizer(AdamW)`` with the
same loss scaler (bfloat16), fed the mean gradient. The per-rank gradients are dyadic and their mean is
exact in any summation order (``optbook.distributed.workers.zero1_grads``), and AdamW is element-wise, so
the sharded run must equal the reference **bit for bit**; only clipping (whose norm is summed in another
order) is compared with a tolerance. Each launched process spends seconds importing torch, so one
launch of 4 processes runs every check on process
groups of 2, 3 and 4 of them (the smaller groups do not start at global rank 0); the 3-rank run resumes
from the 2-rank checkpoint and the 4-rank run from the 3-rank one.
"""

import copy
import math
import multiprocessing

import pytest
import torch
from zero1_ranks import SUITE_GROUPS, zero1_grad_buffer_failures, zero1_raise_mid_run, zero1_suite

from optbook.distributed import launch, shard_layout
from optbook.distributed.workers import zero1_mean_grads, zero1_problem
from optbook.optim import AdamW
from optbook.precision import DynamicLossScaler, MixedPrecisionOptimizer
from helpers import scaled_timeout

STEPS, CHECKPOINT_AT = 6, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world size: [group rank 0's report, rank 1's, ...]} from one launch of 4 processes, which runs the
    checks on groups of 2, 3 and 4 of them (SUITE_GROUPS); 3 resumes from 2's checkpoint, 4 from 3's; the
    sharded checkpoints (one file per rank) go to a temporary directory."""
    out = launch(zero1_suite, 4, str(tmp_path_factory.mktemp("zero1_sharded")), timeout=scaled_timeout(90.0))
    return {size: [out[g][size] for g in ranks] for size, ranks in SUITE_GROUPS.items()}


def reference(low_precision=False, steps=STEPS, overflow_at=(2,)):
    """The single-process run of ``zero1_train``: returns (params, optimizer)."""
    dtype = torch.bfloat16 if low_precision else torch.float64
    params, groups = zero1_problem(0, dtype)
    if low_precision:
        opt = MixedPrecisionOptimizer(AdamW(groups, lr=0.01),
                                      DynamicLossScaler(2.0**10, growth_interval=2, hysteresis=1))
    else:
        opt = AdamW(groups, lr=0.01)
    for t in range(steps):
        if t == 2:
            opt.param_groups[0]["lr"] = 0.02
        grads = zero1_mean_grads(params, t)
        if low_precision:
            grads = [None if g is None else g * opt.loss_scale for g in grads]
            if t in overflow_at:
                grads[0][0, 0] = math.inf
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
    return params, opt


def assert_bitwise(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a.view(torch.uint8), e.detach().view(torch.uint8)), (a - e.detach()).abs().max()


def assert_state_dicts_equal(actual, expected):
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for k, st in expected["state"].items():
        assert actual["state"][k].keys() == st.keys()
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                assert_bitwise([actual["state"][k][key]], [v])
            else:
                assert actual["state"][k][key] == v


# --- the layout, without processes -------------------------------------------------------------------
def test_shards_are_equal_and_cover_every_element_once():
    params, _ = zero1_problem()
    for world_size in (1, 2, 3, 4, 7):
        layout = shard_layout(params, world_size, bucket_size=200)
        for b in layout.buckets:
            assert b.numel % math.lcm(world_size, 128) == 0 and b.shard_numel * world_size == b.numel
        for r in layout.params:
            assert r.start % 64 == 0
            covered = sorted((p.param_start, p.param_end) for rank in range(world_size)
                             for p in layout.pieces(rank) if p.index == r.index)
            if r.numel == 0:
                assert covered == []
                continue
            assert [s for s, _ in covered] == [0] + [e for _, e in covered[:-1]]  # contiguous, no overlap
            assert covered[-1][1] == r.numel


def test_padding_layout_pads_on_two_ranks_and_leaves_the_last_rank_only_padding():
    A, B = torch.zeros(5, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)
    layout = shard_layout([A, B], 4, param_alignment=1, bucket_alignment=16)
    assert layout.buffer_numel[torch.float64] == 16 and layout.buckets[0].shard_numel == 4
    assert [[(p.index, p.param_start, p.param_end) for p in layout.pieces(r)] for r in range(4)] == \
        [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(1, 3, 4)], []]
    assert [layout.padding(r) for r in range(4)] == [0, 0, 3, 4]


def test_zero_element_parameter_gets_an_empty_range_and_a_parameter_larger_than_a_shard_spans_ranks():
    params, _ = zero1_problem()
    layout = shard_layout(params, 4)  # one bucket: shard = 640 / 4 = 160 elements < 300
    assert layout.params[2].numel == 0 and layout.params[2].shape == (0, 3)
    assert all(p.index != 2 for r in range(4) for p in layout.pieces(r))
    assert len({p.rank for r in range(4) for p in layout.pieces(r) if p.index == 0}) >= 2


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(world_size=0), ValueError, "world_size"),
    (dict(world_size=2, bucket_size=0), ValueError, "bucket_size"),
    (dict(world_size=2, param_alignment=1.5), TypeError, "param_alignment"),
    (dict(world_size=2, bucket_alignment=0), ValueError, "bucket_alignment"),
])
def test_bad_layout_arguments_are_named(kwargs, error, word):
    with pytest.raises(error, match=word):
        shard_layout([torch.zeros(3)], **kwargs)


def test_constructing_without_a_process_group_says_what_to_do():
    from optbook.distributed import DistributedOptimizer

    with pytest.raises(RuntimeError, match="launch"):
        DistributedOptimizer([torch.zeros(3, requires_grad=True)])


# --- multi-process: equivalence ----------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_float64_adamw_equals_single_process_adamw_bit_for_bit(runs, world_size):
    params, opt = reference()
    for report in runs[world_size]:
        assert_bitwise(report["float64"]["params"], params)
        assert report["float64"]["params"][2].shape == (0, 3)  # the zero-element parameter keeps its shape
    assert_state_dicts_equal(runs[world_size][0]["float64"]["state_dict"], opt.state_dict())
    assert 5 not in opt.state_dict()["state"]  # the parameter without a gradient has no state, in both


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bfloat16_with_loss_scaling_equals_mixed_precision_adamw_and_every_rank_skips_together(runs,
                                                                                              world_size):
    params, opt = reference(low_precision=True)
    ref_sd = opt.state_dict()
    for report in runs[world_size]:
        r = report["bfloat16"]
        assert_bitwise(r["params"], params)
        assert r["applied"] == [True, True, False, True, True, True]  # the overflow: on the last rank only
        assert r["skipped_steps"] == opt.skipped_steps == 1
        assert r["scales"][-1] == opt.loss_scale
    sd = runs[world_size][0]["bfloat16"]["state_dict"]
    # optbook.masters' layout, MixedPrecisionOptimizer's: one float32 master per bfloat16 parameter (the
    # zero-element one included) in its state under "master_param", nothing at the top level
    assert_state_dicts_equal(sd, ref_sd)
    assert sorted(i for i, s in sd["state"].items() if "master_param" in s) == list(range(6))
    assert "master_params" not in sd
    assert sd["loss_scaler"] == ref_sd["loss_scaler"]


def test_a_consolidated_bfloat16_checkpoint_loads_into_mixed_precision_on_one_process(runs):
    """One checkpoint layout for masters: ZeRO-1's consolidated dict is a MixedPrecisionOptimizer's, so it
    loads into the single-process wrapper over the same model, masters included, and saves back equal."""
    _, ref = reference(low_precision=True)
    sd = runs[2][0]["bfloat16"]["state_dict"]
    params, groups = zero1_problem(0, torch.bfloat16)
    opt = MixedPrecisionOptimizer(AdamW(groups, lr=0.01), DynamicLossScaler(2.0**10, growth_interval=2,
                                                                            hysteresis=1))
    opt.load_state_dict(copy.deepcopy(sd))
    assert_state_dicts_equal(opt.state_dict(), ref.state_dict())
    assert_bitwise(opt.master_params(), ref.master_params())
    assert opt.skipped_steps == 1 and opt.loss_scale == ref.loss_scale


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_checkpoint_from_another_world_size_continues_bit_for_bit(runs, world_size):
    for kind, low in (("float64", False), ("bfloat16", True)):
        params, _ = reference(low_precision=low)
        for report in runs[world_size]:
            assert_bitwise(report[kind + "_resumed"]["params"], params)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_sharded_checkpoint_resumed_from_each_ranks_own_file_continues_bit_for_bit(runs, world_size):
    for kind, low in (("float64", False), ("bfloat16", True)):
        params, opt = reference(low_precision=low)
        for report in runs[world_size]:
            r = report[kind + "_sharded_own"]
            assert_bitwise(r["params"], params)
            assert r["skipped_steps"] == (1 if low else 0)
        sd = runs[world_size][0][kind + "_sharded_own"]["state_dict"]  # m, v, steps and masters too
        ref = opt.state_dict()
        assert_state_dicts_equal(sd, ref)   # the masters too, under state[i]["master_param"]
        if low:
            assert sd["loss_scaler"] == ref["loss_scaler"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_checkpoints_reshard_to_another_world_size_and_continue_bit_for_bit(runs, world_size):
    """3 ranks load the 2 files of the 2-rank run, 4 ranks the 3 files, 2 ranks the 4 files."""
    for kind, low in (("float64", False), ("bfloat16", True)):
        params, _ = reference(low_precision=low)
        for report in runs[world_size]:
            assert_bitwise(report[kind + "_resharded"]["params"], params)


@pytest.mark.parametrize("world_size, saved", [(3, 2), (4, 3)])
def test_one_sharded_file_from_another_world_size_is_refused_naming_both_sizes(runs, world_size, saved):
    for rank, report in enumerate(runs[world_size]):
        kind, message = report["wrong_size"]["one_file"]
        assert kind == "ValueError"
        assert f"saved by rank {rank % saved} of {saved}: world size {saved}, this group has {world_size}" \
            in message and f"list of all {saved} files" in message
        kind, message = report["wrong_size"]["missing"]  # a list without the last rank's file
        assert kind == "ValueError"
        assert f"got ranks {list(range(saved - 1))} saved at world sizes [{saved}]" in message
        assert report["wrong_size"]["untouched"]


def test_a_checkpoint_loads_into_single_process_adamw_and_torch_optim_adamw(runs):
    """The 4-process checkpoint (plain torch.optim layout) resumes one process: optbook's AdamW bit for bit,
    torch.optim.AdamW to 1e-12 (the same algorithm, other float64 arithmetic)."""
    expected, _ = reference()
    checkpoint = runs[4][-1]["float64"]["checkpoint"]
    for cls, exact in ((AdamW, True), (torch.optim.AdamW, False)):
        params, groups = zero1_problem()
        with torch.no_grad():
            for p, saved in zip(params, checkpoint["params"]):
                p.copy_(saved)
        opt = cls(groups, lr=0.01)
        opt.load_state_dict(checkpoint["optimizer"])
        for t in range(CHECKPOINT_AT, STEPS):
            for p, g in zip(params, zero1_mean_grads(params, t)):
                p.grad = g
            opt.step()
        if exact:
            assert_bitwise(params, expected)
        else:
            for p, e in zip(params, expected):
                torch.testing.assert_close(p, e, rtol=1e-12, atol=1e-14)


def test_padding_and_clipping_match_the_single_process_numbers_and_padding_stays_zero(runs):
    final_A = [0.697302946, 2.293706051, 2.691308919, 4.287712074, 4.685314909]
    final_B = [[0.697302907, -0.697302907], [0.198801402, -0.198801402]]
    for world_size in (2, 3, 4):
        for report in runs[world_size]:
            c = report["padding_clip"]
            assert c["norms"] == pytest.approx([1.6401219, 3.2802439, 4.9203658], abs=1e-7)
            # the values are given to 9 decimals; float64 clipping sums the norm in another order (1e-16)
            torch.testing.assert_close(c["params"][0], torch.tensor(final_A, dtype=torch.float64),
                                       rtol=0, atol=1e-9)
            torch.testing.assert_close(c["params"][1], torch.tensor(final_B, dtype=torch.float64),
                                       rtol=0, atol=1e-9)
            assert c["padding_zero"]
            views = report["padding_clip_views"]  # gradients written in place into the flat buffer
            assert views["views"] == 2 and views["in_buffer"] and views["padding_zero"]
            assert views["norms"] == c["norms"]
            assert_bitwise(views["params"], c["params"])
            c32 = report["padding_clip32"]  # float32: the same values to 1e-6
            assert c32["norms"] == pytest.approx([1.6401219, 3.2802439, 4.9203658], abs=1e-6)
            torch.testing.assert_close(c32["params"][0], torch.tensor(final_A), rtol=0, atol=1e-6)
            torch.testing.assert_close(c32["params"][1], torch.tensor(final_B), rtol=0, atol=1e-6)
            assert c32["padding_zero"]
    # at 4 ranks rank 2 holds one real element (B[1, 1]) and rank 3 only padding; both took part (no hang)
    assert [[(p.index, p.param_start, p.param_end) for p in r["padding_clip"]["pieces"]] for r in runs[4]] \
        == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(1, 3, 4)], []]


# --- multi-process: bad input and failures -----------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bad_input_on_one_rank_makes_every_rank_raise_before_any_write(runs, world_size):
    last = world_size - 1
    for rank, report in enumerate(runs[world_size]):
        b = report["bad_input"]
        assert all(b["untouched"]) and b["grads_untouched"]
        sparse, betas, lr, data = b["errors"]
        assert sparse[0] == ("TypeError" if rank == last else "ValueError")
        assert ("sparse" in sparse[1]) if rank == last else (f"rank {last} " in sparse[1])
        assert "betas" in betas[1] if rank == 0 else "rank 0 " in betas[1]
        assert lr == ("ValueError", "Invalid lr: expected lr >= 0.0, got -1.0")
        assert ("no longer lives" in data[1]) if rank == last else (f"rank {last} " in data[1])
        for name, (kind, message) in b["constructor_errors"].items():
            assert kind in ("TypeError", "ValueError")
            assert {"muon": "optimizer_class", "float16": "loss_scaler"}.get(name, name) in message
    after = [r["bad_input"]["after"] for r in runs[world_size]]
    for a in after[1:]:
        assert_bitwise(a, after[0])  # the ranks are still in step after the refused steps


def test_a_rank_that_raises_mid_run_fails_every_rank_quickly():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 raised") as info:
        launch(zero1_raise_mid_run, 2, bad_rank=1, at_step=2, timeout=scaled_timeout(120.0))
    assert "fails on purpose at step 2" in str(info.value)
    # Rank 0, left waiting in the reduce-scatter, was stopped by the launch as soon as rank 1's
    # error arrived: the report has no timeout of its own (nor the launch's "did not finish"),
    # and no process of the launch is left.
    assert "Timed out" not in str(info.value) and "did not finish" not in str(info.value)
    assert not multiprocessing.active_children()


def test_step_hooks_run_once_per_step_and_a_scheduler_sets_the_lr_the_shards_use(runs):
    for report in runs[2]:
        r = report["scheduler"]
        assert r["calls"] == ["pre", "post", "pre", "post", "pre"]  # the third step raised: no post hook
        assert r["lrs"] == [1.0, 0.5]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_an_inf_on_one_rank_without_a_loss_scaler_raises_on_every_rank_naming_the_parameter(runs, world_size):
    for report in runs[world_size]:  # 2 and 4: mean and check fused in one pass; 3: divide, then check
        r = report["scheduler"]
        kind, message = r["inf_error"]
        assert kind == "NonFiniteGradientError"
        assert "parameter 0 (param_groups[0]['params'][0], shape (3,))" in message and "no loss_scaler" in message
        assert r["inf_untouched"] and r["skipped_steps"] == 0


def test_a_failed_step_leaves_the_grad_buffer_views_unchanged_and_a_retry_is_exact():
    # use_grad_buffer(): every .grad is a view of the flat buffer that step() reduces and divides in place
    reports = launch(zero1_grad_buffer_failures, 2, timeout=scaled_timeout(30.0))
    for rank, r in enumerate(reports):
        for case, kind in (("lr", "ValueError"), ("inf", "NonFiniteGradientError"),
                           ("nan", "NonFiniteGradientError"), ("overflow", "NonFiniteGradientError")):
            err, grads_unchanged, unchanged = r["cases"][case]
            assert err is not None and err[0] == kind, (rank, case, err)
            assert grads_unchanged and unchanged, (rank, case)
        assert "parameter 1" in r["cases"]["overflow"][0][1]
        assert r["still_views"]
        # the retries after fixing the input: bitwise the run that never failed (gradients copied, no views)
        assert all(torch.equal(a, b) for a, b in zip(r["after"], r["reference"]))
