"""optbook.runtime (seeds shifted by the sweep's offset) and optbook.testing.assert_claim (asserts or records)."""

import json

import pytest
import torch

from optbook import runtime
from optbook.testing import assert_claim


def test_seeds_are_the_notebooks_own_outside_a_sweep(monkeypatch):
    monkeypatch.delenv("OPTBOOK_SEED_OFFSET", raising=False)
    assert runtime.seeds(0, 1, 2) == (0, 1, 2)
    assert runtime.generator(5).initial_seed() == 5


def test_a_sweep_shifts_every_seed_the_same_way(monkeypatch):
    monkeypatch.setenv("OPTBOOK_SEED_OFFSET", "1009")
    assert runtime.seeds(0, 1, 2) == (1009, 1010, 1011)
    assert runtime.generator(1).initial_seed() == 1010
    gen = runtime.seed_everything(3, num_threads=None)
    assert gen.initial_seed() == 1012 and torch.initial_seed() == 1012


@pytest.mark.parametrize("raw", ["-1", "x", "1.5"])
def test_a_bad_offset_is_refused_with_its_name(monkeypatch, raw):
    monkeypatch.setenv("OPTBOOK_SEED_OFFSET", raw)
    with pytest.raises(ValueError, match="OPTBOOK_SEED_OFFSET"):
        runtime.seeds(0)


def test_bad_seeds_are_refused():
    with pytest.raises(ValueError, match="seed"):
        runtime.seeds(-1)
    with pytest.raises(TypeError, match="seed"):
        runtime.seeds(1.0)


def test_a_claim_that_holds_returns_its_value(monkeypatch):
    monkeypatch.delenv("OPTBOOK_CLAIMS_LOG", raising=False)
    assert assert_claim("x", torch.tensor(2.5), ">", 2) == 2.5
    assert assert_claim("y", 3, "<=", 3) == 3.0


def test_a_failing_claim_names_itself_value_and_bound(monkeypatch):
    monkeypatch.delenv("OPTBOOK_CLAIMS_LOG", raising=False)
    with pytest.raises(AssertionError, match=r"ratio of norms: 1\.5 > 2\.0"):
        assert_claim("ratio of norms", 1.5, ">", 2)
    with pytest.raises(AssertionError):
        assert_claim("nan never holds", float("nan"), "<", 1)


def test_claim_refuses_bad_arguments():
    with pytest.raises(ValueError, match="op"):
        assert_claim("x", 1, "!=", 0)
    with pytest.raises(ValueError, match="bound"):
        assert_claim("x", 1, "<", float("inf"))
    with pytest.raises(ValueError, match="real numbers"):
        assert_claim("x", "big", "<", 1)


def test_in_a_sweep_claims_are_recorded_not_raised(monkeypatch, tmp_path):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("OPTBOOK_CLAIMS_LOG", str(log))
    monkeypatch.setenv("OPTBOOK_SEED_OFFSET", "2018")
    monkeypatch.setenv("OPTBOOK_NOTEBOOK", "06_muon")
    monkeypatch.setenv("OPTBOOK_KERNELS", "generic")
    assert_claim("holds", 1.0, "<", 2)
    assert_claim("fails", 3.0, "<", 2)       # recorded, not raised
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["claim"], r["holds"]) for r in records] == [("holds", True), ("fails", False)]
    assert records[1] == {"notebook": "06_muon", "kernels": "generic", "seed_offset": 2018, "claim": "fails",
                          "value": 3.0, "op": "<", "bound": 2.0, "holds": False}


def test_glue_writes_numpy_and_tensor_scalars_as_plain_numbers(monkeypatch):
    # {glue:text}`name:.2f` formats the text/plain form; NumPy 2 writes np.float64(1.5) there
    np = pytest.importorskip("numpy")
    myst_nb = pytest.importorskip("myst_nb")
    seen = {}
    monkeypatch.setattr(myst_nb, "glue", lambda name, value, display=False: seen.__setitem__(name, value))
    for name, value in (("np", np.float64(1.5)), ("tensor", torch.tensor(1.5)), ("int", np.int64(3))):
        assert runtime.glue(name, value) is value
        assert type(seen[name]) in (float, int) and repr(seen[name]) in ("1.5", "3"), (name, seen[name])
    assert runtime.glue("list", [1.0]) == [1.0] and seen["list"] == [1.0]
