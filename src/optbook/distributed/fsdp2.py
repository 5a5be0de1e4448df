"""Muon on parameters sharded by PyTorch's FSDP2 (``fully_shard``), on 1-D and 2-D device meshes: whole
matrices through owners, two all-to-alls per step.

FSDP2 keeps each parameter as a ``DTensor`` and hands the optimizer each rank's part of the mean gradient:
rows (``Shard(0)``, ``torch.chunk`` sizes: possibly uneven, possibly empty on the last ranks) on a 1-D mesh;
on a 2-D mesh HSDP's ``(Replicate(), Shard(0))``, tensor parallelism under FSDP2 (``Shard(0)``/``Shard(1)``
on the TP dimension, with FSDP2's ``_StridedShard`` on the data-parallel one over a row-sharded TP weight),
or whole experts of a stacked ``(E, M, N)`` weight on an expert-parallel dimension. Element-wise optimizers
step the local parts directly (:mod:`optbook.optim`). Muon cannot: Newton–Schulz needs the whole matrix
(chapter 14). :class:`FSDP2Muon` brings each matrix to one *owner* rank and back (microsoft/dion's FSDP2
Muon, ``dion/muon.py`` at commit 0c20549, also moves whole matrices by all-to-all, in batches of ``d``
matrices, each rank orthogonalising one):

1. momentum on the local elements (element-wise, exactly Muon's ``lerp``; the buffer is a ``DTensor`` placed
   as the parameter) and the step direction (Nesterov's look-ahead) on them;
2. one ``all_to_all_single`` brings every matrix's elements to its owner, each element sent once (a
   replicated one by one replica) (:class:`optbook.distributed.mesh_exchange.MeshExchange`: the plan is
   made once, from each rank's global element indices; owners by LPT on the Newton–Schulz cost
   ``max(m, n) min(m, n)^2``, chapter 14, a matrix some rank holds whole staying there);
3. the owner orthogonalises each of its matrices once per step (:func:`optbook.optim.functional.muon`'s
   own arithmetic: head split, schedule, scale), and one more ``all_to_all_single`` sends every rank its
   elements of the updates (every replica of them);
4. every rank applies its elements: ``W_r <- W_r (1 - lr wd) - lr U_r``, Muon's update line.

With the agreement on the inputs (one small all-reduce) and, with ``max_grad_norm``, the norm (one more),
a step is at most 4 collective calls whatever the number of matrices. Every element sees single-process
Muon's operations in the same order, so the result is bitwise ``optbook.optim.Muon``'s in float64 and
float32 (``tests/test_fsdp2.py``, ``tests/test_fsdp2_mesh.py`` at 1 to 4 gloo processes). Per step a rank
receives the elements of its matrices that other ranks hold, and the elements it holds of matrices others
own (:meth:`FSDP2Muon.predicted_received_bytes`): on a 1-D mesh about ``2 (d - 1)/d`` of a matrix's bytes
per matrix over the ranks together, as FSDP2's own reduce-scatter and all-gather of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..clipping import _reduce_device, clip_coefficient, grad_sumsq
from ..optim import Muon
from ..optim.matrix_views import check_matrix_view, matrix_shape, matrix_view_of
from ..optim.muon import MUON_ROUTE, split_rows
from ..optim.optimizer import BookOptimizer
from ..optim._functional import momentum_directions
from ..optim.optimizer import all_finite
from .._sharded import is_dtensor, local
from . import _muon_common as common
from ._comm import (
    LOW_PRECISION,
    agree,
    first_nonfinite,
    group_position,
    param_name,
    raise_nonfinite_across,
    validate_locally,
)
from .mesh_exchange import MeshExchange
from .wire import all_reduce_received

__all__ = ["FSDP2Muon"]


class FSDP2Muon(common.MuonWrapper, Muon):
    """Muon for ``DTensor`` parameters on 1-D or 2-D device meshes (``fully_shard``, HSDP, TP under FSDP2,
    expert-parallel stacks): each matrix orthogonalised once per step by its owner rank (module docstring).

    Args:
        params: the ``DTensor`` parameters (or param-group dicts of them), the same list on every rank:
            2-D matrices, or with a group's ``matrix_view`` ``"stacked"`` (``(*E, M, N)``: ``prod(E)``
            matrices, e.g. MoE experts) or ``"flatten"`` (conv kernels), as :class:`optbook.optim.Muon`.
            Placements ``Shard``, ``_StridedShard`` or ``Replicate`` on each mesh dimension. All on one
            1-D mesh: the exchange runs over that mesh's group; otherwise (2-D meshes, sub-meshes, several
            meshes of one job, e.g. dense weights on ``dp`` and experts on ``ep``) over the default group,
            every rank of which must construct the optimizer. One dtype, float32 or float64
            (bfloat16/float16 shards are refused, naming the parameter: no float32 masters are kept here;
            FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` computes in bfloat16 over float32
            shards).
        max_grad_norm: clip the gradient by its global norm (all Muon parameters of this optimizer, summed
            over the shards: the norm of the unsharded gradient) before the momentum; ``None``: no clip.
        **muon_defaults: as :class:`optbook.optim.Muon` (``lr``, ``momentum``, ``nesterov``,
            ``weight_decay``, ``ns_steps``, ``ns_dtype``, ``head_split``, ...).

    Attributes:
        owners: ``owners[u]``, the rank (of the exchange group) that orthogonalises matrix ``u``: one matrix
            per 2-D parameter, ``prod(E)`` per stacked one, in group order (:attr:`units` says which).
        units: ``[(parameter index, matrix index in it, (M, N))]``, one per matrix.
        ns_calls: how many matrices this rank has orthogonalised since construction (every step adds the
            number it owns that had a gradient: Newton–Schulz runs once per matrix per step, whatever the
            gradient accumulation before it).
        last_grad_norm: the global gradient norm at the last step (``max_grad_norm`` set), else ``None``.
        found_inf, skipped_steps: the step contract's report (no loss scaler: a non-finite gradient raises
            on every rank, so ``found_inf`` is ``False`` after every completed step).
        report: the last step's :class:`optbook.wrapper.StepReport` (``found_inf``, ``grad_norm``,
            ``skipped_steps``).

    It is an :class:`optbook.wrapper.OptimizerWrapper` (``MuonWrapper`` of ``optbook.distributed._muon_common``):
    :meth:`step` is the base's template over the phases ``prepare_grads`` (every rank's checks agreed over the
    mesh), ``clip_grads`` (the norm over the shards, with ``max_grad_norm``), ``step_with_ready_grads``
    (momentum, one all-to-all to the owners, Newton–Schulz, one all-to-all back, the local update) and
    ``publish_weights`` (nothing: FSDP2 all-gathers the rows in the next forward pass). The base gives
    ``train()``/``eval()`` (no-ops: Muon has no modes), hooks, ``zero_grad(set_to_none=...)``, pickling and
    ``repr``; ``add_param_group`` after construction raises ``NotImplementedError`` (the owners are fixed).
    Checkpoints are :class:`optbook.optim.Muon`'s layout over the sharded state (``torch.distributed.checkpoint``
    reads and writes them, and reshards them to another mesh shape or world size: the momentum is a
    ``DTensor`` placed as its parameter).

    Raises:
        TypeError: a parameter that is not a ``DTensor``, or one with a ``Partial`` placement (named); what
            :class:`optbook.optim.Muon` raises (naming the argument).
        ValueError: ``max_grad_norm`` not a number ``> 0``; a bfloat16 or float16 parameter, or parameters
            of different dtypes (named); ranks passing different parameters, or a parameter whose mesh
            lies outside the exchange group (named). Raised at construction, before any state exists.
        optbook.contract.NonFiniteGradientError: :meth:`step`, a gradient shard holds ``inf`` or ``NaN`` on
            any rank (every rank raises, naming the parameter; nothing written).
    """

    #: steps sharded parameters (whole matrices are brought to owners), unlike :class:`optbook.optim.Muon`
    gathers_whole_matrices = True

    def __init__(self, params, *, max_grad_norm=None, **muon_defaults):
        max_grad_norm = common.check_max_grad_norm(max_grad_norm)
        Muon.__init__(self, params, **muon_defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(all_params):
            if not is_dtensor(p):
                raise TypeError(f"Invalid params: parameter {i} (shape {tuple(p.shape)}) is not a DTensor; "
                                "FSDP2Muon steps DTensors on a device mesh, as torch.distributed.fsdp."
                                "fully_shard (and tensor or expert parallelism) makes them (plain tensors: "
                                "optbook.optim.Muon)")
            if p.dtype in LOW_PRECISION:
                raise ValueError(f"Invalid params: {param_name(self.param_groups, i)} is {p.dtype}; FSDP2Muon steps "
                                 "float32 or float64 shards and keeps no float32 masters, so bfloat16 updates "
                                 "below the weights' precision would be lost. Keep float32 sharded parameters and "
                                 "compute in bfloat16 with fully_shard(module, mp_policy=MixedPrecisionPolicy("
                                 "param_dtype=torch.bfloat16)) (torch.distributed.fsdp)")
            if p.dtype != all_params[0].dtype:
                raise ValueError(f"Invalid params: {param_name(self.param_groups, i)} is {p.dtype} and parameter 0 "
                                 f"{all_params[0].dtype}; FSDP2Muon exchanges one dtype (one optimizer per dtype)")
        meshes = {id(p.device_mesh): p.device_mesh for p in all_params}
        one = next(iter(meshes.values())) if len(meshes) == 1 else None
        self.mesh = one if one is not None and one.ndim == 1 else None   # else: the default group
        self.process_group = self.mesh.get_group() if self.mesh is not None else dist.group.WORLD
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._exchange = MeshExchange(all_params, [matrix_view_of(self.param_groups[gi]) for gi in self._group_of],
                                      [self.param_groups[gi].get("head_split") for gi in self._group_of],
                                      self.process_group)
        self.world_size, self.rank = self._exchange.world_size, self._exchange.rank
        self.max_grad_norm = max_grad_norm
        self.owners, self.units = list(self._exchange.owners), list(self._exchange.units)
        # the local elements this rank counts in the norm (None: all of them; a replica counts none twice)
        self._primary = []
        for i, p in enumerate(all_params):
            primary = self._exchange.primary(i)
            self._primary.append(None if primary.numel() == p.to_local().numel() else primary)
        self._params = all_params
        self.ns_calls = 0
        self.last_grad_norm: float | None = None
        self.found_inf, self.skipped_steps = False, 0
        self._coefficient: float | None = None   # the clip of this step (clip_grads), for step_with_ready_grads

    def _check_shapes(self, group: dict, params: list) -> None:
        """:class:`optbook.optim.Muon`'s check of the shapes under the group's ``matrix_view`` (every view
        is stepped here: the exchange moves whole matrices, whichever tensor holds them)."""
        view = matrix_view_of(group)
        check_matrix_view(params, view, "FSDP2Muon", MUON_ROUTE)
        for p in params:
            if isinstance(p, torch.Tensor):
                split_rows(matrix_shape(p.shape, view)[0], group["head_split"])

    def _repr_options(self) -> str:
        return f"mesh rank {self.rank} of {self.world_size}, max_grad_norm={self.max_grad_norm}"

    def __getstate__(self) -> dict:
        """The base's (hooks dropped), without the process group: the mesh's (a device mesh pickles; a
        process group does not) or the default group again when unpickled."""
        group, self.process_group = self.process_group, None
        try:
            return super().__getstate__()   # (the exchange pickles without its group: MeshExchange.__getstate__)
        finally:
            self.process_group = group

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "process_group" in state and state["process_group"] is None:
            self.process_group = self.mesh.get_group() if self.mesh is not None else dist.group.WORLD
            self._exchange.group = self.process_group

    # --- checkpoints: optbook.optim.Muon's layout of the sharded state, the base running the hooks ------------
    def check_state_dict(self, state_dict) -> None:
        """:meth:`optbook.optim.BookOptimizer.check_state_dict` (writes nothing; ``ValueError``/``TypeError``)."""
        BookOptimizer.check_state_dict(self, state_dict)

    def _state_dict(self) -> dict:
        return common.plain_state_dict(self)

    def _load_state_dict(self, state_dict: dict) -> None:
        common.load_plain(self, state_dict)

    def predicted_received_bytes(self, with_grad=None) -> dict:
        """Bytes this rank receives in one :meth:`step`, by the plan: in the two all-to-alls, the elements
        of the matrices it owns that other ranks send it and the elements it holds of the matrices other
        ranks own (each times the parameters' bytes per element); in the all-reduces, the agreement's three
        int32 and, with ``max_grad_norm``, the float64 norm, as a ring all-reduce delivers them
        (:func:`optbook.distributed.wire.all_reduce_received`). ``with_grad``: which parameters have a
        gradient (default: all).

        Returns:
            ``{"all_to_all": int, "all_reduce": int or Fraction}``: what
            :class:`optbook.distributed.wire.CommCounter` counts on this rank (zeros at one rank).
        """
        present = tuple(True if with_grad is None else bool(with_grad[i]) for i in range(len(self._params)))
        size = self._params[0].element_size() if self._params else 0
        d = self.world_size
        reduced = all_reduce_received(12, d) + (all_reduce_received(8, d) if self.max_grad_norm is not None else 0)
        return {"all_to_all": self._exchange.received(present, size) if d > 1 and any(present) else 0,
                "all_reduce": reduced if d > 1 else 0}

    def _agree_on_inputs(self) -> None:
        """This rank's checks (hyperparameters, gradients, ``inf``/``NaN`` in its gradient shards; no
        collective), then one all-reduce (MAX) over the mesh of three int32 numbers, ``[outcome, s, M - s]``
        (:func:`~optbook.distributed._comm.agree`): the outcome is ``2 (rank + 1)`` (+1 for a non-finite
        error) for an invalid input, ``1`` for a non-finite shard, else ``0``, and
        ``s`` is a signature of which parameters have a gradient here (their bit mask for the first 30
        parameters, plus a hash modulo the prime ``M = 2**31 - 1`` for the others), so the ranks differ when
        the largest ``s`` is not the smallest. Every rank then raises if some rank's input was invalid (its
        own error, or a ``ValueError`` naming that rank), or if some parameter has a gradient on some ranks
        and none on others (naming it and both sets of mesh ranks: one ``all_gather_object`` on this error
        path), or if a gradient is non-finite (naming the first over the mesh:
        :func:`~optbook.distributed._comm.raise_nonfinite_across`, one more small
        collective on that error path). Nothing has been written then. 12 bytes per step in the common case
        (the non-finite verdict included)."""
        named = []  # (name, parameter) of the gradients to check for inf/NaN
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None and p.numel():
                    named.append((f"param_groups[{gi}]['params'][{pi}]", p))
        error = validate_locally(self)   # inf/NaN judged over the mesh below
        nonfinite = (error is None and self.refuse_nonfinite_grads and bool(named)
                     and not all_finite(local([p.grad for _, p in named])))  # this rank's shards: no collective
        present = [p.grad is not None for p in self._params]
        modulus = 2**31 - 1
        signature = sum((1 << i) if i < 30 else pow(16807, i, modulus) for i, h in enumerate(present) if h) % modulus
        device = local([self._params[0]])[0].device if self._params else torch.device("cpu")
        nonfinite, largest, complement = agree(error, self.rank, self.process_group, device, "FSDP2Muon",
                                               [signature, modulus - signature], verdict=nonfinite,
                                               dtype=torch.int32, group_name="mesh")
        if largest != modulus - complement:  # the ranks' signatures differ: name the first such parameter
            every = [None] * self.world_size
            dist.all_gather_object(every, present, group=self.process_group)
            i = next(i for i in range(len(present)) if len({e[i] for e in every}) > 1)
            gi, pi = group_position(self.param_groups, i)
            with_grad = [r for r in range(self.world_size) if every[r][i]]
            without = [r for r in range(self.world_size) if not every[r][i]]
            raise ValueError(f"FSDP2Muon.step: parameter {i} (param_groups[{gi}]['params'][{pi}], shape "
                             f"{tuple(self._params[i].shape)}) has a gradient on mesh ranks {with_grad} and none "
                             f"on mesh ranks {without}; FSDP2 gives every rank its shard of the mean gradient, so "
                             "the ranks disagree (zero_grad or backward on some ranks only?); nothing was changed "
                             "on any rank")
        if nonfinite:   # the same parameters on every rank: name the first non-finite one over the mesh
            raise_nonfinite_across("FSDP2Muon", first_nonfinite(local([p.grad for p in self._params])),
                                   self.param_groups, self.process_group, device)

    # --- the step in public phases (optbook.wrapper's template runs them) -------------------------------------
    def prepare_grads(self) -> bool:
        """Phase 1 of the step (a collective: every rank of the mesh calls :meth:`step`).

        Returns:
            ``False`` (no loss scaler: a non-finite gradient raises, it is never skipped).

        Every rank first checks its hyperparameters and gradients, then one small all-reduce over the mesh
        (12 bytes) agrees on the outcome, on ``inf``/``NaN`` and on which parameters have a gradient, so that
        every rank raises together (no rank is left waiting in an all-to-all) and nothing is written on any rank
        when one fails.

        Raises:
            ValueError, TypeError: an invalid hyperparameter (a one-element tensor ``lr``, ``momentum``,
                ``weight_decay``, ... is read as a float, as :class:`optbook.optim.Muon` reads it) or gradient,
                on any rank: on every rank (the others name the failing rank), before anything is written.
            ValueError: a parameter whose gradient is ``None`` on some ranks and present on others (FSDP2
                gives every rank its shard of the mean gradient, so the ranks disagree: a ``zero_grad`` or a
                backward pass on some ranks only), naming the parameter and both sets of mesh ranks; on every
                rank, before anything is written. A parameter without a gradient on every rank is not stepped.
            optbook.contract.NonFiniteGradientError: a gradient shard holds ``inf`` or ``NaN`` on some rank:
                every rank raises, nothing written.
        """
        self._coefficient = None
        self._agree_on_inputs()  # hyperparameters, gradients, the non-finite verdict: agreed over the mesh
        return False

    @torch.no_grad()
    def clip_grads(self) -> float | None:
        """Phase 2 (a collective with ``max_grad_norm``): the global norm over the shards (each element
        counted once: a replicated one on the rank that sends it to its owner), kept in
        :attr:`last_grad_norm` and returned, and the clip coefficient for the next phase; ``None`` without."""
        self._coefficient = 1.0
        if self.max_grad_norm is None:
            return None
        grads = []
        for p, primary in zip(self._params, self._primary):
            if p.grad is not None:
                g = local([p.grad])[0]
                grads.append(g if primary is None else g.reshape(-1)[primary])
        # no gradient on this rank: a zero on the CPU, or on the current GPU for NCCL (it reduces no CPU tensor)
        sumsq = grad_sumsq(grads, device=_reduce_device(grads, self.process_group))
        dist.all_reduce(sumsq, group=self.process_group)   # the shards' squares: the unsharded norm
        self.last_grad_norm = float(sumsq.sqrt())
        self._coefficient = clip_coefficient(self.last_grad_norm, self.max_grad_norm)
        return self.last_grad_norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Phase 3 (a collective): momentum on the local elements, one all-to-all bringing every matrix to
        its owner, Newton–Schulz there, one all-to-all bringing each rank its elements of the updates, the
        update of the local elements."""
        if self._coefficient is None:
            raise RuntimeError("FSDP2Muon: call prepare_grads() and clip_grads() first (nothing written)")
        coefficient, self._coefficient = self._coefficient, None
        groups = [self._read_floats(group) for group in self.param_groups]  # one-element tensors read as floats
        present = tuple(p.grad is not None for p in self._params)
        if not any(present):
            return
        directions = []
        for gi, p in zip(self._group_of, self._params):
            if p.grad is None:
                directions.append(None)
                continue
            group, state = groups[gi], self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            g = local([p.grad])[0]
            if coefficient < 1.0:
                g = g * coefficient
            (d,) = momentum_directions(local([state["momentum_buffer"]]), [g], group["momentum"],
                                       group["nesterov"])
            directions.append(d)
        full = self._exchange.to_owners(directions, present)       # all-to-all 1: {matrix: whole (M, N)}
        updates = {}
        for gi, group in enumerate(groups):   # per group (its options); matrices in the plan's order
            mine = [u for u in sorted(full) if self._group_of[self.units[u][0]] == gi]
            if mine:
                updates.update(zip(mine, common.scaled_orthogonal([full[u] for u in mine],
                                                                  {**group, "matrix_view": "matrix"})))
        self.ns_calls += len(full)
        like = next(d for d in directions if d is not None)
        received = self._exchange.from_owners(updates, present, like)   # all-to-all 2: this rank's elements
        for gi, p, u in zip(self._group_of, self._params, received):
            if u is None:
                continue
            lr, wd = groups[gi]["lr"], groups[gi]["weight_decay"]
            w = local([p])[0]
            w.mul_(1 - lr * wd)
            w.sub_(u.view(w.shape), alpha=lr)
