"""The single-process composition matrix (tests/composition_matrix.py): SGD, AdamW, Muon, NorMuon, Dion,
ScheduleFreeAdamW, SOAP x ChainedOptimizer, MixedPrecisionOptimizer, OffloadOptimizer x (step, clip, skipped
non-finite step, eval/train, save -> load, DCP full), each cell bitwise against one plain single-process run.
``matrix_rows()`` there returns the table as data for the README/chapter-10 renderer."""

from __future__ import annotations

import pytest
from composition_matrix import FEATURES, KNOWN, OPTIMIZERS, WRAPPERS, matrix_rows, render, run_cell

CELLS = [(o, w, f) for o in OPTIMIZERS for w in WRAPPERS for f in FEATURES]


@pytest.mark.parametrize("optimizer, wrapper, feature", [
    pytest.param(*c, marks=pytest.mark.xfail(reason=KNOWN[c], strict=True)) if c in KNOWN else c for c in CELLS],
    ids=lambda v: v.replace(" ", "_").replace("/", "_").replace(">", ""))
def test_cell(optimizer, wrapper, feature):
    outcome = run_cell(optimizer, wrapper, feature)
    assert outcome == "ok" or outcome.startswith("refused"), outcome


def test_the_rows_are_data_a_tool_can_render():
    rows = matrix_rows(optimizers=["SGD"], wrappers=["ChainedOptimizer"], features=("step", "clip"))
    assert rows == [{"optimizer": "SGD", "wrapper": "ChainedOptimizer", "feature": f, "outcome": "ok"}
                    for f in ("step", "clip")]
    assert render(rows).splitlines()[2] == "| SGD | ChainedOptimizer | ok | ok |"


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind():
    """The DCP cells start a one-process gloo group in this process (composition_matrix._dcp); it is destroyed
    after the module, so that a later test in the same worker starts without one."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()
