"""Rank programs of tests/test_qk_clip_distributed.py: QK-clip (MuonClip) in a data-parallel stack.

Each rank trains a hybrid model (:func:`hybrid_model`: a GQA layer, a layer without attention, an MLA layer
and an MQA layer, so 4, 2 and 8 heads) on its own share of every step's batch, in micro-batches, with every
block's activations recomputed in the backward (``torch.utils.checkpoint``), then steps its optimizer
(ZeRO-1's :class:`~optbook.distributed.DistributedOptimizer`, or ``FSDP2Muon`` + AdamW on ``fully_shard``
parameters) and calls ``qk_clip_``. In the same process, the single-process MuonClip runs on a plain copy:
the same micro-batches of every rank in turn, no recompute, ``optbook.optim`` optimizers (bfloat16: in
:class:`~optbook.precision.MixedPrecisionOptimizer`), ``qk_clip_`` after each step. Its maxima are the
whole batch's by construction, so the all-reduce its ``qk_clip_`` makes (the process group is initialised)
meets the same values on every rank and changes nothing.

``launch`` imports these functions by name in the spawned processes (``tests/`` is on their ``sys.path``).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from optbook.distributed.wire import CommCounter
from optbook.models import TinyTransformer, attention_modules
from optbook.models.transformer import Block
from optbook.qk_clip import clipped_blocks, qk_clip_

VOCAB, SEQ, WIDTH = 16, 8, 16
#: Heads of the attention layers of :func:`hybrid_model`, in order (GQA, MLA, MQA).
HEADS = (4, 2, 8)
#: The clip threshold; the query and key weights are scaled so that some heads exceed it at every step.
TAU = 5.0
STEPS = 3
MAX = int(dist.ReduceOp.RedOpType.MAX)


class MlpOnly(nn.Module):
    """A residual MLP block without attention (the linear / Mamba layers of a hybrid stack)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.norm = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model, bias=False), nn.GELU(),
                                 nn.Linear(2 * d_model, d_model, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Recompute(nn.Module):
    """``block`` whose activations are recomputed in the backward (``torch.utils.checkpoint``): the backward
    runs the block's forward a second time, recording its max logits again."""

    def __init__(self, block: nn.Module, use_reentrant: bool = False):
        super().__init__()
        self.block, self.use_reentrant = block, use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=self.use_reentrant)


def hybrid_model(dtype: torch.dtype = torch.float64) -> TinyTransformer:
    """Four blocks: GQA (4 query heads, 2 key heads), an MLP without attention, MLA (2 heads), MQA (8 query
    heads, 1 key head); the query and key weights multiplied by 20 (MLA's by 60): logits of a few units."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=VOCAB, d_model=WIDTH, n_layers=4, n_heads=4, n_kv_heads=2,
                            max_seq_len=SEQ, mlp_ratio=2)
    model.layers[1] = MlpOnly(WIDTH)
    model.layers[2] = Block(WIDTH, 2, None, 2, False, "mla")
    model.layers[3] = Block(WIDTH, 8, 1, 2, False, "mha")
    model.apply(model._init)
    with torch.no_grad():
        for attn in attention_modules(model):
            for weight in clipped_blocks(attn):   # the query, key and rotary-query weights
                attn.get_parameter(weight).mul_(60.0 if attn.head_layout.n_heads == 2 else 20.0)
    return model.to(dtype)


def recomputed(model: nn.Module, use_reentrant: bool = False) -> nn.Module:
    """``model`` with every block wrapped in :class:`Recompute` (in place; the parameters are the same)."""
    for i, block in enumerate(model.layers):
        model.layers[i] = Recompute(block, use_reentrant)
    return model


def shares(world_size: int, sizes: tuple) -> list[list[int]]:
    """Sequences per micro-batch of each rank: ``sizes[r]`` sequences for rank ``r``, cut in two micro-batches
    (one when it holds a single sequence; none when it holds none)."""
    return [[n - n // 2, n // 2] if n > 1 else [n] * n for n in sizes[:world_size]]


def micro_batches(step: int, rank: int, plan: list[list[int]]) -> list[torch.Tensor]:
    """Rank ``rank``'s micro-batches of step ``step``: int64 tokens ``(n, SEQ)``, cut from its batch."""
    total = sum(sum(p) for p in plan)
    tokens = torch.randint(0, VOCAB, (total, SEQ), generator=torch.Generator().manual_seed(10 + step))
    start = sum(sum(p) for p in plan[:rank])
    out = []
    for n in plan[rank]:
        out.append(tokens[start:start + n])
        start += n
    return out


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


class OpCounter(CommCounter):
    """:class:`~optbook.distributed.wire.CommCounter` that also counts the all-reduces with ``op=MAX``."""

    def __init__(self):
        super().__init__()
        self.max_all_reduces = []   # numel of each MAX all-reduce

    def _record(self, func, args, kwargs) -> None:
        super()._record(func, args, kwargs)
        if func._schema.name.split("::")[-1] == "allreduce_":
            bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
            bound.update(kwargs)
            if bound["reduce_op"].op() == MAX:
                self.max_all_reduces.append(sum(t.numel() for t in bound["tensors"]))


def _names(counter: CommCounter) -> list[str]:
    return [name for name, _, _ in counter.calls]


def _reference_grads(reference, ref_opt, step, plan, mode: str) -> None:
    """The reference's gradient of step ``step``. ``"rank-mean"``: each rank's micro-batches accumulated in
    turn, then ``(G_0 + G_1) * 0.5`` (what ZeRO-1 computes at 2 ranks, bitwise); ``"whole"``: every
    micro-batch accumulated in one ``.grad`` (a single process's gradient accumulation)."""
    ref_opt.zero_grad(set_to_none=True)
    per_rank = []
    for r in range(len(plan)):
        for tokens in micro_batches(step, r, plan):
            loss_of(reference, tokens).backward()
        if mode == "rank-mean":
            per_rank.append([p.grad.clone() for p in reference.parameters()])
            ref_opt.zero_grad(set_to_none=True)
    if mode == "rank-mean":
        assert len(per_rank) == 2
        for p, g0, g1 in zip(reference.parameters(), *per_rank):
            p.grad = (g0 + g1) * 0.5


def zero1_stack(rank: int, world_size: int, *, dtype=torch.float32, sizes=(4, 4), grads: str = "own") -> dict:
    """ZeRO-1 (AdamW) + ``qk_clip_`` on :func:`hybrid_model` with recompute, against the single-process
    MuonClip (AdamW; bfloat16: ``MixedPrecisionOptimizer(AdamW)``, whose float32 masters ZeRO-1's master
    shards must equal).

    ``grads="own"`` (2 ranks): each rank's gradient is its own micro-batches' (ZeRO-1 reduces them; the
    reference takes the same mean, bitwise at 2 ranks). ``grads="reference"``: after its own backward (which
    records the maxima), each rank's ``.grad`` is replaced by the reference's (a bfloat16 gradient: its sum
    over up to 4 ranks is exact in ZeRO-1's float32 buffer, so the mean is it, bitwise).

    Returns:
        ``"equal"``: after every step the model's weights (and bfloat16: this rank's master pieces) are
        bitwise the reference's; ``"reports"``: whether the clip reports agreed; ``"clipped"``: heads clipped
        per step; ``"fwd_bwd_calls"``: collectives of the forwards and backwards; ``"clip_max"``: numel of
        each MAX all-reduce of each ``qk_clip_``; ``"clip_calls"``: its other collectives; ``"buckets"``.
    """
    from optbook.distributed import DistributedOptimizer
    from optbook.optim import AdamW
    from optbook.precision import MixedPrecisionOptimizer

    torch.set_num_threads(1)
    plan = shares(world_size, sizes)
    reference = hybrid_model(dtype)
    model = recomputed(copy.deepcopy(reference))
    opt = DistributedOptimizer(model.parameters(), AdamW, lr=0.02, weight_decay=0.1)
    ref_opt = AdamW(reference.parameters(), lr=0.02, weight_decay=0.1)
    if dtype == torch.bfloat16:
        ref_opt = MixedPrecisionOptimizer(ref_opt)
    out = {"equal": [], "reports": [], "clipped": [], "fwd_bwd_calls": [], "clip_max": [], "clip_calls": [],
           "buckets": len(opt.layout.buckets)}
    for step in range(STEPS):
        _reference_grads(reference, ref_opt, step, plan, "rank-mean" if grads == "own" else "whole")
        ref_opt.step()
        ref_report = qk_clip_(reference, TAU)
        model.zero_grad(set_to_none=True)
        with OpCounter() as fwd_bwd:
            for tokens in micro_batches(step, rank, plan):
                loss_of(model, tokens).backward()
        if grads == "reference":
            for p, r in zip(model.parameters(), reference.parameters()):
                p.grad = None if r.grad is None else r.grad.clone()
        opt.step()
        with OpCounter() as clip:
            report = qk_clip_(model, TAU)
        out["fwd_bwd_calls"].append(_names(fwd_bwd))
        out["clip_max"].append(clip.max_all_reduces)
        out["clip_calls"].append(_names(clip))
        out["clipped"].append(len(report))
        out["reports"].append(report == ref_report)
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
        if dtype == torch.bfloat16:
            masters = ref_opt.master_params()
            for piece in opt.pieces:
                offset = piece.buffer_start - opt.layout.buckets[piece.bucket].shard(opt.rank)[0]
                mine = opt.master_shards[piece.bucket][offset:offset + piece.numel]
                theirs = masters[piece.index].detach().reshape(-1)[piece.param_start:piece.param_end]
                same &= torch.equal(mine, theirs)
        out["equal"].append(bool(same))
    return out


def fsdp2_stack(rank: int, world_size: int, *, sizes=(3, 3, 2)) -> dict:
    """FSDP2: every block (recomputed) and the root ``fully_shard``-ed (float64, ``Shard(0)``; uneven and
    empty row shards at 3 ranks), ``FSDP2Muon`` on the blocks' matrices and AdamW on every other parameter,
    ``qk_clip_`` scaling the local rows; against the single-process MuonClip (optbook's Muon + AdamW).

    Each rank's forwards and backwards run its own micro-batches (two per rank: FSDP2's collectives need
    the same count on every rank), recording the maxima; the gradients FSDP2 reduced are then replaced by the
    reference's (cut as the parameters are), so the two runs differ only in where the maxima were recorded
    and in the sharded steps and clip.

    Returns:
        ``"equal"``: whole weights bitwise the reference's after every step; ``"reports"``; ``"clipped"``;
        ``"max_per_step"``: numel of each MAX all-reduce over the forwards, backwards (FSDP2's gathers and
        reductions) and ``qk_clip_`` of a step (the optimizers' own agreements on their inputs are not
        counted); ``"clip_calls"``: every collective of each ``qk_clip_``.
    """
    from optbook.distributed import FSDP2Muon
    from optbook.distributed.fsdp2_workers import full_tensor, set_sharded_grads
    from optbook.optim import AdamW, Muon
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    plan = shares(world_size, sizes)
    reference = hybrid_model(torch.float64)
    model = recomputed(copy.deepcopy(reference))
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)

    def groups(m):
        blocks = {id(p) for p in m.layers.parameters()}
        matrices = [p for p in m.parameters() if p.ndim == 2 and id(p) in blocks]
        return matrices, [p for p in m.parameters() if id(p) not in {id(q) for q in matrices}]

    muon = dict(lr=0.02, momentum=0.95, nesterov=True, ns_dtype=torch.float64, weight_decay=0.01)
    (ref_m, ref_v), (m, v) = groups(reference), groups(model)
    ref_opts = [Muon(ref_m, **muon), AdamW(ref_v, lr=0.01, weight_decay=0.1)]
    opts = [FSDP2Muon(m, **muon), AdamW(v, lr=0.01, weight_decay=0.1)]
    out = {"equal": [], "reports": [], "clipped": [], "max_per_step": [], "clip_calls": []}
    for step in range(STEPS):
        for o in ref_opts:
            o.zero_grad(set_to_none=True)
        _reference_grads(reference, ref_opts[0], step, plan, "whole")
        for o in ref_opts:
            o.step()
        ref_report = qk_clip_(reference, TAU)
        with OpCounter() as fwd_bwd:
            for tokens in micro_batches(step, rank, plan):
                loss_of(model, tokens).backward()
        set_sharded_grads(model, reference)
        for o in opts:
            o.step()
        with OpCounter() as clip:
            report = qk_clip_(model, TAU)
        out["max_per_step"].append(fwd_bwd.max_all_reduces + clip.max_all_reduces)
        out["clip_calls"].append(_names(clip))
        out["clipped"].append(len(report))
        out["reports"].append(report == ref_report)
        out["equal"].append(all(torch.equal(full_tensor(p.detach()), r.detach())
                                for p, r in zip(model.parameters(), reference.parameters())))
    return out


def refusals(rank: int, world_size: int) -> dict:
    """``qk_clip_`` on 2 ranks when one rank's recorded maxima are not usable. Each case: both ranks run a
    training forward on their own batch (except where said), then one rank's maxima are edited:

    * ``"nan"``: rank 1's maximum of layer 0, head 1 is NaN (rank 0's is finite and larger);
    * ``"inf"``: rank 0's maximum of layer 2, head 3 is inf;
    * ``"short"``: rank 1 holds 3 maxima for layer 0's 4 heads;
    * ``"no_forward_on_one_rank"``: rank 1 ran no forward (its share of the batch was empty);
    * ``"no_forward"``: no rank ran a forward.

    Returns:
        ``{case: (error type name or None, message or None, weights unchanged, report length)}``.
    """
    torch.set_num_threads(1)
    out = {}
    for case in ("nan", "inf", "short", "no_forward_on_one_rank", "no_forward"):
        model = hybrid_model(torch.float64)
        layers = attention_modules(model)
        forward = case != "no_forward" and not (case == "no_forward_on_one_rank" and rank == 1)
        if forward:
            with torch.no_grad():
                model(micro_batches(0, rank, shares(2, (2, 2)))[0][:, :-1])
        if case == "nan" and rank == 1:
            layers[0].max_logits[1] = float("nan")
        if case == "nan" and rank == 0:
            layers[0].max_logits[1] = 50.0
        if case == "inf" and rank == 0:
            layers[2].max_logits[3] = float("inf")
        if case == "short" and rank == 1:
            layers[0].max_logits = layers[0].max_logits[:3].clone()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            report = qk_clip_(model, TAU)
            error = (None, None)
        except (RuntimeError, ValueError) as e:
            report, error = [], (type(e).__name__, str(e))
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        out[case] = (*error, unchanged, len(report))
        dist.barrier()
    out["zero1"] = zero1_scale_refusals()
    return out


def zero1_scale_refusals() -> dict:
    """ZeRO-1's ``_scale_weights_many_`` (what ``qk_clip_`` hands a step's scalings to) on bad pairs, called
    alike on every rank: ``{case: (error message, masters and weights unchanged, collectives issued)}`` for
    a tensor it does not hold (after a good pair), a parameter named twice, a factor that does not
    broadcast."""
    from optbook.distributed import DistributedOptimizer
    from optbook.optim import AdamW

    model = hybrid_model(torch.bfloat16)
    opt = DistributedOptimizer(model.parameters(), AdamW, lr=0.01)
    q = attention_modules(model)[0].q_proj.weight
    half = torch.full((q.shape[0], 1), 0.5)
    cases = {"foreign": [(q, half), (torch.zeros_like(q), half)], "twice": [(q, half), (q, half)],
             "shape": [(q, torch.full((q.shape[0] + 1, 1), 0.5))]}
    out = {}
    for case, pairs in cases.items():
        before = [p.detach().clone() for p in model.parameters()]
        masters = {b: m.clone() for b, m in opt.master_shards.items()}
        with OpCounter() as counter:
            try:
                opt._scale_weights_many_(pairs)
                message = None
            except ValueError as e:
                message = str(e)
        unchanged = (all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                     and all(torch.equal(m, masters[b]) for b, m in opt.master_shards.items()))
        out[case] = (message, unchanged, len(counter.calls) + counter.other_calls)
    return out
