"""Functions run on every rank by :func:`optbook.distributed.launch` for chapter 14 (distributed Muon). Each
takes ``(rank, world_size, ...)`` and returns picklable values; the single-process references are here too,
so the notebook and the tests (whose own rank programs are in ``tests/muon_rank_programs.py``) use the same
problem.

Every random draw here starts from a ``seed`` argument shifted by :func:`optbook.runtime.seeds`, so a sweep's
``OPTBOOK_SEED_OFFSET`` changes the problem in this process and, inherited by the spawned ranks, in every worker
alike (offset 0, the default: the seeds as given).
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import torch
import torch.distributed as dist

from ..runtime import seeds
from .wire import CommCounter, all_reduce_received
from .workers import spread_over_ranks

__all__ = [
    "MUON_OPTIONS",
    "chain_problem",
    "chain_reference",
    "chain_train",
    "chapter_transformer",
    "layerwise_train",
    "moonlight_train",
    "muon_chapter",
    "muon_grads",
    "muon_mean_grads",
    "muon_problem",
    "muon_reference",
    "set_grads",
    "tp_modes",
    "transformer_comm",
]

#: Muon hyperparameters of the equivalence runs: float64 Newton–Schulz, so differences are rounding only.
MUON_OPTIONS = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_dtype": torch.float64}
MOONLIGHT_LAYOUT = {"param_alignment": 1, "bucket_alignment": 4}  # small alignments: matrices cut across ranks


def set_grads(params, grads) -> None:
    """``p.grad = g.clone()`` (or ``None``) for each pair."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seed(seed: int) -> int:
    """``seed`` plus the sweep's ``OPTBOOK_SEED_OFFSET`` (:func:`optbook.runtime.seeds`); shifted once, before
    it is mixed with a step or a salt, so that fresh offsets never reproduce another step's draw.

    Raises:
        ValueError: ``seed`` is not a non-negative int.
    """
    return seeds(seed)[0]


def muon_problem(seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], list[dict]]:
    """Seven 2-D parameters and two groups, the same on every rank for ``seed``.

    Shapes ``(16, 8)``, ``(8, 24)``, ``(12, 12)``, ``(16, 8)`` (shares the first's shape: batched together in
    one Newton–Schulz call), ``(6, 10)``, then ``(8, 6)``, ``(4, 6)``; entries ``k / 64``, ``k`` in
    ``[-64, 64)``. Groups: the first five (weight decay 0.1), the last two with ``head_split=2`` (two row
    blocks each) and ``lr=0.01``. ``seed`` is shifted by ``OPTBOOK_SEED_OFFSET`` (:mod:`optbook.runtime`).
    """
    gen = _gen(_seed(seed))
    shapes = [(16, 8), (8, 24), (12, 12), (16, 8), (6, 10), (8, 6), (4, 6)]
    params = [(torch.randint(-64, 64, s, generator=gen) / 64).to(dtype).requires_grad_() for s in shapes]
    groups = [{"params": params[:5], "weight_decay": 0.1},
              {"params": params[5:], "head_split": 2, "lr": 0.01}]
    return params, groups


def muon_mean_grads(params, step: int, seed: int = 0) -> list[torch.Tensor | None]:
    """The mean gradient at ``step`` (what a single process uses): entries ``k / 256``, ``k`` in
    ``[-512, 512)``; ``params[4]`` has none."""
    gen = _gen(100003 * _seed(seed) + 1009 * step + 3)
    grads = [(torch.randint(-512, 512, p.shape, generator=gen) / 256).to(p.dtype) for p in params]
    grads[4] = None
    return grads


def muon_grads(params, step: int, rank: int, world_size: int, seed: int = 0) -> list[torch.Tensor | None]:
    """Rank ``rank``'s gradients: their mean over the ranks is exactly :func:`muon_mean_grads` (dyadic values,
    exact sums in any order). Rank ``r`` gets ``G + (r - (d - 1) / 2) D``; ``params[1]`` gets ``d G`` on rank 0
    and ``None`` elsewhere; ``params[4]`` never has one."""
    mean = muon_mean_grads(params, step, seed)
    gen = _gen(100003 * _seed(seed) + 1009 * step + 11)
    return spread_over_ranks(params, mean, gen, rank, world_size)


def muon_reference(steps: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """Single-process ``optbook.optim.Muon`` (float64 Newton–Schulz) on :func:`muon_mean_grads`."""
    from ..optim import Muon

    params, groups = muon_problem(seed)
    opt = Muon(groups, **MUON_OPTIONS)
    for t in range(steps):
        set_grads(params, muon_mean_grads(params, t, seed))
        opt.step()
    return [p.detach().clone() for p in params]


def _train_counted(opt, params, steps: int, rank: int, world_size: int, seed: int):
    """``steps`` steps of ``opt`` on :func:`muon_grads` with the bytes on the wire counted; then the state
    consolidated on the group's last rank. Returns ``(counter, checkpoint or None)``."""
    with CommCounter() as counter:
        for t in range(steps):
            set_grads(params, muon_grads(params, t, rank, world_size, seed))
            opt.step()
    opt.consolidate_state_dict(to=world_size - 1)
    return counter, (opt.state_dict() if rank == world_size - 1 else None)


def layerwise_train(rank: int, world_size: int, *, steps: int = 4, seed: int = 0, group=None,
                    assignment: str = "lpt") -> dict:
    """:class:`~optbook.distributed.LayerWiseMuon` on :func:`muon_problem` for ``steps`` steps.

    Returns:
        ``{"params", "owners", "loads", "comm_bytes", "predicted" (one step's bytes times steps),
        "received" (:class:`~optbook.distributed.wire.CommCounter`'s count over the steps), "state_numel"
        (momentum elements this rank holds), "checkpoint" (consolidated on the group's last rank, else
        None)}``.
    """
    from .layerwise_muon import LayerWiseMuon

    params, groups = muon_problem(seed)
    opt = LayerWiseMuon(groups, process_group=group, assignment=assignment, **MUON_OPTIONS)
    counter, checkpoint = _train_counted(opt, params, steps, rank, world_size, seed)
    pred = opt.predicted_comm_bytes([g is not None for g in muon_mean_grads(params, 0, seed)])
    return {"params": [p.detach().clone() for p in params], "owners": opt.owners, "loads": opt.loads,
            "comm_bytes": dict(opt.comm_bytes), "predicted": {k: steps * v for k, v in pred.items()},
            "received": dict(counter.received),
            "state_numel": sum(s["momentum_buffer"].numel() for s in opt.state.values()),
            "checkpoint": checkpoint}


def moonlight_train(rank: int, world_size: int, *, steps: int = 4, seed: int = 0, group=None,
                    gather_dtype: torch.dtype = torch.float64, gather: str = "all") -> dict:
    """:class:`~optbook.distributed.DistributedMuon` (``gather=`` ``"all"`` or ``"touched"``) on
    :func:`muon_problem` (small alignments, so matrices are cut across ranks).

    Returns:
        ``{"params", "comm_bytes", "predicted" (:func:`zero1_comm_bytes` times steps), "received"
        (:class:`~optbook.distributed.wire.CommCounter`'s count over the steps), "received_predicted"
        (:func:`~optbook.distributed.distributed_muon.received_bytes` times steps, plus the control
        all-reduces), "state_numel", "split" (indices of parameters cut across two or more ranks),
        "checkpoint" (consolidated on the group's last rank, else None)}``.
    """
    from .distributed_muon import received_bytes
    from .layerwise_muon import DistributedMuon, zero1_comm_bytes

    params, groups = muon_problem(seed)
    opt = DistributedMuon(groups, process_group=group, gather_dtype=gather_dtype, gather=gather,
                          **MOONLIGHT_LAYOUT, **MUON_OPTIONS)
    counter, checkpoint = _train_counted(opt, params, steps, rank, world_size, seed)
    pred = zero1_comm_bytes(opt.layout, gather_dtype, gather=gather, rank=rank)
    wire = received_bytes(opt.layout, rank, gather_dtype, gather=gather)
    key = "all_gather" if gather == "all" else "all_to_all"
    received_predicted = {"reduce_scatter": steps * wire["reduce_scatter"],
                          "all_reduce": steps * all_reduce_received(8 * (1 + len(params)) + 16, world_size)}
    received_predicted["all_gather"] = steps * wire["all_gather"] + (steps * wire["gather"] if key == "all_gather" else 0)
    if key == "all_to_all":
        received_predicted["all_to_all"] = steps * wire["gather"]
    holders = {}
    for r in range(world_size):
        for piece in opt.layout.pieces(r):
            holders.setdefault(piece.index, set()).add(r)
    return {"params": [p.detach().clone() for p in params], "comm_bytes": dict(opt.comm_bytes),
            "predicted": {k: steps * v for k, v in pred.items() if k != "total"},
            "received": dict(counter.received), "received_predicted": received_predicted,
            "state_numel": sum(m.numel() for m in opt.momentum_shard.values()),
            "split": sorted(i for i, rs in holders.items() if len(rs) > 1), "checkpoint": checkpoint}


# --- one global norm: Muon (layer-wise) + AdamW (ZeRO-1) ----------------------------------------------------
def chain_problem(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(matrices, others)``: the matrices of :func:`muon_problem` and three AdamW tensors ``(10,)``,
    ``(5, 4)`` (an embedding-like table), ``(3,)``, entries ``k / 64`` in float64."""
    params, _ = muon_problem(seed)
    gen = _gen(_seed(seed) + 17)
    others = [(torch.randint(-64, 64, s, generator=gen) / 64).double().requires_grad_() for s in [(10,), (5, 4), (3,)]]
    return params, others


def _chain_mean_grads(matrices, others, step: int, seed: int):
    mg = muon_mean_grads(matrices, step, seed)
    gen = _gen(7 * _seed(seed) + 31 * step + 5)
    og = [(torch.randint(-512, 512, p.shape, generator=gen) / 256).double() for p in others]
    return mg, og


def _chain_rank_grads(matrices, others, step, rank, world_size, seed):
    mg = muon_grads(matrices, step, rank, world_size, seed)
    _, og = _chain_mean_grads(matrices, others, step, seed)
    gen = _gen(7 * _seed(seed) + 31 * step + 6)
    og = [g + (rank - (world_size - 1) / 2) * (torch.randint(-512, 512, g.shape, generator=gen) / 256).double()
          for g in og]
    return mg, og


CHAIN_MAX_NORM = 3.0


def chain_reference(steps: int = 3, seed: int = 0) -> dict:
    """Single process: ``ChainedOptimizer([Muon, AdamW], max_grad_norm=3)`` on the mean gradients.
    Returns ``{"params": matrices + others, "norms": the global norm of each step}``."""
    from ..optim import AdamW, ChainedOptimizer, Muon

    matrices, others = chain_problem(seed)
    chain = ChainedOptimizer([Muon(matrices, **MUON_OPTIONS), AdamW(others, lr=0.01, weight_decay=0.1)],
                             max_grad_norm=CHAIN_MAX_NORM)
    norms = []
    for t in range(steps):
        mg, og = _chain_mean_grads(matrices, others, t, seed)
        set_grads(matrices, mg)
        set_grads(others, og)
        chain.step()
        norms.append(float(chain.last_grad_norm))
    return {"params": [p.detach().clone() for p in matrices + others], "norms": norms}


def chain_train(rank: int, world_size: int, *, steps: int = 3, seed: int = 0, group=None) -> dict:
    """:class:`~optbook.distributed.DistributedChain` of LayerWiseMuon and DistributedOptimizer(AdamW), clip at
    3.0 (active: the norms are about 20), on each rank's gradients. Returns ``{"params", "norms",
    "raw_norm_check"}`` where ``raw_norm_check`` is the norm of the *mean raw* gradients at step 0 computed
    here from :func:`_chain_mean_grads` (what the chain's first norm must equal); ``"lrs"``: every group's lr
    after one step of ``LambdaLR(chain, 0.5 ** s)``; ``"errors"``: what three bad constructions raised."""
    from ..clipping import get_grad_norm
    from .chain import DistributedChain
    from .layerwise_muon import LayerWiseMuon
    from .zero1 import DistributedOptimizer

    matrices, others = chain_problem(seed)
    muon = LayerWiseMuon(matrices, process_group=group, **MUON_OPTIONS)
    adamw = DistributedOptimizer(others, process_group=group, lr=0.01, weight_decay=0.1)
    chain = DistributedChain(muon, adamw, max_grad_norm=CHAIN_MAX_NORM)
    norms = []
    for t in range(steps):
        mg, og = _chain_rank_grads(matrices, others, t, rank, world_size, seed)
        set_grads(matrices, mg)
        set_grads(others, og)
        chain.step()
        norms.append(float(chain.last_grad_norm))
    fresh_m, fresh_o = chain_problem(seed)
    mg, og = _chain_mean_grads(fresh_m, fresh_o, 0, seed)
    set_grads(fresh_m, mg)
    set_grads(fresh_o, og)
    # one scheduler drives both members; constructor errors
    sched = torch.optim.lr_scheduler.LambdaLR(chain, lambda s: 0.5 ** s)
    with warnings.catch_warnings():  # stepped before any optimizer step on purpose: only the lr is read
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        sched.step()
    lrs = [g["lr"] for g in chain.param_groups]
    errors = {}
    for name, make in [("own_norm", lambda: DistributedChain(
                            LayerWiseMuon(matrices[:1], process_group=group, max_grad_norm=1.0), adamw)),
                       ("not_layerwise", lambda: DistributedChain(adamw, adamw)),
                       ("max_grad_norm", lambda: DistributedChain(muon, adamw, max_grad_norm=-1.0))]:
        try:
            make()
            errors[name] = None
        except (TypeError, ValueError) as e:
            errors[name] = (type(e).__name__, str(e))
    return {"params": [p.detach().clone() for p in matrices + others], "norms": norms,
            "raw_norm_check": float(get_grad_norm(fresh_m + fresh_o)), "lrs": lrs, "errors": errors}


# --- chapter 14 ------------------------------------------------------------------------------------------------
def tp_modes(rank: int, world_size: int, *, shape=(96, 32), partition_dim: int = 0, seed: int = 0,
             group=None) -> dict:
    """Newton–Schulz (float64, 5 simple steps) of one ``shape`` matrix split over the tensor-parallel ranks in
    each mode of :func:`~optbook.distributed.tensor_parallel_newton_schulz`; the matrix is drawn from ``seed``
    on every rank, rank ``r`` keeps block ``r``.

    Returns:
        ``{mode: this rank's block of the result}`` for the three modes, plus ``"comm_bytes"``: ``{mode:
        bytes}`` (the function's own tally of its buffers, ``comm_bytes=``), ``"received"``: ``{mode:
        {collective: bytes}}``, what :class:`~optbook.distributed.wire.CommCounter` counts at the dispatcher
        (the bytes this rank receives, the shape-check all-reduces included), and ``"G"``: the whole matrix.
    """
    from .tp_newton_schulz import TP_MODES, tensor_parallel_newton_schulz

    t = world_size if group is None else dist.get_world_size(group)
    r = rank if group is None else dist.get_rank(group)
    G = torch.randn(*shape, generator=_gen(_seed(seed)), dtype=torch.float64)
    block = G.chunk(t, dim=partition_dim)[r].contiguous()
    out, comm, received = {}, {}, {}
    for mode in TP_MODES:
        counted: dict = {}
        with CommCounter() as counter:
            out[mode] = tensor_parallel_newton_schulz(block, partition_dim, mode, group, dtype=torch.float64,
                                                      comm_bytes=counted)
        comm[mode] = sum(counted.values())
        received[mode] = dict(counter.received)
    out["comm_bytes"] = comm
    out["received"] = received
    out["G"] = G
    return out


def chapter_transformer(seed: int = 0):
    """The communication example's model: ``TinyTransformer(vocab_size=512, d_model=64, n_layers=2)`` in float32,
    built from ``seed`` (the routing of :func:`optbook.optim.muon_param_groups` splits it)."""
    from ..models.transformer import TinyTransformer

    state = torch.random.get_rng_state()
    torch.manual_seed(_seed(seed))
    model = TinyTransformer(vocab_size=512, d_model=64, n_layers=2, n_heads=4)
    torch.random.set_rng_state(state)
    return model


def transformer_comm(rank: int, world_size: int, *, group=None, seed: int = 0) -> dict:
    """One step on :func:`chapter_transformer` with random gradients, each wrapper inside a
    :class:`~optbook.distributed.wire.CommCounter` (the bytes this rank receives), next to the formulas:

    * ``"dp"``: plain data parallelism, one ``all_reduce`` of the flat float32 gradients;
    * ``"zero1"``: ZeRO-1 AdamW over every parameter (``DistributedOptimizer``) on its reduce-scatter /
      all-gather path (the one it takes with NCCL); ``"zero1_gloo"``: the same on gloo's default path (an
      all-reduce of each bucket, then one broadcast per shard);
    * ``"moonlight_all"`` / ``"moonlight_touched"``: ``DistributedMuon`` (bfloat16 gather, ``gather="all"``
      or ``"touched"``) over the Muon matrices plus ZeRO-1 AdamW (reduce-scatter path) over the rest;
    * ``"layerwise"``: ``LayerWiseMuon`` over the Muon matrices plus the same ZeRO-1 AdamW over the rest.

    Returns:
        ``{name: {"received": {collective: bytes}, "predicted": {collective: bytes}}}`` for the five names, plus
        ``"muon_all"`` / ``"muon_touched"``: ``DistributedMuon.comm_bytes`` (buffer convention) and
        ``"n_matrix"``, ``"n_total"`` (elements in Muon matrices, in all parameters). The byte counts are ints,
        or :class:`fractions.Fraction` where a ring all-reduce's share is not whole.
    """
    from ..optim import muon_param_groups
    from .distributed_muon import received_bytes
    from .layerwise_muon import DistributedMuon, LayerWiseMuon
    from .zero1 import DistributedOptimizer

    f32 = torch.float32

    def model_with_grads():
        m = chapter_transformer(seed)
        gen = _gen(_seed(seed) + 99)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        return m

    def plain(groups):
        return [{k: v for k, v in g.items() if k != "param_names"} for g in groups]

    def add(*dicts):
        out = {}
        for d in dicts:
            for k, v in d.items():
                out[k] = out.get(k, 0) + v
        return out

    def zero1(params_or_groups, gloo_path: bool):
        opt = DistributedOptimizer(params_or_groups, process_group=group, lr=1e-3)
        # DistributedOptimizer picks an all-reduce and broadcasts on gloo (faster there); switching the flag
        # off runs its reduce-scatter / all-gather path, the one it takes with NCCL.
        opt._gloo_collectives = gloo_path = gloo_path and opt._gloo_collectives  # (NCCL: never the gloo path)
        n = len(opt._params)
        control = {"all_reduce": all_reduce_received(8 * (2 + n), world_size)}
        if gloo_path:
            wire = received_bytes(opt.layout, rank)
            pred = {"all_reduce": control["all_reduce"] + sum(
                        all_reduce_received(4 * b.numel, world_size) for b in opt.layout.buckets if b.numel),
                    "broadcast": wire["all_gather"]}
        else:
            wire = received_bytes(opt.layout, rank)
            pred = {**control, "reduce_scatter": wire["reduce_scatter"], "all_gather": wire["all_gather"]}
        return opt, pred

    out = {}
    # plain data parallelism: one all-reduce of every gradient
    model = model_with_grads()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    with CommCounter() as c:
        dist.all_reduce(flat, group=group)
    out["dp"] = {"received": c.received, "predicted": {"all_reduce": all_reduce_received(4 * flat.numel(), world_size)}}
    for name, gloo_path in (("zero1", False), ("zero1_gloo", True)):
        opt, pred = zero1(model_with_grads().parameters(), gloo_path)
        with CommCounter() as c:
            opt.step()
        out[name] = {"received": c.received, "predicted": pred}
    for gather in ("all", "touched"):
        routing = muon_param_groups(model_with_grads())
        muon = DistributedMuon(plain(routing.muon), process_group=group, lr=0.02, gather=gather)
        rest, rest_pred = zero1(plain(routing.adamw), False)
        wire = received_bytes(muon.layout, rank, torch.bfloat16, gather=gather)
        n = len(muon._params)
        muon_pred = {"reduce_scatter": wire["reduce_scatter"],
                     "all_reduce": all_reduce_received(8 * (1 + n) + 16, world_size)}
        if gather == "all":
            muon_pred["all_gather"] = wire["all_gather"] + wire["gather"]
        else:
            muon_pred.update(all_gather=wire["all_gather"], all_to_all=wire["gather"])
        with CommCounter() as c:
            muon.step()
            rest.step()
        out[f"moonlight_{gather}"] = {"received": c.received, "predicted": add(muon_pred, rest_pred)}
        out[f"muon_{gather}"] = dict(muon.comm_bytes)
        out["n_matrix"] = sum(p.numel() for p in muon._params)
    routing = muon_param_groups(model_with_grads())
    layerwise = LayerWiseMuon(plain(routing.muon), process_group=group, lr=0.02)
    rest, rest_pred = zero1(plain(routing.adamw), False)
    lw = layerwise.predicted_comm_bytes()  # buffer convention: received is (d - 1) / d of it
    lw_pred = {"all_reduce": Fraction(world_size - 1, world_size) * (lw["all_reduce"] + 2 * lw["control"]),
               "all_gather": Fraction(world_size - 1, world_size) * lw["all_gather"]}
    with CommCounter() as c:
        layerwise.step()
        rest.step()
    out["layerwise"] = {"received": c.received, "predicted": add(lw_pred, rest_pred)}
    out["n_total"] = sum(p.numel() for p in model.parameters())
    return out


def muon_chapter(rank: int, world_size: int, *, sizes: tuple = (2, 4), steps: int = 4, seed: int = 0) -> dict:
    """Everything chapter 14 runs on processes, in one launch: for each ``d`` in ``sizes``, on the first ``d``
    processes: :func:`layerwise_train`, :func:`moonlight_train` (float64 gather, ``"all"`` and ``"touched"``),
    :func:`chain_train`,
    :func:`tp_modes` on a ``(96, 32)`` matrix split by rows and by columns and :func:`transformer_comm`, all
    drawn from ``seed`` (a non-negative int, shifted by ``OPTBOOK_SEED_OFFSET`` through :mod:`optbook.runtime`,
    which the spawned ranks inherit).

    Returns:
        ``{d: report or None}`` with report keys ``"layerwise"``, ``"moonlight"``, ``"moonlight_touched"``,
        ``"chain"``, ``"tp_rows"``,
        ``"tp_cols"``, ``"comm"``.

    Raises:
        ValueError: ``seed`` is not a non-negative int (on every rank, before any collective).
    """
    _seed(seed)
    torch.set_num_threads(1)
    groups = {d: dist.group.WORLD if d == world_size else dist.new_group(list(range(d))) for d in sizes}
    out = {}
    for d in sizes:
        report = None
        if rank < d:
            g = groups[d]
            report = {"layerwise": layerwise_train(rank, d, steps=steps, seed=seed, group=g),
                      "moonlight": moonlight_train(rank, d, steps=steps, seed=seed, group=g),
                      "moonlight_touched": moonlight_train(rank, d, steps=steps, seed=seed, group=g,
                                                           gather="touched"),
                      "chain": chain_train(rank, d, seed=seed, group=g),
                      "tp_rows": tp_modes(rank, d, shape=(96, 32), partition_dim=0, seed=seed, group=g),
                      "tp_cols": tp_modes(rank, d, shape=(96, 32), partition_dim=1, seed=seed, group=g),
                      "comm": transformer_comm(rank, d, seed=seed, group=g)}
        out[d] = report
        dist.barrier()
    return out
