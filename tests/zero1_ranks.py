"""Rank programs that only the tests run (``launch`` imports them by name in spawned processes): the
ZeRO-1 checks of test_zero1.py and test_zero1_contract.py and the failing ranks of test_distributed_launch.py.

``launch`` checks that ``fn`` is a module-level function; the spawned processes get the parent's
``sys.path`` (``multiprocessing``'s spawn preparation data), in which pytest put ``tests/`` (rootdir-based
``prepend`` import mode, no ``__init__.py``), so ``import zero1_ranks`` works there as here.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from optbook.distributed.workers import zero1_grads, zero1_problem, zero1_train


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


# --- ZeRO-1 (test_zero1.py) -------------------------------------------------------------------------------
def raise_on_rank(rank: int, world_size: int, bad_rank: int = 1) -> int:
    """Rank ``bad_rank`` raises ``ValueError``; the others wait in a barrier it never reaches.

    Shows that :func:`optbook.distributed.launch` reports the failing rank instead of hanging until the
    collective times out. Returns ``rank`` on the ranks that get past the barrier (none, when
    ``bad_rank < world_size``).
    """
    if rank == bad_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    dist.barrier()
    return rank


def zero1_padding_clip(rank: int, world_size: int, *, dtype: torch.dtype = torch.float64,
                       steps: int = 3, group=None, grad_buffer: bool = False) -> dict:
    """Two parameters on ``world_size`` ranks, flat buffer padded to a multiple of ``lcm(world_size, 16)``
    (at 4 ranks: 9 elements in 16, rank 2 holds one real element and rank 3 only padding): AdamW (lr 0.1,
    weight decay 0.01) with a global clip at 1.0, gradients ``k * gA`` and ``k * gB`` at steps
    ``k = 1, 2, 3``. ``grad_buffer``: the gradients are written into the views that
    :meth:`~optbook.distributed.DistributedOptimizer.use_grad_buffer` made (no copy in ``step``).

    Returns:
        ``{"params": [A, B], "norms": [pre-clip norm per step], "pieces": this rank's pieces,
        "padding_zero": whether the padding of the parameter and gradient buffers is still exactly zero}``.
    """
    from optbook.distributed import DistributedOptimizer

    A = torch.tensor([1.0, 2, 3, 4, 5], dtype=dtype, requires_grad=True)
    B = torch.tensor([[1.0, -1], [0.5, -0.5]], dtype=dtype, requires_grad=True)
    opt = DistributedOptimizer([A, B], process_group=group, lr=0.1, weight_decay=0.01, max_grad_norm=1.0,
                               param_alignment=1,
                               bucket_alignment=16)
    norms = []
    views = opt.use_grad_buffer() if grad_buffer else 0
    for k in range(1, steps + 1):
        gA = k * torch.tensor([0.1, -0.1, 0.2, -0.2, 0.3], dtype=dtype)
        gB = k * torch.tensor([[0.5, -0.5], [1.0, -1.0]], dtype=dtype)
        if grad_buffer:
            A.grad.copy_(gA)
            B.grad.copy_(gB)
        else:
            A.grad, B.grad = gA, gB
        opt.step()
        norms.append(opt.last_grad_norm)
    real = sum(r.numel for r in opt.layout.params)
    padding_zero = all(bool((buf[real:] == 0).all()) for buf in (*opt.param_buffers.values(),
                                                                   *opt.grad_buffers.values()))
    in_buffer = grad_buffer and A.grad.data_ptr() == opt.grad_buffers[dtype].data_ptr()
    return {"params": [A.detach(), B.detach()], "norms": norms, "pieces": opt.pieces,
            "padding_zero": padding_zero, "views": views, "in_buffer": in_buffer}


def zero1_bad_input(rank: int, world_size: int, *, seed: int = 0, group=None) -> dict:
    """Bad input on one rank or on all: every rank raises, nothing is written, the ranks stay in step.

    After two good steps: (1) the last rank passes a sparse gradient, (2) rank 0 alone sets ``betas`` to
    ``(1.5, 0.999)``, (3) every rank sets ``lr = -1``, (4) the last rank replaces a parameter's ``.data`` (it
    leaves the flat buffer). Each time every rank catches the error; then a good step runs (no rank hangs).

    Returns:
        ``{"errors": [(type name, message) per case], "untouched": [bool per case: parameters, state and
        masters bitwise unchanged], "grads_untouched": bool, "after": parameters after the final good step,
        "constructor_errors": {case: (type name, message)}}``.
    """
    from optbook.distributed import DistributedOptimizer
    from optbook.optim import Muon

    params, groups = zero1_problem(seed)
    opt = DistributedOptimizer(groups, process_group=group, lr=0.01)
    for t in range(2):
        _set(params, zero1_grads(params, t, rank, world_size, seed))
        opt.step()
    errors, untouched = [], []
    good = zero1_grads(params, 2, rank, world_size, seed)
    grads_untouched = True
    last = world_size - 1
    for what in ("sparse", "betas", "lr", "data"):
        grads = [None if g is None else g.clone() for g in good]
        if what == "sparse" and rank == last:
            grads[4] = grads[4].to_sparse()
        _set(params, grads)
        before = _snapshot(opt, params)
        grads_before = [p.grad.clone() for p in params if p.grad is not None]
        saved = {k: opt.param_groups[0][k] for k in ("lr", "betas")}
        view = params[0].data
        if what == "betas" and rank == 0:
            opt.param_groups[0]["betas"] = (1.5, 0.999)
        if what == "lr":
            opt.param_groups[0]["lr"] = -1.0
        if what == "data" and rank == last:
            params[0].data = view.clone()
        try:
            opt.step()
            errors.append(None)
        except (TypeError, ValueError, RuntimeError) as e:
            errors.append((type(e).__name__, str(e)))
        opt.param_groups[0].update(saved)
        params[0].data = view
        untouched.append(_same_bits(before, _snapshot(opt, params)))
        grads_untouched &= all(torch.equal(a.to_dense(), b.to_dense()) for a, b in
                               zip(grads_before, [p.grad for p in params if p.grad is not None]))
    _set(params, good)
    opt.step()
    constructor_errors = {}
    for name, kwargs in [("muon", dict(optimizer_class=Muon)), ("max_grad_norm", dict(max_grad_norm=0.0)),
                         ("bucket_size", dict(bucket_size=0)), ("lr", dict(lr=-0.1)),
                         ("float16", dict()), ("to", None)]:
        try:
            if name == "float16":
                DistributedOptimizer([torch.zeros(3, dtype=torch.float16, requires_grad=True)])
            elif name == "to":
                opt.consolidate_state_dict(to=world_size)
            else:
                DistributedOptimizer([torch.zeros(3, requires_grad=True)], **kwargs)
            constructor_errors[name] = None
        except (TypeError, ValueError) as e:
            constructor_errors[name] = (type(e).__name__, str(e))
    return {"errors": errors, "untouched": untouched, "grads_untouched": grads_untouched,
            "after": [p.detach() for p in params], "constructor_errors": constructor_errors}


def zero1_grad_buffer_failures(rank: int, world_size: int) -> dict:
    """Failed steps with ``use_grad_buffer()`` (each ``.grad`` a view of the flat buffer that ``step`` reduces
    in place): ``lr = -1`` on the last rank; an ``inf``, a ``NaN`` on the last rank; finite float32 gradients
    whose sum over the ranks overflows. Each case: ``(error type and message, .grad bitwise unchanged,
    parameters and state bitwise unchanged)``, then the input is fixed and the step retried. ``"after"``:
    the parameters after every retry, and ``"reference"``: the same steps with the gradients copied into the
    buffer (no views) and no failure: they must be equal bit for bit."""
    from optbook.distributed import DistributedOptimizer
    from optbook.optim import AdamW

    def problem():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(5, 3, generator=g, dtype=torch.float64).requires_grad_(),
                torch.randn(7, generator=g).requires_grad_(), torch.randn(2, 2, generator=g).requires_grad_()]

    def good(step):
        g = torch.Generator().manual_seed(100 + 10 * step + rank)
        return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]

    last = world_size - 1
    params, ref_params = problem(), problem()
    opt = DistributedOptimizer(params, AdamW, lr=0.01, weight_decay=0.1)
    ref = DistributedOptimizer(ref_params, AdamW, lr=0.01, weight_decay=0.1)
    for p in params:
        p.grad = torch.zeros_like(p)
    assert opt.use_grad_buffer() == len(params)

    def set_grads(step):
        for p, g in zip(params, good(step)):
            p.grad.copy_(g)  # in place: the views stay views
        for p, g in zip(ref_params, good(step)):
            p.grad = g

    def state():
        return [p.detach().clone() for p in params] + [v.clone() for s in opt.optimizer.state.values()
                                                       for v in s.values() if isinstance(v, torch.Tensor)]

    cases = {}
    for step, case in enumerate(("lr", "inf", "nan", "overflow")):
        set_grads(step)
        grads = [p.grad.clone() for p in params]
        before = state()
        if case == "lr" and rank == last:
            opt.param_groups[0]["lr"] = -1.0
        elif case in ("inf", "nan") and rank == last:
            params[1].grad[3] = float(case)
        elif case == "overflow":
            params[1].grad[0] = 3e38  # finite on every rank, inf once summed (float32)
        bad = [p.grad.clone() for p in params]
        try:
            opt.step()
            err = None
        except Exception as e:  # noqa: BLE001 -- reported to the test, which checks the type
            err = (type(e).__name__, str(e))
        cases[case] = (err, _same_bits(bad, [p.grad for p in params]), _same_bits(before, state()))
        opt.param_groups[0]["lr"] = 0.01
        for p, g in zip(params, grads):  # fix the input (in place) and retry
            p.grad.copy_(g)
        opt.step()
        opt.zero_grad(set_to_none=False)
        ref.step()
    still_views = opt.use_grad_buffer() == len(params) and all(
        p.grad.data_ptr() == opt._grad_view(i).data_ptr() for i, p in enumerate(params))
    return {"cases": cases, "after": [p.detach().clone() for p in params],
            "reference": [p.detach().clone() for p in ref_params], "still_views": still_views}


def zero1_raise_mid_run(rank: int, world_size: int, *, bad_rank: int = 1, at_step: int = 2) -> int:
    """Train :func:`zero1_problem`; rank ``bad_rank`` raises before its step ``at_step`` while the other ranks
    enter the step's reduce-scatter. :func:`optbook.distributed.launch` must then fail fast (not hang)."""
    from optbook.distributed import DistributedOptimizer

    params, groups = zero1_problem()
    opt = DistributedOptimizer(groups, lr=0.01)
    for t in range(4):
        if t == at_step and rank == bad_rank:
            raise RuntimeError(f"rank {rank} fails on purpose at step {t}")
        _set(params, zero1_grads(params, t, rank, world_size))
        opt.step()
    return rank


#: The process groups of :func:`zero1_suite` on 4 processes: world size -> global ranks.
SUITE_GROUPS = {2: [2, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}


def zero1_suite(rank: int, world_size: int, ckpt_dir: str | None = None) -> dict:
    """Every ZeRO-1 check of ``test_zero1.py`` in one launch of 4 processes (a launch costs seconds of
    imports per process): the checks run on 2, 3 and 4 of them, one process group each.

    The groups are :data:`SUITE_GROUPS` (2 ranks: global 2, 3; 3 ranks: global 1, 2, 3; 4: all), so a
    group's rank 0 is not global rank 0 (the broadcast and gather of DistributedOptimizer name global
    ranks). On each group: :func:`zero1_train` in float64 and in bfloat16 with a loss scaler and an overflow
    at step 2, from step 0 and (3 and 4 ranks) resumed from the checkpoint of the group before;
    :func:`zero1_padding_clip` (float64 and float32); :func:`zero1_bad_input`; a scheduler and step hooks.

    With ``ckpt_dir`` (an existing directory shared by the processes) each group also writes sharded
    checkpoints (one file per rank) into ``ckpt_dir/w{size}-{kind}`` and resumes from them: from its own
    files (``*_sharded_own``, same world size), and from all files of the group before (``*_resharded``:
    3 from 2, 4 from 3, and at the end 2 from 4); ``"wrong_size"`` is the error of loading one file saved at
    another world size (``None`` when it did not raise).

    Returns:
        ``{size: report or None}`` for sizes 2, 3, 4 (``None`` where this process is not in the group); a
        report is ``{"float64", "bfloat16", "float64_resumed", "bfloat16_resumed", "padding_clip",
        "padding_clip32", "bad_input", "scheduler"}`` (the dicts those functions return; ``*_resumed`` is
        ``None`` at 2 ranks), with ``ckpt_dir`` also ``"float64_sharded_own", "bfloat16_sharded_own",
        "float64_resharded", "bfloat16_resharded", "wrong_size"``.
    """
    if world_size != 4:
        raise ValueError(f"Invalid world_size: zero1_suite runs on 4 processes, got {world_size}")
    groups = {size: dist.new_group(ranks) for size, ranks in SUITE_GROUPS.items()}  # every rank, same order
    kinds = (("float64", False), ("bfloat16", True))

    def where(size, kind):
        path = os.path.join(ckpt_dir, f"w{size}-{kind}")
        os.makedirs(path, exist_ok=True)
        return path

    out, resume, previous = {}, None, None
    for size, ranks in SUITE_GROUPS.items():
        report = None
        if rank in ranks:
            g, r = groups[size], ranks.index(rank)
            report = {}
            for kind, low in kinds:
                save = None if ckpt_dir is None else where(size, kind)
                report[kind] = zero1_train(r, size, low_precision=low, overflow_at=(2,) if low else (),
                                           group=g, save_dir=save)
            for kind, low in kinds:
                report[kind + "_resumed"] = None if resume is None else zero1_train(
                    r, size, low_precision=low, overflow_at=(2,), resume=resume[kind], group=g)
            if ckpt_dir is not None:
                for kind, low in kinds:
                    report[kind + "_sharded_own"] = zero1_train(r, size, low_precision=low, overflow_at=(2,),
                                                                group=g, resume_dir=where(size, kind),
                                                                own_file=True)
                    report[kind + "_resharded"] = None if previous is None else zero1_train(
                        r, size, low_precision=low, overflow_at=(2,), group=g,
                        resume_dir=where(previous, kind))
                report["wrong_size"] = None if previous is None else _wrong_size_error(
                    r, size, g, os.path.join(where(previous, "float64"), f"optim_rank{r % previous}.pt"))
            report["padding_clip"] = zero1_padding_clip(r, size, group=g)
            report["padding_clip32"] = zero1_padding_clip(r, size, group=g, dtype=torch.float32)
            report["padding_clip_views"] = zero1_padding_clip(r, size, group=g, grad_buffer=True)
            report["bad_input"] = zero1_bad_input(r, size, group=g)
            report["scheduler"] = _zero1_scheduler_and_hooks(group=g)
        # the checkpoint was consolidated on the group's last rank: every process gets it for the next group
        shared = [None if report is None else {k: report[k]["checkpoint"] for k in ("float64", "bfloat16")}]
        dist.broadcast_object_list(shared, src=ranks[-1])
        resume, out[size], previous = shared[0], report, size
    if ckpt_dir is not None:  # shrink: the 2-rank group resumes from the 4-rank files
        ranks = SUITE_GROUPS[2]
        if rank in ranks:
            g, r = groups[2], ranks.index(rank)
            for kind, low in kinds:
                out[2][kind + "_resharded"] = zero1_train(r, 2, low_precision=low, overflow_at=(2,), group=g,
                                                          resume_dir=where(4, kind))
        dist.barrier()
    return out


def _wrong_size_error(rank: int, world_size: int, group, path: str) -> dict:
    """The errors of loading sharded files wrongly: ``"one_file"``, one file saved at another world size;
    ``"missing"``, the list of that save's files without its last one. Each ``(type name, message)`` or
    ``None`` when nothing was raised; afterwards the parameters must still be the initial ones
    (``"untouched"``)."""
    from optbook.distributed import DistributedOptimizer

    params, groups = zero1_problem()
    before = [p.detach().clone() for p in params]
    opt = DistributedOptimizer(groups, process_group=group, lr=0.01, bucket_size=200)
    folder = os.path.dirname(path)
    saved_size = len([f for f in os.listdir(folder) if f.startswith("optim_rank")])
    out = {}
    for name, shards in (("one_file", lambda: torch.load(path)),
                         ("missing", lambda: [torch.load(os.path.join(folder, f"optim_rank{r}.pt"))
                                              for r in range(saved_size - 1)])):
        try:
            opt.load_sharded_state_dict(shards())
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
    out["untouched"] = _same_bits(before, [p.detach() for p in params]) and not opt.optimizer.state
    return out


def _zero1_scheduler_and_hooks(group=None) -> dict:
    """Two steps under ``LambdaLR(lambda s: 0.5 ** s)`` with a step pre- and post-hook: the lrs used and
    the hook calls (each hook must run once per step); then a third step with an ``inf`` in the last rank's
    gradient and no loss scaler, which must raise ``NonFiniteGradientError`` on every rank with nothing
    written ("inf_error": (type name, message), "inf_untouched")."""
    from optbook.contract import NonFiniteGradientError
    from optbook.distributed import DistributedOptimizer

    p = torch.ones(3, dtype=torch.float64, requires_grad=True)
    opt = DistributedOptimizer([p], process_group=group, lr=1.0, weight_decay=0.0)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    lrs = []
    for _ in range(2):
        p.grad = torch.ones(3, dtype=torch.float64)
        assert opt.step() is None and not opt.found_inf
        lrs.append(opt.optimizer.param_groups[0]["lr"])  # what the shard step used
        sched.step()
    # an inf in the last rank's gradient, no loss scaler: found on the shard's owner, every rank skips
    before = p.detach().clone()
    p.grad = torch.ones(3, dtype=torch.float64)
    if dist.get_rank(group) == dist.get_world_size(group) - 1:
        p.grad[0] = float("inf")
    try:
        opt.step()
        error = None
    except NonFiniteGradientError as e:
        error = (type(e).__name__, str(e))
    return {"calls": calls, "lrs": lrs, "param": before, "inf_error": error,
            "inf_untouched": torch.equal(before, p.detach()), "skipped_steps": opt.skipped_steps}


# --- ZeRO-1 and the step contract (tests/test_zero1_contract.py) ----------------------------------------
#: The process groups of :func:`contract_suite` on 4 processes: world size -> global ranks.
CONTRACT_GROUPS = {2: [2, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}
#: Layout arguments that make the (6, 5) matrix span several ranks' shards.
TIGHT = {"param_alignment": 1, "bucket_alignment": 8}
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
        p.grad = None if g is None else g.clone()


def _masters(sd: dict) -> dict:
    """``{index: float32 master}`` of a consolidated dict (optbook.masters' layout:
    ``state[i]["master_param"]``)."""
    return {i: s["master_param"] for i, s in sd["state"].items() if "master_param" in s}


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
    masters = _masters(_consolidated_everywhere(opt, world_size))
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
    masters_after_load = _masters(_consolidated_everywhere(opt, world_size))
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
    dict); with ``resume`` it starts there, loading ``how`` = ``"consolidated"``, ``"sharded"`` (every
    rank's file), ``"own"`` (this rank's file of a save at the same world size) or ``"plain"`` (``resume["plain"]``: a single-process ``torch.optim.AdamW`` state dict)."""
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
        elif how == "own":
            opt.load_sharded_state_dict(resume["shards"][rank])
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
        out[name] = _error(lambda params=params: DistributedOptimizer(params, process_group=group, lr=0.01))
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
            report["scalar_own"] = scalar_run(r, size, g, resume=report["scalar_run"]["checkpoint"], how="own")
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
