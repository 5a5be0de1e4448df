"""Functions run on every rank by :func:`optbook.distributed.launch` for the chapters (12, 13, 16).

They live in a module (not a notebook cell) because ``launch`` starts fresh processes (``spawn``) that
import the function by name. Each takes ``(rank, world_size, ...)`` and returns picklable values. Rank
programs that only the tests run live in the tests (``tests/zero1_ranks.py``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..clipping import REPLICATED, clip_grad_norm_, get_grad_norm

__all__ = ["chapter_batch", "chapter_mlp", "clip_problem", "max_logits_now", "memory_chapter", "qk_clip_backward",
           "qk_clip_batch", "qk_clip_model", "sharded_clip_worker",
           "spread_over_ranks", "zero1_chapter", "zero1_grads", "zero1_mean_grads", "zero1_problem",
           "zero1_qk_clip", "zero1_reference", "zero1_train"]


def clip_problem(seed: int = 0, n_params: int = 6, dtype: torch.dtype = torch.float64
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The same parameters with gradients on every rank, drawn from ``seed``.

    Returns:
        ``(params, replicated)``: ``n_params`` tensors of shapes ``(3 + i, 2)`` for ``i = 0 .. n_params - 1``
        (the ones to shard), and one tensor of shape ``(4,)`` that every rank holds whole, marked
        ``optbook_replicated = True``. Every gradient is ``N(0, 1)`` entries of ``dtype``, so the global norm
        is about ``sqrt(number of entries)`` (a few units).
    """
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i in range(n_params):
        p = torch.zeros(3 + i, 2, dtype=dtype, requires_grad=True)
        p.grad = torch.randn(3 + i, 2, generator=gen, dtype=dtype)
        params.append(p)
    replicated = torch.zeros(4, dtype=dtype, requires_grad=True)
    replicated.grad = torch.randn(4, generator=gen, dtype=dtype)
    setattr(replicated, REPLICATED, True)
    return params, replicated


def sharded_clip_worker(rank: int, world_size: int, *, seed: int = 0, n_params: int = 6,
                        max_norm: float = 1.0, dtype: torch.dtype = torch.float64) -> dict:
    """Clip gradients sharded over the ranks and report the norms seen with and without the all-reduce.

    Every rank builds :func:`clip_problem` ``(seed, n_params, dtype)``, keeps the parameters it owns (rank
    ``r`` owns ``r, r + world_size, r + 2 * world_size, ...``) plus the replicated one, and clips them by the
    norm over the whole group (``torch.distributed.group.WORLD``).

    Returns:
        A dict of floats and CPU tensors:
        ``rank``; ``owned`` (indices of this rank's parameters);
        ``full_norm``: :func:`~optbook.clipping.get_grad_norm` of all parameters in this one process (the
        reference every rank can compute alone);
        ``local_norm``: the norm of this rank's parameters without ``group`` (what a rank sees if it forgets
        the all-reduce: too small, about ``1 / sqrt(world_size)`` of the true norm for equal shards);
        ``group_norm``: the norm of this rank's parameters with ``group=WORLD`` (equals ``full_norm``);
        ``unmarked_norm``: the same with the replicated parameter's mark removed (it is then counted once
        per rank, so the norm is too large);
        ``clip_norm``: what :func:`~optbook.clipping.clip_grad_norm_` returned (the norm before clipping);
        ``clipped``: the clipped gradients of the owned parameters, in ``owned`` order;
        ``clipped_replicated``: the clipped gradient of the replicated parameter.
    """
    params, replicated = clip_problem(seed, n_params, dtype)
    full_norm = get_grad_norm(params + [replicated])
    owned = list(range(rank, n_params, world_size))
    mine = [params[i] for i in owned] + [replicated]
    world = dist.group.WORLD
    local_norm = get_grad_norm(mine)
    group_norm = get_grad_norm(mine, group=world)
    unmarked = torch.zeros_like(replicated, requires_grad=True)
    unmarked.grad = replicated.grad.clone()
    unmarked_norm = get_grad_norm(mine[:-1] + [unmarked], group=world)
    clip_norm = clip_grad_norm_(mine, max_norm, group=world)
    return {"rank": rank, "owned": owned, "full_norm": full_norm.item(), "local_norm": local_norm.item(),
            "group_norm": group_norm.item(), "unmarked_norm": unmarked_norm.item(),
            "clip_norm": clip_norm.item(),
            "clipped": [params[i].grad for i in owned], "clipped_replicated": replicated.grad}


# --- ZeRO-1 (chapter 13 and tests/test_zero1.py) ---------------------------------------------------------
def zero1_problem(seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], list[dict]]:
    """Parameters and param groups that exercise the ZeRO-1 layout, the same on every rank for ``seed``.

    Returns:
        ``(params, groups)``: six leaf tensors of ``dtype`` with shapes ``(20, 15)`` (larger than a shard),
        ``(7,)``, ``(0, 3)`` (zero elements), ``(1,)``, ``(9, 4)``, ``(3,)``, entries ``k / 64`` with integer
        ``k`` in ``[-64, 64)`` (exact in bfloat16); and three groups that interleave relative to that order:
        ``[params[4], params[0]]`` (weight decay 0.1), ``[params[3]]`` (one element: fewer than the ranks;
        lr 0.05, no decay), ``[params[1], params[2], params[5]]`` (defaults).
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = [(20, 15), (7,), (0, 3), (1,), (9, 4), (3,)]
    params = [(torch.randint(-64, 64, s, generator=gen) / 64).to(dtype).requires_grad_() for s in shapes]
    groups = [{"params": [params[4], params[0]], "weight_decay": 0.1},
              {"params": [params[3]], "lr": 0.05, "weight_decay": 0.0},
              {"params": [params[1], params[2], params[5]]}]
    return params, groups


def zero1_mean_grads(params: list[torch.Tensor], step: int, seed: int = 0) -> list[torch.Tensor | None]:
    """The gradient of the whole batch at ``step`` (the same at every world size): what a single process
    would use. Entries ``k / 256`` with integer ``k`` in ``[-512, 512)`` in ``params``' dtype; ``params[5]``
    has none (``None``)."""
    gen = torch.Generator().manual_seed(100003 * seed + 1009 * step)
    grads = [(torch.randint(-512, 512, p.shape, generator=gen) / 256).to(p.dtype) for p in params]
    grads[5] = None
    return grads


def zero1_grads(params: list[torch.Tensor], step: int, rank: int, world_size: int, seed: int = 0, *,
                same_on_every_rank: bool = False) -> list[torch.Tensor | None]:
    """Rank ``rank``'s gradients at ``step``: their mean over the ``world_size`` ranks is exactly
    :func:`zero1_mean_grads` at every world size (all values are dyadic, so the sums are exact in any order).

    Rank ``r`` gets ``G + (r - (world_size - 1) / 2) * D`` (the deviations sum to zero), with ``G`` the mean
    gradient and ``D`` another draw of the same kind; ``params[1]`` gets ``world_size * G`` on rank 0 and no
    gradient (``None``) elsewhere; ``params[5]`` never has one. ``same_on_every_rank``: every rank gets ``G``
    (for bfloat16, where ``G + D`` would be rounded).
    """
    mean = zero1_mean_grads(params, step, seed)
    if same_on_every_rank:
        return mean
    gen = torch.Generator().manual_seed(100003 * seed + 1009 * step + 7)
    return spread_over_ranks(params, mean, gen, rank, world_size)


def spread_over_ranks(params, mean, gen, rank: int, world_size: int) -> list[torch.Tensor | None]:
    """Rank ``rank``'s share of the gradients ``mean``: ``g + (rank - (d - 1) / 2) D`` with a dyadic ``D``
    drawn from ``gen`` (so the mean over ranks is exactly ``g``); ``params[1]`` gets ``d g`` on rank 0 only."""
    out = []
    for i, (p, g) in enumerate(zip(params, mean)):
        d = (torch.randint(-512, 512, p.shape, generator=gen) / 256).to(p.dtype)
        if g is None:
            out.append(None)
        elif i == 1:
            out.append(world_size * g if rank == 0 else None)
        else:
            out.append(g + (rank - (world_size - 1) / 2) * d)
    return out


def _set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def zero1_train(rank: int, world_size: int, *, steps: int = 6, seed: int = 0, resume: dict | None = None,
                group=None, checkpoint_at: int = 3, bucket_size: int | None = 200,
                low_precision: bool = False, overflow_at: tuple = (), lr_change_at: int = 2,
                save_dir: str | None = None, resume_dir: str | None = None, own_file: bool = False) -> dict:
    """Train :func:`zero1_problem` with :class:`~optbook.distributed.DistributedOptimizer` (AdamW, lr 0.01).

    float64 (``low_precision=False``): each rank gets its own :func:`zero1_grads`. bfloat16 with a
    ``DynamicLossScaler(2**10, growth_interval=2, hysteresis=1)``: every rank gets the same gradient times
    the loss scale, and at each step in ``overflow_at`` the last rank's first gradient holds ``inf``.
    At step ``lr_change_at`` the first group's lr becomes 0.02 (as a scheduler would set it).

    Args:
        resume: ``None`` to start at step 0, or a checkpoint returned by an earlier call (any world size):
            the parameters and the consolidated optimizer state at step ``checkpoint_at``, from which this
            run continues.
        group: the process group (``None``: all processes); ``rank`` and ``world_size`` are this process's
            rank in it and its size (a subgroup as in the tests' rank programs).
        save_dir: also write a sharded checkpoint at step ``checkpoint_at`` into this existing directory:
            ``optim_rank{r}.pt`` (:meth:`~optbook.distributed.DistributedOptimizer.sharded_state_dict`) from
            every rank and ``model.pt`` (the parameters) from rank 0.
        resume_dir: start from the sharded checkpoint in this directory instead (saved at any world size):
            every rank loads the list of all ``optim_rank*.pt`` files (resharding), or with ``own_file``
            only ``optim_rank{rank}.pt`` (same world size only).

    Returns:
        ``{"params": final parameters, "state_dict": consolidated at the end (rank 0, else None),
        "checkpoint": {"params", "optimizer"} at ``checkpoint_at`` (on the last rank; None when resuming),
        "applied": whether each step was applied (``not found_inf``), "scales": loss scale after each step, "skipped_steps": int,
        "pieces": this rank's pieces, "memory": memory_bytes()}``.
    """
    from ..precision import DynamicLossScaler
    from .zero1 import DistributedOptimizer

    dtype = torch.bfloat16 if low_precision else torch.float64
    params, groups = zero1_problem(seed, dtype)
    scaler = DynamicLossScaler(2.0**10, growth_interval=2, hysteresis=1) if low_precision else None
    start = 0
    if resume_dir is not None:
        resume = {"params": torch.load(os.path.join(resume_dir, "model.pt"))}
    if resume is not None:
        with torch.no_grad():
            for p, saved in zip(params, resume["params"]):
                p.copy_(saved)
        start = checkpoint_at
    opt = DistributedOptimizer(groups, process_group=group, lr=0.01, bucket_size=bucket_size,
                               loss_scaler=scaler)
    if resume_dir is not None:
        if own_file:
            opt.load_sharded_state_dict(torch.load(os.path.join(resume_dir, f"optim_rank{rank}.pt")))
        else:
            saved_size = len([f for f in os.listdir(resume_dir) if f.startswith("optim_rank")])
            opt.load_sharded_state_dict([torch.load(os.path.join(resume_dir, f"optim_rank{r}.pt"))
                                         for r in range(saved_size)])
    elif resume is not None:
        opt.load_state_dict(resume["optimizer"])
    checkpoint, applied, scales = None, [], []
    for t in range(start, steps):
        if t == checkpoint_at and resume is None:
            opt.consolidate_state_dict(to=world_size - 1)
            if rank == world_size - 1:
                checkpoint = {"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict()}
            if save_dir is not None:
                torch.save(opt.sharded_state_dict(), os.path.join(save_dir, f"optim_rank{rank}.pt"))
                if rank == 0:
                    torch.save([p.detach().clone() for p in params], os.path.join(save_dir, "model.pt"))
        if t == lr_change_at:
            opt.param_groups[0]["lr"] = 0.02
        grads = zero1_grads(params, t, rank, world_size, seed, same_on_every_rank=low_precision)
        if low_precision:
            grads = [None if g is None else g * opt.loss_scale for g in grads]
            if t in overflow_at and rank == world_size - 1:
                grads[0][0, 0] = float("inf")
        _set_grads(params, grads)
        opt.step()
        applied.append(not opt.found_inf)
        scales.append(opt.loss_scale)
        opt.zero_grad()
    opt.consolidate_state_dict(to=0)
    return {"params": [p.detach() for p in params], "state_dict": opt.state_dict() if rank == 0 else None,
            "checkpoint": checkpoint, "applied": applied, "scales": scales,
            "skipped_steps": opt.skipped_steps,
            "pieces": opt.pieces, "memory": opt.memory_bytes()}


def chapter_mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Sequential:
    """The chapter's model: ``Linear(64, 256) - ReLU - Linear(256, 256) - ReLU - Linear(256, 10)`` (85 002
    parameters, the middle matrix 77 % of them), initialised from ``seed`` in ``dtype``."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dtype)
    torch.random.set_rng_state(gen_state)
    return model


def chapter_batch(seed: int = 0, n: int = 32, dtype: torch.dtype = torch.float64
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch for :func:`chapter_mlp`: inputs ``(n, 64)`` and targets ``(n, 10)``, N(0, 1)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n, 64, generator=gen, dtype=dtype), torch.randn(n, 10, generator=gen, dtype=dtype)


def _state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def zero1_chapter(rank: int, world_size: int, *, sizes: tuple = (2, 4), steps: int = 20,
                  seed: int = 0) -> dict:
    """Everything chapter 13 runs, in one launch: the checks below on the first ``d`` processes (a process
    group of ranks ``0 .. d - 1``) for each ``d`` in ``sizes`` (each at most ``world_size``).

    Returns:
        ``{d: report, or None on a process outside that group}``, a report being:

        1. ``"dyadic"``: the final parameters of :func:`zero1_train` (float64; its single-process twin
           :func:`zero1_reference` is exactly computable).
        2. ``"mlp"``: :func:`chapter_mlp` in float64 trained for ``steps`` steps on this rank's equal slice
           of :func:`chapter_batch` (mean squared error), DistributedOptimizer(AdamW, lr 1e-2, weight decay
           0.1, max_grad_norm 1.0); ``"norms"``: the pre-clip norm of each step.
        3. ``"ledger"``: ``memory_bytes()`` after one step of the bfloat16 model (float32 masters, dynamic
           loss scaling) with default alignment; ``"applied16"``: whether that step was applied.
        4. ``"zero_state"`` / ``"ours_state"``: optimizer-state bytes on this rank after one step of the
           float32 model, for ``torch.distributed.optim.ZeroRedundancyOptimizer(torch.optim.AdamW)`` (whole
           parameters per rank; gradients all-reduced by hand, mean) and for
           DistributedOptimizer(torch.optim.AdamW); ``"zero_vs_ours"``: the largest difference between
           their parameters after that step; ``"numel"``: the model's parameter count.
    """
    torch.set_num_threads(1)
    groups = {d: dist.group.WORLD if d == world_size else dist.new_group(list(range(d))) for d in sizes}
    out = {}
    for d in sizes:
        out[d] = _zero1_chapter_checks(rank, d, groups[d], steps, seed) if rank < d else None
        dist.barrier()
    return out


def _zero1_chapter_checks(rank: int, world_size: int, group, steps: int, seed: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ..precision import DynamicLossScaler
    from .zero1 import DistributedOptimizer

    out = {"dyadic": zero1_train(rank, world_size, group=group)["params"]}
    X, Y = chapter_batch(seed)
    n = X.shape[0] // world_size
    mine = slice(rank * n, (rank + 1) * n)

    model = chapter_mlp(seed)
    opt = DistributedOptimizer(model.parameters(), process_group=group, lr=1e-2, weight_decay=0.1,
                               max_grad_norm=1.0)
    norms = []
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(X[mine]), Y[mine]).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    out["mlp"], out["norms"] = [p.detach() for p in model.parameters()], norms

    model16 = chapter_mlp(seed, torch.bfloat16)
    opt16 = DistributedOptimizer(model16.parameters(), process_group=group, lr=1e-3,
                                 loss_scaler=DynamicLossScaler(2.0**8))
    loss = torch.nn.functional.mse_loss(model16(X[mine].bfloat16()).float(), Y[mine].float())
    opt16.scale_loss(loss).backward()
    opt16.step()
    out["applied16"] = not opt16.found_inf
    out["ledger"] = opt16.memory_bytes()

    ours_model, zero_model = chapter_mlp(seed, torch.float32), chapter_mlp(seed, torch.float32)
    ours = DistributedOptimizer(ours_model.parameters(), torch.optim.AdamW, group, lr=1e-3)
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), optimizer_class=torch.optim.AdamW,
                                   process_group=group, lr=1e-3)
    for m in (ours_model, zero_model):
        torch.nn.functional.mse_loss(m(X[mine].float()), Y[mine].float()).backward()
    for p in zero_model.parameters():  # what DistributedDataParallel would do
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world_size)
    ours.step()
    zero.step()
    out["ours_state"], out["zero_state"] = _state_bytes(ours.optimizer), _state_bytes(zero.optim)
    out["zero_vs_ours"] = max((a - b).abs().max().item()
                              for a, b in zip(ours_model.parameters(), zero_model.parameters()))
    out["numel"] = sum(p.numel() for p in model.parameters())
    return out


def zero1_reference(steps: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """The single-process twin of :func:`zero1_train` in float64: ``optbook.optim.AdamW`` (lr 0.01; the
    first group's lr 0.02 from step 2) on :func:`zero1_mean_grads`. Returns the final parameters."""
    from ..optim import AdamW

    params, groups = zero1_problem(seed)
    opt = AdamW(groups, lr=0.01)
    for t in range(steps):
        if t == 2:
            opt.param_groups[0]["lr"] = 0.02
        _set_grads(params, zero1_mean_grads(params, t, seed))
        opt.step()
    return [p.detach() for p in params]


def qk_clip_model(seed: int = 0) -> torch.nn.Module:
    """Chapter 13's QK-clip model: a one-layer, two-head bfloat16 :class:`~optbook.models.TinyTransformer`
    (vocabulary 16, width 16, sequences of 8), drawn from ``seed``, its query and key weights multiplied by 12 so
    that its max logits are a few units (a model whose logits have grown)."""
    from ..models import TinyTransformer

    torch.manual_seed(seed)
    model = TinyTransformer(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    with torch.no_grad():
        for name in ("q_proj", "k_proj"):
            getattr(model.layers[0].attn, name).weight.mul_(12.0)
    return model.to(torch.bfloat16)


def qk_clip_batch(seed: int = 0) -> torch.Tensor:
    """Chapter 13's token batch for :func:`qk_clip_model`: ``(8, 8)`` int64 tokens from ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, 16, (8, 8), generator=gen)


def qk_clip_backward(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    """One training forward (it records each head's max logit) and backward: next-token cross-entropy."""
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()


def max_logits_now(model: torch.nn.Module, tokens: torch.Tensor) -> list[float]:
    """Each head's max pre-softmax logit on ``tokens`` now (a training-mode forward, without gradients, whose
    recorded maxima are read and reset)."""
    from ..models import attention_modules

    with torch.no_grad():
        model(tokens[:, :-1])
    out = []
    for attn in attention_modules(model):
        out += [float(x) for x in attn.max_logits]
        attn.max_logits = None
    return out


def zero1_qk_clip(rank: int, world_size: int, *, seed: int = 0, tau_fraction: float = 0.6,
                  lr: float = 1e-2, bucket_size: int = 512) -> dict:
    """Chapter 13: QK-clip after a ZeRO-1 step of a bfloat16 model, against the single-process
    mixed-precision run.

    Every rank builds :func:`qk_clip_model` and trains it on :func:`qk_clip_batch` (the same batch on every
    rank, so the mean gradient is each rank's own) with ``DistributedOptimizer(AdamW, lr, weight decay 0.1)``,
    buckets of ``bucket_size`` elements and small alignments (1 and 4): at 3 ranks the query and the key
    weights are each cut across two ranks' float32 master shards. The reference is ``MixedPrecisionOptimizer(AdamW)`` on a copy in the same process. Step 0: a
    step, then ``qk_clip_`` with ``tau = tau_fraction`` times the largest max logit of step 0. Step 1: a
    step with ``lr`` 0 (only the copy of the masters into the weights). Step 2: a checkpoint
    (``sharded_state_dict``), a step, and the same step from a second model and optimizer loaded from the
    checkpoint.

    Returns:
        ``"q_pieces"``: ``(first, last + 1)`` element ranges of the flattened query weight in this rank's
        shard; ``"tau"``; ``"before"``, ``"clipped"``, ``"after_lr0"``: each head's max logit after step 0,
        after the clip, after step 1; ``"lr0_unchanged"``: step 1 left every weight bitwise as the clip did;
        ``"masters_match"``, ``"weights_match"``: this rank's master pieces and the model's weights equal
        the reference's bitwise after steps 0 and 1 and after step 2; ``"resumed_match"``: the resumed
        step gave bitwise the same weights.
    """
    import copy

    from ..models import attention_modules
    from ..optim import AdamW
    from ..precision import MixedPrecisionOptimizer
    from ..qk_clip import qk_clip_
    from .zero1 import DistributedOptimizer

    torch.set_num_threads(1)
    model, tokens = qk_clip_model(seed), qk_clip_batch(seed)
    ref_model = copy.deepcopy(model)
    layout = {"param_alignment": 1, "bucket_alignment": 4, "bucket_size": bucket_size}
    opt = DistributedOptimizer(model.parameters(), AdamW, lr=lr, weight_decay=0.1, **layout)
    ref = MixedPrecisionOptimizer(AdamW(ref_model.parameters(), lr=lr, weight_decay=0.1))
    params, ref_masters = list(model.parameters()), ref.master_params()
    q_index = next(i for i, p in enumerate(params) if p is model.layers[0].attn.q_proj.weight)

    def step_both():
        for m, o in ((model, opt), (ref_model, ref)):
            m.zero_grad(set_to_none=True)
            qk_clip_backward(m, tokens)
            o.step()

    def master_piece(piece):  # the piece's range in this rank's float32 master shard
        offset = piece.buffer_start - opt.layout.buckets[piece.bucket].shard(rank)[0]
        return opt.master_shards[piece.bucket][offset:offset + piece.numel]

    def agree() -> tuple[bool, bool]:
        masters = all(torch.equal(master_piece(piece), ref_masters[piece.index].detach().reshape(-1)[
            piece.param_start:piece.param_end]) for piece in opt.pieces)
        weights = all(torch.equal(p, q) for p, q in zip(params, ref_model.parameters()))
        return masters, weights

    step_both()
    for m in (model, ref_model):  # the stepped models' own maxima (a training forward records them)
        for a in attention_modules(m):
            a.max_logits = None   # drop the running maxima of step 0's forward, taken before the step
        with torch.no_grad():
            m(tokens[:, :-1])
    before = [float(x) for a in attention_modules(model) for x in a.max_logits]
    tau = tau_fraction * max(before)
    qk_clip_(model, tau)            # every rank: an all-reduce (max) of the maxima, then each scales its pieces
    qk_clip_(ref_model, tau)        # the same maxima (same weights, same batch), all-reduced alike
    clipped_weights = [p.detach().clone() for p in params]
    clipped = max_logits_now(model, tokens)
    max_logits_now(ref_model, tokens)
    for o in (opt, ref):
        for g in o.param_groups:
            g["lr"] = 0.0
    step_both()
    lr0_unchanged = all(torch.equal(p, c) for p, c in zip(params, clipped_weights))
    after_lr0 = max_logits_now(model, tokens)
    max_logits_now(ref_model, tokens)
    agree_01 = agree()

    for o in (opt, ref):
        for g in o.param_groups:
            g["lr"] = lr
    shards = [None] * world_size
    dist.all_gather_object(shards, opt.sharded_state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = DistributedOptimizer(resumed_model.parameters(), AdamW, lr=lr, weight_decay=0.1, **layout)
    resumed.load_sharded_state_dict(shards)
    step_both()
    resumed_model.zero_grad(set_to_none=True)
    qk_clip_backward(resumed_model, tokens)
    resumed.step()
    agree_2 = agree()
    q_pieces = [(p.param_start, p.param_end) for p in opt.pieces if p.index == q_index]
    return {"q_pieces": q_pieces, "tau": tau, "before": before, "clipped": clipped, "after_lr0": after_lr0,
            "lr0_unchanged": lr0_unchanged, "masters_match": agree_01[0] and agree_2[0],
            "weights_match": agree_01[1] and agree_2[1],
            "resumed_match": all(torch.equal(p, q) for p, q in zip(params, resumed_model.parameters()))}


def memory_chapter(rank: int, world_size: int, *, seed: int = 0) -> dict:
    """What chapter 16 measures on ``world_size`` processes: :func:`chapter_mlp` in bfloat16 under
    DistributedOptimizer(AdamW) after one step and ``zero_grad()``, counted by :func:`optbook.memory.measure`.

    Returns:
        ``{"megatron": ..., "unpadded": ...}``: for Megatron's alignments (64, 128) and for alignments of 1
        (no padding when ``world_size`` divides the element count), each ``{"bytes": role -> int,
        "numel": real parameter elements, "buffer_numel": elements of the flat buffer, "shard_numel":
        elements of this rank's shard, "state_numel": elements this rank's AdamW state covers,
        "applied": whether the step was applied}``.
    """
    from ..memory import measure
    from .zero1 import DistributedOptimizer

    torch.set_num_threads(1)
    X, Y = chapter_batch(seed)
    n = X.shape[0] // world_size
    mine = slice(rank * n, (rank + 1) * n)
    out = {}
    for name, align in (("megatron", (64, 128)), ("unpadded", (1, 1))):
        model = chapter_mlp(seed, torch.bfloat16)
        opt = DistributedOptimizer(model.parameters(), lr=1e-3, param_alignment=align[0],
                                   bucket_alignment=align[1])
        torch.nn.functional.mse_loss(model(X[mine].bfloat16()).float(), Y[mine].float()).backward()
        opt.step()
        applied = not opt.found_inf
        opt.zero_grad()
        (bucket,) = opt.layout.buckets
        out[name] = {"bytes": measure(opt).bytes, "numel": sum(p.numel() for p in model.parameters()),
                     "buffer_numel": bucket.numel, "shard_numel": bucket.shard_numel,
                     "state_numel": sum(piece.numel for piece in opt.pieces), "applied": applied}
    return out
