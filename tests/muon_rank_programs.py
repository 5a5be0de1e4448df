"""Rank programs that only ``tests/test_layerwise_muon.py`` and ``tests/test_muon_contract.py`` run (bad
input, a rank failing mid-run, the one-launch suite on groups of 2, 3 and 4 ranks, resumes). The programs
chapter 14 runs stay in :mod:`optbook.distributed.muon_workers`.

Spawned processes import this module by name (``muon_rank_programs``): ``tests/`` is on ``sys.path`` under
pytest (rootdir-relative imports, no ``__init__.py``), and ``multiprocessing``'s spawn start method hands the
parent's ``sys.path`` to each child.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from optbook.distributed import DistributedMuon, LayerWiseMuon
from optbook.distributed.muon_workers import (
    MOONLIGHT_LAYOUT,
    MUON_OPTIONS,
    chain_train,
    layerwise_train,
    moonlight_train,
    muon_grads,
    muon_problem,
    muon_reference,
    set_grads,
    tp_modes,
)

#: The process groups of :func:`muon_suite` on 4 processes: world size -> global ranks.
MUON_SUITE_GROUPS = {2: [2, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}


def snapshot(opt, params) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for s in opt.state.values():
        out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def bitwise(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def layerwise_bad_input(rank: int, world_size: int, *, group=None, kind: str = "layerwise") -> dict:
    """Bad input on one rank or on all, for LayerWiseMuon (``kind="layerwise"``) or DistributedMuon
    (``"moonlight"``): after two good steps, (1) the last rank passes a sparse gradient, (2) rank 0
    alone sets ``lr = -1``, (3) the last rank's gradient holds a NaN, (4) every rank sets ``momentum = 1.5``.
    Every rank must raise with nothing written; then a good step runs. Also constructor errors.

    Returns:
        ``{"errors": [(type, message) or None per case], "untouched": [bool per case], "grads_untouched": bool,
        "after": parameters after the final good step, "constructor_errors": {case: (type, message)}}``.
    """

    cls = LayerWiseMuon if kind == "layerwise" else DistributedMuon
    extra = {} if kind == "layerwise" else {"gather_dtype": torch.float64, **MOONLIGHT_LAYOUT}
    params, groups = muon_problem()
    opt = cls(groups, process_group=group, **MUON_OPTIONS, **extra)
    for t in range(2):
        set_grads(params, muon_grads(params, t, rank, world_size))
        opt.step()
    last = world_size - 1
    good = muon_grads(params, 2, rank, world_size)
    errors, untouched, grads_untouched = [], [], True
    for what in ("sparse", "lr", "nan", "momentum"):
        grads = [None if g is None else g.clone() for g in good]
        if what == "sparse" and rank == last:
            grads[0] = grads[0].to_sparse()
        if what == "nan" and rank == last:
            grads[2][0, 0] = float("nan")
        saved = {k: opt.param_groups[0][k] for k in ("lr", "momentum")}
        if what == "lr" and rank == 0:
            opt.param_groups[0]["lr"] = -1.0
        if what == "momentum":
            opt.param_groups[0]["momentum"] = 1.5
        set_grads(params, grads)
        before = snapshot(opt, params)
        grads_before = [None if p.grad is None else p.grad.clone() for p in params]
        try:
            opt.step()
            errors.append(None)
        except (TypeError, ValueError, RuntimeError) as e:
            errors.append((type(e).__name__, str(e)))
        opt.param_groups[0].update(saved)
        untouched.append(bitwise(before, snapshot(opt, params)))
        grads_untouched &= all((a is None and p.grad is None) or torch.equal(  # bit patterns: NaN == NaN
            a.to_dense().view(torch.int64), p.grad.to_dense().view(torch.int64)) for a, p in zip(grads_before, params))
    set_grads(params, good)
    opt.step()
    checkpoint_errors = {}
    everywhere = copy.deepcopy(opt.state_dict())   # nothing consolidated since the last step: on every rank
    opt.consolidate_state_dict(to=0)
    try:
        saved = opt.state_dict()   # rank 0 only, now
        checkpoint_errors["elsewhere"] = None
    except RuntimeError as e:
        saved = None
        checkpoint_errors["elsewhere"] = (type(e).__name__, str(e))
    shared = [saved]
    dist.broadcast_object_list(shared, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    checkpoint_errors["everywhere_equal"] = (sorted(everywhere["state"]) == sorted(shared[0]["state"]) and all(
        torch.equal(everywhere["state"][i]["momentum_buffer"], e["momentum_buffer"])
        for i, e in shared[0]["state"].items()))
    bad = copy.deepcopy(shared[0])
    first = min(bad["state"])
    bad["state"][first]["momentum_buffer"] = bad["state"][first]["momentum_buffer"].t()[:1]
    before = snapshot(opt, params)
    try:
        opt.load_state_dict(bad)
        checkpoint_errors["shape"] = None
    except (TypeError, ValueError) as e:
        checkpoint_errors["shape"] = (type(e).__name__, str(e))
    checkpoint_errors["untouched"] = bitwise(before, snapshot(opt, params))
    constructor_errors = {}
    cases = [("vector", lambda: cls([torch.zeros(3, dtype=torch.float64, requires_grad=True)], process_group=group)),
             ("lr", lambda: cls([torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)], process_group=group,
                                lr=-0.1)),
             ("max_grad_norm", lambda: cls([torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)],
                                           process_group=group, max_grad_norm=0.0)),
             ("differs", lambda: cls([torch.zeros(2 + (rank == last), 2, dtype=torch.float64, requires_grad=True)],
                                     process_group=group))]
    if kind == "layerwise":
        cases.append(("assignment", lambda: cls([torch.zeros(2, 2, requires_grad=True)], process_group=group,
                                                assignment="random")))
    else:
        cases.append(("gather", lambda: cls([torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)],
                                            process_group=group, gather="some")))
        cases.append(("bfloat16", lambda: cls([torch.zeros(2, 2, dtype=torch.bfloat16, requires_grad=True)],
                                              process_group=group)))
    for name, make in cases:
        try:
            make()
            constructor_errors[name] = None
        except (TypeError, ValueError) as e:
            constructor_errors[name] = (type(e).__name__, str(e))
    return {"errors": errors, "untouched": untouched, "grads_untouched": grads_untouched,
            "after": [p.detach().clone() for p in params], "constructor_errors": constructor_errors,
            "checkpoint_errors": checkpoint_errors}


def layerwise_raise_mid_run(rank: int, world_size: int, *, bad_rank: int = 1, at_step: int = 2) -> int:
    """LayerWiseMuon on :func:`muon_problem`; rank ``bad_rank`` raises before its step ``at_step`` while the
    others enter the step's collectives: :func:`optbook.distributed.launch` must fail fast, not hang."""

    params, groups = muon_problem()
    opt = LayerWiseMuon(groups, **MUON_OPTIONS)
    for t in range(4):
        if t == at_step and rank == bad_rank:
            raise RuntimeError(f"rank {rank} fails on purpose at step {t}")
        set_grads(params, muon_grads(params, t, rank, world_size))
        opt.step()
    return rank


def muon_suite(rank: int, world_size: int) -> dict:
    """Every multi-process check of ``tests/test_layerwise_muon.py`` in one launch of 4 processes, on groups of
    2, 3 and 4 of them (:data:`MUON_SUITE_GROUPS`; the smaller groups do not start at global rank 0).

    Returns:
        ``{size: report or None}``; a report is ``{"layerwise", "round_robin", "moonlight", "moonlight_touched", "chain",
        "bad_layerwise", "bad_moonlight", "resumed", "resumed_moonlight", "tp_rows", "tp_cols"}`` (the results
        of the functions above, :func:`tp_modes` on a ``(96, 48)`` matrix split by rows and by columns;
        ``"resumed"`` / ``"resumed_moonlight"``: the parameters after 2 more steps of a LayerWiseMuon /
        DistributedMuon that loaded the previous group's checkpoint of the same kind, or None for the first
        group).
    """
    if world_size != 4:
        raise ValueError(f"Invalid world_size: muon_suite runs on 4 processes, got {world_size}")
    torch.set_num_threads(1)
    groups = {size: dist.new_group(ranks) for size, ranks in MUON_SUITE_GROUPS.items()}
    out, resume = {}, None
    for size, ranks in MUON_SUITE_GROUPS.items():
        report = None
        if rank in ranks:
            g, r = groups[size], ranks.index(rank)
            report = {"layerwise": layerwise_train(r, size, group=g),
                      "round_robin": layerwise_train(r, size, group=g, assignment="round_robin"),
                      "moonlight": moonlight_train(r, size, group=g),
                      "moonlight_touched": moonlight_train(r, size, group=g, gather="touched"),
                      "chain": chain_train(r, size, group=g),
                      "bad_layerwise": layerwise_bad_input(r, size, group=g),
                      "bad_moonlight": layerwise_bad_input(r, size, group=g, kind="moonlight"),
                      "resumed": None if resume is None else resume_run(r, size, g, resume[0]),
                      "resumed_moonlight": None if resume is None else resume_run(r, size, g, resume[1], "moonlight"),
                      "tp_rows": tp_modes(r, size, shape=(96, 48), partition_dim=0, group=g),
                      "tp_cols": tp_modes(r, size, shape=(96, 48), partition_dim=1, group=g)}
        shared = [None if report is None else (report["layerwise"]["checkpoint"], report["moonlight"]["checkpoint"])]
        dist.broadcast_object_list(shared, src=ranks[-1])
        resume, out[size] = shared[0], report
    return out


def resume_run(rank, world_size, group, checkpoint, kind: str = "layerwise", seed: int = 0) -> list[torch.Tensor]:
    """Continue :func:`layerwise_train` (``kind="layerwise"``) or :func:`moonlight_train` (``"moonlight"``),
    4 steps done, from ``checkpoint`` for steps 4 and 5."""

    params = muon_reference(4, seed)
    _, groups = muon_problem(seed)
    fresh = [p.clone().requires_grad_() for p in params]
    groups = [{**g, "params": fresh[:5] if i == 0 else fresh[5:]} for i, g in enumerate(groups)]
    if kind == "layerwise":
        opt = LayerWiseMuon(groups, process_group=group, **MUON_OPTIONS)
    else:
        opt = DistributedMuon(groups, process_group=group, gather_dtype=torch.float64, **MOONLIGHT_LAYOUT,
                              **MUON_OPTIONS)
    opt.load_state_dict(checkpoint)
    for t in (4, 5):
        set_grads(fresh, muon_grads(fresh, t, rank, world_size, seed))
        opt.step()
    return [p.detach().clone() for p in fresh]


# --- the step contract: owners, all-or-nothing loads, non-finite gradients, cross-rank checks -------------------
#: Row factors of a QK-clip-style rescaling (dyadic, so every product is exact in float64).
ROW_FACTORS = {0: [0.5, 0.75] * 8, 5: [0.25, 1.0] * 4}


def row_scale(params) -> None:
    """``contract.scale_weights_`` of :data:`ROW_FACTORS` (one factor per row) on each listed parameter."""
    from optbook.contract import scale_weights_

    for i, rows in ROW_FACTORS.items():
        scale_weights_(params[i], torch.tensor(rows, dtype=params[i].dtype).view(-1, 1))


def scaled_reference(steps: int, scale_at=(2,), loaded: float | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Single-process ``optbook.optim.Muon`` on :func:`muon_mean_grads`, with :func:`row_scale` before the
    steps in ``scale_at`` and, with ``loaded``, every weight set to that value after construction."""
    from optbook.distributed.muon_workers import muon_mean_grads
    from optbook.optim import Muon

    params, groups = muon_problem(seed)
    opt = Muon(groups, **MUON_OPTIONS)
    if loaded is not None:
        with torch.no_grad():
            for p in params:
                p.fill_(loaded)
    for t in range(steps):
        if t in scale_at:
            row_scale(params)
        set_grads(params, muon_mean_grads(params, t, seed))
        opt.step()
    return [p.detach().clone() for p in params]


def _make(kind: str, groups, group, **extra):
    if kind == "layerwise":
        return LayerWiseMuon(groups, process_group=group, **{**MUON_OPTIONS, **extra})
    return DistributedMuon(groups, process_group=group, gather_dtype=torch.float64, **MOONLIGHT_LAYOUT,
                           **{**MUON_OPTIONS, **extra})


def _model(params) -> torch.nn.Module:
    """A module over the tensors (as buffers: they are plain tensors); its ``load_state_dict`` copies into
    them in place, as a model's does into its parameters."""
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_buffer(f"w{i}", p)
    return model


def _error(call):
    """``(type name, message)`` of what ``call()`` raises, or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 -- reported to the test, which checks the type
        return type(e).__name__, str(e)
    return None


def _state_tensors(opt) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def owner_checks(rank: int, world_size: int, *, group=None, kind: str = "moonlight") -> dict:
    """The step contract's owner rules for ``kind`` (``"moonlight"``: DistributedMuon, ``"layerwise"``):

    ``"loaded"``: parameters after a weights-only ``model.load_state_dict`` of 5.0 everywhere (after the
    optimizer was built) and 2 steps; ``"lr0"``: after :func:`row_scale` and one step with ``lr = 0``, with the
    weights before the scaling (``"lr0_before"``); ``"resumed"``: the parameters of a run with
    :func:`row_scale` before steps 2 and 4, checkpointed after step 3 and resumed by a fresh optimizer over
    fresh tensors; ``"owner"``: whether ``contract.owner_of`` of a parameter is the optimizer;
    ``"returned"``: what ``step(closure)`` returned; ``"bad_factor"``: the error of a factor of the wrong
    shape and whether nothing changed.
    """
    from optbook.contract import owner_of, scale_weights_

    out = {}
    params, groups = muon_problem()
    opt = _make(kind, groups, group)
    out["owner"] = owner_of(params[0]) is opt
    _model(params).load_state_dict({f"w{i}": torch.full_like(p, 5.0) for i, p in enumerate(params)})
    for t in range(2):
        set_grads(params, muon_grads(params, t, rank, world_size))
        out.setdefault("returned", opt.step(closure=lambda: 1.25))
    out["loaded"] = [p.detach().clone() for p in params]
    # a row scaling with lr = 0 must not be undone
    params, groups = muon_problem()
    opt = _make(kind, groups, group)
    set_grads(params, muon_grads(params, 0, rank, world_size))
    opt.step()
    for g in opt.param_groups:
        g["lr"] = 0.0
    out["lr0_before"] = [p.detach().clone() for p in params]
    before = [p.detach().clone() for p in params] + _state_tensors(opt)
    out["bad_factor"] = (_error(lambda: scale_weights_(params[0], torch.ones(3, 1, dtype=torch.float64))),
                         bitwise(before, [p.detach().clone() for p in params] + _state_tensors(opt)))
    row_scale(params)
    set_grads(params, muon_grads(params, 1, rank, world_size))
    opt.step()
    out["lr0"] = [p.detach().clone() for p in params]
    # scaling mid-run, a checkpoint, a resume by a fresh optimizer, scaling again
    params, groups = muon_problem()
    opt = _make(kind, groups, group)
    for t in range(4):
        if t == 2:
            row_scale(params)
        set_grads(params, muon_grads(params, t, rank, world_size))
        opt.step()
    opt.consolidate_state_dict(to=0)
    shared = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    fresh = [p.detach().clone().requires_grad_() for p in params]
    _, groups = muon_problem()
    groups = [{**g, "params": fresh[:5] if i == 0 else fresh[5:]} for i, g in enumerate(groups)]
    opt = _make(kind, groups, group)
    opt.load_state_dict(shared[0])
    for t in (4, 5):
        if t == 4:
            row_scale(fresh)
        set_grads(fresh, muon_grads(fresh, t, rank, world_size))
        opt.step()
    out["resumed"] = [p.detach().clone() for p in fresh]
    return out


def foreign_checkpoints(rank: int, world_size: int, *, group=None, kind: str = "moonlight") -> dict:
    """Checkpoints of another model (the matrices transposed) and of another optimizer (AdamW over the same
    shapes) into ``kind`` after 2 steps: ``{case: ((type, message), nothing changed)}``, then two more steps
    (``"after"``: must equal the uninterrupted run, :func:`muon_reference` of 4 steps) and a dict saved
    before ``skipped_steps`` existed (``"old_dict"``: the error or None)."""
    from optbook.optim import AdamW, Muon

    params, groups = muon_problem()
    opt = _make(kind, groups, group)
    for t in range(2):
        set_grads(params, muon_grads(params, t, rank, world_size))
        opt.step()
    other = [torch.zeros(p.shape[::-1], dtype=p.dtype, requires_grad=True) for p in params]
    other_groups = [{**g, "params": other[:5] if i == 0 else other[5:]} for i, g in enumerate(groups)]
    foreign = Muon(other_groups, **MUON_OPTIONS)
    set_grads(other, [torch.ones_like(p) for p in other])
    foreign.step()
    same = [torch.zeros_like(p, requires_grad=True) for p in params]
    adamw = AdamW([{"params": same[:5]}, {"params": same[5:]}], lr=0.01)
    set_grads(same, [torch.ones_like(p) for p in same])
    adamw.step()
    out = {}
    for case, sd in (("other model", foreign.state_dict()), ("other optimizer", adamw.state_dict())):
        before = [p.detach().clone() for p in params] + _state_tensors(opt)
        err = _error(lambda sd=sd: opt.load_state_dict(sd))
        out[case] = (err, bitwise(before, [p.detach().clone() for p in params] + _state_tensors(opt)))
    for t in (2, 3):
        set_grads(params, muon_grads(params, t, rank, world_size))
        opt.step()
    out["after"] = [p.detach().clone() for p in params]
    opt.consolidate_state_dict(to=0)
    shared = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    old = {k: v for k, v in shared[0].items() if k != "skipped_steps"}
    out["saved_skipped_steps"] = shared[0].get("skipped_steps")
    out["old_dict"] = _error(lambda: opt.load_state_dict(old))
    return out


def sharded_checks(rank: int, world_size: int, *, group=None, kind: str = "moonlight", previous=None) -> dict:
    """Sharded checkpoints of ``kind`` after 2 steps: ``"own"`` / ``"listed"``: the parameters after a fresh
    optimizer loaded this rank's file / every rank's files and ran steps 2 and 3; ``"resharded"``: the same
    from ``previous`` (every rank's files of a save at another world size, or None); ``"files"``: every
    rank's files (for the next world size); ``"other_model"``, ``"other_rank"``: ``((type, message), nothing
    changed)`` for a file of another model and another rank's file."""
    params, groups = muon_problem()
    opt = _make(kind, groups, group)
    for t in range(2):
        set_grads(params, muon_grads(params, t, rank, world_size))
        opt.step()
    own = opt.sharded_state_dict()
    every = [None] * world_size
    dist.all_gather_object(every, own, group=group)
    other = [torch.zeros(p.shape[::-1], dtype=p.dtype, requires_grad=True) for p in params]
    other_opt = _make(kind, [{**g, "params": other[:5] if i == 0 else other[5:]} for i, g in enumerate(groups)],
                      group)
    out = {"files": every}

    def fresh_copy():
        fresh = [p.detach().clone().requires_grad_() for p in params]
        return fresh, _make(kind, [{**g, "params": fresh[:5] if i == 0 else fresh[5:]} for i, g in enumerate(groups)],
                            group)

    for case, sd in (("other_model", other_opt.sharded_state_dict()),
                     ("other_rank", every[(rank + 1) % world_size])):
        fresh, loader = fresh_copy()
        before = [p.detach().clone() for p in fresh] + _state_tensors(loader)
        out[case] = (_error(lambda sd=sd, loader=loader: loader.load_sharded_state_dict(sd)),
                     bitwise(before, [p.detach().clone() for p in fresh] + _state_tensors(loader)))
    for case, sd in (("own", own), ("listed", every), ("resharded", previous)):
        if sd is None:
            out[case] = None
            continue
        fresh, loader = fresh_copy()
        loader.load_sharded_state_dict(sd)
        for t in (2, 3):
            set_grads(fresh, muon_grads(fresh, t, rank, world_size))
            loader.step()
        out[case] = [p.detach().clone() for p in fresh]
    return out


def _chain(group, others_shapes=((10,), (5, 4), (3,)), seed: int = 0):
    from optbook.distributed import DistributedChain, DistributedOptimizer

    matrices, _ = muon_problem(seed)
    gen = torch.Generator().manual_seed(seed + 17)
    others = [(torch.randint(-64, 64, s, generator=gen) / 64).double().requires_grad_() for s in others_shapes]
    muon = LayerWiseMuon(matrices, process_group=group, **MUON_OPTIONS)
    adamw = DistributedOptimizer(others, process_group=group, lr=0.01, weight_decay=0.1)
    return matrices, others, DistributedChain(muon, adamw, max_grad_norm=3.0)


def _other_grads(others, step, rank, world_size, seed: int = 0):
    """Dyadic per-rank gradients of the AdamW tensors whose mean is exact; returns ``(rank's, mean)``."""
    gen = torch.Generator().manual_seed(7 * seed + 31 * step + 5)
    mean = [(torch.randint(-512, 512, p.shape, generator=gen) / 256).double() for p in others]
    gen = torch.Generator().manual_seed(7 * seed + 31 * step + 6)
    mine = [g + (rank - (world_size - 1) / 2) * (torch.randint(-512, 512, g.shape, generator=gen) / 256).double()
            for g in mean]
    return mine, mean


def chain_reference_shapes(others_shapes, steps: int = 2, seed: int = 0) -> list[torch.Tensor]:
    """Single process ``ChainedOptimizer([Muon, AdamW], max_grad_norm=3)`` on the mean gradients of
    :func:`_chain`'s problem with AdamW tensors of ``others_shapes``."""
    from optbook.distributed.muon_workers import muon_mean_grads
    from optbook.optim import AdamW, ChainedOptimizer, Muon

    matrices, _ = muon_problem(seed)
    gen = torch.Generator().manual_seed(seed + 17)
    others = [(torch.randint(-64, 64, s, generator=gen) / 64).double().requires_grad_() for s in others_shapes]
    chain = ChainedOptimizer([Muon(matrices, **MUON_OPTIONS), AdamW(others, lr=0.01, weight_decay=0.1)],
                             max_grad_norm=3.0)
    for t in range(steps):
        set_grads(matrices, muon_mean_grads(matrices, t, seed))
        set_grads(others, _other_grads(others, t, 0, 1, seed)[1])
        chain.step()
    return [p.detach().clone() for p in matrices + others]


def _chain_snapshot(matrices, others, chain) -> list[torch.Tensor]:
    inner = chain.adamw.optimizer.state.values()
    return ([p.detach().clone() for p in matrices + others] + _state_tensors(chain.muon)
            + [torch.as_tensor(v).clone() for s in inner for v in s.values()])


def chain_contract(rank: int, world_size: int, *, group=None) -> dict:
    """DistributedChain under the step contract: ``"nan_muon"`` / ``"nan_adamw"``: a NaN in the last rank's
    gradient of a Muon / AdamW parameter, ``((type, message), nothing changed, skipped_steps of chain and
    AdamW member, found_inf)``; ``"returned"``: ``step(closure)``; ``"zero_dim"``: parameters after 2 steps
    with a 0-dim AdamW tensor; ``"load_other"``: a chain checkpoint whose AdamW part is of another model,
    and ``"load_other_muon"``: whose Muon part is, ``((type, message), nothing changed)``; ``"resumed"``:
    the parameters after a save, a load into a fresh chain and 2 more steps (``"resumed_sharded"``,
    ``"resumed_listed"``: from this rank's sharded file, from every rank's); ``"sharded_other"`` /
    ``"sharded_other_muon"``: sharded files of another model; ``"old_dict"``: loading a dict without
    ``skipped_steps``."""
    last = world_size - 1
    out = {}
    matrices, others, chain = _chain(group)
    for case in ("nan_muon", "nan_adamw"):
        set_grads(matrices, muon_grads(matrices, 0, rank, world_size))
        set_grads(others, _other_grads(others, 0, rank, world_size)[0])
        if rank == last:
            (matrices[2] if case == "nan_muon" else others[1]).grad[0, 0] = float("nan")
        before = _chain_snapshot(matrices, others, chain)
        err = _error(chain.step)
        out[case] = (err, bitwise(before, _chain_snapshot(matrices, others, chain)),
                     (chain.skipped_steps, chain.adamw.skipped_steps), chain.found_inf)
    for t in range(2):
        set_grads(matrices, muon_grads(matrices, t, rank, world_size))
        set_grads(others, _other_grads(others, t, rank, world_size)[0])
        out.setdefault("returned", chain.step(closure=lambda: 2.5))
    out["after_errors"] = [p.detach().clone() for p in matrices + others]
    out["last_grad_norm"] = chain.last_grad_norm
    # checkpoints: all or nothing
    chain.consolidate_state_dict(to=0)
    shared = [chain.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    good = shared[0]
    out["skipped_in_dict"] = good.get("skipped_steps")
    m2, o2, other_chain = _chain(group, others_shapes=((3,), (4, 5), (10,)))
    set_grads(m2, muon_grads(m2, 0, rank, world_size))
    set_grads(o2, _other_grads(o2, 0, rank, world_size)[0])
    other_chain.step()
    other_chain.consolidate_state_dict(to=0)
    shared = [other_chain.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    foreign = shared[0]
    fm, fo, fresh = _chain(group)
    fresh_params = fm + fo
    with torch.no_grad():
        for p, q in zip(fresh_params, out["after_errors"]):
            p.copy_(q)
    # torch's layout over the chain's groups: the Muon member's parameters first (indices < n), then AdamW's
    n, k = len(matrices), len(chain.muon.param_groups)
    other_adamw = {**good, "param_groups": good["param_groups"][:k] + foreign["param_groups"][k:],
                   "state": {**{i: e for i, e in good["state"].items() if i < n},
                             **{i: e for i, e in foreign["state"].items() if i >= n}}}
    other_muon = {**good, "state": {i: {"momentum_buffer": e["momentum_buffer"].t()} if i < n else e
                                    for i, e in good["state"].items()}}
    for case, sd in (("load_other", other_adamw), ("load_other_muon", other_muon)):
        before = _chain_snapshot(fm, fo, fresh)
        err = _error(lambda sd=sd: fresh.load_state_dict(sd))
        out[case] = (err, bitwise(before, _chain_snapshot(fm, fo, fresh)))
    out["old_dict"] = _error(lambda: fresh.load_state_dict({k: v for k, v in good.items() if k != "skipped_steps"}))
    fresh.load_state_dict(good)
    # sharded checkpoints: this rank's own file, and every rank's files
    own, foreign_own = chain.sharded_state_dict(), other_chain.sharded_state_dict()
    every = [None] * world_size
    dist.all_gather_object(every, own, group=group)
    sm, so, sharded = _chain(group)
    with torch.no_grad():
        for p, q in zip(sm + so, out["after_errors"]):
            p.copy_(q)
    moved = {**own["muon"], "params": [(tuple(shape)[::-1], dtype) for shape, dtype in own["muon"]["params"]]}
    for case, sd in (("sharded_other", {**own, "adamw": foreign_own["adamw"]}),
                     ("sharded_other_muon", [{**e, "muon": moved} if k == 0 else e for k, e in enumerate(every)])):
        before = _chain_snapshot(sm, so, sharded)
        err = _error(lambda sd=sd: sharded.load_sharded_state_dict(sd))
        out[case] = (err, bitwise(before, _chain_snapshot(sm, so, sharded)))
    sharded.load_sharded_state_dict(own)
    lm, lo, listed = _chain(group)
    with torch.no_grad():
        for p, q in zip(lm + lo, out["after_errors"]):
            p.copy_(q)
    listed.load_sharded_state_dict(every)
    runs = [(matrices, others, chain), (fm, fo, fresh), (sm, so, sharded), (lm, lo, listed)]
    for t in (2, 3):
        for ms, os_, opt in runs:
            set_grads(ms, muon_grads(ms, t, rank, world_size))
            set_grads(os_, _other_grads(os_, t, rank, world_size)[0])
            opt.step()
    out["uninterrupted"], out["resumed"], out["resumed_sharded"], out["resumed_listed"] = (
        [p.detach().clone() for p in ms + os_] for ms, os_, _ in runs)
    # a 0-dim AdamW tensor
    zm, zo, zchain = _chain(group, others_shapes=((10,), (), (3,)))
    for t in range(2):
        set_grads(zm, muon_grads(zm, t, rank, world_size))
        set_grads(zo, _other_grads(zo, t, rank, world_size)[0])
        zchain.step()
    out["zero_dim"] = [p.detach().clone() for p in zm + zo]
    return out


def cross_rank_checks(rank: int, world_size: int, *, group=None) -> dict:
    """Construction on ranks that disagree (the last rank's parameter 1 has another shape, then another
    dtype, then one parameter more), and with a 0-dim parameter: ``{case: (type, message)}`` per class."""
    last = world_size - 1
    out = {}
    f64 = torch.float64
    cases = {
        "shape": lambda: [torch.zeros(2, 2, dtype=f64), torch.zeros(3 if rank == last else 2, 2, dtype=f64)],
        "dtype": lambda: [torch.zeros(2, 2, dtype=f64),
                          torch.zeros(2, 2, dtype=torch.float32 if rank == last else f64)],
        "count": lambda: [torch.zeros(2, 2, dtype=f64)] * (1 + (rank == last)),
        "zero_dim": lambda: [torch.zeros(2, 2, dtype=f64), torch.zeros((), dtype=f64)],
    }
    for kind in ("layerwise", "moonlight"):
        for case, make in cases.items():
            params = [p.clone().requires_grad_() for p in make()]
            out[kind, case] = _error(lambda params=params, kind=kind: _make(kind, params, group))
    return out


def contract_suite(rank: int, world_size: int) -> dict:
    """Every check of ``tests/test_muon_contract.py`` in one launch of 4 processes, on the groups of
    :data:`MUON_SUITE_GROUPS`: ``{size: {"moonlight", "layerwise", "foreign_moonlight", "foreign_layerwise",
    "chain", "cross"}}`` (``None`` for a size this rank is not in)."""
    if world_size != 4:
        raise ValueError(f"Invalid world_size: contract_suite runs on 4 processes, got {world_size}")
    torch.set_num_threads(1)
    groups = {size: dist.new_group(ranks) for size, ranks in MUON_SUITE_GROUPS.items()}
    out, previous = {}, {"moonlight": None, "layerwise": None}
    for size, ranks in MUON_SUITE_GROUPS.items():
        report = None
        if rank in ranks:
            g, r = groups[size], ranks.index(rank)
            report = {"moonlight": owner_checks(r, size, group=g), "layerwise": owner_checks(r, size, group=g,
                                                                                             kind="layerwise"),
                      "foreign_moonlight": foreign_checkpoints(r, size, group=g),
                      "foreign_layerwise": foreign_checkpoints(r, size, group=g, kind="layerwise"),
                      "chain": chain_contract(r, size, group=g), "cross": cross_rank_checks(r, size, group=g)}
            for kind, files in previous.items():
                report["sharded_" + kind] = sharded_checks(r, size, group=g, kind=kind, previous=files)
        shared = [None if report is None else {k: report["sharded_" + k].pop("files") for k in previous}]
        dist.broadcast_object_list(shared, src=ranks[0])
        previous, out[size] = shared[0], report
        dist.barrier()
    return out


def checkpoint_acceptance(rank: int, world_size: int) -> dict:
    """Loads that must be all or nothing, or must be accepted (2 ranks):

    ``"chain_consolidated"``, ``"chain_sharded"``: a :class:`~optbook.distributed.DistributedChain` checkpoint
    whose Muon momentum is float32 for float64 parameters (each rank owns one matrix); ``(error or None, the
    AdamW member's state and every parameter unchanged)``. ``"scheduler_keys"``: a plain Muon checkpoint whose
    groups carry ``initial_lr`` (set by :class:`optbook.schedules.SampleScheduler`) loaded into plain Muon,
    LayerWiseMuon and DistributedMuon: ``{name: error or None, name + " lr": the loaded lr}``;
    ``"adamw_empty_state"``: an AdamW checkpoint taken before any step (no state) into both: the errors."""
    from optbook.distributed import DistributedChain, DistributedOptimizer
    from optbook.optim import AdamW, Muon
    from optbook.schedules import LRSchedule, SampleScheduler

    def build():
        g = torch.Generator().manual_seed(0)
        mats = [torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64)) for _ in range(2)]
        b = torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))
        chain = DistributedChain(LayerWiseMuon(mats, lr=0.02, ns_dtype=torch.float64),
                                 DistributedOptimizer([b], AdamW, lr=0.01), max_grad_norm=1.0)
        return mats + [b], chain

    def one_step(params, chain, k):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 1.0 + k + rank + i)
        chain.step()

    def chain_snapshot(params, chain):
        out = [p.detach().clone() for p in params]
        for opt in (chain.adamw.optimizer, chain.muon):
            for s in opt.state.values():
                out += [v.clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in s.values()]
        return out

    out = {}
    for which in ("consolidated", "sharded"):
        params, chain = build()
        for k in range(2):
            one_step(params, chain, k)
        chain.consolidate_state_dict(0)
        shared = [copy.deepcopy(chain.state_dict()) if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        sd, shard = shared[0], copy.deepcopy(chain.sharded_state_dict())
        one_step(params, chain, 2)  # the state now differs from the checkpoint
        if which == "consolidated":
            for entry in sd["state"].values():
                if "momentum_buffer" in entry:   # the Muon member's (torch's layout over both members)
                    entry["momentum_buffer"] = entry["momentum_buffer"].float()
            load = lambda: chain.load_state_dict(sd)  # noqa: E731
        else:
            assert shard["muon"]["state"], "each rank owns a matrix"
            for entry in shard["muon"]["state"].values():
                entry["momentum_buffer"] = entry["momentum_buffer"].float()
            load = lambda: chain.load_sharded_state_dict(shard)  # noqa: E731
        before = chain_snapshot(params, chain)
        err = _error(load)
        out["chain_" + which] = (err, bitwise(before, chain_snapshot(params, chain)))

    def fresh():
        return [torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(1),
                                               dtype=torch.float64))]

    ps = fresh()
    muon = Muon(ps, lr=0.02)
    sched = SampleScheduler(muon, LRSchedule(max_lr=1.0, total=100, warmup=10), batch_size=4)
    ps[0].grad = torch.ones(4, 4, dtype=torch.float64)
    muon.step()
    sched.step()
    sd = muon.state_dict()
    assert "initial_lr" in sd["param_groups"][0]
    keys, empty = {}, {}
    adamw_sd = AdamW(fresh(), lr=0.01).state_dict()  # no step yet: no state entries, only the groups
    for name, cls in (("Muon", Muon), ("LayerWiseMuon", LayerWiseMuon), ("DistributedMuon", DistributedMuon)):
        new = cls(fresh(), lr=0.02)
        keys[name] = _error(lambda new=new: new.load_state_dict(sd))
        keys[name + " lr"] = new.param_groups[0]["lr"]
        if name != "Muon":
            empty[name] = _error(lambda cls=cls: cls(fresh(), lr=0.02).load_state_dict(adamw_sd))
    out["scheduler_keys"], out["adamw_empty_state"] = keys, empty
    out["scheduled_lr"] = sd["param_groups"][0]["lr"]

    # The chain's dict is torch's layout over both members (what torch.distributed.checkpoint reads): the two
    # matrices (indices 0, 1) then the AdamW vector (2). The older {"muon": ..., "adamw": ...} layout of the
    # same state still loads, to the same steps.
    params, chain = build()
    one_step(params, chain, 0)
    sd = chain.state_dict()   # nothing consolidated: put together on every rank (a collective)
    old = {"muon": {"state": {i: e for i, e in sd["state"].items() if i < 2}, "param_groups": sd["param_groups"][:1]},
           "adamw": {"state": {i - 2: e for i, e in sd["state"].items() if i >= 2},
                     "param_groups": [{**g, "params": [i - 2 for i in g["params"]]} for g in sd["param_groups"][1:]]}}
    resumed = []
    for layout in (sd, old):
        p2, c2 = build()
        with torch.no_grad():
            for a, b in zip(p2, params):
                a.copy_(b)
        c2.load_state_dict(copy.deepcopy(layout))
        one_step(p2, c2, 1)
        resumed.append([p.detach().clone() for p in p2])
    one_step(params, chain, 1)
    out["chain_layout"] = (sorted(sd), sorted(sd["state"]), [g["params"] for g in sd["param_groups"]],
                           [sorted(e) for e in sd["state"].values()],
                           [bitwise(r, [p.detach() for p in params]) for r in resumed])
    return out


def bfloat16_layout_both_ways(rank: int, world_size: int) -> dict:
    """A bfloat16 LayerWiseMuon's consolidated dict is MixedPrecisionOptimizer's layout (each float32 master in
    its parameter's state under ``"master_param"``, where ``torch.distributed.checkpoint`` keeps it): after 2
    steps each one's dict loads into the other, and 2 more steps of all four agree bitwise.
    ``{"keys": (LayerWiseMuon's state keys, MixedPrecisionOptimizer's), "equal": [after 2 steps, after 4]}``."""
    from optbook.optim import Muon
    from optbook.precision import MixedPrecisionOptimizer

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 6, generator=g).bfloat16(), torch.randn(4, 5, generator=g).bfloat16()]

    def grads(ps, k):
        gen = torch.Generator().manual_seed(10 + k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()

    def build(weights, kind):
        ps = [torch.nn.Parameter(w.detach().clone()) for w in weights]
        return ps, (LayerWiseMuon(ps, lr=0.02, ns_dtype=torch.float32) if kind == "layerwise"
                    else MixedPrecisionOptimizer(Muon(ps, lr=0.02, ns_dtype=torch.float32)))

    (a, la), (b, mb) = build(start, "layerwise"), build(start, "mixed")
    for k in range(2):
        for ps, opt in ((a, la), (b, mb)):
            grads(ps, k)
            opt.step()
    equal = [bitwise([p.detach() for p in a], [p.detach() for p in b])]
    sd, msd = copy.deepcopy(la.state_dict()), copy.deepcopy(mb.state_dict())
    (a2, la2), (b2, mb2) = build(a, "layerwise"), build(b, "mixed")
    la2.load_state_dict(msd)
    mb2.load_state_dict(sd)
    runs = ((a, la), (b, mb), (a2, la2), (b2, mb2))
    for k in range(2, 4):
        for ps, opt in runs:
            grads(ps, k)
            opt.step()
    equal.append(all(bitwise([p.detach() for p in a], [p.detach() for p in ps]) for ps, _ in runs[1:]))
    return {"keys": ([sorted(e) for e in sd["state"].values()], [sorted(e) for e in msd["state"].values()]),
            "equal": equal}
