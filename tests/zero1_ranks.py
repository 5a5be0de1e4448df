"""Rank programs that only the tests run (``launch`` imports them by name in spawned processes).

``launch`` checks that ``fn`` is a module-level function; the spawned processes get the parent's
``sys.path`` (``multiprocessing``'s spawn preparation data), in which pytest put ``tests/`` (rootdir-based
``prepend`` import mode, no ``__init__.py``), so ``import zero1_ranks`` works there as here.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist


# --- launch ---------------------------------------------------------------------------------------------
def die_on_rank(rank: int, world_size: int, bad_rank: int = 1, how: str = "exit") -> int:
    """Rank ``bad_rank`` ends without a Python exception (``how``: ``"exit"`` is ``os._exit(3)``, ``"kill"``
    is ``SIGKILL`` to itself) after a barrier, while the others wait in an all-reduce it never joins (their
    gloo connection to it is then reset)."""
    dist.barrier()
    if rank == bad_rank:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return rank


# --- ZeRO-1 and the step contract (tests/test_zero1_contract.py) ----------------------------------------
#: The process groups of :func:`contract_suite` on 4 processes: world size -> global ranks.
CONTRACT_GROUPS = {2: [2, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}
#: Layout arguments that make the (6, 5) matrix span several ranks' shards.
TIGHT = dict(param_alignment=1, bucket_alignment=8)
#: A row scaling of the (6, 5) matrix (shape (6, 1), float32), as qk_clip_ applies one.
ROW_FACTOR = torch.tensor([[0.9], [0.7], [1.0], [0.55], [0.3], [0.85]])


def contract_problem(dtype: torch.dtype, seed: int = 0, shapes=((6, 5), (), (7,), (3, 4))) -> list[torch.Tensor]:
    """Leaf tensors of ``shapes`` (a matrix spanning ranks, a learnable scalar, ...), entries ``k / 64``."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(-64, 64, s, generator=gen) / 64).to(dtype).requires_grad_() for s in shapes]


def contract_grads(params, step: int, seed: int = 0) -> list[torch.Tensor]:
    """The same dyadic gradient on every rank (its mean over any number of ranks is exact)."""
    gen = torch.Generator().manual_seed(1000 * seed + step + 1)
    return [(torch.randint(-512, 512, p.shape, generator=gen) / 256).to(p.dtype) for p in params]


def _set(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _consolidated_everywhere(opt, world_size: int) -> dict:
    """The consolidated state dict on every rank (one consolidation per rank)."""
    mine = None
    for r in range(world_size):
        opt.consolidate_state_dict(to=r)
        if opt.rank == r:
            mine = opt.state_dict()
    return mine


def _all_shards(opt, group, world_size: int) -> list:
    every = [None] * world_size
    dist.all_gather_object(every, opt.sharded_state_dict(), group=group)
    return every


def _error(fn):
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def _snapshot(opt, params) -> list[torch.Tensor]:
    state = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in (*params, *state, *opt.master_shards.values())]


def _same_bits(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                    and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                                    for x, y in zip(a, b))


def scaled_weights_survive(rank: int, world_size: int, group=None) -> dict:
    """bfloat16 ZeRO-1 (float32 master shards): after one step, ``contract.scale_weights_`` scales the
    matrix's rows by :data:`ROW_FACTOR` and the scalar by 0.5; then a step at lr 0 must leave them scaled.
    Then new weights are copied into the model (as ``model.load_state_dict`` does); a step at lr 0 must
    leave them in place and the masters must hold them.

    Returns the masters before the scaling (consolidated, float32), the model after the scaling and after
    each lr-0 step, the loaded weights and the masters after the load."""
    from optbook import contract
    from optbook.distributed import DistributedOptimizer

    params = contract_problem(torch.bfloat16)
    opt = DistributedOptimizer(params, process_group=group, lr=0.01, weight_decay=0.1, **TIGHT)
    _set(params, contract_grads(params, 0))
    opt.step()
    masters = _consolidated_everywhere(opt, world_size)["master_params"]
    opt.param_groups[0]["lr"] = 0.0
    contract.scale_weights_(params[0], ROW_FACTOR)
    contract.scale_weights_(params[1], 0.5)
    scaled = [p.detach().clone() for p in params]
    _set(params, contract_grads(params, 1))
    opt.step()
    after_step = [p.detach().clone() for p in params]
    loaded = [(p.detach().float() * -0.5 + 0.125).bfloat16() for p in params]
    with torch.no_grad():
        for p, v in zip(params, loaded):
            p.copy_(v)
    _set(params, contract_grads(params, 2))
    opt.step()
    after_load = [p.detach().clone() for p in params]
    masters_after_load = _consolidated_everywhere(opt, world_size)["master_params"]
    return {"masters": masters, "scaled": scaled, "after_step": after_step, "loaded": loaded,
            "after_load": after_load, "masters_after_load": masters_after_load}


def scaled_run(rank: int, world_size: int, group=None, *, steps: int = 6, checkpoint_at: int = 3,
               scale_at: tuple = (2, 4), resume: dict | None = None, shards: list | None = None) -> dict:
    """bfloat16 ZeRO-1 AdamW (lr 0.01, weight decay 0.1) with :data:`ROW_FACTOR` applied to the matrix
    through ``contract.scale_weights_`` before the steps in ``scale_at``. From step 0, it saves at
    ``checkpoint_at`` (consolidated and every rank's sharded dict); with ``resume`` (``{"params", "optimizer"}``)
    or ``shards`` (that save's list) it starts there: the model's weights are copied in after the optimizer
    is built (a weights-only load), then the optimizer state is loaded."""
    from optbook import contract
    from optbook.distributed import DistributedOptimizer

    params = contract_problem(torch.bfloat16)
    opt = DistributedOptimizer(params, process_group=group, lr=0.01, weight_decay=0.1, **TIGHT)
    start, checkpoint = 0, None
    if resume is not None:
        with torch.no_grad():
            for p, v in zip(params, resume["params"]):
                p.copy_(v)
        if shards is not None:
            opt.load_sharded_state_dict(shards)
        else:
            opt.load_state_dict(resume["optimizer"])
        start = checkpoint_at
    for t in range(start, steps):
        if t == checkpoint_at and resume is None:
            checkpoint = {"params": [p.detach().clone() for p in params],
                          "optimizer": _consolidated_everywhere(opt, world_size),
                          "shards": _all_shards(opt, group, world_size)}
        if t in scale_at:
            contract.scale_weights_(params[0], ROW_FACTOR)
        _set(params, contract_grads(params, t))
        opt.step()
    return {"params": [p.detach().clone() for p in params], "checkpoint": checkpoint}


def scalar_run(rank: int, world_size: int, group=None, *, steps: int = 6, checkpoint_at: int = 3,
               resume: dict | None = None, how: str | None = None) -> dict:
    """float64 ZeRO-1 ``torch.optim.AdamW`` (lr 0.01, weight decay 0.1) on :func:`contract_problem`, which
    holds a 0-dim parameter. From step 0 it saves at ``checkpoint_at`` (consolidated, every rank's sharded
    dict); with ``resume`` it starts there, loading ``how`` = ``"consolidated"``, ``"sharded"`` or
    ``"plain"`` (``resume["plain"]``: a single-process ``torch.optim.AdamW`` state dict)."""
    from optbook.distributed import DistributedOptimizer

    params = contract_problem(torch.float64)
    opt = DistributedOptimizer(params, torch.optim.AdamW, group, lr=0.01, weight_decay=0.1, **TIGHT)
    start, checkpoint = 0, None
    if resume is not None:
        with torch.no_grad():
            for p, v in zip(params, resume["params_plain" if how == "plain" else "params"]):
                p.copy_(v)
        if how == "sharded":
            opt.load_sharded_state_dict(resume["shards"])
        else:
            opt.load_state_dict(resume["plain" if how == "plain" else "optimizer"])
        start = checkpoint_at
    for t in range(start, steps):
        if t == checkpoint_at and resume is None:
            checkpoint = {"params": [p.detach().clone() for p in params],
                          "optimizer": _consolidated_everywhere(opt, world_size),
                          "shards": _all_shards(opt, group, world_size)}
        _set(params, contract_grads(params, t))
        opt.step()
    return {"params": [p.detach().clone() for p in params], "checkpoint": checkpoint}


def scalar_reference(steps: int = 6, checkpoint_at: int = 3) -> dict:
    """Single-process ``torch.optim.AdamW`` twin of :func:`scalar_run`: final parameters and the plain
    state dict (and parameters) at ``checkpoint_at``."""
    params = contract_problem(torch.float64)
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    saved = None
    for t in range(steps):
        if t == checkpoint_at:
            import copy

            saved = {"params": [p.detach().clone() for p in params], "plain": copy.deepcopy(opt.state_dict())}
        _set(params, contract_grads(params, t))
        opt.step()
    return {"params": [p.detach().clone() for p in params], "saved": saved}


def other_model_loads(rank: int, world_size: int, group=None) -> dict:
    """Checkpoints of another model loaded into ZeRO-1 AdamW over ``[(4, 3), (1,)]`` float64 after one step:
    a consolidated and a sharded one of ``[(4, 3), ()]`` (a scalar where this model has one element), a
    plain ``torch.optim.AdamW`` dict of that model, a plain ``torch.optim.SGD(momentum=0.9)`` dict of this
    model (another optimizer). Each must raise with nothing written; then a step must still work.

    Returns ``{name: error}``, ``untouched`` per name, the final parameters."""
    from optbook.distributed import DistributedOptimizer

    shapes, other_shapes = ((4, 3), (1,)), ((4, 3), ())
    other = contract_problem(torch.float64, 1, other_shapes)
    other_opt = DistributedOptimizer(other, process_group=group, lr=0.01, weight_decay=0.1)
    _set(other, contract_grads(other, 0))
    other_opt.step()
    consolidated = _consolidated_everywhere(other_opt, world_size)
    sharded = _all_shards(other_opt, group, world_size)
    plain_params = contract_problem(torch.float64, 1, other_shapes)
    plain = torch.optim.AdamW(plain_params, lr=0.01, weight_decay=0.1)
    _set(plain_params, contract_grads(plain_params, 0))
    plain.step()
    sgd_params = contract_problem(torch.float64, 2, shapes)
    sgd = torch.optim.SGD(sgd_params, lr=0.01, momentum=0.9)
    _set(sgd_params, contract_grads(sgd_params, 0))
    sgd.step()

    params = contract_problem(torch.float64, 0, shapes)
    opt = DistributedOptimizer(params, process_group=group, lr=0.01, weight_decay=0.1)
    _set(params, contract_grads(params, 0))
    opt.step()
    errors, untouched = {}, {}
    for name, load in (("consolidated", lambda: opt.load_state_dict(consolidated)),
                       ("sharded", lambda: opt.load_sharded_state_dict(sharded)),
                       ("plain_adamw", lambda: opt.load_state_dict(plain.state_dict())),
                       ("plain_sgd", lambda: opt.load_state_dict(sgd.state_dict()))):
        before = _snapshot(opt, params)
        errors[name] = _error(load)
        untouched[name] = _same_bits(before, _snapshot(opt, params))
    _set(params, contract_grads(params, 1))
    opt.step()
    return {"errors": errors, "untouched": untouched, "params": [p.detach().clone() for p in params]}


def mismatched_params(rank: int, world_size: int, group=None) -> dict:
    """The last rank builds its model differently: a transposed layer, then a layer of another size, then
    one parameter fewer. Returns the error every rank got for each (``None`` if none)."""
    from optbook.distributed import DistributedOptimizer

    last = world_size - 1
    out = {}
    for name, shapes in (("transposed", ((4, 3), (3, 2))), ("size", ((4, 3), (5, 2))), ("count", ((4, 3),))):
        mine = shapes if rank == last else ((4, 3), (2, 3))
        params = contract_problem(torch.float32, 0, mine)
        out[name] = _error(lambda: DistributedOptimizer(params, process_group=group, lr=0.01))
    return out


def contract_misc(rank: int, world_size: int, group=None) -> dict:
    """Refused optimizer classes (torch.optim.Adafactor, torch.optim.Muon, optbook Muon); the closure's loss
    returned by step(); an old state dict without ``skipped_steps`` loads."""
    from optbook.distributed import DistributedOptimizer
    from optbook.optim import Muon

    refused = {}
    for cls in (torch.optim.Adafactor, torch.optim.Muon, Muon):
        refused[f"{cls.__module__}.{cls.__qualname__}"] = _error(
            lambda cls=cls: DistributedOptimizer([torch.zeros(4, 3, requires_grad=True)], cls, group, lr=0.01))
    params = contract_problem(torch.float64)
    opt = DistributedOptimizer(params, process_group=group, lr=0.01)

    def closure():
        _set(params, contract_grads(params, 0))
        return torch.tensor(1.5)

    returned = opt.step(closure)
    returned_plain = opt.step()
    old = _consolidated_everywhere(opt, world_size)
    del old["skipped_steps"]
    opt.skipped_steps = 7
    old_error = _error(lambda: opt.load_state_dict(old))
    return {"refused": refused, "returned": returned, "returned_plain": returned_plain,
            "old_error": old_error, "skipped_after_old": opt.skipped_steps}


def contract_suite(rank: int, world_size: int) -> dict:
    """Every check of tests/test_zero1_contract.py in one launch of 4 processes, on groups of 2, 3 and 4
    (:data:`CONTRACT_GROUPS`). The 3-rank group resumes from the 2-rank group's checkpoints, the 4-rank
    group from the 3-rank group's.

    Returns ``{size: report or None}`` (``None`` where this process is not in the group)."""
    groups = {size: dist.new_group(ranks) for size, ranks in CONTRACT_GROUPS.items()}
    out, saved = {}, None
    for size, ranks in CONTRACT_GROUPS.items():
        report = None
        if rank in ranks:
            g, r = groups[size], ranks.index(rank)
            report = {"scale": scaled_weights_survive(r, size, g), "scaled_run": scaled_run(r, size, g),
                      "scalar_run": scalar_run(r, size, g), "other_model": other_model_loads(r, size, g),
                      "mismatched": mismatched_params(r, size, g), "misc": contract_misc(r, size, g)}
            if saved is not None:
                report["scaled_resumed"] = scaled_run(r, size, g, resume=saved["scaled"])
                report["scaled_resharded"] = scaled_run(r, size, g, resume=saved["scaled"],
                                                        shards=saved["scaled"]["shards"])
                for how in ("consolidated", "sharded", "plain"):
                    report[f"scalar_{how}"] = scalar_run(r, size, g, resume=saved["scalar"], how=how)
        shared = [None if report is None else {"scaled": report["scaled_run"]["checkpoint"],
                                               "scalar": report["scalar_run"]["checkpoint"]}]
        dist.broadcast_object_list(shared, src=ranks[-1])
        saved = shared[0]
        plain = scalar_reference()["saved"]
        saved["scalar"]["plain"], saved["scalar"]["params_plain"] = plain["plain"], plain["params"]
        out[size] = report
    return out
