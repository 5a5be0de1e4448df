"""``optbook.distributed.overlap_workers``: ZeRO-1's parameter all-gather overlapped with the forward pass
(chapter 13). Nothing here depends on timing: the values must be bitwise those of the synchronous gathers
and of the unsharded model, and the event log must show Megatron-LM's schedule (bucket k + 1's gather
issued before layer k computes, awaited after it finished)."""

import pytest
import torch

from optbook.distributed import launch
from optbook.distributed.overlap_workers import MODES, overlap_forward, overlap_model
from helpers import scaled_timeout


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_three_gloo_ranks_overlapped_forward_is_bitwise_the_synchronous_one_and_follows_the_schedule(
        monkeypatch):
    monkeypatch.setenv("OPTBOOK_SEED_OFFSET", "1009")  # inherited by the spawned workers
    reports = launch(overlap_forward, 3, layers=4, width=40, batch=6, repeats=1, seed=5, timeout=scaled_timeout(60.0))
    model = overlap_model(4, 40, seed=5)                # shifted by the same offset in this process
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(5 + 1 + 1009))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                            # as in the workers: the same kernels, the same bits
    try:
        with torch.no_grad():
            expected = model(x)
    finally:
        torch.set_num_threads(threads)
    for rep in reports:
        assert rep["buckets"] == 4
        # lcm(3, 128) = 384 divides every bucket: 40 * 40 + 40 = 1640 elements, padded to 1920
        assert rep["shard_numel"] == [640] * 4
        assert torch.equal(rep["reference"], expected)  # the offset reached the worker processes
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        for b, lin in enumerate(linears):
            bucket = rep["params"][b * 1920:(b + 1) * 1920]
            assert torch.equal(bucket[:1600], lin.weight.detach().reshape(-1))
            assert torch.equal(bucket[1600:1640], lin.bias.detach()) and not bucket[1640:].any()
        for mode in MODES:
            assert torch.equal(rep["outputs"][mode], rep["reference"])
            assert torch.equal(rep["buffers"][mode], rep["params"])      # every NaN placeholder overwritten
            assert len(rep["gather_s"][mode]) == 1 and rep["gather_s"][mode][0] >= 0
            events = rep["events"][mode]
            assert len(events) == len(set(events)) == 16       # start, wait, compute, done per bucket
            at = {event: i for i, event in enumerate(events)}
            for k in range(3):
                if mode == "overlap":
                    assert at["start", k + 1] < at["compute", k] < at["done", k] < at["wait", k + 1]
                else:
                    assert at["done", k] < at["start", k + 1] < at["wait", k + 1] < at["compute", k + 1]
        assert rep["events"]["overlap"][0] == ("start", 0)


def test_model_seed_goes_through_the_runtime_offset(monkeypatch):
    base = _flat(overlap_model(2, 8, seed=3))
    monkeypatch.setenv("OPTBOOK_SEED_OFFSET", "1009")
    shifted = _flat(overlap_model(2, 8, seed=3))
    monkeypatch.delenv("OPTBOOK_SEED_OFFSET")
    assert not torch.equal(base, shifted) and torch.equal(shifted, _flat(overlap_model(2, 8, seed=1012)))
    state = torch.random.get_rng_state()
    overlap_model(2, 8)
    assert torch.equal(state, torch.random.get_rng_state())  # the global generator is left alone


@pytest.mark.parametrize("kwargs, name, error", [({"layers": 1}, "layers", ValueError), ({"width": 0}, "width", ValueError),
                                                 ({"batch": 2.0}, "batch", TypeError),
                                                 ({"repeats": True}, "repeats", TypeError),
                                                 ({"seed": -1}, "seed", ValueError)])
def test_bad_arguments_raise_naming_them_before_any_collective(kwargs, name, error):
    # no process group exists in this process: the check must come first; a count that is not an int is a TypeError
    with pytest.raises(error, match=f"Invalid {name}"):
        overlap_forward(0, 2, **kwargs)
