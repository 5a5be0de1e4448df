"""The feature matrix of the training loop: every wrapper x {AdamW, Muon, Muon + AdamW} x every feature, each
cell checked against the single-process run of the same algorithm (tests/composition_ranks.py builds and runs
them).

A cell is ``ok`` when the wrapper's weights (and its own copies: masters, host copies) equal the reference's
within the tolerance of its precision and it reports what the step contract says (``step()`` returns
``None``; ``found_inf``, ``skipped_steps``, ``last_grad_norm``); ``refused`` when the wrapper refuses the
combination by design with an error naming it (:func:`refusal`); ``n/a`` when the wrapper does not take that
optimizer. The distributed wrappers run every feature on 2 and on 3 gloo processes (one launch per world
size, every cell in it); "resume at another world size" saves on 2 and continues on 3.

These features (QK-clip, loss scaler, LR schedule, gradient accumulation, outside writes) complement the
composition matrix of tests/test_composition_matrix.py, whose table is the one book/api_contract.md shows.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from composition_ranks import (
    AGREE_ERROR,
    BUILDERS,
    FEATURES,
    LOW_PRECISION,
    MAX_GRAD_NORM,
    OPTIMIZERS,
    OVERFLOW_AT,
    SPLIT_AT,
    STEPS,
    WORLD_SIZES,
    Plan,
    cell_file,
    distributed_cells,
    distributed_suite,
    expected_loss_scale,
    lr_factor,
    make_loss_scaler,
    reference_run,
    run_cell,
)
from helpers import scaled_timeout

from optbook.distributed import launch


#: Largest weight difference from the reference. float64 runs differ only in the order of sums (the mean over
#: ranks, a micro-batch's share of a matmul): a few ulps of weights of size 0.1-3, far below 1e-12. The
#: bfloat16 model's float32 masters see the same bfloat16 gradients as the reference's, so they are equal up
#: to float32 roundings of the same operations done in another order (QK-clip's factor applied in float32 or
#: float64: 6e-8 at |w| <= 1); 1e-6 allows a few such steps and is far below one bfloat16 step (2^-8 |w|).
TOLERANCE = {False: 1e-12, True: 1e-6}

#: The collective timeout of a launch; the whole launch must end within it plus 30 s (10-60 s here; each cell
#: that raises during a step on some ranks only adds CELL_TIMEOUT = 20 s).
LAUNCH_TIMEOUT = scaled_timeout(240.0)

#: Combinations refused by design: (pattern the error message must contain, the reason shown in the table).
NOT_ELEMENTWISE = (r"element", "not element-wise")
NO_LOSS_SCALER = (r"loss.scaler", "takes no loss scaler")
ONLY_LAYERWISE = (r"expected a LayerWiseMuon", "DistributedChain takes a LayerWiseMuon")
TAKES_NO_SCALER = {"LayerWiseMuon", "DistributedMuon", "DistributedChain", "OffloadOptimizer", "ChainedOptimizer"}


def refusal(wrapper: str, kind: str, feature: str):
    """``(pattern, reason)`` when the wrapper refuses this cell by design, else ``None``."""
    if wrapper == "DistributedOptimizer (ZeRO-1)" and kind != "AdamW":
        return NOT_ELEMENTWISE
    if feature == "loss scaler" and wrapper in TAKES_NO_SCALER:
        return NO_LOSS_SCALER
    if wrapper == "DistributedMuon" and kind == "Muon + AdamW":
        return ONLY_LAYERWISE
    return None


def cells() -> list[tuple[str, str, str]]:
    return [(w, k, f) for w, (_, kinds, _) in BUILDERS.items() for k in kinds for f in FEATURES]


# --- judging one cell -------------------------------------------------------------------------------------------
def max_diff(actual, expected) -> float:
    if len(actual) != len(expected) or any(a.shape != e.shape for a, e in zip(actual, expected)):
        return math.inf
    return max((float((a.double() - e.double()).abs().max()) for a, e in zip(actual, expected) if a.numel()),
               default=0.0)


def contract_problems(run: dict, ref: dict, feature: str) -> list[str]:
    """What the wrapper reports against what the step contract and the reference say."""
    plan = FEATURES[feature]
    steps = range(SPLIT_AT, STEPS) if plan.resume else range(STEPS)
    problems = []
    returned = {repr(v) for v in run["returned"] if v is not None}
    if returned:
        problems.append(f"step() returned {', '.join(sorted(returned))} (contract: None)")
    expected = [plan.loss_scaler and t == OVERFLOW_AT for t in steps]
    if run["found_inf"] != expected or any(type(v) is not bool for v in run["found_inf"]):
        problems.append(f"found_inf {run['found_inf']} (expected {expected})")
    skipped = sum(expected)
    if run["skipped_steps"] != skipped or type(run["skipped_steps"]) is not int:
        problems.append(f"skipped_steps {run['skipped_steps']!r} (expected {skipped})")
    norms = run["last_grad_norm"]
    if any(v is not None and type(v) is not float for v in norms):
        problems.append(f"last_grad_norm is {sorted({type(v).__name__ for v in norms})} (contract: float or None)")
    elif plan.max_grad_norm is not None and norms[-1] is not None \
            and not math.isclose(norms[-1], ref["norms"][-1], rel_tol=1e-6):
        problems.append(f"last_grad_norm {norms[-1]:.6g} (reference {ref['norms'][-1]:.6g})")
    if run["lrs"] != ref["lrs"]:
        problems.append(f"learning rates {run['lrs']} (reference {ref['lrs']})")
    if plan.loss_scaler and run["scale"] != expected_loss_scale():
        problems.append(f"loss scale {run['scale']} (expected {expected_loss_scale()})")
    if run["clipped_heads"] != ref["clipped_heads"]:
        problems.append(f"QK-clip clipped {run['clipped_heads']} heads (reference {ref['clipped_heads']})")
    return problems


def judge(wrapper: str, kind: str, feature: str, runs: list[tuple[str, dict]], ref: dict) -> str:
    """The cell's text: ``ok (max diff ...)``, ``refused: ...`` or ``FAIL: ...``. ``runs``: (where, result)
    for every rank that ran the cell."""
    expected_refusal = refusal(wrapper, kind, feature)
    errors = sorted(((where, r["error"]) for where, r in runs if "error" in r),
                    key=lambda e: AGREE_ERROR in e[1][1] or "Timed out" in e[1][1])   # the cause before its echoes
    if expected_refusal is not None:
        pattern, reason = expected_refusal
        if errors and len(errors) == len(runs) and all(re.search(pattern, m, re.IGNORECASE) for _, (_, m) in errors):
            return f"refused: {reason}"
        if not errors:
            return f"FAIL: ran, expected a refusal ({reason})"
    if errors:
        where, (name, message) = errors[0]
        return f"FAIL: {where}{name}: {message}"
    low = wrapper in LOW_PRECISION
    worst, problems = 0.0, []
    for where, run in runs:
        diff = max_diff(run["params"], ref["params"])
        if run["masters"] is not None:
            diff = max(diff, max_diff(run["masters"], ref["masters"]))
        if diff > TOLERANCE[low]:
            problems.append(f"{where}weights differ from the reference by {diff:.1e}")
        problems += [where + p for p in contract_problems(run, ref, feature)]
        worst = max(worst, diff)
    if problems:
        return "FAIL: " + "; ".join(dict.fromkeys(problems))
    return f"ok (max diff {format_diff(worst)})"


def format_diff(diff: float) -> str:
    """``0``, or the power of ten just above ``diff`` (stable across machines, unlike the digits)."""
    return "0" if diff == 0 else f"< 1e{math.floor(math.log10(diff)) + 1}"


# --- running every cell -----------------------------------------------------------------------------------------
def launch_suite(world_size: int, directory: str) -> dict:
    """{cell: [(where, result) per rank]} of one launch; cells a stopped launch did not reach get its error."""
    try:
        launch(distributed_suite, world_size, directory, timeout=LAUNCH_TIMEOUT)
        stopped = None
    except RuntimeError as e:
        stopped = ("RuntimeError", f"the launch on {world_size} processes stopped first: {str(e)[:300]}")
    out = {}
    for index, cell in enumerate(distributed_cells()):
        runs = []
        for rank in range(world_size):
            path = cell_file(directory, world_size, index, rank)
            result = torch.load(path, weights_only=False) if os.path.exists(path) else {"error": stopped}
            runs.append((f"{world_size} ranks, rank {rank}: ", result))
        if any(r == {"error": None} for _, r in runs):   # a resume whose save failed: not run on purpose
            runs = []
        out[cell] = runs
    return out


def distributed_runs(directory: str) -> dict:
    """{cell: [(where, result)]}: every distributed cell on 2 and on 3 processes; for the resume feature the
    save on 2 when it failed, else the continuation on 3."""
    first, second = (launch_suite(w, directory) for w in WORLD_SIZES)
    out = {}
    for cell in distributed_cells():
        if FEATURES[cell[2]].resume:
            failed = [(where, r) for where, r in first[cell] if "error" in r]
            out[cell] = failed or second[cell]
        else:
            out[cell] = first[cell] + second[cell]
    return out


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    runs = distributed_runs(str(tmp_path_factory.mktemp("composition")))
    references: dict = {}
    out = {}
    for wrapper, kind, feature in cells():
        low = wrapper in LOW_PRECISION
        key = (kind, feature, low)
        if key not in references:
            references[key] = reference_run(kind, FEATURES[feature], low)
        cell_runs = runs.get((wrapper, kind, feature)) or [("", run_cell(wrapper, kind, feature))]
        out[(wrapper, kind, feature)] = judge(wrapper, kind, feature, cell_runs, references[key])
    return out


@pytest.mark.parametrize("wrapper, kind, feature", cells(), ids=lambda v: v.replace(" ", "_"))
def test_cell(verdicts, wrapper, kind, feature):
    verdict = verdicts[(wrapper, kind, feature)]
    assert not verdict.startswith("FAIL"), verdict


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_every_feature_acts_in_the_reference(kind):
    """The features change something: heads are clipped, the clip scales at every step, the schedule moves
    the per-group rates, the loss scale moves, and the outside writes and the skipped step change the end."""
    base = reference_run(kind, Plan(), False)
    assert reference_run(kind, FEATURES["QK-clip"], False)["clipped_heads"] > 0
    assert min(reference_run(kind, FEATURES["global clip"], False)["norms"]) > MAX_GRAD_NORM
    assert len(set(base["lrs"])) > 1
    assert reference_run(kind, FEATURES["LR schedule"], False)["lrs"] == [lr * lr_factor(STEPS)
                                                                         for lr in base["lrs"]]
    assert expected_loss_scale() != make_loss_scaler().scale
    for feature in ("weights-only load", "in-place edit", "loss scaler", "QK-clip"):
        params = reference_run(kind, FEATURES[feature], False)["params"]
        assert max_diff(params, base["params"]) > 1e-3, feature
