"""Muon on parameters sharded by PyTorch's FSDP2 (``fully_shard``): whole matrices through owners.

FSDP2 keeps each parameter as a ``DTensor`` sharded by rows (``Shard(0)``, ``torch.chunk`` sizes: possibly
uneven, possibly empty on the last ranks) and hands the optimizer each rank's rows of the mean gradient.
Element-wise optimizers step those rows directly (:mod:`optbook.optim`). Muon cannot: Newton–Schulz needs
the whole matrix (chapter 14). :class:`FSDP2Muon` brings each matrix to one *owner* rank and back, a
"gather to owners, scatter back" design (microsoft/dion's FSDP2 Muon, ``dion/muon.py`` at commit 0c20549, also
moves whole matrices, in batches of ``d`` matrices exchanged by all-to-all, each rank orthogonalising one):

1. momentum on the local rows (element-wise, exactly Muon's ``lerp``; the buffer is a sharded ``DTensor``,
   ``1/d`` of Muon's state per rank) and the step direction (Nesterov's look-ahead) on the local rows;
2. the direction's rows gathered to the matrix's owner (``torch.distributed.gather``, rows padded to the
   largest shard); owners chosen once by LPT on the Newton–Schulz cost ``max(m, n) min(m, n)^2``
   (:func:`optbook.distributed.lpt_assign`, chapter 14);
3. the owner orthogonalises each of its matrices once per step (:func:`optbook.optim.functional.muon`'s own arithmetic:
   head split, schedule, scale) and scatters each rank its rows of the update
   (``torch.distributed.scatter``);
4. every rank applies its rows: ``W_r <- W_r (1 - lr wd) - lr U_r``, Muon's update line.

Every element sees single-process Muon's operations in the same order, so in float64 the result is bitwise
``optbook.optim.Muon``'s (``tests/test_fsdp2.py`` at 1 to 4 gloo processes). Per matrix of ``m x n``
elements and step, the two collectives move ``(d - 1)/d`` of the matrix each way (in the parameters'
dtype), against ``(d - 1)/d`` for FSDP2's own reduce-scatter of the gradient and all-gather of the weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..clipping import _reduce_device, clip_coefficient, grad_sumsq
from ..optim import Muon
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
from .assignment import lpt_assign, ns_cost

__all__ = ["FSDP2Muon"]


def _row_chunks(rows: int, world_size: int) -> list[int]:
    """The rows of each rank under ``Shard(0)``: ``torch.chunk``'s sizes, zeros for ranks past the last chunk."""
    sizes = [c.shape[0] for c in torch.empty(rows, 0).chunk(world_size)]
    return sizes + [0] * (world_size - len(sizes))


class FSDP2Muon(common.MuonWrapper, Muon):
    """Muon for ``fully_shard``-ed 2-D parameters (``DTensor``, ``Shard(0)`` on a 1-D mesh): each matrix
    orthogonalised once per step by its owner rank (module docstring).

    Args:
        params: the 2-D ``DTensor`` parameters FSDP2 made (or param-group dicts of them), the same on every
            rank of one 1-D device mesh, sharded by rows; float32 or float64 (bfloat16/float16 shards are
            refused, naming the parameter: no float32 masters are kept here; FSDP2's
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` computes in bfloat16 over float32 shards).
        max_grad_norm: clip the gradient by its global norm (all Muon parameters of this optimizer, summed
            over the shards: the norm of the unsharded gradient) before the momentum; ``None``: no clip.
        **muon_defaults: as :class:`optbook.optim.Muon` (``lr``, ``momentum``, ``nesterov``,
            ``weight_decay``, ``ns_steps``, ``ns_dtype``, ``head_split``, ...).

    Attributes:
        owners: ``owners[i]``, the mesh rank that orthogonalises parameter ``i`` (in group order).
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
    (momentum, gather to owners, Newton–Schulz, scatter back, the update of the local rows) and
    ``publish_weights`` (nothing: FSDP2 all-gathers the rows in the next forward pass). The base gives
    ``train()``/``eval()`` (no-ops: Muon has no modes), hooks, ``zero_grad(set_to_none=...)``, pickling and
    ``repr``; ``add_param_group`` after construction raises ``NotImplementedError`` (the owners are fixed).
    Checkpoints are :class:`optbook.optim.Muon`'s layout over the sharded state (``torch.distributed.checkpoint``
    reads and writes them).

    Raises:
        TypeError: a parameter that is not a ``DTensor`` sharded by rows on a 1-D mesh, or parameters on
            different meshes; what :class:`optbook.optim.Muon` raises (naming the argument).
        ValueError: ``max_grad_norm`` not a number ``> 0``; a bfloat16 or float16 parameter (named).
        optbook.contract.NonFiniteGradientError: :meth:`step`, a gradient shard holds ``inf`` or ``NaN`` on
            any rank (every rank raises, naming the parameter; nothing written).
    """

    #: steps sharded parameters (whole matrices are gathered), unlike :class:`optbook.optim.Muon`
    gathers_whole_matrices = True

    def __init__(self, params, *, max_grad_norm=None, **muon_defaults):
        max_grad_norm = common.check_max_grad_norm(max_grad_norm)
        Muon.__init__(self, params, **muon_defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        mesh = None
        for i, p in enumerate(all_params):
            placements = tuple(p.placements) if is_dtensor(p) else None
            if placements is None or p.device_mesh.ndim != 1 or not placements[0].is_shard(0):
                raise TypeError(f"Invalid params: parameter {i} (shape {tuple(p.shape)}) is "
                                f"{'a DTensor placed as ' + str(placements) if placements else 'not a DTensor'}; "
                                "FSDP2Muon steps DTensors sharded by rows (Shard(0)) on a 1-D mesh, as "
                                "torch.distributed.fsdp.fully_shard makes them (plain tensors: optbook.optim.Muon)")
            if p.dtype in LOW_PRECISION:
                raise ValueError(f"Invalid params: {param_name(self.param_groups, i)} is {p.dtype}; FSDP2Muon steps "
                                 "float32 or float64 shards and keeps no float32 masters, so bfloat16 updates "
                                 "below the weights' precision would be lost. Keep float32 sharded parameters and "
                                 "compute in bfloat16 with fully_shard(module, mp_policy=MixedPrecisionPolicy("
                                 "param_dtype=torch.bfloat16)) (torch.distributed.fsdp)")
            if mesh is None:
                mesh = p.device_mesh
            elif p.device_mesh != mesh:
                raise TypeError(f"Invalid params: parameter {i} is on another device mesh than parameter 0")
        self.mesh = mesh
        self.process_group = mesh.get_group() if mesh is not None else None
        self.world_size = mesh.size() if mesh is not None else 1
        self.rank = mesh.get_local_rank() if mesh is not None else 0
        self.max_grad_norm = max_grad_norm
        self.owners = lpt_assign([ns_cost(tuple(p.shape), g.get("head_split")) for g in self.param_groups
                                  for p in g["params"]], self.world_size)
        self._params = all_params
        self.ns_calls = 0
        self.last_grad_norm: float | None = None
        self.found_inf, self.skipped_steps = False, 0
        self._coefficient: float | None = None   # the clip of this step (clip_grads), for step_with_ready_grads

    def _repr_options(self) -> str:
        return f"mesh rank {self.rank} of {self.world_size}, max_grad_norm={self.max_grad_norm}"

    def __getstate__(self) -> dict:
        """The base's (hooks dropped), without the mesh's process group: read from the mesh again when
        unpickled (a device mesh pickles; a process group does not)."""
        group, self.process_group = self.process_group, None
        try:
            return super().__getstate__()
        finally:
            self.process_group = group

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "process_group" in state and state["process_group"] is None and self.mesh is not None:
            self.process_group = self.mesh.get_group()

    # --- checkpoints: optbook.optim.Muon's layout of the sharded state, the base running the hooks ------------
    def check_state_dict(self, state_dict) -> None:
        """:meth:`optbook.optim.BookOptimizer.check_state_dict` (writes nothing; ``ValueError``/``TypeError``)."""
        BookOptimizer.check_state_dict(self, state_dict)

    def _state_dict(self) -> dict:
        return common.plain_state_dict(self)

    def _load_state_dict(self, state_dict: dict) -> None:
        common.load_plain(self, state_dict)

    def _global_rank(self, mesh_rank: int) -> int:
        return dist.get_global_rank(self.process_group, mesh_rank)

    def _to_owner(self, rows: torch.Tensor, shape: tuple, owner: int):
        """Start gathering the row shards of one ``shape`` matrix on ``owner`` (``async_op``: every matrix's
        gather is in flight before the first is waited on). Returns ``(work, finish)``: after
        ``work.wait()``, ``finish()`` is the full matrix on ``owner``, ``None`` elsewhere."""
        sizes = _row_chunks(shape[0], self.world_size)
        pad = max(sizes)
        if rows.shape[0] == pad and rows.is_contiguous():
            send = rows   # (read by the gather, not written, until the wait)
        else:   # a short or empty last shard: padded (the pad rows are sent but never read)
            send = rows.new_zeros((pad, shape[1]))
            send[: rows.shape[0]].copy_(rows)
        full = recv = None
        if self.rank == owner:
            if pad and all(n == pad for n in sizes):   # even shards: received straight into the rows of the matrix
                full = rows.new_empty(shape)
                recv = list(full.split(pad))
            else:
                recv = [torch.empty_like(send) for _ in sizes]
        work = dist.gather(send, recv, dst=self._global_rank(owner), group=self.process_group, async_op=True)

        def finish():
            if self.rank != owner:
                return None
            return full if full is not None else torch.cat([r[:n] for r, n in zip(recv, sizes)])
        return work, finish

    def _from_owner(self, full: torch.Tensor | None, shape: tuple, owner: int, like: torch.Tensor):
        """Start scattering ``full`` (on ``owner``) back as row shards (``async_op``). Returns ``(work, rows)``:
        after ``work.wait()``, ``rows`` is this rank's rows of it."""
        sizes = _row_chunks(shape[0], self.world_size)
        pad = max(sizes)
        recv = like.new_empty((pad, shape[1]))
        chunks = None
        if self.rank == owner:
            if pad and full.is_contiguous() and all(n == pad for n in sizes):   # even shards: the rows themselves
                chunks = list(full.split(pad))
            else:   # uneven shards (padded; the pad rows are sent but never read) or a transposed view
                chunks, row = [], 0
                for n in sizes:
                    c = full.new_empty((pad, shape[1]))
                    c[:n].copy_(full[row:row + n])
                    c[n:].zero_()
                    chunks.append(c)
                    row += n
        work = dist.scatter(recv, chunks, src=self._global_rank(owner), group=self.process_group, async_op=True)
        return work, recv[: sizes[self.rank]]

    def predicted_received_bytes(self, with_grad=None) -> dict:
        """Bytes this rank receives in one :meth:`step`, by the design: for each matrix ``(m, n)`` of
        ``b``-byte elements, with ``p = ceil(m / d)`` the rows of the largest shard (the collectives move
        padded shards), the owner receives ``(d - 1) p n b`` in the gather and every other rank ``p n b`` in
        the scatter. ``with_grad``: which parameters have a gradient (default: all).

        Returns:
            ``{"gather": int, "scatter": int}`` (what :class:`optbook.distributed.wire.CommCounter` counts).
        """
        d = self.world_size
        out = {"gather": 0, "scatter": 0}
        for i, p in enumerate(self._params):
            if (with_grad is not None and not with_grad[i]) or d == 1:
                continue
            padded = max(_row_chunks(p.shape[0], d)) * p.shape[1] * p.element_size()
            if self.owners[i] == self.rank:
                out["gather"] += (d - 1) * padded
            else:
                out["scatter"] += padded
        return out

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
        every rank raises together (no rank is left waiting in a gather) and nothing is written on any rank
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
        """Phase 2 (a collective with ``max_grad_norm``): the global norm over the shards (kept in
        :attr:`last_grad_norm` and returned) and the clip coefficient for the next phase; ``None`` without."""
        self._coefficient = 1.0
        if self.max_grad_norm is None:
            return None
        grads = local([p.grad for p in self._params if p.grad is not None])
        # no gradient on this rank: a zero on the CPU, or on the current GPU for NCCL (it reduces no CPU tensor)
        mesh_group = dist.group.WORLD if self.process_group is None else self.process_group
        sumsq = grad_sumsq(grads, device=_reduce_device(grads, mesh_group))
        dist.all_reduce(sumsq, group=self.process_group)   # the shards' squares: the unsharded norm
        self.last_grad_norm = float(sumsq.sqrt())
        self._coefficient = clip_coefficient(self.last_grad_norm, self.max_grad_norm)
        return self.last_grad_norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Phase 3 (a collective): momentum on the local rows, the directions gathered to their owners,
        Newton–Schulz there, the update scattered back and applied to the local rows."""
        if self._coefficient is None:
            raise RuntimeError("FSDP2Muon: call prepare_grads() and clip_grads() first (nothing written)")
        coefficient, self._coefficient = self._coefficient, None
        groups = [self._read_floats(group) for group in self.param_groups]  # one-element tensors read as floats
        index = 0
        for group in groups:
            entries = []  # (parameter index, parameter, local direction rows)
            for p in group["params"]:
                i, index = index, index + 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                g = local([p.grad])[0]
                if coefficient < 1.0:
                    g = g * coefficient
                (d,) = momentum_directions(local([state["momentum_buffer"]]), [g], group["momentum"],
                                           group["nesterov"])
                entries.append((i, p, d))
            # every rank takes part in every matrix's gather, in the same order; all are in flight at once
            gathers = [(i, *self._to_owner(d, tuple(p.shape), self.owners[i])) for i, p, d in entries]
            full = {}
            for i, work, finish in gathers:
                work.wait()
                gathered = finish()
                if gathered is not None:
                    full[i] = gathered
            mine = sorted(full)
            updates = dict(zip(mine, common.scaled_orthogonal([full[i] for i in mine], group))) if mine else {}
            self.ns_calls += len(mine)
            lr, wd = group["lr"], group["weight_decay"]
            scatters = [(p, *self._from_owner(updates.get(i), tuple(p.shape), self.owners[i], d))
                        for i, p, d in entries]
            for p, work, rows in scatters:
                work.wait()
                w = local([p])[0]
                w.mul_(1 - lr * wd)
                w.sub_(rows, alpha=lr)
