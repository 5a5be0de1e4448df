"""The single-process composition matrix: optimizer x wrapper x feature, each cell run against one plain,
single-process reference, with its outcome as data (:func:`matrix_rows`) that a tool can render.

Optimizers (:data:`OPTIMIZERS`): SGD, AdamW, Muon, NorMuon, Dion, ScheduleFreeAdamW, SOAP. Wrappers
(:data:`WRAPPERS`; more columns are added by adding entries): ChainedOptimizer, MixedPrecisionOptimizer (a
bfloat16 model with float32 masters), OffloadOptimizer (half the elements on the host). Features
(:data:`FEATURES`): step, clip, skipped non-finite step, eval/train, save -> load, DCP full (``get_/
set_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True`` on one gloo process, read once
before the first step too).

The reference keeps the weights the wrapper would: the model itself in float64, or float32 masters of the
bfloat16 model (the model is then the masters rounded). Every cell is compared bitwise: the wrapper performs
the same operations on the same numbers. A cell's outcome is ``"ok"``, ``"refused: <reason>"`` (the
combination is refused by design, with an error naming it) or ``"FAIL: <what differs>"``; :data:`KNOWN`
lists failures owned elsewhere.
"""

from __future__ import annotations

import copy
import io
import os
from dataclasses import dataclass

import torch

from optbook.clipping import clip_grad_norm_
from optbook.contract import NonFiniteGradientError
from optbook.memory import OffloadOptimizer
from optbook.optim import SGD, SOAP, AdamW, ChainedOptimizer, Dion, Muon, NorMuon
from optbook.optim.schedule_free import ScheduleFreeAdamW
from optbook.precision import ConstantLossScaler, MixedPrecisionOptimizer

#: name -> (class, hyperparameters)
OPTIMIZERS = {
    "SGD": (SGD, dict(lr=0.1, momentum=0.9)),
    "AdamW": (AdamW, dict(lr=0.01, weight_decay=0.1)),
    "Muon": (Muon, dict(lr=0.02)),
    "NorMuon": (NorMuon, dict(lr=0.02)),
    "Dion": (Dion, dict(lr=0.02)),
    "ScheduleFreeAdamW": (ScheduleFreeAdamW, dict(lr=0.01)),
    "SOAP": (SOAP, dict(lr=0.01)),
}
FEATURES = ("step", "clip", "skipped non-finite step", "eval/train", "save -> load", "DCP full")
MAX_GRAD_NORM = 0.5
SHAPES = ((5, 6), (4, 5))
STEPS = 4

#: (optimizer, wrapper, feature) -> reason: a failure owned by another module, expected until it is fixed
#: (the test marks these cells xfail, strict: a fix shows up as a pass to be recorded).
KNOWN: dict[tuple[str, str, str], str] = {}   # none left: Muon's and NorMuon's ns_dtype is kept by name now


@dataclass
class Setup:
    """A wrapper ready to step, its model's parameters and its reference."""

    wrapper: torch.optim.Optimizer
    params: list
    ref_params: list     # the reference's weights (float64 model or float32 masters)
    ref: torch.optim.Optimizer
    low: bool            # a bfloat16 model with float32 masters


def _start(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=g, dtype=torch.float64) / 3).to(dtype)) for s in SHAPES]


def _grads(params, k, bad=False):
    g = torch.Generator().manual_seed(100 + k)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if bad and i == 1:
            p.grad[0, 0] = float("inf")


def build(opt_name: str, wrapper: str, max_grad_norm=None, scaler=False) -> Setup:
    cls, hyper = OPTIMIZERS[opt_name]
    low = wrapper == "MixedPrecisionOptimizer"
    params = _start(torch.bfloat16 if low else torch.float64)
    ref_params = [p.detach().float().requires_grad_() if low else p.detach().clone().requires_grad_()
                  for p in params]
    ref = cls(ref_params, **hyper)
    if wrapper == "ChainedOptimizer":
        w = ChainedOptimizer([cls(params, **hyper)], max_grad_norm=max_grad_norm)
    elif wrapper == "MixedPrecisionOptimizer":
        w = MixedPrecisionOptimizer(cls(params, **hyper), ConstantLossScaler(1.0) if scaler else None,
                                    max_grad_norm=max_grad_norm)
    elif wrapper == "OffloadOptimizer":
        w = OffloadOptimizer(params, cls, offload_fraction=0.5, **hyper)
    else:  # pragma: no cover - a column added without a builder
        raise KeyError(wrapper)
    return Setup(w, params, ref_params, ref, low)


#: wrapper name -> whether it has a max_grad_norm and a loss scaler (else: clip outside; raise on inf/NaN)
WRAPPERS = {"ChainedOptimizer": (True, False), "MixedPrecisionOptimizer": (True, True),
            "OffloadOptimizer": (False, False)}


def _ref_step(s: Setup, k: int, clip: bool):
    _grads(s.ref_params, k) if not s.low else _copy_grads(s, k)
    if clip:
        clip_grad_norm_(s.ref_params, MAX_GRAD_NORM)
    s.ref.step()


def _copy_grads(s: Setup, k: int):   # the reference of a bfloat16 model: its bfloat16 gradients, in float32
    tmp = [torch.empty(p.shape, dtype=torch.bfloat16) for p in s.params]
    _grads(tmp, k)
    for r, t in zip(s.ref_params, tmp):
        r.grad = t.grad.float()


def _compare(s: Setup) -> str | None:
    mine = s.wrapper.master_params() if s.low else s.params
    for i, (a, b) in enumerate(zip(mine, s.ref_params)):
        if not torch.equal(a.detach(), b.detach()):
            return f"parameter {i} differs by {float((a.double() - b.double()).abs().max()):.3g}"
    if s.low:
        for i, (p, r) in enumerate(zip(s.params, s.ref_params)):
            if not torch.equal(p.detach(), r.detach().bfloat16()):
                return f"model parameter {i} is not its master rounded"
    return None


def _dcp():
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
        dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.checkpoint import state_dict as dcp
    return dcp


class _Module(torch.nn.Module):
    def __init__(self, params):
        super().__init__()
        self.weights = torch.nn.ParameterList(params)   # the very Parameters the wrapper steps


def run_cell(opt_name: str, wrapper: str, feature: str) -> str:
    """Run one cell; return its outcome (module docstring)."""
    has_clip, has_scaler = WRAPPERS[wrapper]
    clip = feature == "clip"
    s = build(opt_name, wrapper, MAX_GRAD_NORM if clip and has_clip else None,
              scaler=feature == "skipped non-finite step" and has_scaler)
    if feature == "DCP full":
        return _run_dcp(s, opt_name, wrapper)
    for k in range(STEPS):
        if feature == "skipped non-finite step" and k == 1:
            _grads(s.params, k, bad=True)
            before = [p.detach().clone() for p in s.params]
            if has_scaler:
                s.wrapper.step()
                if not (s.wrapper.found_inf and s.wrapper.skipped_steps == 1):
                    return "FAIL: the non-finite step was not reported as skipped"
            else:
                try:
                    s.wrapper.step()
                    return "FAIL: a non-finite gradient without a loss scaler did not raise"
                except NonFiniteGradientError:
                    pass
            if not all(torch.equal(a, b.detach()) for a, b in zip(before, s.params)):
                return "FAIL: the non-finite step wrote the weights"
            continue
        _grads(s.params, k)
        if clip and not has_clip:
            clip_grad_norm_(s.params, MAX_GRAD_NORM)
        s.wrapper.step()
        _ref_step(s, k, clip)
        if feature == "eval/train" and k == 1:
            s.wrapper.eval()
            if hasattr(s.ref, "eval"):
                s.ref.eval()
            bad = _compare(s)
            if bad:
                return f"FAIL: in eval mode, {bad}"
            s.wrapper.train()
            if hasattr(s.ref, "train"):
                s.ref.train()
        if feature == "save -> load" and k == 1:
            buf = io.BytesIO()
            torch.save(s.wrapper.state_dict(), buf)
            fresh = build(opt_name, wrapper)
            with torch.no_grad():
                for p, q in zip(fresh.params, s.params):
                    p.copy_(q)
            buf.seek(0)
            fresh.wrapper.load_state_dict(torch.load(buf, weights_only=False))
            s = Setup(fresh.wrapper, fresh.params, s.ref_params, s.ref, s.low)
    bad = _compare(s)
    if bad:
        return f"FAIL: {bad}"
    if clip and has_clip and not isinstance(s.wrapper.last_grad_norm, float):
        return "FAIL: last_grad_norm not reported"
    return "ok"


def _run_dcp(s: Setup, opt_name: str, wrapper: str) -> str:
    dcp = _dcp()
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    try:
        model = _Module(s.params)
        dcp.get_optimizer_state_dict(model, s.wrapper, options=options)   # read before the first step
        for k in range(2):
            _grads(s.params, k)
            s.wrapper.step()
            _ref_step(s, k, False)
        saved = dcp.get_optimizer_state_dict(model, s.wrapper, options=options)
        fresh = build(opt_name, wrapper)
        with torch.no_grad():
            for p, q in zip(fresh.params, s.params):
                p.copy_(q)
        model2 = _Module(fresh.params)
        dcp.set_optimizer_state_dict(model2, fresh.wrapper, copy.deepcopy(saved), options=options)
    except Exception as e:   # noqa: BLE001 - the outcome is data
        return f"FAIL: {type(e).__name__}: {str(e)[:120]}"
    s = Setup(fresh.wrapper, fresh.params, s.ref_params, s.ref, s.low)
    for k in range(2, STEPS):
        _grads(s.params, k)
        s.wrapper.step()
        _ref_step(s, k, False)
    bad = _compare(s)
    return f"FAIL: {bad}" if bad else "ok"


def matrix_rows(optimizers=None, wrappers=None, features=FEATURES) -> list[dict]:
    """The matrix as rows: ``{"optimizer", "wrapper", "feature", "outcome"}`` for every cell, optimizers
    outermost. A renderer pivots them (one row per optimizer and wrapper, one column per feature)."""
    return [{"optimizer": o, "wrapper": w, "feature": f, "outcome": run_cell(o, w, f)}
            for o in (optimizers or OPTIMIZERS) for w in (wrappers or WRAPPERS) for f in features]


def render(rows: list[dict]) -> str:
    """Rows as a Markdown table: optimizer, wrapper, then one column per feature."""
    features = list(dict.fromkeys(r["feature"] for r in rows))
    table: dict = {}
    for r in rows:
        table.setdefault((r["optimizer"], r["wrapper"]), {})[r["feature"]] = r["outcome"]
    lines = ["| optimizer | wrapper | " + " | ".join(features) + " |", "|---|---|" + "---|" * len(features)]
    lines += [f"| {o} | {w} | " + " | ".join(cells.get(f, "") for f in features) + " |"
              for (o, w), cells in table.items()]
    return "\n".join(lines)
