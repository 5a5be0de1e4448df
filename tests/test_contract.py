"""The step contract (optbook.contract.CONTRACT), walked row by row.

For each row the class is built on a small problem (the single-process ones here, the distributed ones in
one launch of 2 gloo processes) and checked against its row: ``step()`` returns ``None`` or the closure's
loss; the reported attributes exist and describe the last step; a parameter's owner is registered where
the row says the class keeps a copy of the weights; a NaN or inf gradient raises
``NonFiniteGradientError`` with parameters and state bitwise untouched (and, where the class takes a loss
scaler, is skipped and reported); a bad ``load_state_dict`` raises with everything untouched. The checks
live in ``contract_workers.py`` (the launched processes import them by name).
"""

import pytest
from contract_workers import DISTRIBUTED, SINGLE_PROCESS, distributed_reports, row_report
from helpers import check_readme_section, scaled_timeout

from optbook import contract
from optbook.distributed import launch


def test_the_table_has_one_row_per_kind_and_the_docstring_holds_it():
    kinds = [row.kind for row in contract.CONTRACT]
    assert kinds == ["plain optimizer", "ChainedOptimizer", "MixedPrecisionOptimizer", "DistributedOptimizer",
                     "LayerWiseMuon", "DistributedMuon", "DistributedChain", "OffloadOptimizer"]
    assert set(SINGLE_PROCESS) | set(DISTRIBUTED) == set(kinds)
    table = contract.contract_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(kinds) and all(line.count("|") == len(contract.COLUMNS) + 1 for line in lines)
    assert table in contract.__doc__
    assert [r.kind for r in contract.CONTRACT if r.takes_loss_scaler] == ["MixedPrecisionOptimizer",
                                                                          "DistributedOptimizer"]
    assert not contract.CONTRACT[0].owner and contract.CONTRACT[2].owner


def _assert_ok(report):
    failed = {check: outcome for check, outcome in report.items() if outcome != "ok"}
    assert not failed, "\n".join(f"{check}: {outcome}" for check, outcome in failed.items())


@pytest.mark.parametrize("kind", SINGLE_PROCESS)
def test_single_process_row(kind):
    _assert_ok(row_report(kind))


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """{kind: [rank 0's report, rank 1's]} from one launch of 2 gloo processes."""
    out = launch(distributed_reports, 2, timeout=scaled_timeout(60.0))
    return {kind: [out[r][kind] for r in range(2)] for kind in DISTRIBUTED}


@pytest.mark.parametrize("kind", DISTRIBUTED)
def test_distributed_row(kind, distributed):
    for rank, report in enumerate(distributed[kind]):
        _assert_ok({f"rank {rank}: {k}": v for k, v in report.items()})


def test_the_readme_shows_the_contract_table():
    check_readme_section("contract-table", "Generated from `optbook.contract.CONTRACT` by `tests/test_contract.py` "
                         "(`OPTBOOK_UPDATE_README=1` rewrites it).\n\n" + contract.contract_table())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_all_finite_finds_every_nonfinite_value_wherever_it_sits(dtype):
    """The non-finite check of every step: a NaN, +inf or -inf at the start, the middle, or the tail of a
    vectorised loop (lengths around the vector widths), in a non-contiguous tensor, next to empty tensors."""
    import torch

    from optbook.optim.optimizer import all_finite

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 4099):
        for pos in sorted({0, n // 2, n - 1}):
            for value in (float("nan"), float("inf"), -float("inf")):
                t = torch.randn(n, generator=gen).to(dt)
                assert all_finite([torch.empty(0, dtype=dt), t])
                t[pos] = value
                assert not all_finite([torch.ones(3, dtype=dt), t]), (n, pos, value)
        wide = torch.randn(n, 3, generator=gen).to(dt).t()   # non-contiguous
        wide[1, n - 1] = float("nan")
        assert not all_finite([wide])
    big = torch.full((5,), torch.finfo(dt).max, dtype=dt)
    assert all_finite([big, -big])   # the largest finite values are finite: nothing overflows
