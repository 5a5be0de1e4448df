"""Rank programs of tests/test_numerical_edges.py: torch.distributed.checkpoint's optimizer state dict of
each optimizer of chapters 4 and 18 (one gloo process)."""

from __future__ import annotations

import torch
from torch import nn

#: name -> constructor options (beyond lr); every class whose module h3 maintains.
CLASSES = {
    "Muon": dict(lr=0.02), "NorMuon": dict(lr=0.02), "AdaMuon": dict(lr=0.02), "Scion": dict(lr=0.02),
    "Dion": dict(lr=0.02), "Shampoo": dict(lr=0.01, precondition_frequency=2), "SOAP": dict(lr=0.01),
    "ScheduleFreeAdamW": dict(lr=0.01),
}


def dcp_optimizer_state_dict_run(rank: int, world_size: int, names: list[str]) -> dict:
    """For each class: two steps on a two-layer bias-free model, then
    ``get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))``
    and ``set_optimizer_state_dict`` of that dict into a fresh optimizer. Returns name -> ``"ok"`` or the
    error's type and first line, and name -> the group values of the saved dict (their types)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    import optbook.optim as optim
    out, kinds = {}, {}
    for name in names:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 4, bias=False))
        opt = getattr(optim, name)(model.parameters(), **CLASSES[name])
        if hasattr(opt, "train"):
            opt.train()
        try:
            for _ in range(2):
                model(torch.randn(5, 8)).square().sum().backward()
                opt.step()
                opt.zero_grad()
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            sd = get_optimizer_state_dict(model, opt, options=options)
            fresh = getattr(optim, name)(model.parameters(), **CLASSES[name])
            set_optimizer_state_dict(model, fresh, sd, options=StateDictOptions(full_state_dict=True))
            kinds[name] = sorted({type(v).__name__ for g in sd["param_groups"] for k, v in g.items() if k != "params"})
            out[name] = "ok"
        except Exception as e:   # reported, not raised: the test lists every class that fails
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return {"results": out, "kinds": kinds}
