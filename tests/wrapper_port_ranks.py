"""Rank programs of tests/test_wrapper_ports.py: LayerWiseMuon, DistributedMuon and FSDP2Muon on the wrapper
base (:class:`optbook.wrapper.OptimizerWrapper`), each checked for what the base gives it.

Spawned processes import this module by name (``wrapper_port_ranks``; ``tests/`` is on ``sys.path`` under
pytest and ``spawn`` hands it to each child).
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch import nn

from optbook.distributed import DistributedMuon, FSDP2Muon, LayerWiseMuon
from optbook.distributed.fsdp2_workers import shard_model
from optbook.wrapper import StepReport

SHAPES = [(6, 4), (5, 6)]   # the weights of Linear(4, 6) and Linear(6, 5)
OPTIONS = dict(lr=0.05, weight_decay=0.01, ns_dtype=torch.float64)
KINDS = ("layerwise", "moonlight", "fsdp2")


def rank_grads(step: int, rank: int) -> list[torch.Tensor]:
    """Dyadic float64 gradients (multiples of 1/8): their mean over 2 ranks is exact in any order."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-16, 17, s, generator=gen, dtype=torch.float64) / 8 for s in SHAPES]


def mean_norm(step: int, world_size: int) -> float:
    """The float64 L2 norm of the mean over the ranks of :func:`rank_grads`."""
    every = [rank_grads(step, r) for r in range(world_size)]
    means = [sum(gs) / world_size for gs in zip(*every)]
    return float(torch.linalg.vector_norm(torch.cat([m.reshape(-1) for m in means])))


class _Problem:
    """One optimizer of ``kind`` over fresh float64 matrices, and how to give it the gradients of a step."""

    def __init__(self, kind: str, rank: int, world_size: int):
        self.kind, self.rank, self.world_size = kind, rank, world_size
        gen = torch.Generator().manual_seed(7)
        if kind == "fsdp2":
            torch.manual_seed(0)   # the same model on every rank, then each keeps its rows
            self.model = shard_model(nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 5, bias=False)).double())
            self.params = list(self.model.parameters())
            self.opt = FSDP2Muon(self.params, max_grad_norm=100.0, **OPTIONS)
        else:
            self.params = [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]
            cls, extra = ((LayerWiseMuon, {}) if kind == "layerwise"
                          else (DistributedMuon, {"gather_dtype": torch.float64, "bucket_size": 16}))
            self.opt = cls(self.params, **OPTIONS, **extra)

    def set_grads(self, step: int, params=None, nan_on_last_rank: bool = False) -> None:
        params = self.params if params is None else params
        if self.kind == "fsdp2":   # every rank holds its rows of the same (full) gradient
            from torch.distributed.tensor import distribute_tensor

            for p, g in zip(params, rank_grads(step, 0)):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            if nan_on_last_rank and self.rank == self.world_size - 1:
                params[1].grad.to_local().view(-1)[0] = float("nan")
            return
        for p, g in zip(params, rank_grads(step, self.rank)):
            p.grad = g.clone()
        if nan_on_last_rank and self.rank == self.world_size - 1:
            params[1].grad.view(-1)[0] = float("nan")

    def expected_norm(self, step: int) -> float:
        if self.kind == "fsdp2":
            return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in rank_grads(step, 0)])))
        return mean_norm(step, self.world_size)

    def snapshot(self, opt=None, params=None) -> list[torch.Tensor]:
        opt, params = opt or self.opt, params or self.params
        out = [_local(p).detach().clone() for p in params]
        for p in params:
            out += [_local(v).clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bitwise(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _error(fn):
    """``None`` or ``(type name, message)`` of what ``fn()`` raised."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type
        return type(e).__name__, str(e)
    return None


def port_checks(rank: int, world_size: int) -> dict:
    """For each kind of :data:`KINDS`, a dict of what the test asserts (values, errors, bitwise comparisons), and
    under ``"low_precision"`` what :func:`low_precision_refusals` found."""
    return {**{kind: _checks(kind, rank, world_size) for kind in KINDS},
            "low_precision": low_precision_refusals(rank, world_size)}


def _checks(kind: str, rank: int, world_size: int) -> dict:
    out: dict = {}
    prob = _Problem(kind, rank, world_size)
    opt = prob.opt
    calls = {"pre": 0, "post": 0, "sd": 0, "load": 0}
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.__setitem__("post", calls["post"] + 1))
    opt.register_state_dict_post_hook(lambda o, sd: (calls.__setitem__("sd", calls["sd"] + 1),
                                                     sd.__setitem__("hooked", sd.get("hooked", 0) + 1))[-1])
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.__setitem__("load", calls["load"] + 1))

    # one StepReport per step: the grad norm of the mean gradient, nothing skipped
    reports, norms = [], []
    for step in range(2):
        prob.set_grads(step)
        opt.step()
        reports.append(getattr(opt, "report", None))
        norms.append(prob.expected_norm(step))
    out["reports"] = [r if r is None else (type(r) is StepReport, r.found_inf, r.grad_norm, r.skipped_steps)
                      for r in reports]
    out["norms"] = norms
    out["step_hooks"] = (calls["pre"], calls["post"])

    # a non-finite gradient on the last rank: every rank raises naming it, nothing written, the report kept
    before = prob.snapshot()
    prob.set_grads(2, nan_on_last_rank=True)
    out["nonfinite_error"] = _error(opt.step)
    out["nonfinite_untouched"] = _bitwise(before, prob.snapshot())
    report = getattr(opt, "report", None)
    out["report_after_raise"] = None if report is None else (report.found_inf, report.grad_norm, report.skipped_steps)

    # modes: Muon has none, so eval()/train() leave the weights as they are; any other mode is refused
    before = prob.snapshot()
    out["eval_train"] = _error(lambda: (opt.eval(), opt.train()))
    out["eval_untouched"] = _bitwise(before, prob.snapshot())
    out["set_mode"] = _error(lambda: opt.set_mode("average"))

    # add_param_group after construction: refused, naming the class
    extra = nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))
    out["add_param_group"] = _error(lambda: opt.add_param_group({"params": [extra]}))
    out["groups_after_add"] = len(opt.param_groups)

    # zero_grad(set_to_none=False) zeroes in place; set_to_none=True drops them
    prob.set_grads(3)
    opt.zero_grad(set_to_none=False)
    out["zeroed"] = all(p.grad is not None and not bool(_local(p.grad).any()) for p in prob.params)
    opt.zero_grad()
    out["dropped"] = all(p.grad is None for p in prob.params)

    # state-dict hooks run once per call
    if kind == "fsdp2":
        sd = opt.state_dict()
    else:
        opt.consolidate_state_dict(0)
        sd = opt.state_dict() if rank == 0 else None
        shared = [sd]
        dist.broadcast_object_list(shared, src=0)
        sd = shared[0]
    out["sd_hook_calls"] = calls["sd"]
    out["sd_hooked"] = sd.pop("hooked", None)   # the post hook saw the dict state_dict() returned
    opt.load_state_dict(sd)
    out["load_hook_calls"] = calls["load"]

    # repr: the groups and the wrapper's own options
    out["repr"] = repr(opt)

    # pickling with lambda hooks: the copy has no hooks and steps as the original does, bit for bit
    def pickled():
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    twin = None
    try:
        twin = pickled()
        out["pickle"] = None
    except Exception as e:  # noqa: BLE001
        out["pickle"] = (type(e).__name__, str(e))
    if twin is not None:
        out["twin_hooks"] = sum(len(getattr(twin, name, {})) for name in (
            "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks"))
        twin_params = [p for g in twin.param_groups for p in g["params"]]
        prob.set_grads(4)
        prob.set_grads(4, params=twin_params)
        opt.step()
        out["twin_step"] = _error(twin.step)
        out["twin_same"] = out["twin_step"] is None and _bitwise(prob.snapshot(), prob.snapshot(twin, twin_params))
        out["original_hooks_kept"] = calls["pre"]
    return out


def low_precision_refusals(rank: int, world_size: int) -> dict:
    """DistributedMuon and FSDP2Muon on a bfloat16 matrix: refused naming it, before anything is written (the
    ranks' different values are not broadcast over)."""
    out = {}
    params = [nn.Parameter(torch.full(s, float(rank + 1), dtype=torch.float32)) for s in SHAPES]
    params[1].data = params[1].data.to(torch.bfloat16)
    before = [p.detach().clone() for p in params]
    out["moonlight"] = _error(lambda: DistributedMuon(params, lr=0.02))
    out["moonlight_untouched"] = _bitwise(before, [p.detach().clone() for p in params])
    torch.manual_seed(0)
    model = shard_model(nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 5, bias=False).to(torch.bfloat16)))
    before = [_local(p).detach().clone() for p in model.parameters()]
    out["fsdp2"] = _error(lambda: FSDP2Muon(model.parameters(), lr=0.02))
    out["fsdp2_untouched"] = _bitwise(before, [_local(p).detach().clone() for p in model.parameters()])
    return out
