"""The composition matrix: optimizer x wrapper x feature, each cell run against one plain, single-process
reference; :func:`matrix_table` gives every cell's outcome as data, :func:`render` the table of
book/api_contract.md (tests/test_composition_matrix.py checks the page holds it; tools/composition_matrix.py
rewrites it).

Optimizers (:data:`OPTIMIZERS`): SGD, AdamW, Muon, NorMuon, Dion, ScheduleFreeAdamW, SOAP. Single-process
wrappers (:data:`WRAPPERS`): ChainedOptimizer, MixedPrecisionOptimizer (a bfloat16 model with float32
masters), OffloadOptimizer (half the elements on the host). Distributed wrappers (:data:`DIST_WRAPPERS`, with
the optimizers each can meet): ZeRO-1 DistributedOptimizer, DistributedChain, LayerWiseMuon, DistributedMuon,
FSDP2Muon, all cells in one launch of ``WORLD_SIZE`` gloo processes (composition_ranks.matrix_suite), every
rank given the same gradient (so the mean over the ranks is that gradient, exactly). Features
(:data:`FEATURES`): step; clip (the wrapper's ``max_grad_norm``, else ``clip_grad_norm_`` before the step);
skipped non-finite step (an inf in one gradient -- on rank 0 only, for the distributed wrappers: skipped with
a loss scaler, else ``NonFiniteGradientError`` on every rank, the weights untouched either way); eval/train
(Schedule-Free's average ``x`` in eval mode); save -> load (the wrapper's own checkpoint, consolidated, into a
fresh wrapper at the same world size); save -> load at another world size (saved on ``WORLD_SIZE``
processes, continued on ``OTHER_WORLD_SIZE`` in this process; FSDP2Muon, which has no consolidated checkpoint,
through DCP's full state dict); DCP full and DCP sharded (``get_/set_optimizer_state_dict`` with
``StateDictOptions(full_state_dict=True/False, cpu_offload=True)``, read once before the first step too).

The reference keeps the weights the wrapper would: the model itself in float64, or float32 masters of the
bfloat16 model (the model is then the masters rounded). Every cell is compared bitwise (the wrapper performs
the same operations on the same numbers), except where a distributed clip sums the squares of the gradient
over the ranks: :data:`DIST_TOLERANCE`. A cell's outcome is ``"ok"``, ``"refused: <reason>"`` (refused by
design, :data:`REFUSALS`, with an error naming it), ``"n/a"`` (the wrapper cannot meet that optimizer) or
``"FAIL: <what differs>"``; :data:`KNOWN` lists the failures expected until they are fixed.
"""

from __future__ import annotations

import copy
import io
import math
import os
from dataclasses import dataclass, replace

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
FEATURES = ("step", "clip", "skipped non-finite step", "eval/train", "save -> load",
            "save -> load at another world size", "DCP full", "DCP sharded")
MAX_GRAD_NORM = 0.5
SHAPES = ((5, 6), (4, 5))
STEPS = 4

#: (optimizer, wrapper, feature) -> reason: a failure expected until it is fixed (the test marks these cells
#: xfail, strict: a fix shows up as a pass to be recorded; the table shows them as failures).
KNOWN: dict[tuple[str, str, str], str] = {}


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


def nonfinite_step(wrapper, has_scaler: bool, weights) -> str | None:
    """Step ``wrapper`` on a gradient holding an inf: skipped and reported with a loss scaler, else
    ``NonFiniteGradientError``; the weights (``weights()``, copies) untouched either way. ``None`` when so."""
    before = weights()
    if has_scaler:
        wrapper.step()
        if not (wrapper.found_inf and wrapper.skipped_steps == 1):
            return "FAIL: the non-finite step was not reported as skipped"
    else:
        try:
            wrapper.step()
            return "FAIL: a non-finite gradient without a loss scaler did not raise"
        except NonFiniteGradientError:
            pass
    if not all(torch.equal(a, b) for a, b in zip(before, weights())):
        return "FAIL: the non-finite step wrote the weights"
    return None


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
    if feature.startswith("DCP"):
        return _run_dcp(s, opt_name, wrapper, full=feature == "DCP full")
    for k in range(STEPS):
        if feature == "skipped non-finite step" and k == 1:
            _grads(s.params, k, bad=True)
            bad = nonfinite_step(s.wrapper, has_scaler, lambda: [p.detach().clone() for p in s.params])
            if bad:
                return bad
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


def _run_dcp(s: Setup, opt_name: str, wrapper: str, full: bool = True) -> str:
    dcp = _dcp()
    options = dcp.StateDictOptions(full_state_dict=full, cpu_offload=True)
    try:
        model = _Module(s.params)
        dcp.get_optimizer_state_dict(model, s.wrapper, options=options)   # read before the first step
        for k in range(2):
            _grads(s.params, k)
            s.wrapper.step()
            s.wrapper.zero_grad(set_to_none=True)   # as a loop does: DCP then primes unless it sees state
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


# --- the distributed wrappers -------------------------------------------------------------------------------
# Every cell of one world size runs in ONE launch of gloo processes (composition_ranks.matrix_suite); a cell's
# checkpoint "at another world size" is saved there and loaded at OTHER_WORLD_SIZE in the test's own process.
WORLD_SIZE = 2
OTHER_WORLD_SIZE = 1
#: Small ZeRO-1 / DistributedMuon alignments, so that both matrices are cut across the ranks.
LAYOUT = {"param_alignment": 1, "bucket_alignment": 4}
#: The bfloat16 ZeRO-1 rows' layout: on 2 ranks the 50 elements all fall in rank 0's shard of the one
#: 128-element bucket, and rank 1 steps no piece -- a rank that holds no state must still agree with the
#: others (on DCP's priming, which every rank takes or none).
PADDING_RANK = {"param_alignment": 1, "bucket_alignment": 128}

#: wrapper -> the optimizers it can meet (every other row is "n/a": LayerWiseMuon, DistributedMuon and
#: FSDP2Muon are Muon itself). DistributedChain: LayerWiseMuon on the first matrix and a ZeRO-1
#: DistributedOptimizer of the row's optimizer on the second (Muon's row: ZeRO-1 AdamW).
#: A name ending in LOW (", bfloat16") is the same wrapper over a bfloat16 model: it keeps float32 masters (the
#: reference: the plain optimizer over float32 masters of the bfloat16 model, fed its bfloat16 gradients, as
#: MixedPrecisionOptimizer on one process; the model must be the masters rounded) or refuses.
LOW = ", bfloat16"
DIST_WRAPPERS = {
    "DistributedOptimizer (ZeRO-1)": tuple(OPTIMIZERS),
    "DistributedChain": tuple(OPTIMIZERS),
    "LayerWiseMuon": ("Muon",),
    "DistributedMuon": ("Muon",),
    "FSDP2Muon": ("Muon",),
}
DIST_WRAPPERS.update({w + LOW: opts for w, opts in list(DIST_WRAPPERS.items())})
#: The single-process wrappers have no other world size.
ONE_PROCESS_ONLY = ("save -> load at another world size",)


@dataclass
class DistSetup:
    """A distributed wrapper over ``model`` (its parameters: plain tensors, or DTensors for FSDP2Muon) and its
    reference: the plain optimizers ``refs`` over ``ref_params`` (float64), stepped one after the other."""

    wrapper: torch.optim.Optimizer
    model: torch.nn.Module
    refs: list
    ref_params: list
    has_scaler: bool
    low: bool = False    # a bfloat16 model; ref_params are float32 masters


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build_distributed(opt_name: str, wrapper: str, group, weights=None, max_grad_norm=None,
                      scaler=False) -> DistSetup:
    """The wrapper over a float64 model (a bfloat16 one for a name ending in :data:`LOW`) starting at ``weights``
    (default: :func:`_start`'s), on ``group``."""
    from optbook.distributed import DistributedChain, DistributedMuon, DistributedOptimizer, LayerWiseMuon
    from optbook.distributed.fsdp2 import FSDP2Muon
    from optbook.precision import ConstantLossScaler

    cls, hyper = OPTIMIZERS[opt_name]
    low = wrapper.endswith(LOW)
    wrapper = wrapper.removesuffix(LOW)
    params = _start(torch.bfloat16 if low else torch.float64)
    if weights is not None:
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)
    ref_params = [p.detach().to(torch.float32 if low else torch.float64, copy=True).requires_grad_()
                  for p in params]
    model = _Module(params)
    clip = {} if max_grad_norm is None else {"max_grad_norm": max_grad_norm}
    if wrapper == "DistributedOptimizer (ZeRO-1)":   # bfloat16: rank 1 holds padding only (LAYOUT's note)
        w = DistributedOptimizer(params, cls, group, loss_scaler=ConstantLossScaler(1.0) if scaler else None,
                                 **clip, **(PADDING_RANK if low else LAYOUT), **hyper)
    elif wrapper == "DistributedChain":
        ocls, ohyper = OPTIMIZERS["AdamW" if opt_name == "Muon" else opt_name]
        muon = LayerWiseMuon([params[0]], group, **MUON_HYPER)
        w = DistributedChain(muon, DistributedOptimizer([params[1]], ocls, group, **LAYOUT, **ohyper), **clip)
    elif wrapper == "LayerWiseMuon":
        w = LayerWiseMuon(params, group, **clip, **MUON_HYPER)
    elif wrapper == "DistributedMuon":
        w = DistributedMuon(params, group, gather_dtype=torch.float64, **clip, **LAYOUT, **MUON_HYPER)
    elif wrapper == "FSDP2Muon":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=DeviceMesh.from_group(group, "cpu"))
        w = FSDP2Muon(list(model.parameters()), **clip, **MUON_HYPER)
    else:  # pragma: no cover - a column added without a builder
        raise KeyError(wrapper)
    return DistSetup(w, model, references(opt_name, wrapper, ref_params), ref_params, scaler, low)


#: Muon inside the distributed wrappers and their references: Newton-Schulz in float64, as the model.
MUON_HYPER = {**OPTIMIZERS["Muon"][1], "ns_dtype": torch.float64}


def references(opt_name: str, wrapper: str, ref_params: list) -> list:
    """The single-process reference of a distributed cell: the plain optimizers, stepped in turn."""
    cls, hyper = OPTIMIZERS[opt_name]
    wrapper = wrapper.removesuffix(LOW)
    if wrapper == "DistributedChain":
        ocls, ohyper = OPTIMIZERS["AdamW" if opt_name == "Muon" else opt_name]
        return [Muon([ref_params[0]], **MUON_HYPER), ocls([ref_params[1]], **ohyper)]
    if wrapper == "DistributedOptimizer (ZeRO-1)":
        return [cls(ref_params, **hyper)]
    return [Muon(ref_params, **MUON_HYPER)]


def _dist_grads(s: DistSetup, k: int, rank: int, bad: bool = False) -> None:
    """Every rank gets step ``k``'s gradient (so the mean over the ranks is it, exactly: (g + g) / 2 = g);
    with ``bad``, rank 0's gradient of parameter 1 holds an inf (the others are finite)."""
    full = [torch.empty(p.shape, dtype=p.dtype) for p in s.model.parameters()]
    _grads(full, k)
    for p, g in zip(s.model.parameters(), full):
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor
            p.grad = distribute_tensor(g.grad, p.device_mesh, p.placements)
        else:
            p.grad = g.grad.clone()
    if bad and rank == 0:
        p = list(s.model.parameters())[1]
        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)[0, 0] = float("inf")


def _ref_dist_step(s: DistSetup, k: int, clip: bool) -> None:
    """The reference's step ``k``: the model's gradients (bfloat16 ones in float32, for float32 masters)."""
    model_grads = [torch.empty(r.shape, dtype=torch.bfloat16 if s.low else torch.float64) for r in s.ref_params]
    _grads(model_grads, k)
    for r, g in zip(s.ref_params, model_grads):
        r.grad = g.grad.to(r.dtype)
    if clip:
        clip_grad_norm_(s.ref_params, MAX_GRAD_NORM)
    for r in s.refs:
        r.step()


#: Largest difference from the reference a distributed cell may show (float64): where the ranks sum the
#: squares of the gradient for the clip's global norm in another order than one process, the norm and so the
#: clip coefficient may differ in the last bit, and the weights by a few ulps (|w| < 3: far below 1e-12).
DIST_TOLERANCE = 1e-12


def _dist_compare(s: DistSetup) -> tuple[float, str | None]:
    worst = 0.0
    for i, (p, r) in enumerate(zip(s.model.parameters(), s.ref_params)):
        a = _full(p.detach())
        if a.shape != r.shape:
            return math.inf, f"parameter {i} has shape {tuple(a.shape)}"
        # a bfloat16 model must be its float32 masters rounded: compared with the reference's rounded
        worst = max(worst, float((a.double() - r.detach().to(a.dtype).double()).abs().max()))
    if worst > DIST_TOLERANCE:
        return worst, f"the weights differ from the reference by {worst:.3g}"
    return worst, None


def _ok(worst: float) -> str:
    return "ok" if worst == 0 else f"ok (within {DIST_TOLERANCE:g})"


def _broadcast(obj, rank: int, group):
    import torch.distributed as dist
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def save_distributed(s: DistSetup, rank: int, group):
    """The wrapper's own checkpoint, on every rank: consolidated on rank 0 and broadcast where the wrapper
    consolidates (a collective), else (FSDP2Muon) DCP's full state dict, broadcast from rank 0."""
    if hasattr(s.wrapper, "consolidate_state_dict"):
        s.wrapper.consolidate_state_dict(to=0)
        sd = s.wrapper.state_dict() if rank == 0 else None
        return ("own", _roundtrip(_broadcast(sd, rank, group)))
    dcp = _dcp()
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = dcp.get_optimizer_state_dict(s.model, s.wrapper, options=options)
    return ("dcp", _roundtrip(_broadcast(sd, rank, group)))


def load_distributed(s: DistSetup, saved) -> None:
    kind, sd = saved
    if kind == "own":
        s.wrapper.load_state_dict(sd)
        return
    dcp = _dcp()
    dcp.set_optimizer_state_dict(s.model, s.wrapper, sd,
                                 options=dcp.StateDictOptions(full_state_dict=True, cpu_offload=True))


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _weights(s: DistSetup) -> list:
    return [_full(p.detach()).clone() for p in s.model.parameters()]


def run_distributed_cell(opt_name: str, wrapper: str, feature: str, rank: int, group,
                         checkpoint: str | None = None) -> str:
    """One distributed cell on this rank (a collective: every rank of ``group`` runs it). Returns the outcome
    (module docstring); ``"refused: <type>: <message>"`` when building raises (judged by the test), and for
    "save -> load at another world size" ``"saved"`` once the checkpoint is in the file ``checkpoint``."""
    has_scaler = wrapper.removesuffix(LOW) == "DistributedOptimizer (ZeRO-1)"
    clip = feature == "clip"
    skip = feature == "skipped non-finite step"
    try:
        s = build_distributed(opt_name, wrapper, group, max_grad_norm=MAX_GRAD_NORM if clip else None,
                              scaler=skip and has_scaler)
    except (TypeError, ValueError) as e:
        return f"refused: {type(e).__name__}: {e}"
    try:
        if feature.startswith("DCP"):
            return _run_distributed_dcp(s, opt_name, wrapper, feature == "DCP full", rank, group)
        worst = 0.0
        for k in range(STEPS):
            if skip and k == 1:
                _dist_grads(s, k, rank, bad=True)
                bad = nonfinite_step(s.wrapper, has_scaler, lambda: _weights(s))
                if bad:
                    return bad
                continue
            if feature == "save -> load at another world size" and k == SPLIT:
                saved, weights = save_distributed(s, rank, group), _weights(s)
                if rank == 0:
                    torch.save({"weights": weights, "optimizer": saved}, checkpoint)
                return "saved"
            _dist_grads(s, k, rank)
            s.wrapper.step()
            _ref_dist_step(s, k, clip)
            if feature == "eval/train" and k == 1:
                bad = _modes(s)
                if bad:
                    return bad
            if feature == "save -> load" and k == 1:
                saved = save_distributed(s, rank, group)
                fresh = build_distributed(opt_name, wrapper, group, weights=_weights(s))
                load_distributed(fresh, saved)
                s = replace(s, wrapper=fresh.wrapper, model=fresh.model)
        worst, bad = _dist_compare(s)
        if bad:
            return f"FAIL: {bad}"
        if clip and not isinstance(s.wrapper.last_grad_norm, float):
            return "FAIL: last_grad_norm not reported"
        return _ok(worst)
    except Exception as e:   # noqa: BLE001 - the outcome is data
        return f"FAIL: {type(e).__name__}: {' '.join(str(e).split())[:160]}"


def _modes(s: DistSetup) -> str | None:
    """eval() then train() on the wrapper and the reference; the weights compared in eval mode."""
    ref_modes = [r for r in s.refs if hasattr(r, "eval")]
    if not ref_modes and not hasattr(s.wrapper, "eval"):
        return None   # neither has modes (Muon): nothing to forward
    if not hasattr(s.wrapper, "eval"):
        return "FAIL: the wrapper has no eval()/train() to forward"
    s.wrapper.eval()
    for r in ref_modes:
        r.eval()
    _, bad = _dist_compare(s)
    if bad:
        return f"FAIL: in eval mode, {bad}"
    s.wrapper.train()
    for r in ref_modes:
        r.train()
    return None


#: The step after which "save -> load at another world size" saves (and the other world size continues).
SPLIT = 2


def _run_distributed_dcp(s: DistSetup, opt_name: str, wrapper: str, full: bool, rank: int, group) -> str:
    """DCP's ``get_/set_optimizer_state_dict`` (``full_state_dict=full, cpu_offload=True``): read once before
    the first step, then after two steps; the dict (rank 0's, broadcast, when full) loaded into a fresh
    wrapper over the same weights, which runs the last two steps."""
    dcp = _dcp()
    options = dcp.StateDictOptions(full_state_dict=full, cpu_offload=True)
    dcp.get_optimizer_state_dict(s.model, s.wrapper, options=options)   # read before the first step
    for k in range(2):
        _dist_grads(s, k, rank)
        s.wrapper.step()
        s.wrapper.zero_grad(set_to_none=True)   # as a loop does: DCP then primes unless it sees state
        _ref_dist_step(s, k, False)
    saved = dcp.get_optimizer_state_dict(s.model, s.wrapper, options=options)
    saved = _broadcast(saved, rank, group) if full else copy.deepcopy(saved)
    fresh = build_distributed(opt_name, wrapper, group, weights=_weights(s))
    dcp.set_optimizer_state_dict(fresh.model, fresh.wrapper, saved, options=options)
    s = replace(s, wrapper=fresh.wrapper, model=fresh.model)
    for k in range(2, STEPS):
        _dist_grads(s, k, rank)
        s.wrapper.step()
        _ref_dist_step(s, k, False)
    worst, bad = _dist_compare(s)
    return f"FAIL: {bad}" if bad else _ok(worst)


def resume_at_other_world_size(opt_name: str, wrapper: str, checkpoint: str) -> str:
    """Load the checkpoint a ``WORLD_SIZE``-rank run saved after ``SPLIT`` steps into the wrapper on this
    process (a one-process gloo group, ``OTHER_WORLD_SIZE``) and run the rest; compared with the reference."""
    import torch.distributed as dist
    _dcp()
    group = dist.group.WORLD
    try:
        saved = torch.load(checkpoint, weights_only=False)
        s = build_distributed(opt_name, wrapper, group, weights=saved["weights"])
        load_distributed(s, saved["optimizer"])
        s.ref_params = [p.detach().to(torch.float32 if s.low else torch.float64, copy=True).requires_grad_()
                        for p in _start(torch.bfloat16 if s.low else torch.float64)]
        s.refs = references(opt_name, wrapper, s.ref_params)
        for k in range(SPLIT):
            _ref_dist_step(s, k, False)
        for k in range(SPLIT, STEPS):
            _dist_grads(s, k, 0)
            s.wrapper.step()
            _ref_dist_step(s, k, False)
        worst, bad = _dist_compare(s)
        return f"FAIL: {bad}" if bad else _ok(worst)
    except Exception as e:   # noqa: BLE001 - the outcome is data
        return f"FAIL: at {OTHER_WORLD_SIZE} process: {type(e).__name__}: {' '.join(str(e).split())[:160]}"


# --- the whole table ----------------------------------------------------------------------------------------
ALL_FEATURES = FEATURES
#: Refusals by design: (wrapper, optimizer) -> (pattern the error must match, the reason shown in the table).
NOT_ELEMENTWISE = (r"is not element-wise", "refused: not element-wise")
NO_MASTERS = (r"no float32 masters", "refused: bfloat16, no float32 masters")
REFUSALS = {(w, o): NOT_ELEMENTWISE for w in ("DistributedOptimizer (ZeRO-1)", "DistributedOptimizer (ZeRO-1)" + LOW)
            for o in ("Muon", "NorMuon", "Dion", "SOAP")}
REFUSALS.update({(w, o): NOT_ELEMENTWISE for w in ("DistributedChain", "DistributedChain" + LOW)
                 for o in ("NorMuon", "Dion", "SOAP")})
REFUSALS.update({(w + LOW, "Muon"): NO_MASTERS for w in ("DistributedMuon", "FSDP2Muon")})


def distributed_cells() -> list[tuple[str, str, str]]:
    """(optimizer, wrapper, feature) of every distributed cell, in a fixed order (every rank runs them so)."""
    return [(o, w, f) for w, opts in DIST_WRAPPERS.items() for o in opts for f in FEATURES]


def judge(opt_name: str, wrapper: str, outcomes: list[str]) -> str:
    """One cell's outcome from every rank's: the common one (a refusal checked against :data:`REFUSALS`), else
    the first rank's that differs from rank 0's, named."""
    first = outcomes[0]
    if first.startswith("FAIL") and all(o.startswith("FAIL") for o in outcomes):
        return first   # the same failure, each rank naming itself
    if any(o != first for o in outcomes[1:]):
        r = next(i for i, o in enumerate(outcomes) if o != first)
        return f"FAIL: the ranks disagree: rank 0 {first[:100]!r}, rank {r} {outcomes[r][:100]!r}"
    return judge_refusal(opt_name, wrapper, first)


def judge_refusal(opt_name: str, wrapper: str, outcome: str) -> str:
    import re
    expected = REFUSALS.get((wrapper, opt_name))
    if expected is None:
        return f"FAIL: unexpected {outcome}" if outcome.startswith("refused") else outcome
    pattern, reason = expected
    if outcome.startswith("refused") and re.search(pattern, outcome):
        return reason
    return f"FAIL: expected a refusal ({reason}), got {outcome[:120]}"


def matrix_table(directory: str, launch_timeout: float = 240.0) -> dict:
    """``{(optimizer, wrapper, feature): outcome}`` for every cell: the single-process ones here, the
    distributed ones from one launch of ``WORLD_SIZE`` gloo processes (composition_ranks.matrix_suite),
    their "another world size" continued here at ``OTHER_WORLD_SIZE``. Cells a wrapper cannot meet: "n/a"."""
    from composition_ranks import matrix_checkpoint_file, matrix_rank_file, matrix_suite

    from optbook.distributed import launch

    table = {}
    for o in OPTIMIZERS:
        for w in WRAPPERS:
            for f in FEATURES:
                table[(o, w, f)] = "n/a (one process)" if f in ONE_PROCESS_ONLY else judge_refusal(
                    o, w, run_cell(o, w, f))
    stopped = None
    try:
        launch(matrix_suite, WORLD_SIZE, directory, timeout=launch_timeout)
    except RuntimeError as e:
        stopped = f"FAIL: the launch stopped first: {' '.join(str(e).split())[:200]}"
    per_rank = [torch.load(matrix_rank_file(directory, r), weights_only=False)
                if os.path.exists(matrix_rank_file(directory, r)) else {} for r in range(WORLD_SIZE)]
    for index, (o, w, f) in enumerate(distributed_cells()):
        outcomes = [results.get((o, w, f)) for results in per_rank]
        if any(x is None for x in outcomes):
            table[(o, w, f)] = stopped or "FAIL: not run"
            continue
        outcome = judge(o, w, outcomes)
        if outcome == "saved":
            outcome = resume_at_other_world_size(o, w, matrix_checkpoint_file(directory, index))
        table[(o, w, f)] = outcome
    for w, opts in DIST_WRAPPERS.items():
        for o in OPTIMIZERS:
            if o not in opts:
                for f in FEATURES:
                    table[(o, w, f)] = "n/a"
    return table


def render(table: dict) -> str:
    """The table as the Markdown section of book/api_contract.md: one row per wrapper and optimizer it meets
    (rows that are all "n/a" left out), one column per feature."""
    note = ("Generated by `tests/test_composition_matrix.py` from the outcome of every cell "
            "(`OPTBOOK_UPDATE_README=1`, or `python tools/composition_matrix.py`, rewrites it). Each cell "
            f"runs {STEPS} steps of a two-matrix float64 model (the mixed-precision wrapper: bfloat16 with "
            "float32 masters) and compares every weight with the plain single-process optimizer: `ok` is "
            f"bitwise equal; `ok (within {DIST_TOLERANCE:g})`: the clip's global norm summed over the ranks "
            f"in another order. The distributed wrappers run on {WORLD_SIZE} gloo processes; \"another world "
            f"size\" saves there and continues on {OTHER_WORLD_SIZE}. `refused`: the combination raises, "
            "naming it, before anything is written. DistributedChain: LayerWiseMuon on one matrix and ZeRO-1 "
            "of the row's optimizer on the other (Muon's row: ZeRO-1 AdamW); LayerWiseMuon, DistributedMuon "
            f"and FSDP2Muon are Muon itself. `{LOW[2:]}`: the wrapper over a bfloat16 model, against the plain "
            "optimizer over float32 masters (MixedPrecisionOptimizer's numbers); the model must be them rounded.")
    known = list(dict.fromkeys(KNOWN[c] for c in sorted(KNOWN) if table.get(c, "").startswith("FAIL")))
    lines = [note, "", "| wrapper | optimizer | " + " | ".join(FEATURES) + " |",
             "|---|---|" + "---|" * len(FEATURES)]
    for w in list(WRAPPERS) + list(DIST_WRAPPERS):
        for o in OPTIMIZERS:
            cells = [table[(o, w, f)] for f in FEATURES]
            if all(c == "n/a" for c in cells):
                continue
            shown = [f"FAIL (known {known.index(KNOWN[(o, w, f)]) + 1})"
                     if c.startswith("FAIL") and (o, w, f) in KNOWN else c for c, f in zip(cells, FEATURES)]
            lines.append(f"| {w} | {o} | " + " | ".join(_cell_text(c) for c in shown) + " |")
    if known:
        lines += [""] + [f"Known {k + 1}: {reason}." for k, reason in enumerate(known)]
    return "\n".join(lines)


def _cell_text(text: str, width: int = 90) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"
