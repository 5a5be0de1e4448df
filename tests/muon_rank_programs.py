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
    try:
        opt.state_dict()  # not consolidated since the last step
        checkpoint_errors["not consolidated"] = None
    except RuntimeError as e:
        checkpoint_errors["not consolidated"] = (type(e).__name__, str(e))
    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict() if rank == 0 else None
    shared = [saved]
    dist.broadcast_object_list(shared, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
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
        ``{size: report or None}``; a report is ``{"layerwise", "round_robin", "moonlight", "chain",
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
