"""Functions the FSDP2 section (14b) runs on every rank with :func:`optbook.distributed.launch`.

They live in a module (not a notebook cell) because ``launch`` starts fresh processes that import the
function by name. :func:`shard_model` and :func:`set_sharded_grads` are also what ``tests/test_fsdp2.py``
builds its checks on.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..optim._sharded import local

__all__ = ["chapter_model", "fsdp2_chapter", "full_tensor", "set_sharded_grads", "shard_model"]


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


def fsdp2_chapter(rank: int, world_size: int, *, steps: int = 3, seed: int = 0) -> dict:
    """Everything section 14b runs, in one launch.

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
        rows), ``"single_process_state_bytes"``: the same count for the single-process Muon + AdamW.
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
    return {"layout": layout, "adamw_equal": adamw_equal, "muon_equal": muon_equal,
            "owners": list(muon_opt.owners), "ns_calls": muon_opt.ns_calls,
            "muon_bytes": {k: int(v) for k, v in counter.received.items()}, "muon_predicted": predicted,
            "fsdp_bytes": {k: int(v) for k, v in fsdp.received.items()},
            "state_bytes": state_bytes(opts), "single_process_state_bytes": state_bytes(ref_opts)}
