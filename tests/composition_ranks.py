"""The composition matrix's problem, wrappers, features and rank programs (used by tests/test_composition.py).

One cell is (wrapper, optimizer, feature): a wrapper built over a small transformer for one optimizer
(AdamW, Muon, or a Muon + AdamW chain), trained for ``STEPS`` steps with one feature switched on. The same
steps are run by the *reference*: the plain single-process optimizer (``optbook.optim.AdamW``, ``Muon`` or
``ChainedOptimizer([Muon, AdamW])``) with the feature applied the plain way (``clip_grad_norm_`` before the
step, ``qk_clip_`` after it, ``LambdaLR``, micro-batch gradients summed in ``.grad``, a skipped step where
the loss scaler must skip). :func:`run_cell` runs one cell on one rank (the distributed wrappers run under
``optbook.distributed.launch``; this module is importable by the spawned processes because ``tests/`` is on
the ``sys.path`` they inherit), :func:`reference_run` the reference.

The wrappers and how each is built are :data:`BUILDERS` (one function each). The features are
:data:`FEATURES` (one :class:`Plan` each) and the functions the driver :func:`train` calls for them.
"""

from __future__ import annotations

import copy
import datetime
import io
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import scaled_timeout
from torch import nn

from optbook.clipping import clip_grad_norm_
from optbook.distributed import DistributedChain, DistributedMuon, DistributedOptimizer, LayerWiseMuon
from optbook.memory import OffloadOptimizer
from optbook.models import TinyTransformer, attention_modules
from optbook.optim import AdamW, ChainedOptimizer, Muon, muon_param_groups
from optbook.optim.param_groups import weight_decay_param_groups
from optbook.precision import DynamicLossScaler, MixedPrecisionOptimizer, take_up_
from optbook.qk_clip import qk_clip_

STEPS = 4
SPLIT_AT = 2          # resume: steps run before the checkpoint; outside writes: before this step
OVERFLOW_AT = 1       # the loss-scaler feature puts an inf into a gradient at this step (rank 0 only)
BATCH, SEQ, VOCAB = 12, 4, 16   # 12 sequences: equal shares for 1, 2, 3 ranks times 2 micro-batches
TAU = 1.0             # QK-clip threshold; the initial weights (std 0.4) give max logits of 2-5
MAX_GRAD_NORM = 0.5   # global clip; the gradient norms of the problem are about 2-3, so it always acts
WORLD_SIZES = (2, 3)  # the resume feature saves at the first and continues at the second

OPTIMIZERS = ("AdamW", "Muon", "Muon + AdamW")
ADAMW_OPTIONS = {"betas": (0.9, 0.95), "eps": 1e-8}
MUON_OPTIONS = {"momentum": 0.95, "nesterov": True, "ns_dtype": torch.float64}
ADAMW_LRS, MUON_LRS = (0.01, 0.003), (0.02, 0.01)   # per-group base rates (decayed / not; whole / per head)
#: Small ZeRO-1 alignments, so matrices are cut across ranks.
LAYOUT = {"param_alignment": 1, "bucket_alignment": 4}


# --- the problem --------------------------------------------------------------------------------------------
class CompositionModel(TinyTransformer):
    """A one-layer, two-head TinyTransformer (d_model 8) with a 0-dim ``temperature`` multiplying the logits."""

    def __init__(self):
        super().__init__(VOCAB, d_model=8, n_layers=1, n_heads=2, max_seq_len=SEQ, mlp_ratio=2)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.temperature


@torch.no_grad()
def make_model(seed: int, dtype: torch.dtype) -> CompositionModel:
    """Matrices N(0, 0.4^2) (max logits 2-5, above ``TAU``), gains 1 + N(0, 0.1^2), temperature 1 + N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    model = CompositionModel()
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.copy_(noise * 0.4 if p.ndim == 2 else 1 + 0.1 * noise)
    return model.to(dtype).train()


def backward(model: nn.Module, step: int, rank: int, world_size: int, accum: int, scale: float) -> None:
    """Gradients of ``scale`` times this rank's mean loss at ``step``, from ``accum`` micro-batches summed in
    ``.grad``. The global batch is fixed per step; rank ``r`` of ``d`` takes the ``r``-th ``1/d`` of it."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    per = BATCH // (world_size * accum)
    for k in range(accum):
        lo = (rank * accum + k) * per
        logits = model(tokens[lo:lo + per, :-1])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[lo:lo + per, 1:].flatten())
        (loss * (scale / accum)).backward()   # scale / accum: a power of two, exact


def _plain(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "param_names"} for g in groups]


def optimizer_groups(model: nn.Module, kind: str) -> tuple[list[dict], list[dict]]:
    """``(Muon groups, AdamW groups)`` for ``kind``, each group with its own base ``lr``. AdamW alone takes
    every parameter (decayed matrices, the rest undecayed); Muon alone the 2-D hidden weights (the others
    stay fixed); the chain routes with :func:`optbook.optim.muon_param_groups` (Q/K/V split per head)."""
    if kind == "AdamW":
        return [], _plain([{**g, "lr": lr} for g, lr in zip(weight_decay_param_groups(model, 0.1), ADAMW_LRS)])
    routing = muon_param_groups(model, weight_decay=0.1, split="head")
    muon = _plain([{**g, "lr": lr} for g, lr in zip(routing.muon, MUON_LRS)])
    adamw = _plain([{**g, "lr": lr} for g, lr in zip(routing.adamw, ADAMW_LRS)])
    return muon, (adamw if kind == "Muon + AdamW" else [])


def plain_optimizer(model: nn.Module, kind: str, **chain_options) -> torch.optim.Optimizer:
    """The single-process optimizer of ``kind`` (the reference, and what the single-process wrappers wrap)."""
    muon, adamw = optimizer_groups(model, kind)
    if kind == "AdamW":
        return AdamW(adamw, **ADAMW_OPTIONS)
    if kind == "Muon":
        return Muon(muon, **MUON_OPTIONS)
    return ChainedOptimizer([Muon(muon, **MUON_OPTIONS), AdamW(adamw, **ADAMW_OPTIONS)], **chain_options)


def group_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


# --- the features -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What one feature switches on (the default: nothing, the base run)."""

    accum: int = 1
    max_grad_norm: float | None = None
    loss_scaler: bool = False
    schedule: bool = False
    qk_clip: bool = False
    outside_write: str | None = None   # a key of OUTSIDE_WRITES, done before step SPLIT_AT
    resume: bool = False


FEATURES = {
    "QK-clip": Plan(qk_clip=True),
    "global clip": Plan(max_grad_norm=MAX_GRAD_NORM),
    "loss scaler": Plan(loss_scaler=True),
    "LR schedule": Plan(schedule=True),
    "grad accumulation": Plan(accum=2),
    "resume at another world size": Plan(resume=True),
    "weights-only load": Plan(outside_write="load"),
    "in-place edit": Plan(outside_write="edit"),
}


def lr_factor(step: int) -> float:
    """The one schedule, applied to every group's own base rate: halve at each step."""
    return 0.5 ** step


def make_loss_scaler() -> DynamicLossScaler:
    """Grows after every clean step and backs off at the injected overflow: 2^10 -> 2^11 -> 2^10 -> 2^11 -> 2^12."""
    return DynamicLossScaler(2.0 ** 10, growth_interval=1, hysteresis=1)


def expected_loss_scale() -> float:
    scaler = make_loss_scaler()
    for t in range(STEPS):
        scaler.update(t == OVERFLOW_AT)
    return scaler.scale


@torch.no_grad()
def inject_overflow(model: nn.Module) -> None:
    model.layers[0].mlp[0].weight.grad[0, 0] = float("inf")


@torch.no_grad()
def load_other_weights(model: nn.Module) -> list[torch.Tensor]:
    """A weights-only ``model.load_state_dict`` of another initialisation; returns the parameters written."""
    model.load_state_dict(make_model(1, next(model.parameters()).dtype).state_dict())
    return list(model.parameters())


@torch.no_grad()
def halve_one_weight(model: nn.Module) -> list[torch.Tensor]:
    """A user's in-place edit of one hidden weight (stepped by every optimizer kind)."""
    w = model.layers[0].mlp[0].weight
    w.mul_(0.5)
    return [w]


OUTSIDE_WRITES = {"load": load_other_weights, "edit": halve_one_weight}


def train(model: nn.Module, runner, plan: Plan, steps, rank: int = 0, world_size: int = 1) -> None:
    """The training loop every cell and every reference runs; ``runner`` steps (the wrapper or the plain
    optimizer) and applies QK-clip its way."""
    sched = torch.optim.lr_scheduler.LambdaLR(runner.opt, lr_factor) if plan.schedule else None
    for t in steps:
        if plan.outside_write and t == SPLIT_AT:
            runner.after_outside_write(OUTSIDE_WRITES[plan.outside_write](model))
        model.zero_grad(set_to_none=True)
        backward(model, t, rank, world_size, plan.accum, runner.loss_scale())
        overflow = plan.loss_scaler and t == OVERFLOW_AT
        if overflow and rank == 0:
            inject_overflow(model)
        runner.step(overflow)
        if sched is not None and not overflow:
            sched.step()
        if plan.qk_clip:
            runner.clipped_heads += runner.qk_clip()


# --- the reference: the plain optimizer, the features applied the plain way ---------------------------------
class Reference:
    """The plain optimizer over ``master`` (the model itself in float64; for a bfloat16 model, a float32
    copy whose values are rounded into the model after each step: mixed precision done by hand)."""

    def __init__(self, model: nn.Module, master: nn.Module, kind: str, plan: Plan):
        self.model, self.master, self.plan = model, master, plan
        self.opt = plain_optimizer(master, kind)
        self.pairs = [] if master is model else list(zip(model.parameters(), master.parameters()))
        self.clipped_heads = 0
        self.norms: list[float] = []

    def loss_scale(self) -> float:
        return 1.0

    @torch.no_grad()
    def step(self, overflow: bool) -> None:
        if overflow:
            return
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
        if self.plan.max_grad_norm is not None:
            self.norms.append(float(clip_grad_norm_(group_params(self.opt), self.plan.max_grad_norm)))
        self.opt.step()
        self._round_into_model()

    def _round_into_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

    @torch.no_grad()
    def qk_clip(self) -> int:
        for a, b in zip(attention_modules(self.model), attention_modules(self.master)):
            if a is not b:
                b.max_logits, a.max_logits = a.max_logits, None
        report = qk_clip_(self.master, TAU)
        self._round_into_model()
        return len(report)

    @torch.no_grad()
    def after_outside_write(self, written) -> None:
        ids = {id(p) for p in written}
        for p, m in self.pairs:  # the documented rule for a float32 copy of a bfloat16 weight
            if id(p) in ids:
                take_up_(m, p)


def reference_run(kind: str, plan: Plan, low_precision: bool) -> dict:
    """The reference of a cell: ``{"params", "masters" (group order), "norms", "lrs", "clipped_heads"}``."""
    model = make_model(0, torch.bfloat16 if low_precision else torch.float64)
    master = copy.deepcopy(model).float() if low_precision else model
    ref = Reference(model, master, kind, plan)
    train(model, ref, plan, range(STEPS))
    return {"params": snapshot(model.parameters()), "masters": snapshot(group_params(ref.opt)),
            "norms": ref.norms, "lrs": [g["lr"] for g in ref.opt.param_groups], "clipped_heads": ref.clipped_heads}


def snapshot(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


# --- the wrappers: one builder each ---------------------------------------------------------------------------
@dataclass
class Built:
    """A wrapper ready to step: ``masters`` reads its own copies (group order) when it keeps them;
    ``clip_outside``: the global clip is ``clip_grad_norm_`` on the model's gradients before ``step()``."""

    opt: torch.optim.Optimizer
    masters: Callable[[], list] | None = None
    clip_outside: bool = False


def _options(plan: Plan, scaler, clip: bool = True) -> dict:
    """The feature arguments a wrapper takes: ``loss_scaler`` and ``max_grad_norm``, only when switched on."""
    out = {} if scaler is None else {"loss_scaler": scaler}
    if clip and plan.max_grad_norm is not None:
        out["max_grad_norm"] = plan.max_grad_norm
    return out


def build_mixed_precision(model, kind, plan, group, scaler) -> Built:
    opt = MixedPrecisionOptimizer(plain_optimizer(model, kind), **_options(plan, scaler))
    return Built(opt, opt.master_params)


def build_chained(model, kind, plan, group, scaler) -> Built:
    muon, adamw = optimizer_groups(model, kind)
    members = ([Muon(muon, **MUON_OPTIONS)] if muon else []) + ([AdamW(adamw, **ADAMW_OPTIONS)] if adamw else [])
    return Built(ChainedOptimizer(members, **_options(plan, scaler)))


def _offload(groups, cls, options, scaler) -> OffloadOptimizer:
    return OffloadOptimizer(groups, cls, offload_fraction=0.5, **options, **_options(Plan(), scaler))


def build_offload(model, kind, plan, group, scaler) -> Built:
    """Half of the elements stepped on the host; the chain is a ChainedOptimizer of two OffloadOptimizers
    (it clips); alone, OffloadOptimizer has no ``max_grad_norm`` and the model's gradients are clipped."""
    muon, adamw = optimizer_groups(model, kind)
    members = ([_offload(muon, Muon, MUON_OPTIONS, scaler)] if muon else []) + \
              ([_offload(adamw, AdamW, ADAMW_OPTIONS, scaler)] if adamw else [])
    if len(members) == 1:
        return Built(members[0], members[0].master_params, clip_outside=True)
    chain = ChainedOptimizer(members, **_options(plan, None))
    return Built(chain, lambda: [t for m in members for t in m.master_params()])


def _zero1(groups, plan, group, scaler, clip=True) -> DistributedOptimizer:
    return DistributedOptimizer(groups, AdamW, process_group=group, **LAYOUT, **ADAMW_OPTIONS,
                                **_options(plan, scaler, clip))


def build_zero1(model, kind, plan, group, scaler) -> Built:
    """ZeRO-1 steps element-wise optimizers only: Muon and the chain are passed as ``optimizer_class``."""
    muon, adamw = optimizer_groups(model, kind)
    if kind == "AdamW":
        return Built(_zero1(adamw, plan, group, scaler))
    cls = Muon if kind == "Muon" else ChainedOptimizer
    return Built(DistributedOptimizer(muon + adamw, cls, process_group=group, **LAYOUT, **_options(plan, scaler)))


def _layerwise(groups, plan, group, scaler, clip=True) -> LayerWiseMuon:
    return LayerWiseMuon(groups, process_group=group, **MUON_OPTIONS, **_options(plan, scaler, clip))


def _moonlight(groups, plan, group, scaler, clip=True) -> DistributedMuon:
    return DistributedMuon(groups, process_group=group, gather_dtype=torch.float64, **LAYOUT, **MUON_OPTIONS,
                           **_options(plan, scaler, clip))


def _distributed_chain(muon_member, model, plan, group, scaler) -> Built:
    """``DistributedChain(muon member, ZeRO-1 AdamW)``: the members without clip or scaler, the chain with them."""
    muon, adamw = optimizer_groups(model, "Muon + AdamW")
    members = muon_member(muon, plan, group, None, clip=False), _zero1(adamw, plan, group, None, clip=False)
    return Built(DistributedChain(*members, **_options(plan, scaler)))


def build_layerwise_muon(model, kind, plan, group, scaler) -> Built:
    return Built(_layerwise(optimizer_groups(model, kind)[0], plan, group, scaler))


def build_distributed_muon(model, kind, plan, group, scaler) -> Built:
    if kind == "Muon + AdamW":
        return _distributed_chain(_moonlight, model, plan, group, scaler)
    return Built(_moonlight(optimizer_groups(model, kind)[0], plan, group, scaler))


def build_distributed_chain(model, kind, plan, group, scaler) -> Built:
    return _distributed_chain(_layerwise, model, plan, group, scaler)


#: wrapper -> (builder, the optimizer kinds it applies to, distributed?)
BUILDERS = {
    "MixedPrecisionOptimizer": (build_mixed_precision, OPTIMIZERS, False),
    "DistributedOptimizer (ZeRO-1)": (build_zero1, OPTIMIZERS, True),
    "LayerWiseMuon": (build_layerwise_muon, ("Muon",), True),
    "DistributedMuon": (build_distributed_muon, ("Muon", "Muon + AdamW"), True),
    "DistributedChain": (build_distributed_chain, ("Muon + AdamW",), True),
    "OffloadOptimizer": (build_offload, OPTIMIZERS, False),
    "ChainedOptimizer": (build_chained, OPTIMIZERS, False),
}

#: The wrapper kept in bfloat16 with float32 masters; every other runs in float64.
LOW_PRECISION = {"MixedPrecisionOptimizer"}


# --- one cell on one rank -------------------------------------------------------------------------------------
MISSING = "<missing>"


class WrapperRunner:
    """Steps a :class:`Built` wrapper and records what the step contract says it reports."""

    def __init__(self, built: Built, model: nn.Module, plan: Plan, group, scaler):
        self.built, self.opt, self.model, self.plan = built, built.opt, model, plan
        self.group, self.scaler = group, scaler
        self.clipped_heads = 0
        self.record = {"returned": [], "found_inf": [], "last_grad_norm": []}

    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def step(self, overflow: bool) -> None:
        if self.built.clip_outside and self.plan.max_grad_norm is not None:
            clip_grad_norm_(group_params(self.opt), self.plan.max_grad_norm)
        self.record["returned"].append(self.opt.step())
        for key in ("found_inf", "last_grad_norm"):
            self.record[key].append(getattr(self.opt, key, MISSING))

    def qk_clip(self) -> int:
        return len(qk_clip_(self.model, TAU, process_group=self.group))

    def after_outside_write(self, written) -> None:
        """Nothing: the wrapper must see the write itself."""


def _save(opt, rank: int):
    """The optimizer's checkpoint (consolidated on rank 0 for a distributed wrapper; a collective)."""
    if isinstance(opt, DistributedChain):
        return [_save(member, rank) for member in (opt.muon, opt.adamw)]
    if hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if rank == 0 else None
    return opt.state_dict()


def _load(opt, state) -> None:
    if isinstance(opt, DistributedChain):
        for member, s in zip((opt.muon, opt.adamw), state):
            _load(member, s)
    else:
        opt.load_state_dict(state)


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _build(wrapper, kind, plan, model, group):
    builder, _, _ = BUILDERS[wrapper]
    scaler = make_loss_scaler() if plan.loss_scaler else None
    built = builder(model, kind, plan, group, scaler)
    return WrapperRunner(built, model, plan, group, scaler)


def _result(runner: WrapperRunner, model: nn.Module) -> dict:
    opt = runner.opt
    masters = runner.built.masters
    return {"params": snapshot(model.parameters()), "masters": None if masters is None else snapshot(masters()),
            **runner.record, "skipped_steps": getattr(opt, "skipped_steps", MISSING),
            "lrs": [g["lr"] for g in opt.param_groups],
            "scale": None if runner.scaler is None else runner.scaler.scale, "clipped_heads": runner.clipped_heads}


AGREE_ERROR = "another rank failed to build or load this cell"


def _agree(group, error: Exception | None) -> None:
    """Raise on every rank when building or loading failed on one (a rank that went on alone would leave the
    others waiting in the first collective of the step)."""
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([0.0 if error is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if error is None and flag.item():
            raise RuntimeError(AGREE_ERROR)
    if error is not None:
        raise error


def _start(wrapper, kind, plan, model, group, state=None) -> WrapperRunner:
    """The wrapper over ``model``, loaded with ``state`` when given; every rank succeeds or every rank raises."""
    runner, error = None, None
    try:
        runner = _build(wrapper, kind, plan, model, group)
        if state is not None:
            _load(runner.opt, state)
    except Exception as e:  # noqa: BLE001 -- re-raised by _agree
        error = e
    _agree(group, error)
    return runner


def run_cell(wrapper: str, kind: str, feature: str, rank: int = 0, world_size: int = 1, group=None,
             checkpoint: str | None = None, phase: str = "all") -> dict:
    """One cell on this rank: ``{"error": (type, message)}`` or :func:`_result`'s dict.

    ``phase``: ``"all"`` (every step; a single-process resume saves after ``SPLIT_AT`` steps and continues
    in a fresh model and wrapper), ``"save"`` (steps before ``SPLIT_AT``, then the checkpoint is written to
    the file ``checkpoint``) or ``"resume"`` (a fresh model and wrapper load that file and run the rest)."""
    plan = FEATURES[feature]
    dtype = torch.bfloat16 if wrapper in LOW_PRECISION else torch.float64
    stage = "build"
    try:
        if phase == "resume":
            saved = torch.load(checkpoint, weights_only=False)
        else:
            model = make_model(0, dtype)
            runner = _start(wrapper, kind, plan, model, group)
            stage = "train"
            train(model, runner, plan, range(SPLIT_AT if plan.resume else STEPS), rank, world_size)
            if not plan.resume:
                return _result(runner, model)
            saved = {"model": model.state_dict(), "optimizer": _save(runner.opt, rank)}
            if phase == "save":
                if rank == 0:
                    torch.save(saved, checkpoint)
                return {"saved": True}
            saved = _roundtrip(saved)
        stage = "build"
        model = make_model(1, dtype)   # another initialisation: every value must come from the checkpoint
        model.load_state_dict(saved["model"])
        runner = _start(wrapper, kind, plan, model, group, saved["optimizer"])
        stage = "train"
        train(model, runner, plan, range(SPLIT_AT, STEPS), rank, world_size)
        return _result(runner, model)
    except Exception as e:  # noqa: BLE001 -- a refusal or a failure is the cell's result
        return {"error": (type(e).__name__, str(e)), "stage": stage}


def distributed_cells() -> list[tuple[str, str, str]]:
    return [(w, k, f) for w, (_, kinds, distributed) in BUILDERS.items() if distributed for k in kinds
            for f in FEATURES]


def cell_file(directory: str, world_size: int, index: int, rank: int) -> str:
    return os.path.join(directory, f"w{world_size}-cell{index}-rank{rank}.pt")


def checkpoint_file(directory: str, index: int) -> str:
    return os.path.join(directory, f"checkpoint-cell{index}.pt")


#: Seconds a collective of one cell waits. A wrapper that raises during a step on some ranks only leaves the
#: others waiting in a collective of that cell's own process group; they give up after this, and every rank
#: meets the others in a barrier (on a group that waits longer) before the next cell, so the suite goes on.
CELL_TIMEOUT = scaled_timeout(20.0)


def distributed_suite(rank: int, world_size: int, directory: str) -> None:
    """Every cell of :func:`distributed_cells` at this world size, each on its own process group (all made
    first); each result is written to :func:`cell_file` as soon as it is known. At ``WORLD_SIZES[0]`` the
    resume cells save their checkpoint into ``directory``; at ``WORLD_SIZES[1]`` they load it and continue."""
    torch.set_num_threads(1)
    cells = distributed_cells()
    timeout = datetime.timedelta(seconds=CELL_TIMEOUT)
    groups = [dist.new_group(list(range(world_size)), timeout=timeout) for _ in cells]
    between = dist.new_group(list(range(world_size)), timeout=6 * timeout)
    for index, ((wrapper, kind, feature), group) in enumerate(zip(cells, groups)):
        phase, path = "all", None
        if FEATURES[feature].resume:
            phase = "save" if world_size == WORLD_SIZES[0] else "resume"
            path = checkpoint_file(directory, index)
            if phase == "resume" and not os.path.exists(path):
                continue   # the save failed: its error is the cell's result
        result = run_cell(wrapper, kind, feature, rank, world_size, group, path, phase)
        torch.save(result, cell_file(directory, world_size, index, rank))
        dist.barrier(group=between)


# --- the rank program of tests/test_composition_matrix.py ---------------------------------------------------
def matrix_rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"matrix-rank{rank}.pt")


def matrix_checkpoint_file(directory: str, index: int) -> str:
    return os.path.join(directory, f"matrix-checkpoint-{index}.pt")


def matrix_suite(rank: int, world_size: int, directory: str) -> None:
    """Every distributed cell of the composition matrix (``composition_matrix.distributed_cells``) on this
    rank, each on a process group of its own (made just before it, in the same order on every rank: a cell
    that leaves one rank waiting gives up after :data:`CELL_TIMEOUT`, and the ranks meet in a barrier on a
    group that waits longer before the next cell). The outcomes so far are written to
    :func:`matrix_rank_file` after each cell."""
    from composition_matrix import distributed_cells, run_distributed_cell

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=CELL_TIMEOUT)
    between = dist.new_group(list(range(world_size)), timeout=6 * timeout)
    outcomes = {}
    for index, (opt_name, wrapper, feature) in enumerate(distributed_cells()):
        group = dist.new_group(list(range(world_size)), timeout=timeout)
        outcomes[(opt_name, wrapper, feature)] = run_distributed_cell(
            opt_name, wrapper, feature, rank, group, matrix_checkpoint_file(directory, index))
        torch.save(outcomes, matrix_rank_file(directory, rank))
        dist.barrier(group=between)
