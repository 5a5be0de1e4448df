"""The step contract (optbook.contract) for LayerWiseMuon, DistributedMuon and DistributedChain on 2, 3 and 4
gloo processes: who owns the weights (outside writes and row scalings are kept), all-or-nothing checkpoint
loads, one non-finite policy (raise on every rank, nothing written), cross-rank checks at construction that
name the parameter and the ranks, 0-dim parameters.

References are single-process ``optbook.optim.Muon`` / ``ChainedOptimizer`` on the exact mean of dyadic
per-rank gradients, float64 Newton–Schulz, so the Muon runs must match bit for bit (the chain's clip norm,
summed in another order, within 1e-12). One launch of 4 processes runs every check on groups of 2, 3 and 4
(``muon_rank_programs.contract_suite``).
"""

import pytest
import torch
from muon_rank_programs import MUON_SUITE_GROUPS, chain_reference_shapes, contract_suite, scaled_reference

from optbook.distributed import launch
from optbook.distributed.muon_workers import muon_reference
from helpers import scaled_timeout

SIZES = [2, 3, 4]
KINDS = ["moonlight", "layerwise"]


@pytest.fixture(scope="module")
def runs():
    """{world size: [group rank 0's report, rank 1's, ...]} from one launch of 4 processes."""
    reports = launch(contract_suite, 4, timeout=scaled_timeout(120.0))
    return {size: [reports[g][size] for g in ranks] for size, ranks in MUON_SUITE_GROUPS.items()}


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES)
def test_weights_loaded_after_construction_survive_the_next_steps(runs, size, kind):
    ref = scaled_reference(2, scale_at=(), loaded=5.0)
    for rep in runs[size]:
        assert _bitwise(rep[kind]["loaded"], ref)
        assert rep[kind]["returned"] == 1.25  # step(closure) returns the closure's loss
    assert min(float(p.abs().min()) for p in ref) > 4.0  # the reverted run would be near the old weights (< 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES)
def test_a_row_scaling_through_the_contract_is_not_undone_by_a_step_with_lr_0(runs, size, kind):
    for rep in runs[size]:
        before, after = rep[kind]["lr0_before"], rep[kind]["lr0"]
        for i, p in enumerate(before):
            rows = {0: [0.5, 0.75] * 8, 5: [0.25, 1.0] * 4}.get(i)
            expected = p if rows is None else p * torch.tensor(rows, dtype=p.dtype).view(-1, 1)
            assert torch.equal(after[i], expected), i
        assert not torch.equal(after[0], before[0])
        err, untouched = rep[kind]["bad_factor"]
        assert err[0] == "ValueError" and "factor" in err[1] and untouched if kind == "moonlight" else untouched


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES)
def test_a_resume_with_row_scalings_mid_run_equals_single_process_muon_bit_for_bit(runs, size, kind):
    ref = scaled_reference(6, scale_at=(2, 4))
    assert not _bitwise(ref, muon_reference(6))  # the scalings changed the run
    for rep in runs[size]:
        assert _bitwise(rep[kind]["resumed"], ref)


@pytest.mark.parametrize("size", SIZES)
def test_distributed_muon_is_the_registered_owner_and_layerwise_muon_keeps_no_copy(runs, size):
    for rep in runs[size]:
        assert rep["moonlight"]["owner"] is True
        assert rep["layerwise"]["owner"] is False


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES)
def test_a_checkpoint_of_another_model_or_optimizer_raises_before_anything_is_loaded(runs, size, kind):
    ref = muon_reference(4)
    for rep in runs[size]:
        rep = rep["foreign_" + kind]
        (etype, msg), untouched = rep["other model"]
        assert etype == "ValueError" and "momentum_buffer of parameter 0" in msg and untouched
        (etype, msg), untouched = rep["other optimizer"]
        assert etype == "ValueError" and ("betas" in msg or "exp_avg" in msg) and untouched
        assert _bitwise(rep["after"], ref)  # the failed loads changed nothing: the run continues exactly
        assert rep["saved_skipped_steps"] == 0 and rep["old_dict"] is None


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case, where", [("nan_muon", "parameter 2"), ("nan_adamw", "AdamW")])
def test_chain_raises_non_finite_gradient_error_on_every_rank_for_either_member(runs, size, case, where):
    for rep in runs[size]:
        err, untouched, skipped, found_inf = rep["chain"][case]
        assert err is not None and err[0] == "NonFiniteGradientError", err
        assert untouched and skipped == (0, 0) and found_inf is False   # raised, not skipped
    last = runs[size][-1]["chain"][case][0][1]
    assert "inf or NaN" in last and where in last


@pytest.mark.parametrize("size", SIZES)
def test_chain_after_the_errors_equals_single_process_chain_and_reports_by_attributes(runs, size):
    ref = chain_reference_shapes(((10,), (5, 4), (3,)))
    for rep in runs[size]:
        ch = rep["chain"]
        assert ch["returned"] == 2.5 and isinstance(ch["last_grad_norm"], float) and ch["last_grad_norm"] > 3.0
        assert max(float((a - b).abs().max()) for a, b in zip(ch["after_errors"], ref)) < 1e-12


@pytest.mark.parametrize("size", SIZES)
def test_chain_checkpoint_loads_all_or_nothing_and_resumes(runs, size):
    for rep in runs[size]:
        ch = rep["chain"]
        (etype, msg), untouched = ch["load_other"]
        assert etype == "ValueError" and "shape" in msg and untouched
        (etype, msg), untouched = ch["load_other_muon"]
        assert etype == "ValueError" and "momentum_buffer of parameter 0" in msg and untouched
        assert ch["skipped_in_dict"] == 0 and ch["old_dict"] is None
        (etype, msg), untouched = ch["sharded_other"]
        assert etype == "ValueError" and "parameter 0 was saved with shape" in msg and untouched
        (etype, msg), untouched = ch["sharded_other_muon"]
        assert etype == "ValueError" and "other parameters" in msg and "parameter 0: shape (16, 8)" in msg
        assert untouched
        for kind in ("resumed", "resumed_sharded", "resumed_listed"):
            assert _bitwise(ch[kind], ch["uninterrupted"]), kind


@pytest.mark.parametrize("size", SIZES)
def test_chain_steps_a_zero_dim_adamw_tensor_as_one_process_does(runs, size):
    ref = chain_reference_shapes(((10,), (), (3,)))
    for rep in runs[size]:
        got = rep["chain"]["zero_dim"]
        assert got[8].shape == () and not torch.equal(got[8], torch.tensor(0.0, dtype=torch.float64))
        assert max(float((a - b).abs().max()) for a, b in zip(got, ref)) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES)
def test_construction_on_ranks_that_disagree_names_the_parameter_the_ranks_and_both_sides(runs, size, kind):
    last, rest = size - 1, list(range(size - 1))
    for rep in runs[size]:
        cross = rep["cross"]
        assert all(cross[kind, case][0] == "ValueError" for case in ("shape", "dtype", "count"))
        assert (f"parameter 1: shape (2, 2) torch.float64 on ranks {rest}, shape (3, 2) torch.float64 on ranks "
                f"[{last}]") in cross[kind, "shape"][1]
        assert (f"parameter 1: shape (2, 2) torch.float64 on ranks {rest}, shape (2, 2) torch.float32 on ranks "
                f"[{last}]") in cross[kind, "dtype"][1]
        assert (f"parameter 1: absent (1 parameters in all) on ranks {rest}, shape (2, 2) torch.float64 on ranks "
                f"[{last}]") in cross[kind, "count"][1]
        etype, msg = cross[kind, "zero_dim"]
        assert etype == "ValueError" and "2-D" in msg and "shape ()" in msg


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES)
def test_sharded_checkpoints_resume_bit_for_bit_and_refuse_files_of_another_model_or_rank(runs, size, kind):
    ref = muon_reference(4)
    for rep in runs[size]:
        sh = rep["sharded_" + kind]
        assert _bitwise(sh["own"], ref) and _bitwise(sh["listed"], ref)
        if size != 2:  # the 3-rank run loads the 2-rank files, the 4-rank run the 3-rank ones
            assert _bitwise(sh["resharded"], ref)
        (etype, msg), untouched = sh["other_model"]
        assert etype == "ValueError" and "other parameters" in msg and "parameter 0: shape (16, 8)" in msg
        assert untouched
        (etype, msg), untouched = sh["other_rank"]
        assert etype == "ValueError" and "pass the list" in msg and untouched
