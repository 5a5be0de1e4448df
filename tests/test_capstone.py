"""optbook.capstone (chapter 19) and tools/capstone.py's merge: tiny runs of the real code."""

import math

import pytest
import torch

from optbook import capstone, text
from optbook.optim import ChainedOptimizer

TINY = capstone.Setup(d_model=16, n_layers=1, n_heads=2, seq_len=16, batch_size=4, max_steps=6, eval_every=2,
                      eval_windows=4, target=10.0)


@pytest.fixture(scope="module")
def split():
    return text.load_corpus()


def test_setup_and_optimizer_errors():
    with pytest.raises(ValueError, match="Invalid target"):
        capstone.Setup(target=0.0)
    with pytest.raises(TypeError, match="Invalid max_steps"):
        capstone.Setup(max_steps=1.5)
    model = capstone.new_model(TINY, 0, 62)
    with pytest.raises(ValueError, match="Invalid name"):
        capstone.build_optimizer("SGD", model, 1e-2)
    with pytest.raises(ValueError, match="Invalid lr"):
        capstone.build_optimizer("Muon", model, 0.0)
    assert isinstance(capstone.build_optimizer("Dion", model, 1e-2), ChainedOptimizer)


def test_steps_to_target_is_deterministic_and_stops_at_the_target(split):
    # the initial loss is about log(62) = 4.1 < 10: reached at the first evaluation, step 2
    a = capstone.steps_to_target("Muon", 1e-2, 3, TINY, split)
    assert a.steps == 2 and a.curve[0][0] == 2 and len(a.curve) == 1 and a.seconds > 0
    never = capstone.Setup(**{**TINY.__dict__, "target": 0.1})
    b = capstone.steps_to_target("AdamW", 1e-2, 3, never, split)
    c = capstone.steps_to_target("AdamW", 1e-2, 3, never, split)
    assert math.isinf(b.steps) and math.isinf(b.seconds) and [s for s, _ in b.curve] == [2, 4, 6]
    assert b.curve == c.curve                               # same seed: same windows, same init, same losses


def test_compare_follows_the_rank_test():
    steps = {"AdamW": list(range(20, 30)), "Muon": list(range(10, 20)), "Dion": list(range(20, 30))}
    rows = capstone.compare(steps)
    assert rows["AdamW"]["verdict"] == "reference" and rows["AdamW"]["p_faster"] is None
    assert rows["Muon"]["verdict"] == "faster" and rows["Muon"]["p_faster"] < 0.005
    assert rows["Muon"]["ratio"] == pytest.approx(24.5 / 14.5)
    assert rows["Dion"]["verdict"] == "no difference shown"
    never = capstone.compare({"AdamW": [math.inf] * 10, "Muon": list(range(10))})
    assert never["Muon"]["verdict"] == "faster"             # inf ("never") ranks last


def test_max_logit_run_clip_bounds_the_next_maximum(split):
    free = capstone.max_logit_run(0.3, 0, TINY, 5, None, split)
    tau = 0.5 * min(free["max_logit"])                      # below every recorded maximum: clipped every step
    clipped = capstone.max_logit_run(0.3, 0, TINY, 5, tau, split)
    assert len(clipped["max_logit"]) == 5 and clipped["max_logit"][0] == free["max_logit"][0]
    # after a clip the logits of the same weights are at most tau; one optimizer step can raise them again,
    # so the recorded maxima (taken before each clip) stay well below the unclipped run's
    assert max(clipped["max_logit"][1:]) < max(free["max_logit"][1:])
    assert math.isfinite(clipped["loss"])


def test_step_seconds_times_every_optimizer(split):
    cost = capstone.step_seconds({"AdamW": 1e-3, "Muon": 1e-2}, TINY, split, rounds=2, steps_per_round=1,
                                 warmup=1)
    assert set(cost) == {"AdamW", "Muon"} and all(0 < v < 10 for v in cost.values())
    with pytest.raises(TypeError, match="Invalid rounds"):
        capstone.step_seconds({"AdamW": 1e-3}, TINY, split, rounds=1.0)


def test_tool_merge_recomputes_the_comparison(tmp_path):
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).parents[1] / "tools" / "capstone.py"
    spec = importlib.util.spec_from_file_location("capstone_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    base = {"setup": {"target": 2.25}, "quick": False, "total_seconds": 1.0}
    parts = []
    for i, (name, steps) in enumerate({"AdamW": [100] * 9 + [None], "Muon": [50] * 10,
                                       "NorMuon": [100] * 10, "Dion": [200] * 10}.items()):
        part = base | {"grid": {name: [0.01, 0.03]}, "tuning": {}, "lr": {name: 0.01}, "steps": {name: steps},
                       "seconds_measured": {name: [1.0] * 10}, "curves": {name: []}}
        parts.append(tmp_path / f"{i}.json")
        parts[-1].write_text(json.dumps(part))
    extra = tmp_path / "extra.json"
    cost = {"AdamW": 1.0, "Muon": 3.0, "NorMuon": 1.0, "Dion": 1.0}
    extra.write_text(json.dumps(base | {"max_logit": {}, "step_seconds": cost}))
    with pytest.raises(ValueError, match="nothing for"):
        tool.merge(parts)
    result = tool.merge(parts + [extra])
    assert result["compare_steps"]["Muon"]["verdict"] == "faster"
    assert result["compare_steps"]["Dion"]["verdict"] == "slower"
    assert result["seconds"]["Muon"] == [150.0] * 10 and result["seconds"]["AdamW"][-1] is None
    assert result["lr_at_grid_edge"] == ["AdamW", "Muon", "NorMuon", "Dion"]
