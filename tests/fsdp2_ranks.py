"""Rank programs of tests/test_fsdp2.py: optbook's element-wise optimizers on FSDP2-sharded parameters.

Each rank builds the same float64 model twice: a plain copy (the single-process reference) and a copy whose
``nn.Linear`` layers and root are ``fully_shard``-ed (parameters become ``DTensor`` with ``Shard(0)``). Every
step, the reference computes its gradients on the full batch, and each sharded parameter's gradient is set
to that same gradient, distributed (its rank's rows): so the only difference between the two runs is the
optimizer stepping shards instead of whole tensors, and the result must be bitwise the same.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from optbook.contract import NonFiniteGradientError
from optbook.distributed.fsdp2_workers import full_tensor as full
from optbook.distributed.fsdp2_workers import set_sharded_grads, shard_model as shard
from optbook.optim import SGD, Adafactor, Adam, AdamW, Lion, Muon, ScheduleFreeAdamW

#: name -> (class, options); every element-wise optimizer of optbook.optim.
ELEMENTWISE = {
    "SGD (momentum, Nesterov, weight decay)": (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "Adam (amsgrad)": (Adam, dict(lr=0.01, amsgrad=True)),
    "AdamW": (AdamW, dict(lr=0.01, weight_decay=0.1)),
    "Lion": (Lion, dict(lr=0.003, weight_decay=0.1)),
    "ScheduleFreeAdamW": (ScheduleFreeAdamW, dict(lr=0.01, warmup_steps=2, weight_decay=0.01)),
}
STEPS = 3


def make_model() -> nn.Module:
    """Rows 7 and 2: shards of uneven size at 2, 3 and 4 ranks, and empty shards of the (2, 7) weight at 3 and 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 5, generator=gen, dtype=torch.float64), torch.randn(16, 2, generator=gen, dtype=torch.float64)


def same_state(sharded_opt, ref_opt, sharded: nn.Module, reference: nn.Module) -> bool:
    for p, r in zip(sharded.parameters(), reference.parameters()):
        a, b = sharded_opt.state[p], ref_opt.state[r]
        if a.keys() != b.keys():
            return False
        for key in a:
            x, y = a[key], b[key]
            if isinstance(y, torch.Tensor) and y.dim():
                if not torch.equal(full(x), y):
                    return False
            elif (float(x) if isinstance(x, torch.Tensor) else x) != (float(y) if isinstance(y, torch.Tensor) else y):
                return False
    return True


def elementwise_run(rank: int, world_size: int) -> dict:
    """For each optimizer of :data:`ELEMENTWISE`: ``{"params": bitwise equal to the reference after every
    step, "state": state bitwise equal after the last step, "eval": for ScheduleFreeAdamW, the eval-mode
    weights equal too}``; ``"empty_shards"``: how many of this rank's parameters have an empty local shard."""
    torch.set_num_threads(1)
    out = {}
    for name, (cls, options) in ELEMENTWISE.items():
        reference = make_model()
        sharded = shard(copy.deepcopy(reference))
        ref_opt, opt = cls(reference.parameters(), **options), cls(sharded.parameters(), **options)
        params_ok = True
        for step in range(STEPS):
            x, y = batch(step)
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            set_sharded_grads(sharded, reference)
            ref_opt.step()
            opt.step()
            params_ok &= all(torch.equal(full(p.detach()), r.detach()) for p, r in zip(sharded.parameters(),
                                                                                       reference.parameters()))
        row = {"params": params_ok, "state": same_state(opt, ref_opt, sharded, reference)}
        if cls is ScheduleFreeAdamW:
            ref_opt.eval()
            opt.eval()
            row["eval"] = all(torch.equal(full(p.detach()), r.detach())
                              for p, r in zip(sharded.parameters(), reference.parameters()))
        out[name] = row
    out["empty_shards"] = sum(p.to_local().numel() == 0 for p in shard(make_model()).parameters())
    return out


def nonfinite_run(rank: int, world_size: int) -> dict:
    """A NaN in the last row of the first weight's gradient (the last rank's shard only): every rank raises
    NonFiniteGradientError naming that parameter, and nothing is written on any rank."""
    torch.set_num_threads(1)
    reference = make_model()
    sharded = shard(copy.deepcopy(reference))
    opt = AdamW(sharded.parameters(), lr=0.01)
    x, y = batch(0)
    nn.functional.mse_loss(reference(x), y).backward()
    reference[0].weight.grad[-1, 0] = float("nan")
    set_sharded_grads(sharded, reference)
    before = [p.detach().to_local().clone() for p in sharded.parameters()]
    try:
        opt.step()
        message = None
    except NonFiniteGradientError as e:
        message = str(e)
    unchanged = all(torch.equal(p.detach().to_local(), b) for p, b in zip(sharded.parameters(), before))
    holds_nan = bool(sharded[0].weight.grad.to_local().isnan().any())
    return {"message": message, "unchanged": unchanged, "state": len(opt.state), "holds_nan_locally": holds_nan}


def refusal_run(rank: int, world_size: int) -> dict:
    """Whole-matrix optimizers on sharded parameters: the TypeError each raises (or None)."""
    sharded = shard(make_model())
    out = {}
    for cls in (Muon, Adafactor):
        params = [p for p in sharded.parameters() if p.dim() == 2]
        try:
            cls(params, lr=0.01)
            out[cls.__name__] = None
        except TypeError as e:
            out[cls.__name__] = str(e)
    return out


# --- Muon ----------------------------------------------------------------------------------------------------
MUON_OPTIONS = dict(momentum=0.95, nesterov=True, ns_dtype=torch.float64, weight_decay=0.01)


def muon_model() -> nn.Module:
    """Three matrices: (8, 6) split into 2 heads, (9, 8) uneven at 2, 3, 4 ranks, (2, 9) with empty shards."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 9, bias=False), nn.Tanh(),
                         nn.Linear(9, 2, bias=False)).double()


def muon_pairs_model() -> nn.Module:
    """Four matrices whose shards are even at 2 ranks (received and scattered in place): (6, 6), a tall
    (12, 6), whose update is a transposed view (copied into shards), a wide (6, 12) (one batch with the tall
    one where one rank owns both), and (2, 6); uneven or empty at 3 and 4 ranks."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 6, bias=False), nn.Tanh(), nn.Linear(6, 12, bias=False), nn.Tanh(),
                         nn.Linear(12, 6, bias=False), nn.Tanh(), nn.Linear(6, 2, bias=False)).double()


def muon_batch(step: int) -> torch.Tensor:
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(200 + step), dtype=torch.float64)


def muon_groups(model: nn.Module) -> list[dict]:
    return [{"params": [model[0].weight], "head_split": 2, "lr": 0.02},
            {"params": [model[2].weight, model[4].weight], "lr": 0.01}]


def muon_run(rank: int, world_size: int, *, max_grad_norm=None, accumulate: int = 1, pairs: bool = False) -> dict:
    """FSDP2Muon against optbook.optim.Muon for 3 steps (``accumulate`` micro-batches per step, the gradients
    summed by FSDP2 and by the reference alike, then the reference's own summed gradient distributed):
    ``"diff"``, the largest difference of the parameters after every step (0.0: bitwise); ``"ns_calls"`` on
    this rank and ``"owned"``, how many matrices it owns; ``"state"``: momentum equal to the reference's.
    ``pairs``: :func:`muon_pairs_model` in one group instead of :func:`muon_model` and its groups."""
    from optbook.clipping import clip_grad_norm_
    from optbook.distributed import FSDP2Muon

    torch.set_num_threads(1)
    reference = muon_pairs_model() if pairs else muon_model()
    sharded = shard(copy.deepcopy(reference))
    groups = (lambda m: [{"params": list(m.parameters()), "lr": 0.02}]) if pairs else muon_groups
    ref_opt = Muon(groups(reference), **MUON_OPTIONS)
    opt = FSDP2Muon(groups(sharded), max_grad_norm=max_grad_norm, **MUON_OPTIONS)
    diff = 0.0
    for step in range(STEPS):
        ref_opt.zero_grad()
        for micro in range(accumulate):
            reference(muon_batch(10 * step + micro)).pow(2).mean().backward()
        set_sharded_grads(sharded, reference)
        if max_grad_norm is not None:
            clip_grad_norm_(list(reference.parameters()), max_grad_norm)
        ref_opt.step()
        opt.step()
        diff = max(diff, max(float((full(p.detach()) - r.detach()).abs().max())
                             for p, r in zip(sharded.parameters(), reference.parameters())))
    state = all(torch.equal(full(opt.state[p]["momentum_buffer"]), ref_opt.state[r]["momentum_buffer"])
                for p, r in zip(sharded.parameters(), reference.parameters()))
    return {"diff": diff, "ns_calls": opt.ns_calls, "owned": sum(o == rank for o in opt.owners), "state": state,
            "last_grad_norm": opt.last_grad_norm}


def muon_refusals(rank: int, world_size: int) -> dict:
    """FSDP2Muon's errors: plain tensors, and a step whose gradient holds NaN in one rank's shard."""
    from optbook.distributed import FSDP2Muon

    out = {}
    try:
        FSDP2Muon(list(muon_model().parameters()), lr=0.01)
        out["plain"] = None
    except TypeError as e:
        out["plain"] = str(e)
    reference = muon_model()
    sharded = shard(copy.deepcopy(reference))
    opt = FSDP2Muon(list(sharded.parameters()), lr=0.01)
    reference(muon_batch(0)).pow(2).mean().backward()
    reference[2].weight.grad[-1, -1] = float("inf")
    set_sharded_grads(sharded, reference)
    before = [p.detach().to_local().clone() for p in sharded.parameters()]
    try:
        opt.step()
        out["nonfinite"] = None
    except NonFiniteGradientError as e:
        out["nonfinite"] = str(e)
    out["unchanged"] = all(torch.equal(p.detach().to_local(), b) for p, b in zip(sharded.parameters(), before))
    return out


# --- QK-clip -------------------------------------------------------------------------------------------------
def qk_clip_run(rank: int, world_size: int) -> dict:
    """QK-clip on a fully_shard-ed float64 TinyTransformer (GQA: 4 query heads, 2 key/value heads). Each rank's
    forward runs its share of the batch; ``"maxima_diff"``: the largest difference between the maxima
    ``qk_clip_`` reduces over the ranks and the single-process forward's on the whole batch. Then both models
    are clipped from the same maxima: ``"clipped"`` heads and ``"weights_equal"`` (bitwise)."""
    from optbook.models import TinyTransformer, attention_modules
    from optbook.qk_clip import qk_clip_

    torch.set_num_threads(1)
    torch.manual_seed(3)
    reference = TinyTransformer(vocab_size=16, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                                max_seq_len=8).double()
    with torch.no_grad():
        for attn in attention_modules(reference):
            attn.q_proj.weight.mul_(8.0)
            attn.k_proj.weight.mul_(8.0)
    sharded = copy.deepcopy(reference)
    shard(sharded, layers=list(sharded.layers))
    tokens = torch.randint(0, 16, (4 * world_size, 8), generator=torch.Generator().manual_seed(4))
    share = tokens.shape[0] // world_size
    with torch.no_grad():
        reference(tokens)
        sharded(tokens[rank * share:(rank + 1) * share])
    ref_maxima = [a.max_logits.clone() for a in attention_modules(reference)]
    reduced = []
    for a in attention_modules(sharded):
        m = a.max_logits.clone()
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
        reduced.append(m)
    maxima_diff = max(float((a - b).abs().max()) for a, b in zip(reduced, ref_maxima))
    for a, m in zip(attention_modules(sharded), ref_maxima):
        a.max_logits = m.clone()
    tau = 0.5 * float(max(m.max() for m in ref_maxima))
    clipped = len(qk_clip_(sharded, tau))
    qk_clip_(reference, tau)
    weights_equal = all(torch.equal(full(p.detach()), r.detach())
                        for p, r in zip(sharded.parameters(), reference.parameters()))
    return {"maxima_diff": maxima_diff, "clipped": clipped, "weights_equal": weights_equal}


# --- DCP checkpoints ---------------------------------------------------------------------------------------------
def _dcp_optimizers(model: nn.Module, sharded: bool):
    from optbook.distributed import FSDP2Muon

    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() != 2]
    muon_cls = FSDP2Muon if sharded else Muon
    return muon_cls(matrices, lr=0.02, **MUON_OPTIONS), AdamW(vectors, lr=0.01, weight_decay=0.1)


def dcp_model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _dcp_step(step, reference, ref_opts, sharded=None, opts=()):
    for o in ref_opts:
        o.zero_grad()
    reference(muon_batch(step)).pow(2).mean().backward()
    for o in ref_opts:
        o.step()
    if sharded is not None:
        set_sharded_grads(sharded, reference)
        for o in opts:
            o.step()


def dcp_run(rank: int, world_size: int, *, ckpt_dir: str, phase: str, split: int = 2, steps: int = 4) -> dict:
    """``phase="save"``: ``split`` steps of FSDP2Muon (matrices) + AdamW (biases) on a fully_shard-ed model,
    then a DCP checkpoint of the model and both optimizers (``get_*_state_dict``). ``phase="resume"``: a fresh
    sharded model and optimizers at this world size, loaded from the checkpoint, ``steps - split`` more steps.
    Both phases run the single-process reference (Muon + AdamW) alongside on the same gradients; returns
    ``"equal"``: the parameters (and, resumed, the momentum) bitwise the reference's after the last step.
    ``phase="single"``: as ``"resume"``, into a plain model with optbook's single-process Muon and AdamW."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    torch.set_num_threads(1)
    reference = dcp_model()
    ref_opts = _dcp_optimizers(reference, sharded=False)
    plain = phase == "single"   # resume into a plain model and optbook's single-process Muon + AdamW
    sharded = copy.deepcopy(reference) if plain else shard(copy.deepcopy(reference))
    opts = _dcp_optimizers(sharded, sharded=not plain)
    if phase == "save":
        for step in range(split):
            _dcp_step(step, reference, ref_opts, sharded, opts)
        state = {"model": get_model_state_dict(sharded),
                 "muon": get_optimizer_state_dict(sharded, opts[0]),
                 "adamw": get_optimizer_state_dict(sharded, opts[1])}
        dcp.save(state, checkpoint_id=ckpt_dir)
        last = split
    else:
        for step in range(split):   # the reference alone up to the checkpoint
            _dcp_step(step, reference, ref_opts)
        # get_optimizer_state_dict creates the state to load into (a step at lr 0 on zero gradients)
        state = {"model": get_model_state_dict(sharded),
                 "muon": get_optimizer_state_dict(sharded, opts[0]),
                 "adamw": get_optimizer_state_dict(sharded, opts[1])}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(sharded, state["model"])
        set_optimizer_state_dict(sharded, opts[0], state["muon"])
        set_optimizer_state_dict(sharded, opts[1], state["adamw"])
        for step in range(split, steps):
            _dcp_step(step, reference, ref_opts, sharded, opts)
        last = steps
    equal = all(torch.equal(full(p.detach()), r.detach()) for p, r in zip(sharded.parameters(),
                                                                           reference.parameters()))
    momentum = all(torch.equal(full(opts[0].state[p]["momentum_buffer"]), ref_opts[0].state[r]["momentum_buffer"])
                   for p, r in zip(opts[0].param_groups[0]["params"], ref_opts[0].param_groups[0]["params"]))
    return {"equal": equal, "momentum": momentum, "steps": last}


def clip_on_shards(rank: int, world_size: int) -> dict:
    """``optbook.clipping.clip_grad_norm_`` on FSDP2 ``DTensor`` gradients, against the single-process clip.

    Returns ``{"norm", "ref_norm", "grads_close", "refused_without_group", "untouched_after_refusal"}``.
    """
    from optbook.clipping import clip_grad_norm_

    reference = make_model()
    sharded = shard(copy.deepcopy(reference))
    x, y = batch(0)
    (reference(x) - y).pow(2).mean().backward()
    set_sharded_grads(sharded, reference)
    before = [full(p.grad).clone() for p in sharded.parameters()]
    refused = False
    if world_size > 1:
        try:
            clip_grad_norm_(list(sharded.parameters()), 0.05)
        except ValueError as e:
            refused = "Invalid group" in str(e)
    untouched = all(torch.equal(full(p.grad), b) for p, b in zip(sharded.parameters(), before))
    group = next(iter(sharded.parameters())).device_mesh.get_group()
    norm = clip_grad_norm_(list(sharded.parameters()), 0.05, group=group)
    ref_norm = clip_grad_norm_(list(reference.parameters()), 0.05)
    close = all(torch.allclose(full(p.grad), r.grad, rtol=1e-12, atol=0)
                for p, r in zip(sharded.parameters(), reference.parameters()))
    return {"norm": float(norm), "ref_norm": float(ref_norm), "grads_close": close,
            "refused_without_group": refused, "untouched_after_refusal": untouched}


def muon_input_agreement(rank: int, world_size: int) -> dict:
    """FSDP2Muon with inputs that must be refused on every rank before any write, or accepted as plain Muon
    accepts them. Each case: ``(error type and message or None, parameters and state bitwise unchanged)``.

    ``"tensor_hyperparameters"``: ``lr``, ``momentum``, ``weight_decay`` as one-element tensors (plain Muon
    reads them as floats): ``"diff"`` against plain Muon with the same options after one step (0.0: bitwise).
    ``"bad_lr_on_last_rank"``: ``lr = -1`` on the last rank only. ``"grad_none_on_last_rank"``: parameter 1
    without a gradient on the last rank only. ``"after"``: the largest difference from plain Muon after the
    inputs were fixed and two steps were taken. ``"all_reduce_bytes"``: what the all-reduces of the last
    step delivered to this rank (:class:`optbook.distributed.wire.CommCounter`)."""
    from optbook.distributed import FSDP2Muon
    from optbook.distributed.wire import CommCounter

    torch.set_num_threads(1)
    last = world_size - 1
    kw = dict(lr=torch.tensor([0.02], dtype=torch.float64), momentum=torch.tensor([0.9], dtype=torch.float64),
              weight_decay=torch.tensor([0.1], dtype=torch.float64), ns_dtype=torch.float64)
    reference = muon_model()
    sharded = shard(copy.deepcopy(reference))
    ref_opt = Muon(list(reference.parameters()), **kw)
    opt = FSDP2Muon(list(sharded.parameters()), **kw)

    def diff():
        return max(float((full(p.detach()) - r.detach()).abs().max())
                   for p, r in zip(sharded.parameters(), reference.parameters()))

    def snapshot():
        return ([p.detach().to_local().clone() for p in sharded.parameters()]
                + [s["momentum_buffer"].to_local().clone() for s in opt.state.values()])

    def attempt(edit, undo):
        before = snapshot()
        edit()
        try:
            opt.step()
            err = None
        except Exception as e:  # noqa: BLE001 -- reported to the test, which checks the type
            err = (type(e).__name__, str(e))
        undo()
        after = snapshot()
        return err, len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))

    out = {}
    for step in range(3):
        ref_opt.zero_grad()
        reference(muon_batch(step)).pow(2).mean().backward()
        set_sharded_grads(sharded, reference)
        if step == 1:
            group = opt.param_groups[0]
            lr = group["lr"]
            out["bad_lr_on_last_rank"] = attempt(lambda: group.update(lr=-1.0 if rank == last else lr),
                                                 lambda: group.update(lr=lr))
            p1 = list(sharded.parameters())[1]
            grad = p1.grad
            out["grad_none_on_last_rank"] = attempt(lambda: setattr(p1, "grad", None if rank == last else grad),
                                                    lambda: setattr(p1, "grad", grad))
        ref_opt.step()
        with CommCounter() as counter:
            opt.step()
        if step == 0:
            out["tensor_hyperparameters"] = diff()
    out["after"] = diff()
    out["all_reduce_bytes"] = counter.received.get("all_reduce", 0)  # the agreement of one good step
    return out
