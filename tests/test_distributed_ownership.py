"""Weight ownership of bfloat16 parameters under the distributed wrappers, and DistributedChain's
composition of its members (issue: one wrapper, items 2 and 5), on 2 and 3 gloo processes.

Every distributed wrapper given bfloat16 parameters either keeps float32 masters and gives the numbers of
the single-process ``MixedPrecisionOptimizer`` around the same optimizer (LayerWiseMuon, DistributedChain;
ZeRO-1's own tests cover DistributedOptimizer), or refuses them with an error naming the parameter
(DistributedMuon, FSDP2Muon). The rank programs are in ``tests/ownership_ranks.py``.
"""

import pytest
from helpers import scaled_timeout
from ownership_ranks import (
    STEPS,
    chain_bfloat16,
    chain_composition,
    layerwise_bfloat16,
    low_precision_refusals,
    zero1_schedule_free,
)

from optbook.distributed import launch


@pytest.fixture(scope="module")
def layerwise():
    return launch(layerwise_bfloat16, 3, timeout=scaled_timeout(180.0))


@pytest.mark.parametrize("rank", [0, 1])
def test_layerwise_muon_on_bfloat16_keeps_float32_masters_and_equals_mixed_precision_muon(layerwise, rank):
    rep = layerwise[rank]
    # before: no masters, so updates below half a bfloat16 ulp were lost and the weights hardly moved
    assert rep["equal"], f"after {STEPS} steps: {rep['changed']} weights changed, {rep['reference_changed']} in the reference"
    assert rep["changed"] == rep["reference_changed"] > 300
    assert rep["masters_equal"]


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("kind", ["resumed_equal", "sharded_equal"])
def test_layerwise_muon_bfloat16_checkpoint_resumes_at_another_world_size_with_its_masters(layerwise, rank, kind):
    assert layerwise[rank][kind]


def test_layerwise_muon_refuses_float16_naming_the_parameter(layerwise):
    assert layerwise[0]["float16"] is not None, "a float16 LayerWiseMuon was accepted (no loss scaler, no masters)"
    kind, message = layerwise[0]["float16"]
    assert kind == "ValueError" and "parameter 0 (param_groups[0]['params'][0], shape (4, 4))" in message
    assert "float16" in message


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_chain_on_bfloat16_equals_mixed_precision_chained_optimizer(world_size):
    for rep in launch(chain_bfloat16, world_size, timeout=scaled_timeout(180.0)):
        assert rep["equal"], rep
        assert rep["changed"] == rep["reference_changed"] > 300


@pytest.fixture(scope="module")
def composition():
    return launch(chain_composition, 2, timeout=scaled_timeout(180.0))


def test_distributed_chain_leaves_its_members_attributes_alone(composition):
    for rep in composition:
        assert rep["member_writes"] == []


def test_distributed_chain_runs_torch_step_hooks(composition):
    for rep in composition:
        assert rep["hook_calls"] == ["pre", "post"] * 3


def test_distributed_chain_is_its_members_public_phases(composition):
    for rep in composition:
        assert rep["phases_equal"] and rep["norm_equal"]


def test_distributed_chain_refuses_fsdp2_muon_naming_the_recipe_that_works(composition):
    for rep in composition:
        assert rep["fsdp2_refusal"] is not None
        kind, message = rep["fsdp2_refusal"]
        assert kind == "TypeError" and "clip_grad_norm_" in message and "group=mesh.get_group()" in message


@pytest.fixture(scope="module")
def refusals():
    return launch(low_precision_refusals, 2, timeout=scaled_timeout(180.0))


def test_fsdp2_muon_refuses_bfloat16_shards_naming_the_parameter(refusals):
    for rep in refusals:
        assert rep["fsdp2"] is not None, "FSDP2Muon accepted bfloat16 DTensors (its docstring says float32/64)"
        kind, message = rep["fsdp2"]
        assert kind == "ValueError" and "parameter 0 (param_groups[0]['params'][0], shape (8, 6))" in message
        assert "MixedPrecisionPolicy" in message


def test_distributed_muon_refuses_bfloat16_naming_the_parameter(refusals):
    for rep in refusals:
        kind, message = rep["moonlight"]
        assert kind == "ValueError" and "parameter 1 (param_groups[0]['params'][1], shape (3, 4))" in message


def test_zero1_forwards_eval_and_train_of_an_inner_schedule_free():
    # before: DistributedOptimizer had no eval()/train(): evaluation ran at the training point y
    for rep in launch(zero1_schedule_free, 2, timeout=scaled_timeout(180.0)):
        for dtype, r in rep.items():
            assert r["eval_equal"] and r["train_equal"], (dtype, r)
            assert r["refused_in_eval"] is not None and "train()" in r["refused_in_eval"]
