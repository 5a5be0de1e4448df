"""ZeRO-1 checkpoints: consolidated (the plain ``torch.optim`` layout) and sharded (one file per rank).
Explained in chapter 13.

Consolidated (:meth:`~optbook.distributed.DistributedOptimizer.consolidate_state_dict`, then ``state_dict()``
on one rank): loadable at any world size and into a single-process optimizer. Sharded
(:meth:`~optbook.distributed.DistributedOptimizer.sharded_state_dict`, one file per rank, no communication):
each rank's pieces of m, v and the masters, with the piece boundaries as layout metadata and the layout
fingerprint every sharded checkpoint of :mod:`optbook.distributed` records (``"layout"``);
:meth:`~optbook.distributed.DistributedOptimizer.load_sharded_state_dict` takes the rank's own file (same world
size) or the list of all files of a save at any world size (each rank keeps the elements its pieces cover).
Every load validates the whole dict before it writes anything.

The consolidated layout is :mod:`optbook.masters`' (one checkpoint layout for masters, as
:class:`~optbook.precision.MixedPrecisionOptimizer` and :class:`~optbook.memory.OffloadOptimizer` write it):
``torch.optim``'s, with the float32 master of a float16/bfloat16 parameter in its state under
:data:`~optbook.masters.MASTER_KEY` (``state[i]["master_param"]``). So the consolidated dict of a bfloat16
model loads into ``MixedPrecisionOptimizer(optimizer_class(...))`` on one process and back. A dict written
before this layout (the masters under a top-level ``"master_params"``: ``{index: master}``) still loads.

``torch.distributed.checkpoint.state_dict``'s ``get_``/``set_optimizer_state_dict`` (full or sharded, with
``cpu_offload``) work on a replicated model: they call ``state_dict()`` on every rank, which then consolidates
on every rank (each holds the whole state: ZeRO-1 saves memory in the step, not in such a checkpoint; for
one file per rank use :meth:`~Zero1Checkpoints.sharded_state_dict`), and the masters travel inside ``state``,
which DCP keeps. DCP primes an optimizer whose ``state`` is empty (a step at ``lr`` 0 on zero gradients,
:mod:`optbook.wrapper`); ``state`` here is a view of this rank's pieces' state, so a read after steps does not
prime again.

:class:`Zero1Checkpoints` holds these methods for :class:`~optbook.distributed.DistributedOptimizer` (its only
user): they read the optimizer's ``layout``, ``pieces``, ``optimizer`` (the inner optimizer over the pieces),
``master_shards``, ``loss_scaler``, ``skipped_steps`` and its parameter views.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..masters import MASTER_KEY
from ._comm import LOW_PRECISION, check_int, check_layout, check_one_save, consolidated_here, describe_layout
from ._comm import layout_fingerprint

__all__ = ["SHARDED_FORMAT", "Zero1Checkpoints"]

#: The ``"format"`` entry of :meth:`DistributedOptimizer.sharded_state_dict`.
SHARDED_FORMAT = "optbook.DistributedOptimizer.sharded/1"


def indexed_param_groups(param_groups: list[dict]) -> list[dict]:
    """``param_groups`` as a state dict stores them: each group's options (deep copies) and its parameters
    as consecutive integers counted across the groups, numbered as ``torch.optim.Optimizer.state_dict``
    numbers them."""
    groups, i = [], 0
    for g in param_groups:
        n = len(g["params"])
        groups.append({**copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
                       "params": list(range(i, i + n))})
        i += n
    return groups


class _StateView(dict):
    """A dict whose truth value is given: whether *any* rank holds state (the same on every rank), so that
    ``torch.distributed.checkpoint``'s ``if optim.state:`` agrees across ranks even where a rank steps no
    piece (a small model: its shard is padding) and so holds none -- one rank priming alone would wait in a
    collective the others never enter."""

    def __init__(self, items: dict, any_rank: bool):
        super().__init__(items)
        self.any_rank = any_rank

    def __bool__(self) -> bool:
        return self.any_rank


class Zero1Checkpoints:
    """The checkpoint methods of :class:`~optbook.distributed.DistributedOptimizer` (a mixin)."""

    _has_state = False   # some rank holds state: after an applied (or priming) step, or a load with state

    @property
    def state(self) -> dict:
        """``{model parameter: this rank's state of its piece}``: the inner optimizer's state of each piece this
        rank steps (1-D tensors of the piece's length; the step count), keyed by the model's parameter; a
        parameter without a piece here, or without state, is absent. A view, rebuilt at each access (writes to
        the inner dicts go through). Its truth value is whether any rank holds state (the same on every rank):
        ``torch.distributed.checkpoint`` reads it to decide on its priming step (``optbook.wrapper.
        is_priming_step``), which every rank must take or none."""
        inner = getattr(self, "optimizer", None)
        if inner is None:   # torch.optim.Optimizer.__init__, before the inner optimizer exists
            return {}
        out = {}
        for piece, target in zip(self.pieces, self._piece_params):
            s = inner.state.get(target)
            if s:
                out[self._params[piece.index]] = s
        return _StateView(out, bool(out) or self._has_state)

    @state.setter
    def state(self, value) -> None:
        """Only ``torch.optim.Optimizer.__init__``'s empty dict: the state lives in the inner optimizer."""
        if value:
            raise AttributeError("DistributedOptimizer.state is a view of the inner optimizer's state; load a "
                                 "state dict instead")

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on group rank ``to`` (a collective), for :meth:`state_dict`.

        Every rank sends its pieces' state (moved to the CPU) with ``torch.distributed.gather_object``; rank
        ``to`` assembles it. The result is dropped at the next :meth:`step`.

        Raises:
            TypeError, ValueError: ``to`` is not an int in ``0 .. world_size - 1`` (on every rank, before any
                communication).
        """
        to = check_int("to", to, 0)
        if to >= self.world_size:
            raise ValueError(f"Invalid to: expected a rank in 0 .. {self.world_size - 1}, got {to}")
        local = self._local_pieces()
        gathered = [None] * self.world_size if self.rank == to else None
        world = self.process_group is dist.group.WORLD
        dst = to if world else dist.get_global_rank(self.process_group, to)
        dist.gather_object(local, gathered, dst=dst, group=self.process_group)
        self._consolidated = (to, self._assemble(gathered) if self.rank == to else None)

    def _consolidate_everywhere(self) -> dict:
        """The consolidated dict on every rank (a collective: one ``all_gather_object`` of the pieces)."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, self._local_pieces(), group=self.process_group)
        self._consolidated = ("every rank", self._assemble(gathered))
        return self._consolidated[1]

    def _local_pieces(self) -> list[tuple]:
        """``(index, param_start, param_end, state, master or None)`` per piece of this rank, on the CPU."""
        local = []
        for piece, target in zip(self.pieces, self._piece_params):
            state = self.optimizer.state.get(target, {})
            state = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                     for k, v in state.items()}
            master = target.detach().cpu().clone() if piece.bucket in self.master_shards else None
            local.append((piece.index, piece.param_start, piece.param_end, state, master))
        return local

    def _assemble(self, gathered: list) -> dict:
        flat_state: dict[int, dict] = {}
        masters: dict[int, torch.Tensor] = {}
        for pieces in gathered:
            for index, s, e, state, master in pieces:
                r = self.layout.params[index]
                entry = flat_state.setdefault(index, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.shape == (e - s,):  # element-wise state
                        entry.setdefault(key, torch.zeros(r.numel, dtype=value.dtype))[s:e] = value
                    else:
                        entry[key] = value  # the same on every piece (a step count)
                if master is not None:
                    masters.setdefault(index, torch.zeros(r.numel, dtype=master.dtype))[s:e] = master
        for r in self.layout.params:  # every low-precision parameter has a master (zero elements included)
            if r.dtype in LOW_PRECISION:
                masters.setdefault(r.index, torch.zeros(r.numel, dtype=torch.float32))
        state = {}
        for index in sorted(set(flat_state) | set(masters)):
            shape = self.layout.params[index].shape
            entry = {k: (v.view(shape) if isinstance(v, torch.Tensor) and v.dim() == 1
                         and v.numel() == self.layout.params[index].numel else v)
                     for k, v in flat_state.get(index, {}).items()}
            if index in masters:   # optbook.masters' layout: the master in its parameter's state
                entry[MASTER_KEY] = masters[index].view(shape)
            if entry:
                state[index] = entry
        param_groups = indexed_param_groups(self.param_groups)
        return {"state": state, "param_groups": param_groups,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        """The consolidated state: on the rank that :meth:`consolidate_state_dict` sent it to; or, when nothing
        was consolidated since the last step or load, on every rank (then a collective: every rank calls it, as
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and ``set_optimizer_state_dict``
        do -- so DCP's full and sharded state dicts of a replicated model work, each rank holding the whole
        state; the last one is kept until the next step or load).

        Returns:
            The plain ``torch.optim`` layout -- ``{"state": {index: {"step": ..., "exp_avg": tensor of the
            parameter's shape, ...}}, "param_groups": [{hyperparameters..., "params": [indices]}]}`` with
            parameters numbered in param-group order (as ``torch.optim``, also when groups interleave
            relative to ``model.parameters()``), state tensors on the CPU in the masters' dtype -- plus
            ``"loss_scaler"`` (its state or ``None``) and ``"skipped_steps"``, which ``torch.optim`` ignores.
            The float32 master of each float16/bfloat16 parameter is in its state under ``"master_param"``
            (:data:`optbook.masters.MASTER_KEY`: the layout of ``MixedPrecisionOptimizer``). It loads into a
            DistributedOptimizer at any world size, into the single-process ``optimizer_class`` (e.g.
            ``torch.optim.AdamW``) over the same float32/float64 parameters, and, for a float16/bfloat16
            model, into ``MixedPrecisionOptimizer(optimizer_class(...))`` over them.

        Raises:
            RuntimeError: consolidated on another rank since the last step (call it on that rank).
        """
        if self._consolidated is None:
            return self._consolidate_everywhere()
        return consolidated_here("DistributedOptimizer", self._consolidated, self.rank)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict (from :meth:`state_dict` at any world size, or from the
        single-process ``optimizer_class`` over the same parameters). Not a collective: call it on every
        rank with the same dict; each rank keeps its own pieces.

        Hyperparameters of ``param_groups`` are taken from the dict (as ``torch.optim``); a parameter's
        ``state[i]["master_param"]`` (:mod:`optbook.masters`' layout; also a ``MixedPrecisionOptimizer``'s
        dict), when present, becomes its master and is rounded into the model parameter (a dict of the
        older layout, masters under a top-level ``"master_params"``, loads the same); ``loss_scaler`` and
        ``skipped_steps``, when present, are restored.

        Raises:
            TypeError, ValueError: not a dict with ``state`` and ``param_groups``; another number of groups or
                of parameters per group; a state tensor or master whose shape differs from its parameter's; a
                master that is not floating point or holds inf/NaN, or one given for a float32/float64
                parameter (which is its own master); a loss-scaler state without a scaler, or one the scaler
                refuses. All found before anything is loaded.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise TypeError("Invalid state_dict: expected a dict with 'state' and 'param_groups' (from "
                            "DistributedOptimizer.state_dict() or a torch.optim optimizer's state_dict())")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"Invalid state_dict: it has {len(saved_groups)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        index_of, i = {}, 0
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"Invalid state_dict: param group {gi} has {len(saved['params'])} "
                                 f"parameters, this optimizer's has {len(group['params'])}")
            for saved_id in saved["params"]:
                index_of[saved_id] = i
                i += 1
        owner_group = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        kinds = [self._state_kinds({k: v for k, v in g.items() if k != "params"}) for g in saved_groups]
        state: dict[int, dict] = {}
        masters = {}
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in index_of:
                raise ValueError(f"Invalid state_dict: state for parameter {saved_id!r}, which no group "
                                 "lists")
            index = index_of[saved_id]
            if isinstance(entry, dict) and MASTER_KEY in entry:
                masters[index] = self._checked_master(f"state[{saved_id!r}][{MASTER_KEY!r}]",
                                                      entry[MASTER_KEY], index)
                entry = {k: v for k, v in entry.items() if k != MASTER_KEY}
                if not entry:   # a master saved before the first step: no optimizer state yet
                    continue
            self._check_state_entry(f"state[{saved_id!r}]", entry, kinds[owner_group[index]], index)
            state[index] = entry
        for saved_id, value in (state_dict.get("master_params") or {}).items():   # the older layout
            index = index_of.get(saved_id)
            if index is None:
                raise ValueError(f"Invalid state_dict: master_params[{saved_id!r}] does not match a "
                                 "parameter's shape")
            masters[index] = self._checked_master(f"master_params[{saved_id!r}]", value, index)
        scaler_state = state_dict.get("loss_scaler")
        if scaler_state is not None:
            if self.loss_scaler is None:
                raise ValueError("Invalid state_dict: it holds a loss scaler state, but this optimizer has "
                                 "no loss_scaler")
            copy.deepcopy(self.loss_scaler).load_state_dict(scaler_state)  # refuses before any write
        skipped = state_dict.get("skipped_steps", self.skipped_steps)
        skipped = check_int("state_dict['skipped_steps']", skipped, 0)

        # The inner optimizer's own state dict: this rank's pieces, numbered in its group order.
        inner_state, inner_groups, k = {}, [], 0
        pieces_of_group: list[list[int]] = [[] for _ in self.param_groups]
        for n, piece in enumerate(self.pieces):
            pieces_of_group[owner_group[piece.index]].append(n)
        order = [n for ns in pieces_of_group for n in ns]
        for gi, ns in enumerate(pieces_of_group):
            hyper = {key: v for key, v in saved_groups[gi].items() if key != "params"}
            inner_groups.append({**hyper, "params": list(range(k, k + len(ns)))})
            k += len(ns)
        for k, n in enumerate(order):
            piece = self.pieces[n]
            if piece.index in state:
                elementwise = kinds[owner_group[piece.index]]
                inner_state[k] = {key: (v.reshape(-1)[piece.param_start:piece.param_end].clone()
                                        if elementwise[key] else copy.deepcopy(v))
                                  for key, v in state[piece.index].items()}
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for gi, group in enumerate(self.param_groups):
            group.update(copy.deepcopy({key: v for key, v in saved_groups[gi].items() if key != "params"}))
        if scaler_state is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        self.skipped_steps = skipped
        with torch.no_grad():
            for index, value in masters.items():
                self._param_view(index).copy_(value.reshape(-1))  # every rank rounds the whole master
            for piece, target in zip(self.pieces, self._piece_params):
                if piece.index in masters:
                    target.copy_(masters[piece.index].reshape(-1)[piece.param_start:piece.param_end])
        self._consolidated = None
        self._has_state = bool(state)   # the same dict on every rank
        # The model's parameters now agree with the loaded masters (or are the masters' own storage); a
        # weights-only reload made before this load is superseded by it.
        self._versions.record(self._params)

    def _checked_master(self, where: str, value, index: int) -> torch.Tensor:
        """``value`` as the master of parameter ``index``: a finite floating-point tensor of its shape, for a
        float16/bfloat16 parameter (a float32/float64 one is its own master)."""
        r = self.layout.params[index]
        if r.dtype not in LOW_PRECISION:
            raise ValueError(f"Invalid state_dict: {where} is a master for parameter {index}, which is "
                             f"{r.dtype} and its own master (a state dict of a bfloat16/float16 model?)")
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != r.shape:
            what = (f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise ValueError(f"Invalid state_dict: {where} does not match a parameter's shape: expected a "
                             f"floating-point tensor of shape {tuple(r.shape)}, got {what}")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"Invalid state_dict: {where} holds inf or NaN; nothing was loaded")
        return value

    def _state_kinds(self, hyper: dict) -> dict:
        """``{state key: element-wise?}`` of the inner optimizer's per-parameter state under the group
        hyperparameters ``hyper``: read from one step of ``optimizer_class`` on a 2-element tensor with a zero
        gradient (element-wise entries are tensors of that tensor's shape; a step count is not). A 0-dim
        parameter's state cannot tell the two apart by shape, so the class is asked."""
        probe = torch.zeros(2, dtype=torch.float32, requires_grad=True)
        probe.grad = torch.zeros(2, dtype=torch.float32)
        try:
            opt = type(self.optimizer)([{**hyper, "params": [probe]}], **self._class_kwargs)
            opt.step()
        except (TypeError, ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"Invalid state_dict: its param_groups hyperparameters are refused by "
                             f"{type(self.optimizer).__name__}: {e}") from e
        return {k: isinstance(v, torch.Tensor) and v.shape == probe.shape for k, v in opt.state[probe].items()}

    def _check_state_entry(self, where: str, entry, kinds: dict, index: int) -> None:
        """``entry`` must hold exactly the inner optimizer's state keys, element-wise ones as floating-point
        tensors of parameter ``index``'s shape, the others as numbers or one-element tensors."""
        shape = self.layout.params[index].shape
        if not isinstance(entry, dict):
            raise TypeError(f"Invalid state_dict: {where} is a {type(entry).__name__}, expected a dict")
        if set(entry) != set(kinds):
            raise ValueError(f"Invalid state_dict: {where} has the keys {sorted(entry)}, "
                             f"{type(self.optimizer).__name__} keeps {sorted(kinds)} (a state dict of another "
                             "optimizer or of another model)")
        for key, value in entry.items():
            if kinds[key]:
                if (not isinstance(value, torch.Tensor) or not value.is_floating_point()
                        or tuple(value.shape) != shape):
                    what = (f"shape {tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                            else type(value).__name__)
                    raise ValueError(f"Invalid state_dict: {where}[{key!r}] is {what}, expected a "
                                     f"floating-point tensor of its parameter's shape {shape} (a state dict "
                                     "of another model?)")
            elif isinstance(value, torch.Tensor) and value.numel() > 1:
                raise ValueError(f"Invalid state_dict: {where}[{key!r}] has shape {tuple(value.shape)}, "
                                 "expected a number (a state dict of another optimizer?)")

    # --- sharded checkpoints: one file per rank --------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's part of the optimizer state, for one checkpoint file per rank. Not a collective.

        Returns:
            ``{"format": SHARDED_FORMAT, "rank", "world_size", "params": [(shape, dtype name)] in
            param-group order, "pieces": [(index, param_start, param_end, state, master)], "param_groups",
            "loss_scaler", "skipped_steps"}``: for each piece this rank owns, elements ``param_start ..
            param_end - 1`` of the flattened parameter ``index``, its inner-optimizer state (element-wise
            tensors such as ``exp_avg``, ``exp_avg_sq`` of the piece's length; the step count) and its
            float32 master (``None`` for a float32/float64 parameter, which is its own master). Tensors are
            CPU copies; only plain types, so ``torch.save`` / ``torch.load(weights_only=True)`` round-trip
            it. Padding is not stored. The model's parameters are not included: save them separately (they
            are the same on every rank, e.g. ``model.state_dict()`` on rank 0). ``"layout"``:
            :meth:`checkpoint_layout`, which :meth:`load_sharded_state_dict` compares.
        """
        groups = indexed_param_groups(self.param_groups)
        return {"format": SHARDED_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "layout": self.checkpoint_layout(),
                "params": [(tuple(r.shape), str(r.dtype)) for r in self.layout.params],
                "pieces": self._local_pieces(), "param_groups": groups,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def checkpoint_layout(self) -> dict:
        """The layout fingerprint of this optimizer's sharded files (:func:`optbook.distributed._comm.
        layout_fingerprint`: class, world size, mesh, parameters, buckets, every rank's pieces, digest)."""
        return layout_fingerprint(self)

    def load_sharded_state_dict(self, shards) -> None:
        """Load sharded checkpoints from :meth:`sharded_state_dict`. Not a collective.

        Args:
            shards: either **this rank's own** dict (saved by the rank of the same number at the same world
                size and layout: the fast path, each rank reads one file), or a list of **every** rank's
                dict of one save, at any world size (each rank reads all files and keeps the elements its
                own pieces cover: resharding). Either way the run continues exactly as the uninterrupted
                one (bitwise: the state is copied, not recomputed).

        With the list, float16/bfloat16 masters are also rounded into the model parameters (as
        :meth:`load_state_dict`); with one dict only this rank's masters are restored and the model
        parameters must come from the model checkpoint (they are the rounded masters).

        Files that record a layout fingerprint (``"layout"``, :meth:`checkpoint_layout`) are judged by it
        (:func:`optbook.distributed._comm.check_layout`): every message names both layouts, the file's and
        this optimizer's; a list must hold files of one save (one layout), each holding its rank's pieces.

        Raises:
            TypeError: ``shards`` is neither a dict nor a list/tuple of dicts of this format.
            ValueError: a file of another optimizer class that records its layout; one dict saved at another
                world size, or by another rank, or with other pieces (another ``bucket_size`` or alignment)
                -- the message names both sides and says to pass all files to reshard; files of two saves
                (two layouts); a list that is not exactly ranks ``0 .. W - 1`` of one save at world size
                ``W``; parameters of other shapes or dtypes (naming the first); what
                :meth:`load_state_dict` raises. All before anything is loaded.
        """
        consolidated, whole, meta = self._from_shards(shards)
        if whole:
            self.load_state_dict(consolidated)
            return
        for entry in consolidated["state"].values():  # other ranks' parts are absent: only this rank's, below
            entry.pop(MASTER_KEY, None)
        consolidated["state"] = {k: v for k, v in consolidated["state"].items() if v}
        self.load_state_dict(consolidated)
        with torch.no_grad():  # the pieces equal the saved ones (checked above)
            for target, (_, _, _, _, master) in zip(self._piece_params, meta["pieces"]):
                if master is not None:
                    target.copy_(master)

    def check_sharded_state_dict(self, shards) -> None:
        """The checks of :meth:`load_sharded_state_dict` on the files themselves (format, parameters, ranks,
        layout fingerprint), writing nothing; the state itself is checked by the load, before it writes (a
        chain checks each member's files before it loads any).

        Raises:
            TypeError, ValueError: as :meth:`load_sharded_state_dict`.
        """
        self._from_shards(shards)

    def _from_shards(self, shards) -> tuple[dict, bool, dict]:
        """``(the consolidated dict to load, whether every rank's file was given, the first file)`` after every
        check on the files; writes nothing."""
        mine = self.checkpoint_layout()
        files = [shards] if isinstance(shards, dict) else shards if isinstance(shards, (list, tuple)) else []
        for k, sd in enumerate(files):   # another class's file that records its layout: name both layouts
            if isinstance(sd, dict) and sd.get("format") != SHARDED_FORMAT and isinstance(sd.get("layout"), dict):
                check_layout(sd["layout"], mine, "DistributedOptimizer", own_file=False, where=f"file {k}")
        if isinstance(shards, dict):
            self._check_sharded(shards, "shards")
            own = [(p.index, p.param_start, p.param_end) for p in self.pieces]
            saved = [tuple(p[:3]) for p in shards["pieces"]]
            layout = shards.get("layout")
            if layout is not None:
                check_layout(layout, mine, "DistributedOptimizer", own_file=False)
            if shards["world_size"] != self.world_size or shards["rank"] != self.rank or saved != own:
                what = (f"world size {shards['world_size']}, this group has {self.world_size}"
                        if shards["world_size"] != self.world_size else
                        f"rank {shards['rank']}, this is rank {self.rank}" if shards["rank"] != self.rank
                        else "other pieces (another bucket_size or alignment)")
                both = ("" if layout is None else f"; the file's layout: {describe_layout(layout)}; this "
                        f"optimizer's layout: {describe_layout(mine)}")
                raise ValueError(f"Invalid shards: this file was saved by rank {shards['rank']} of "
                                 f"{shards['world_size']}: {what}; to reshard, pass the list of all "
                                 f"{shards['world_size']} files of that save{both}")
            if layout is not None:
                check_layout(layout, mine, "DistributedOptimizer", own_file=True)
                self._agrees_with_layout(shards, layout)
            consolidated = self._assemble([shards["pieces"]])
            whole = False
            meta = shards
        elif isinstance(shards, (list, tuple)) and shards:
            for k, sd in enumerate(shards):
                self._check_sharded(sd, f"shards[{k}]")
            layout = check_one_save(list(shards), "DistributedOptimizer")
            if layout is not None:
                check_layout(layout, mine, "DistributedOptimizer", own_file=False, where="the files")
                for sd in shards:
                    self._agrees_with_layout(sd, layout)
            sizes = sorted({sd["world_size"] for sd in shards})
            ranks = sorted(sd["rank"] for sd in shards)
            if len(sizes) != 1 or ranks != list(range(sizes[0])):
                raise ValueError(f"Invalid shards: expected the files of ranks 0 .. W - 1 of one save at "
                                 f"world size W, got ranks {ranks} saved at world sizes {sizes}")
            ordered = sorted(shards, key=lambda sd: sd["rank"])
            consolidated = self._assemble([sd["pieces"] for sd in ordered])
            whole = True
            meta = ordered[0]
        else:
            raise TypeError(f"Invalid shards: expected this rank's dict from sharded_state_dict() or a list of "
                            f"every rank's, got {type(shards).__name__}")
        consolidated.update(param_groups=meta["param_groups"], loss_scaler=meta.get("loss_scaler"),
                            skipped_steps=meta.get("skipped_steps", self.skipped_steps))
        return consolidated, whole, meta

    @staticmethod
    def _agrees_with_layout(sd: dict, layout: dict) -> None:
        """A file holds exactly the pieces of its rank that the layout it records gives that rank.

        Raises:
            ValueError: naming the rank and the layout."""
        rank = sd["rank"]
        expected = [tuple(q) for q in layout["pieces"][rank]] if 0 <= rank < len(layout["pieces"]) else None
        if [tuple(p[:3]) for p in sd["pieces"]] != expected or sd["world_size"] != layout["world_size"]:
            raise ValueError(f"Invalid shards: the file of rank {rank} holds pieces other than the layout it "
                             f"records gives rank {rank}; its layout: {describe_layout(layout)}")

    def _check_sharded(self, sd, name: str) -> None:
        if not isinstance(sd, dict) or sd.get("format") != SHARDED_FORMAT:
            raise TypeError(f"Invalid {name}: expected a dict from DistributedOptimizer.sharded_state_dict() "
                            f"(format {SHARDED_FORMAT!r}), got {type(sd).__name__}")
        mine = [(tuple(r.shape), str(r.dtype)) for r in self.layout.params]
        theirs = [(tuple(shape), dtype) for shape, dtype in sd["params"]]
        if len(theirs) != len(mine):
            raise ValueError(f"Invalid {name}: it holds {len(theirs)} parameters, this optimizer has {len(mine)}")
        for i, (a, b) in enumerate(zip(theirs, mine)):
            if a != b:
                raise ValueError(f"Invalid {name}: parameter {i} was saved with shape and dtype {a}, this "
                                 f"optimizer's is {b}")
