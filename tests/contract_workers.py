"""Builders and checks for tests/test_contract.py: one row of ``optbook.contract.CONTRACT`` at a time.

``row_report(kind, rank, world_size)`` builds the class of a row on a small problem and runs every check
of the row's contract, returning ``{check: "ok" | "FAILED: ..."}``; a check that raises unexpectedly is
reported, not propagated, so one broken check does not hide the others. ``distributed_reports`` is the
rank function of the 2-process gloo launch (``optbook.distributed.launch`` imports it by name, so it is a
module-level function of a module on ``sys.path``: pytest puts ``tests/`` there, as for ``helpers``).
Every rank sets the same gradients, so every rank must take the same branch (a skipped or refused
step, the same error).
"""

from __future__ import annotations

import copy
import traceback

import torch

from optbook.contract import CONTRACT, NonFiniteGradientError, owner_of

ROWS = {row.kind: row for row in CONTRACT}
SINGLE_PROCESS = ("plain optimizer", "ChainedOptimizer", "MixedPrecisionOptimizer", "OffloadOptimizer")
DISTRIBUTED = ("DistributedOptimizer", "LayerWiseMuon", "DistributedMuon", "DistributedChain")
MAX_GRAD_NORM = 1.0   # every wrapper is built with clipping, so it computes (and reports) a norm


def _params(kind):
    """Fresh parameters: two matrices (every kind can step them) and, where the class takes vectors, one."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if kind == "MixedPrecisionOptimizer" else torch.float32
    mats = [torch.randn(4, 3, generator=g).to(dtype).requires_grad_(),
            torch.randn(3, 5, generator=g).to(dtype).requires_grad_()]
    vecs = [] if kind in ("LayerWiseMuon", "DistributedMuon") else [torch.randn(5, generator=g).to(dtype).requires_grad_()]
    return mats, vecs


def build(kind, scaler=False):
    """``(optimizer, params)`` for a row; ``scaler``: with a ``DynamicLossScaler`` (rows that take one)."""
    from optbook.optim import AdamW, ChainedOptimizer, Muon
    from optbook.precision import DynamicLossScaler

    mats, vecs = _params(kind)
    loss_scaler = DynamicLossScaler(initial_scale=2.0**8, hysteresis=1) if scaler else None  # backs off at once
    kw = {"loss_scaler": loss_scaler} if scaler else {}
    if kind == "plain optimizer":
        opt = AdamW(mats + vecs, lr=1e-2)
    elif kind == "ChainedOptimizer":
        opt = ChainedOptimizer([Muon(mats, lr=0.02, ns_dtype=torch.float32), AdamW(vecs, lr=1e-2)],
                               max_grad_norm=MAX_GRAD_NORM)
    elif kind == "MixedPrecisionOptimizer":
        from optbook.precision import MixedPrecisionOptimizer
        opt = MixedPrecisionOptimizer(AdamW(mats + vecs, lr=1e-2), loss_scaler, max_grad_norm=MAX_GRAD_NORM)
    elif kind == "OffloadOptimizer":
        from optbook.memory import OffloadOptimizer
        opt = OffloadOptimizer(mats + vecs, AdamW, lr=1e-2)
    elif kind == "DistributedOptimizer":
        from optbook.distributed import DistributedOptimizer
        opt = DistributedOptimizer(mats + vecs, AdamW, lr=1e-2, max_grad_norm=MAX_GRAD_NORM, **kw)
    elif kind == "LayerWiseMuon":
        from optbook.distributed import LayerWiseMuon
        opt = LayerWiseMuon(mats, lr=0.02, ns_dtype=torch.float32, max_grad_norm=MAX_GRAD_NORM)
    elif kind == "DistributedMuon":
        from optbook.distributed import DistributedMuon
        opt = DistributedMuon(mats, lr=0.02, ns_dtype=torch.float32, max_grad_norm=MAX_GRAD_NORM)
    elif kind == "DistributedChain":
        from optbook.distributed import DistributedChain, DistributedOptimizer, LayerWiseMuon
        opt = DistributedChain(LayerWiseMuon(mats, lr=0.02, ns_dtype=torch.float32),
                               DistributedOptimizer(vecs, AdamW, lr=1e-2), max_grad_norm=MAX_GRAD_NORM)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return opt, mats + vecs


def set_grads(params, k, bad=None):
    """The same gradients on every rank (seeded by ``k``); ``bad``: that value written into the last one."""
    g = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    if bad is not None:
        params[-1].grad.view(-1)[1] = bad


def full_state(opt):
    """The optimizer's whole state dict on every rank (consolidated first where the class shards it)."""
    import torch.distributed as dist

    if hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=0)
        box = [opt.state_dict() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return opt.state_dict()


def same(a, b) -> bool:
    """Nested equality, tensors bitwise (dtype and shape included)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(full_state(opt))


def truncated(state_dict):
    """``state_dict`` with its first state tensor of more than one element cut to one element (a wrong
    shape); ``None`` if it has no such tensor."""
    bad = copy.deepcopy(state_dict)

    def cut(node):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if torch.is_tensor(value) and value.numel() > 1:
                node[key] = value.reshape(-1)[:1].clone()
                return True
            if isinstance(value, (dict, list)) and cut(value):
                return True
        return False

    return bad if cut(bad) else None


def _check(report, name, fn):
    try:
        fn()
        report[name] = "ok"
    except Exception as e:  # noqa: BLE001 - reported, not raised: the test shows every failing check of a row
        report[name] = f"FAILED: {type(e).__name__}: {e}"[:600] + ("" if isinstance(e, AssertionError) else
                                                                 "\n" + traceback.format_exc()[-600:])


def row_report(kind: str) -> dict:
    """Run every check of ``kind``'s row; ``{check: "ok" | "FAILED: ..."}``."""
    row = ROWS[kind]
    report: dict = {}
    box: dict = {}

    def build_it():
        box["opt"], box["params"] = build(kind)
    _check(report, "build", build_it)
    if "opt" not in box:
        return report
    opt, params = box["opt"], box["params"]

    def returns_and_reports():
        set_grads(params, 0)
        assert opt.step() is None, "step() without a closure must return None"
        loss = torch.tensor(0.25)
        set_grads(params, 1)
        out = opt.step(lambda: loss)
        assert out is loss, f"step(closure) must return the closure's loss, got {out!r}"
        for name in row.reports:
            assert hasattr(opt, name), f"no attribute {name}"
        if row.reports:
            assert opt.found_inf is False, f"found_inf after an applied step: {opt.found_inf!r}"
            assert type(opt.skipped_steps) is int and opt.skipped_steps == 0, f"skipped_steps {opt.skipped_steps!r}"
            if hasattr(opt, "max_grad_norm"):  # a class that clips computes the global norm
                assert type(opt.last_grad_norm) is float and opt.last_grad_norm > 0, \
                    f"last_grad_norm must be a float, got {opt.last_grad_norm!r}"
            else:
                assert opt.last_grad_norm is None, f"last_grad_norm without a norm: {opt.last_grad_norm!r}"
    _check(report, "returns and reports", returns_and_reports)

    def owner():
        for p in params:
            # a chain's copies are its members': the ZeRO-1 member owns its parameters, Muon's are stepped in place
            holders = (opt, getattr(opt, "adamw", None), getattr(opt, "muon", None))
            if row.owner and not (hasattr(opt, "adamw") and owner_of(p) is None):
                assert owner_of(p) in holders, f"owner_of(param of shape {tuple(p.shape)}) is {owner_of(p)!r}"
            else:
                assert owner_of(p) is None or owner_of(p) is not opt, "registered as owner but owns no copy"
    _check(report, "owner", owner)

    def nonfinite_raises():
        for bad in (float("nan"), float("inf")):
            set_grads(params, 2, bad)
            before = snapshot(opt, params)
            try:
                opt.step()
            except NonFiniteGradientError as e:
                assert "shape" in str(e) or "param" in str(e), f"the error does not name the parameter: {e}"
            else:
                raise AssertionError(f"step() with a {bad} gradient did not raise NonFiniteGradientError")
            after = snapshot(opt, params)
            assert same(before[0], after[0]), "parameters changed"
            assert same(before[1], after[1]), "optimizer state changed"
    _check(report, "non-finite without scaler", nonfinite_raises)

    if row.takes_loss_scaler:
        def nonfinite_skips():
            sopt, sparams = build(kind, scaler=True)
            set_grads(sparams, 0)
            sopt.step()
            scale = sopt.loss_scaler.scale
            set_grads(sparams, 3, float("inf"))
            before = snapshot(sopt, sparams)
            out = sopt.step()
            assert out is None, f"a skipped step must return None, got {out!r}"
            assert sopt.found_inf is True and sopt.skipped_steps == 1
            assert sopt.loss_scaler.scale < scale, "the scaler did not back off"
            after = snapshot(sopt, sparams)
            assert same(before[0], after[0]), "parameters changed on a skipped step"
            assert full_state(sopt).get("skipped_steps") == 1, "skipped_steps not in the state dict"
        _check(report, "non-finite with scaler", nonfinite_skips)

    def bad_load():
        set_grads(params, 4)
        opt.step()
        saved = full_state(opt)
        bads = [({}, "an empty dict")]
        cut = truncated(saved)
        assert cut is not None, "no state tensor to corrupt"
        bads.append((cut, "a state tensor of the wrong shape"))
        set_grads(params, 5)
        opt.step()   # the state now differs from `saved`
        for bad, what in bads:
            before = snapshot(opt, params)
            try:
                opt.load_state_dict(bad)
            except (ValueError, TypeError, KeyError):
                pass
            else:
                raise AssertionError(f"load_state_dict of {what} did not raise")
            after = snapshot(opt, params)
            assert same(before[0], after[0]), f"parameters changed by a failed load of {what}"
            assert same(before[1], after[1]), f"optimizer state changed by a failed load of {what}"
    _check(report, "bad load untouched", bad_load)
    return report


def distributed_reports(rank: int, world_size: int) -> dict:
    """Rank function of the 2-process launch: ``{kind: row_report(kind)}`` for every distributed row."""
    return {kind: row_report(kind) for kind in DISTRIBUTED}


def refused_compositions(rank: int, world_size: int) -> dict:
    """Rank function: wrap each distributed optimizer in MixedPrecisionOptimizer and put it in a
    ChainedOptimizer; ``{composition: the error message}`` (each must be refused at construction)."""
    from optbook.distributed import DistributedOptimizer, LayerWiseMuon
    from optbook.optim import AdamW, ChainedOptimizer
    from optbook.precision import MixedPrecisionOptimizer

    W = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    builders = {"LayerWiseMuon": lambda: LayerWiseMuon([W.detach().float().requires_grad_()], lr=0.02),
                "DistributedOptimizer": lambda: DistributedOptimizer([b.detach().float().requires_grad_()], AdamW, lr=0.1)}
    out = {}
    for name, build in builders.items():
        for how, wrap in (("MixedPrecisionOptimizer", MixedPrecisionOptimizer),
                          ("ChainedOptimizer", lambda o: ChainedOptimizer([o]))):
            try:
                wrap(build())
                out[f"{how}({name})"] = "accepted"
            except TypeError as e:
                out[f"{how}({name})"] = str(e)
    return out
