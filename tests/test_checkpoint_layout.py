"""Every sharded checkpoint records one layout fingerprint (``optbook.distributed._comm.layout_fingerprint``:
class, world size, mesh shape, parameters and dtypes, owners or buckets and every rank's pieces, a digest):
LayerWiseMuon, DistributedMuon, ZeRO-1's DistributedOptimizer and DistributedChain. On load, this rank's own
file of the same layout loads; the list of every rank's files of another layout reshards and continues bit
for bit; anything else is refused with a ValueError naming both layouts (the file's and this optimizer's)
before anything is written. One launch of 2 gloo processes (``tests/muon_rank_programs.py``,
:func:`layout_suite`).
"""

import pytest
import torch
from checkpoint_layout_ranks import LAYOUT_KINDS, layout_suite

from optbook.distributed import launch
from helpers import scaled_timeout

CLASSES = {"layerwise": "LayerWiseMuon", "moonlight": "DistributedMuon", "zero1": "DistributedOptimizer",
           "chain": "DistributedChain"}


@pytest.fixture(scope="module")
def runs():
    return launch(layout_suite, 2, timeout=scaled_timeout(120.0))


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_every_sharded_checkpoint_records_one_layout_fingerprint(runs, kind):
    for rank, rep in enumerate(runs):
        rep = rep[kind]
        fp = rep["fingerprint"]
        assert fp is not None and fp == rep["expected"]
        assert fp["class"] == CLASSES[kind] and fp["world_size"] == 2 and fp["mesh"] == (2,)
        assert len(fp["digest"]) == 16 and fp["digest"] != rep["other_fingerprint"]["digest"]
        if kind == "layerwise":
            assert fp["owners"] is not None and fp["pieces"] is None
            assert {d for _, d in fp["params"]} == {"torch.float64"} and len(fp["owners"]) == len(fp["params"])
        elif kind in ("moonlight", "zero1"):
            assert fp["owners"] is None and len(fp["pieces"]) == 2 and fp["buckets"]
        else:
            assert fp["parts"]["muon"]["class"] == "LayerWiseMuon"
            assert fp["parts"]["adamw"]["class"] == "DistributedOptimizer"


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_a_file_of_another_layout_is_refused_naming_both_layouts_with_nothing_written(runs, kind):
    for rep in runs:
        rep = rep[kind]
        (etype, msg), untouched = rep["own_other_layout"]
        assert etype == "ValueError" and untouched, msg
        assert f"the file's layout: {rep['describe'][0]}" in msg and f"this optimizer's layout: {rep['describe'][1]}" in msg
        assert "pass the list" in msg


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_files_of_two_saves_are_refused_naming_both_layouts(runs, kind):
    for rep in runs:
        rep = rep[kind]
        (etype, msg), untouched = rep["two_saves"]
        assert etype == "ValueError" and untouched, msg
        assert rep["describe"][0] in msg and rep["describe"][1] in msg and "not of one save" in msg


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_a_file_holding_what_its_layout_gives_another_rank_is_refused(runs, kind):
    for rep in runs:
        (etype, msg), untouched = rep[kind]["tampered"]
        assert etype == "ValueError" and untouched, msg
        assert "the file of rank 1 holds" in msg and "layout:" in msg


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_a_file_of_another_optimizer_class_is_refused_naming_both_layouts(runs, kind):
    foreign = "DistributedMuon" if kind == "layerwise" else "LayerWiseMuon"
    for rep in runs:
        rep = rep[kind]
        (etype, msg), untouched = rep["other_class"]
        assert etype == "ValueError" and untouched, msg
        assert f"saved by a {foreign}" in msg and f"layout: {foreign} at world size 2" in msg
        assert f"this optimizer's layout: {rep['describe'][0]}" in msg


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_the_own_file_loads_and_every_file_reshards_into_another_layout_bit_for_bit(runs, kind):
    for rep in runs:
        rep = rep[kind]
        assert _bitwise(rep["own"], rep["uninterrupted"])
        assert _bitwise(rep["resharded"], rep["uninterrupted"])
        assert rep["resharded_layout"] == rep["expected_other"]   # the loader keeps its own layout


def test_describe_layout_names_class_world_size_mesh_dtypes_owners_and_digest():
    from optbook.distributed._comm import describe_layout

    fp = {"class": "LayerWiseMuon", "world_size": 2, "mesh": (2,), "params": [((4, 3), "torch.bfloat16")],
          "owners": [1], "buckets": None, "pieces": None, "parts": None, "digest": "0123456789abcdef"}
    assert describe_layout(fp) == ("LayerWiseMuon at world size 2 (mesh (2,)), 1 parameters (bfloat16), "
                                   "owners [1], digest 0123456789abcdef")
    assert describe_layout(None) == "no layout fingerprint (NoneType)"
