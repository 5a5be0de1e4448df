"""DistributedOptimizer (ZeRO-1) follows the step contract of optbook.contract.

It owns the weights it keeps float32 master shards of: contract.scale_weights_ scales the masters (a
collective) and an in-place write to a model parameter (a weights-only load) is taken up before the next
step. It checks at construction that every rank holds the same parameters, refuses optimizers that are not
element-wise, loads a checkpoint all-or-nothing (one of another model raises with nothing written), resumes
a model with a 0-dim parameter through every path, returns the closure's loss from step() and raises
NonFiniteGradientError without a loss scaler. One launch of 4 processes runs every check on groups of 2, 3
and 4 (tests/zero1_ranks.py); 3 ranks resume from the 2-rank checkpoints, 4 from the 3-rank ones.
"""

import pytest
import torch
from zero1_ranks import CONTRACT_GROUPS, ROW_FACTOR, contract_suite, scalar_reference

from optbook.distributed import launch
from helpers import scaled_timeout

SIZES = [2, 3, 4]


@pytest.fixture(scope="module")
def runs():
    out = launch(contract_suite, 4, timeout=scaled_timeout(120.0))
    return {size: [out[g][size] for g in ranks] for size, ranks in CONTRACT_GROUPS.items()}


def bitwise(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and
                                    torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("size", SIZES)
def test_scale_weights_scales_the_float32_masters_and_the_next_step_does_not_undo_it(runs, size):
    for rank, report in enumerate(runs[size]):
        r = report["scale"]
        m = r["masters"]
        expected = [(m[0] * ROW_FACTOR).bfloat16(), (m[1] * 0.5).bfloat16()]
        assert bitwise(r["scaled"][:2], expected), rank
        assert not torch.equal(expected[0], m[0].bfloat16())  # the scaling changed the weights
        assert bitwise(r["after_step"], r["scaled"]), rank     # a step at lr 0 keeps them


@pytest.mark.parametrize("size", SIZES)
def test_weights_written_into_the_model_after_construction_survive_the_next_step(runs, size):
    for report in runs[size]:
        r = report["scale"]
        assert bitwise(r["after_load"], r["loaded"])
        assert bitwise([m.bfloat16() for m in r["masters_after_load"].values()], r["loaded"])


def test_a_run_with_row_scalings_resumes_bit_for_bit_at_another_world_size(runs):
    uninterrupted = runs[2][0]["scaled_run"]["params"]
    plain = runs[2][0]["scale"]["masters"]  # differs: the scaling took effect
    assert not torch.equal(uninterrupted[0], plain[0].bfloat16())
    for size in (3, 4):
        for report in runs[size]:
            assert bitwise(report["scaled_run"]["params"], uninterrupted)  # the same run at any size
            assert bitwise(report["scaled_resumed"]["params"], uninterrupted)
            assert bitwise(report["scaled_resharded"]["params"], uninterrupted)


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("how", ["consolidated", "sharded", "plain"])
def test_a_model_with_a_0_dim_parameter_resumes_through_every_path(runs, size, how):
    reference = scalar_reference()["params"]
    uninterrupted = runs[2][0]["scalar_run"]["params"]
    assert uninterrupted[1].shape == ()
    finals = [report[f"scalar_{how}"]["params"] for report in runs[size]]
    for final in finals:
        assert bitwise(final, finals[0])  # every rank holds the same weights
        for a, b in zip(final, reference):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        if how != "plain":
            assert bitwise(final, uninterrupted)


@pytest.mark.parametrize("size", SIZES)
def test_a_model_with_a_0_dim_parameter_resumes_from_each_ranks_own_sharded_file(runs, size):
    for report in runs[size]:
        assert bitwise(report["scalar_own"]["params"], report["scalar_run"]["params"])


@pytest.mark.parametrize("size", SIZES)
def test_a_checkpoint_of_another_model_or_optimizer_raises_with_nothing_written(runs, size):
    finals = []
    for report in runs[size]:
        r = report["other_model"]
        for name, error in r["errors"].items():
            assert error is not None and error[0] in ("ValueError", "TypeError"), name
            assert "Invalid" in error[1], name
            assert r["untouched"][name], name
        assert "another optimizer" in r["errors"]["plain_sgd"][1]
        finals.append(r["params"])
    for f in finals[1:]:
        assert bitwise(f, finals[0])


@pytest.mark.parametrize("size", SIZES)
def test_different_parameters_on_one_rank_are_named_on_every_rank(runs, size):
    last = size - 1
    for report in runs[size]:
        m = report["mismatched"]
        assert m["transposed"][0] == "ValueError"
        assert (f"parameter 1: shape (2, 3) torch.float32 on ranks {list(range(last))}, shape (3, 2) "
                f"torch.float32 on ranks [{last}]") in m["transposed"][1]
        assert f"parameter 1: shape (2, 3) torch.float32 on ranks {list(range(last))}, shape (5, 2)" \
            in m["size"][1]
        assert f"absent (1 parameters in all) on ranks [{last}]" in m["count"][1]


def test_optimizers_that_are_not_element_wise_are_refused_by_name(runs):
    for report in runs[2]:
        refused = report["misc"]["refused"]
        assert set(refused) == {"torch.optim.Adafactor", "torch.optim.Muon",
                                "optbook.optim.muon.Muon"}
        for name, error in refused.items():
            assert error[0] == "ValueError" and "optimizer_class" in error[1] and name in error[1]
            assert "not element-wise" in error[1]


@pytest.mark.parametrize("size", SIZES)
def test_step_returns_the_closures_loss_or_none_and_old_state_dicts_load(runs, size):
    for report in runs[size]:
        m = report["misc"]
        assert isinstance(m["returned"], torch.Tensor) and m["returned"].item() == 1.5
        assert m["returned_plain"] is None
        assert m["old_error"] is None and m["skipped_after_old"] == 7
