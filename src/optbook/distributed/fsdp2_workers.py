"""Functions the FSDP2 section (14b) runs on every rank with :func:`optbook.distributed.launch`.

They live in a module (not a notebook cell) because ``launch`` starts fresh processes that import the
function by name. :func:`train_fsdp2` is the training loop as a reader writes it (the chapter prints its
source); :func:`fsdp2_chapter` runs it next to a single-process reference and returns what the chapter
checks. :func:`shard_model` and :func:`set_sharded_grads` are also what ``tests/test_fsdp2.py`` builds its
checks on.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .._sharded import local

__all__ = ["chapter_batch", "chapter_model", "fsdp2_chapter", "full_tensor", "set_sharded_grads",
           "shard_model", "train_fsdp2"]


def shard_model(model: nn.Module, layers=None) -> nn.Module:
    """``fully_shard`` each module of ``layers`` (default: every ``nn.Linear`` child of ``model``), then
    ``model`` itself, as FSDP2 is applied to a transformer block by block. Returns ``model``."""
    from torch.distributed.fsdp import fully_shard

    for layer in (layers if layers is not None else [m for m in model.children() if isinstance(m, nn.Linear)]):
        fully_shard(layer)
    fully_shard(model)
    return model


def set_sharded_grads(sharded: nn.Module, reference: nn.Module) -> None:
    """Give each parameter of ``sharded`` the gradient of the matching parameter of ``reference``, cut as the
    parameter is (a ``DTensor`` with the parameter's placements; a plain copy for a plain parameter): the
    two models then differ only in how the optimizer steps them."""
    from torch.distributed.tensor import distribute_tensor

    for p, r in zip(sharded.parameters(), reference.parameters()):
        g = r.grad.detach().clone()
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else g


def full_tensor(t) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` (a collective: every rank of its mesh calls it); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def chapter_model(seed: int = 0) -> nn.Module:
    """Section 14b's float64 MLP: matrices of 10 x 12, 9 x 10 and 3 x 9 (rows that 2, 3 or 4 ranks cannot
    split evenly; 3 rows leave a rank empty at 4 ranks), with biases."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 3)).double()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(32, 12, generator=torch.Generator().manual_seed(1000 + step), dtype=torch.float64)


def chapter_batch(step: int, micro: int) -> torch.Tensor:
    """The global micro-batch ``micro`` of step ``step``: 24 float64 rows of 12 features, the same on
    every rank (24 rows split evenly over 1 to 4 ranks: the mean of the ranks' means is the global mean)."""
    return torch.randn(24, 12, generator=torch.Generator().manual_seed(2000 + 10 * step + micro),
                       dtype=torch.float64)


def train_fsdp2(rank: int, world_size: int, *, steps: int = 3, accumulate: int = 2,
                checkpoint_dir=None, seed: int = 0, on_backward=None):
    """Train section 14b's MLP with FSDP2: Muon for the matrices, AdamW for the biases.

    The loop as a reader writes it (the chapter prints this function's source).
    Every rank builds the same model, shards it with ``fully_shard`` layer by layer
    and at the root, and runs ``backward()`` on its own rows of each micro-batch;
    FSDP2 reduce-scatters the mean gradient once per step, after the last of
    ``accumulate`` micro-batches (``set_requires_gradient_sync``).
    ``checkpoint_dir``: a directory every rank can write; the model and both
    optimizers are saved there with ``torch.distributed.checkpoint`` after the last
    step. ``on_backward(step, model)``, when given, is called after each step's last
    backward, before the optimizers step (the chapter's checks read the
    reduce-scattered gradients there).

    Returns:
        ``(model, muon, adamw)``: the sharded model and its two optimizers.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    from optbook.distributed import FSDP2Muon
    from optbook.optim import AdamW

    model = chapter_model(seed)            # the same initial weights on every rank
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)     # its weight and bias become Shard(0) DTensors
    fully_shard(model)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    muon = FSDP2Muon(matrices, lr=0.02, momentum=0.95, nesterov=True,
                     weight_decay=0.01, ns_dtype=torch.float64)
    adamw = AdamW(others, lr=0.01)

    for step in range(steps):
        for micro in range(accumulate):
            last = micro == accumulate - 1
            model.set_requires_gradient_sync(last)  # reduce-scatter after the last
            rows = chapter_batch(step, micro).chunk(world_size)[rank]  # its rows
            loss = model(rows).pow(2).mean() / accumulate
            loss.backward()
        if on_backward is not None:
            on_backward(step, model)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()

    if checkpoint_dir is not None:
        state = {"model": get_model_state_dict(model),
                 "muon": get_optimizer_state_dict(model, muon),
                 "adamw": get_optimizer_state_dict(model, adamw)}
        dcp.save(state, checkpoint_id=checkpoint_dir)
    return model, muon, adamw


def _reference_fsdp2(steps: int, accumulate: int, seed: int):
    """:func:`train_fsdp2`'s run in one process: ``(model, muon, adamw, gradients)``, the gradients of
    each step (summed over its micro-batches) as a list of tensors per step."""
    from ..optim import AdamW, Muon

    model = chapter_model(seed)
    muon = Muon([p for p in model.parameters() if p.dim() == 2],
                lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_dtype=torch.float64)
    adamw = AdamW([p for p in model.parameters() if p.dim() != 2], lr=0.01)
    gradients = []
    for step in range(steps):
        for micro in range(accumulate):
            (model(chapter_batch(step, micro)).pow(2).mean() / accumulate).backward()
        gradients.append([p.grad.detach().clone() for p in model.parameters()])
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return model, muon, adamw, gradients


def _fsdp2_training_checks(rank: int, world_size: int, checkpoint_dir, steps: int = 3, accumulate: int = 2,
                           seed: int = 0) -> dict:
    """Run :func:`train_fsdp2` and its single-process reference; compare gradients, parameters, momentum and
    the DCP checkpoint (loaded into a fresh sharded model and fresh optimizers)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from ..optim import AdamW
    from .fsdp2 import FSDP2Muon

    reference, ref_muon, _, ref_grads = _reference_fsdp2(steps, accumulate, seed)
    grad_diff, grad_scale, grad_bitwise = [], [], []

    def on_backward(step, model):
        diffs = [(full_tensor(p.grad) - g).abs().max().item()
                 for p, g in zip(model.parameters(), ref_grads[step])]
        grad_diff.append(max(diffs))
        grad_scale.append(max(g.abs().max().item() for g in ref_grads[step]))
        grad_bitwise.append(all(d == 0.0 for d in diffs))

    model, muon, adamw = train_fsdp2(rank, world_size, steps=steps, accumulate=accumulate,
                                     checkpoint_dir=checkpoint_dir, seed=seed, on_backward=on_backward)
    param_diff = max((full_tensor(p.detach()) - r.detach()).abs().max().item()
                     for p, r in zip(model.parameters(), reference.parameters()))
    momentum_diff = max((full_tensor(muon.state[p]["momentum_buffer"]) - ref_muon.state[r]["momentum_buffer"])
                        .abs().max().item() for p, r in zip(muon.param_groups[0]["params"],
                                                            ref_muon.param_groups[0]["params"]))
    # the checkpoint, loaded into a fresh sharded model and fresh optimizers, gives back the same tensors
    fresh = shard_model(chapter_model(seed + 1))
    fresh_muon = FSDP2Muon([p for p in fresh.parameters() if p.dim() == 2],
                           lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_dtype=torch.float64)
    fresh_adamw = AdamW([p for p in fresh.parameters() if p.dim() != 2], lr=0.01)
    state = {"model": get_model_state_dict(fresh),
             "muon": get_optimizer_state_dict(fresh, fresh_muon),
             "adamw": get_optimizer_state_dict(fresh, fresh_adamw)}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_muon, state["muon"])
    set_optimizer_state_dict(fresh, fresh_adamw, state["adamw"])
    restored = (all(torch.equal(full_tensor(p.detach()), full_tensor(q.detach()))
                    for p, q in zip(fresh.parameters(), model.parameters()))
                and all(torch.equal(full_tensor(fresh_muon.state[p]["momentum_buffer"]),
                                    full_tensor(muon.state[q]["momentum_buffer"]))
                        for p, q in zip(fresh_muon.param_groups[0]["params"],
                                        muon.param_groups[0]["params"])))
    return {"grad_diff": grad_diff, "grad_scale": grad_scale, "grad_bitwise": grad_bitwise,
            "param_diff": param_diff, "momentum_diff": momentum_diff, "checkpoint_restored": restored}


def fsdp2_chapter(rank: int, world_size: int, *, steps: int = 3, seed: int = 0, checkpoint_dir=None) -> dict:
    """Everything section 14b runs, in one launch.

    Two kinds of check. The optimizer alone: the sharded model is given the single-process run's own
    gradients, cut as the parameters are (:func:`set_sharded_grads`), so the two runs differ only in how the
    optimizer steps them (``"adamw_equal"``, ``"muon_equal"``, the bytes and the state). Training:
    :func:`train_fsdp2` with FSDP2's own reduce-scattered gradients from the sharded model's backward on each
    rank's rows, with gradient accumulation, against the same loop in one process (``"training"``).

    Returns:
        ``"layout"``: per parameter, ``(name, global shape, placements, local shape)`` on this rank after
        ``fully_shard``; ``"adamw_equal"``: ``optbook.optim.AdamW`` on the shards bitwise the single-process
        run after every step; ``"muon_equal"``: ``FSDP2Muon`` (matrices) + AdamW (biases) bitwise Muon + AdamW;
        ``"owners"``, ``"ns_calls"``: ``FSDP2Muon``'s owner of each matrix and the matrices this rank
        orthogonalised; ``"muon_bytes"``, ``"muon_predicted"``: bytes received in the Muon steps, counted
        at the dispatcher (:class:`~optbook.distributed.wire.CommCounter`) and by
        :meth:`FSDP2Muon.predicted_received_bytes`; ``"fsdp_bytes"``: what FSDP2's own forward and backward
        of one step delivered (its all-gathers and reduce-scatters), counted the same way;
        ``"state_bytes"``: the bytes of the optimizer-state tensors this rank holds (FSDP2Muon + AdamW, local
        rows), ``"single_process_state_bytes"``: the same count for the single-process Muon + AdamW;
        ``"training"`` (only with ``checkpoint_dir``, a directory every rank can write): ``"grad_diff"`` and
        ``"grad_scale"``, per step the largest difference between FSDP2's reduce-scattered gradient and the
        single-process gradient and the largest single-process gradient entry; ``"grad_bitwise"``;
        ``"param_diff"``, ``"momentum_diff"``: largest differences after the last step;
        ``"checkpoint_restored"``: the DCP checkpoint loads back bitwise into a fresh model and optimizers.
    """
    from ..optim import AdamW, Muon
    from .fsdp2 import FSDP2Muon
    from .wire import CommCounter

    torch.set_num_threads(1)
    layout = [(name, tuple(p.shape), str(tuple(p.placements)), tuple(p.to_local().shape))
              for name, p in shard_model(chapter_model(seed)).named_parameters()]

    def run(kind: str):
        reference = chapter_model(seed)
        sharded = shard_model(copy.deepcopy(reference))
        if kind == "adamw":
            ref_opts = [AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)]
            opts = [AdamW(sharded.parameters(), lr=0.01, weight_decay=0.1)]
        else:
            def split(model):
                return ([p for p in model.parameters() if p.dim() == 2], [p for p in model.parameters() if p.dim() != 2])
            (rm, rv), (sm, sv) = split(reference), split(sharded)
            muon = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_dtype=torch.float64)
            ref_opts = [Muon(rm, **muon), AdamW(rv, lr=0.01)]
            opts = [FSDP2Muon(sm, **muon), AdamW(sv, lr=0.01)]
        equal, counter = True, CommCounter()
        for step in range(steps):
            for o in ref_opts:
                o.zero_grad()
            reference(_batch(step)).pow(2).mean().backward()
            set_sharded_grads(sharded, reference)
            for o in ref_opts:
                o.step()
            with counter:
                opts[0].step()
            for o in opts[1:]:
                o.step()
            equal &= all(torch.equal(full_tensor(p.detach()), r.detach())
                         for p, r in zip(sharded.parameters(), reference.parameters()))
        return equal, opts, sharded, counter, ref_opts

    def state_bytes(optimizers) -> int:   # counted from the state tensors this rank holds (its rows)
        return sum(t.numel() * t.element_size() for o in optimizers for s in o.state.values()
                   for t in local(list(s.values())) if isinstance(t, torch.Tensor))

    adamw_equal, _, _, _, _ = run("adamw")
    muon_equal, opts, sharded, counter, ref_opts = run("muon")
    muon_opt = opts[0]
    predicted = {k: steps * v for k, v in muon_opt.predicted_received_bytes().items()}
    fsdp = CommCounter()
    with fsdp:
        sharded(_batch(0)).pow(2).mean().backward()
    training = (None if checkpoint_dir is None
                else _fsdp2_training_checks(rank, world_size, checkpoint_dir, steps=steps, seed=seed))
    return {"layout": layout, "adamw_equal": adamw_equal, "muon_equal": muon_equal, "training": training,
            "owners": list(muon_opt.owners), "ns_calls": muon_opt.ns_calls,
            "muon_bytes": {k: int(v) for k, v in counter.received.items()}, "muon_predicted": predicted,
            "fsdp_bytes": {k: int(v) for k, v in fsdp.received.items()},
            "state_bytes": state_bytes(opts), "single_process_state_bytes": state_bytes(ref_opts)}
