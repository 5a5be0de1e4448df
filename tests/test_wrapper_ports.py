"""LayerWiseMuon, DistributedMuon and FSDP2Muon on the wrapper base (optbook.wrapper.OptimizerWrapper), at world
size 2 on gloo: what the base gives each -- one StepReport per step (the norm of the mean gradient), a non-finite
gradient refused on every rank with nothing written, eval()/train() (no-ops: Muon has no modes) and other modes
refused, add_param_group refused after construction, zero_grad(set_to_none=...), the step and state-dict hooks
run once, pickling with lambda hooks (the copy steps as the original, bit for bit), repr with the wrapper's
options -- and the low-precision refusals, naming the parameter before anything is written. The rank programs
are in ``tests/wrapper_port_ranks.py``.
"""

import math

import pytest
from helpers import scaled_timeout
from wrapper_port_ranks import KINDS, port_checks

from optbook.distributed import DistributedMuon, FSDP2Muon, LayerWiseMuon, launch
from optbook.wrapper import OptimizerWrapper

NAMES = {"layerwise": "LayerWiseMuon", "moonlight": "DistributedMuon", "fsdp2": "FSDP2Muon"}


@pytest.fixture(scope="module")
def runs():
    """[rank 0's {kind: checks}, rank 1's] from one launch of 2 processes."""
    return launch(port_checks, 2, timeout=scaled_timeout(60.0))


def test_each_is_a_wrapper_with_no_step_of_its_own():
    for cls in (LayerWiseMuon, DistributedMuon, FSDP2Muon):
        assert issubclass(cls, OptimizerWrapper)
        # the template step of the base (torch may wrap it with its hook runner on the class, keeping it inside)
        step = cls.__dict__.get("step")
        assert step is None or getattr(step, "__wrapped__", None) is OptimizerWrapper.step, cls


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_report_per_step_with_the_norm_of_the_mean_gradient(runs, kind):
    for rep in runs:
        checks = rep[kind]
        assert checks["step_hooks"] == (2, 2)
        for report, norm in zip(checks["reports"], checks["norms"]):
            assert report is not None, "no report"
            is_report, found_inf, grad_norm, skipped = report
            assert is_report and found_inf is False and skipped == 0
            assert math.isclose(grad_norm, norm, rel_tol=1e-12), (grad_norm, norm)


@pytest.mark.parametrize("kind", KINDS)
def test_a_nonfinite_gradient_on_one_rank_raises_on_every_rank_with_nothing_written(runs, kind):
    for rep in runs:
        checks = rep[kind]
        err = checks["nonfinite_error"]
        assert err is not None and err[0] == "NonFiniteGradientError", err
        assert "param_groups[0]['params'][1]" in err[1], err[1]
        assert checks["nonfinite_untouched"]
        # the report is the last completed step's: nothing skipped (no loss scaler: the step raised)
        assert checks["report_after_raise"] == (False, checks["reports"][-1][2], 0)


@pytest.mark.parametrize("kind", KINDS)
def test_eval_and_train_are_forwarded_as_no_ops_and_other_modes_refused(runs, kind):
    for rep in runs:
        checks = rep[kind]
        assert checks["eval_train"] is None, checks["eval_train"]
        assert checks["eval_untouched"]
        err = checks["set_mode"]
        assert err is not None and err[0] == "AttributeError" and "average()" in err[1], err


@pytest.mark.parametrize("kind", KINDS)
def test_add_param_group_after_construction_is_refused_naming_the_class(runs, kind):
    for rep in runs:
        err = rep[kind]["add_param_group"]
        assert err is not None and err[0] == "NotImplementedError" and NAMES[kind] in err[1], err
        assert rep[kind]["groups_after_add"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_zero_grad_and_the_state_dict_hooks(runs, kind):
    for rank, rep in enumerate(runs):
        checks = rep[kind]
        assert checks["zeroed"] and checks["dropped"]
        # state_dict() runs its post hook once (the distributed ones: on the rank that consolidated)
        assert checks["sd_hook_calls"] == (1 if kind == "fsdp2" or rank == 0 else 0)
        assert checks["sd_hooked"] == 1   # it ran on the dict state_dict() returned, once
        assert checks["load_hook_calls"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_pickling_drops_the_lambda_hooks_and_the_copy_steps_bit_for_bit(runs, kind):
    for rep in runs:
        checks = rep[kind]
        assert checks["pickle"] is None, checks["pickle"]
        assert checks["twin_hooks"] == 0
        assert checks["twin_step"] is None, checks["twin_step"]
        assert checks["twin_same"]
        assert checks["original_hooks_kept"] == 4   # 2 steps, the refused one, the last: not the copy's


@pytest.mark.parametrize("kind", KINDS)
def test_repr_shows_the_groups_and_the_wrappers_options(runs, kind):
    for rank, rep in enumerate(runs):
        text = rep[kind]["repr"]
        assert text.startswith(NAMES[kind]) and "Parameter Group 0" in text and "lr: 0.05" in text
        assert f"rank {rank} of 2" in text and "max_grad_norm=" in text


def test_low_precision_parameters_are_refused_by_name_before_anything_is_written(runs):
    for rep in runs:
        found = rep["low_precision"]
        for kind in ("moonlight", "fsdp2"):
            err = found[kind]
            assert err is not None and err[0] == "ValueError", err
            assert "parameter 1 (param_groups[0]['params'][1]" in err[1] and "bfloat16" in err[1], err
            assert found[kind + "_untouched"]
