"""What LayerWiseMuon, DistributedMuon and FSDP2Muon share: their place on :class:`optbook.wrapper.OptimizerWrapper`
(:class:`MuonWrapper`), the set-up of replicated parameters, Muon's orthogonalised update of full matrices, the
Muon hyperparameters of a group, byte counting, and the checkpoints of LayerWiseMuon and DistributedMuon
(:class:`ConsolidatingMuon`: the state put together on one rank or on every rank, as
``torch.distributed.checkpoint`` needs; a ``state`` whose truth value the ranks agree on; the plain Muon
state-dict check).

Private to :mod:`optbook.distributed`; the names here are its internal interface.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict, defaultdict

import torch
import torch.distributed as dist

from ..contract import VersionTracker, register_owner
from ..optim.functional import muon
from ..optim.muon import orthogonalized_blocks
from .._checks import check_int, check_number
from ..optim.optimizer import BookOptimizer, check_hyperparameters
from ..wrapper import OptimizerWrapper
from ._comm import (
    check_layout,
    check_one_save,
    check_same_params,
    consolidated_here,
    describe_layout,
    global_rank,
    layout_fingerprint,
    param_name,
    params_difference,
)

__all__ = ["MUON_KEYS", "AgreedState", "ConsolidatingMuon", "MuonWrapper", "check_max_grad_norm", "check_muon_state_dict",
           "consolidate", "hyper",
           "nbytes", "load_plain", "plain_state_dict", "replicated", "broadcast_from_first", "scaled_orthogonal", "shard_parts"]

#: The hyperparameters the functional core :func:`optbook.optim.functional.muon` takes from a param group.
MUON_KEYS = tuple(k for k, v in inspect.signature(muon).parameters.items() if v.kind is v.KEYWORD_ONLY)


_STATE_DICT_HOOKS = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


@contextlib.contextmanager
def _state_dict_hooks_off(opt):
    """Within the block ``torch.optim``'s own ``state_dict``/``load_state_dict`` run no hook: the wrapper's
    (:meth:`optbook.wrapper.OptimizerWrapper.state_dict`, ``load_state_dict``) ran them once, around the call."""
    saved = {name: opt.__dict__[name] for name in _STATE_DICT_HOOKS}
    opt.__dict__.update({name: OrderedDict() for name in _STATE_DICT_HOOKS})
    try:
        yield
    finally:
        opt.__dict__.update(saved)


def plain_state_dict(opt) -> dict:
    """``torch.optim.Optimizer.state_dict(opt)`` (the plain Muon layout of ``opt``'s own groups and state,
    live tensors) without running the state-dict hooks again."""
    with _state_dict_hooks_off(opt):
        return torch.optim.Optimizer.state_dict(opt)


def load_plain(opt, state_dict: dict) -> None:
    """:meth:`optbook.optim.BookOptimizer.load_state_dict` of a plain Muon dict into ``opt`` (its checks, a
    copy of every tensor) without running the load hooks again."""
    with _state_dict_hooks_off(opt):
        BookOptimizer.load_state_dict(opt, state_dict)


class MuonWrapper(OptimizerWrapper):
    """The three distributed Muons on the wrapper base: each *is* an :class:`optbook.optim.Muon` (its param
    groups and its part of the state are its own; a subclass lists ``MuonWrapper`` before ``Muon``) and the
    wrapper that owns the step around it, so :meth:`optbook.wrapper.OptimizerWrapper.step` runs its phases
    (``prepare_grads``: validate on every rank and agree, reduce, one ``inf``/``NaN`` check; ``clip_grads``;
    ``step_with_ready_grads``: the Muon arithmetic on this rank's part; ``publish_weights``) and reports one
    :class:`~optbook.wrapper.StepReport` per step. It holds no other optimizer (:meth:`inner_optimizers` is
    empty), so what the base forwards becomes:

    * ``train()``/``eval()``: no-ops (Muon has no modes); ``set_mode(name)`` raises ``AttributeError``;
    * ``add_param_group``: only while constructing (owners or layout are fixed then), else
      ``NotImplementedError`` naming the class;
    * ``state_dict``/``load_state_dict``: the subclass's layout, the hooks run once;
    * pickling: hooks dropped, the WORLD group kept by reference (:mod:`optbook.wrapper`); the unpickled
      copy re-reads its parameters' versions and registers as their owner again.
    """

    #: What is fixed at construction (the refusal of :meth:`add_param_group` names it).
    _fixed_at_construction = "the owners are assigned"

    def inner_optimizers(self) -> list:
        return []

    def owned_params(self) -> list[torch.Tensor]:
        """The parameters this optimizer keeps its own copy of (:func:`optbook.contract.register_owner`)."""
        return []

    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing (``torch.optim.Optimizer.__init__`` adds the groups).

        Raises:
            NotImplementedError: after construction.
        """
        if getattr(self, "_params", None) is not None:
            name = type(self).__name__
            raise NotImplementedError(f"{name}.add_param_group: {self._fixed_at_construction} at construction; "
                                      f"build a new {name} with every group")
        super(OptimizerWrapper, self).add_param_group(param_group)   # Muon's (the next class after the base)

    def prime(self) -> None:
        """DCP's priming step (:func:`optbook.wrapper.is_priming_step`): the phases of any step, on every rank
        (the same collectives, so a rank that judges otherwise is not left waiting). With zero gradients and
        ``lr`` 0 the momentum it makes is zero and the weights stay: the state a first step starts from."""
        self.validate()
        self.prepare_grads()
        self.clip_grads()
        self.step_with_ready_grads()
        self.publish_weights()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        if "_versions" in state:
            state["_versions"] = None   # keyed by this process's tensor ids
        return state

    def __setstate__(self, state: dict) -> None:
        OptimizerWrapper.__setstate__(self, state)
        BookOptimizer.__setstate__(self, {})   # the defaults of options newer than the pickle
        if "_versions" in state and state["_versions"] is None:   # unpickled
            self._versions = VersionTracker()
            self._versions.record(self._params)
            register_owner(self.owned_params(), self)

    def __repr__(self) -> str:
        options = self._repr_options()
        return torch.optim.Optimizer.__repr__(self)[:-1] + (f"{options}\n)" if options else ")")


class AgreedState(defaultdict):
    """An optimizer's ``state`` (``{parameter: dict}``, this rank's entries) whose truth value is whether
    **any** rank holds state (``any_rank``, the same on every rank) or this one does.

    ``torch.distributed.checkpoint.state_dict`` reads ``if optim.state:`` on every rank to decide on its
    priming step (``_init_optim_state``: a step at ``lr`` 0 on zero gradients, :mod:`optbook.wrapper`). A
    rank that owns no matrix (LayerWiseMuon) or no piece holds no entry; were its answer its own, it would
    prime alone and wait in a collective the others never enter. ZeRO-1's state view agrees the same way."""

    any_rank = False

    def __bool__(self) -> bool:
        return self.any_rank or len(self) > 0


class ConsolidatingMuon(MuonWrapper):
    """LayerWiseMuon and DistributedMuon: each rank holds part of the state, and the checkpoint is the plain
    Muon layout put together from every rank's part.

    * ``state`` is an :class:`AgreedState` over this rank's entries: empty or not alike on every rank (set
      by a step that made state and by a load, which every rank makes alike);
    * :meth:`consolidate_state_dict` ``(to)`` gathers the parts on rank ``to`` (a collective), for
      ``state_dict()`` there; ``state_dict()`` when nothing was consolidated since the last step or load
      gathers them on **every** rank (a collective then: every rank calls it, as
      ``torch.distributed.checkpoint.state_dict``'s ``get_``/``set_optimizer_state_dict`` do; ZeRO-1's
      ``state_dict`` does the same).

    A subclass gives :meth:`_local_checkpoint` (its part, picklable, on the CPU) and :meth:`_assemble` (the
    plain dict from every rank's parts).
    """

    _has_state = False   # some rank holds state: after a step that made some, or a load of a dict with state
    _consolidated = None   # (to, the dict on rank ``to``, None on the others), until the next step or load

    @property
    def state(self) -> AgreedState:
        raw = self.__dict__.get("state")
        if type(raw) is not AgreedState:   # torch.optim's load_state_dict puts a plain defaultdict there
            raw = AgreedState(dict, raw or {})
            self.__dict__["state"] = raw
        raw.any_rank = bool(self._has_state)
        return raw

    @state.setter
    def state(self, value) -> None:
        self.__dict__["state"] = AgreedState(dict, value)

    def checkpoint_layout(self) -> dict:
        """The layout fingerprint :meth:`sharded_state_dict` records under ``"layout"`` and
        :meth:`load_sharded_state_dict` compares (:func:`optbook.distributed._comm.layout_fingerprint`)."""
        return layout_fingerprint(self)

    def _local_checkpoint(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _assemble(self, gathered: list) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's part of the state on group rank ``to`` (a collective), for :meth:`state_dict`
        there. The result is dropped at the next step or load.

        Raises:
            TypeError, ValueError: ``to`` is not a rank of the group (on every rank, before communicating).
        """
        gathered = consolidate(self, self._local_checkpoint(), to)
        self._consolidated = (to, None if gathered is None else self._assemble(gathered))

    def _state_dict(self) -> dict:
        """The consolidated dict on the rank :meth:`consolidate_state_dict` sent it to; when nothing was
        consolidated since the last step or load, put together on every rank (a collective).

        Raises:
            RuntimeError: consolidated on another rank since the last step (call it there).
        """
        if self._consolidated is None:
            return self._assemble(consolidate(self, self._local_checkpoint(), None))
        return consolidated_here(type(self).__name__, self._consolidated, self.rank)


def replicated(opt, process_group, world_size: int, who: str, refused: tuple, why: str):
    """Check the replicated parameters of ``opt`` (built: its groups hold them) and return ``(params, device)``.

    ``refused``: dtypes refused, each naming the parameter, with ``why``; then all on one device; then the
    same shapes and dtypes on every rank (one collective: :func:`~optbook.distributed._comm.check_same_params`).
    Writes nothing.

    Raises:
        ValueError: the first problem found.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if p.dtype in refused:
            raise ValueError(f"Invalid params: {param_name(opt.param_groups, i)} is {p.dtype}; {why}")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"Invalid params: they are on several devices {sorted(map(str, devices))}")
    check_same_params(params, process_group, world_size, who)
    return params, next(iter(devices)) if devices else None


def broadcast_from_first(params, process_group) -> None:
    """Every rank's ``params`` become the group's rank 0's (one broadcast each; a collective)."""
    src = global_rank(process_group, 0)
    with torch.no_grad():
        for p in params:
            if p.numel():
                dist.broadcast(p.data, src=src, group=process_group)


def check_max_grad_norm(value):
    return None if value is None else check_number("max_grad_norm", value, low=0.0, low_open=True)


def hyper(group: dict) -> dict:
    return {k: group[k] for k in MUON_KEYS if k in group}


def nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()



def check_muon_state_dict(state_dict, opt) -> int:
    """Validate a plain Muon state dict for ``opt`` (a LayerWiseMuon or DistributedMuon) without writing
    anything, as ``torch.optim.Optimizer.load_state_dict`` would load it; return its ``skipped_steps``
    (``opt.skipped_steps`` when the dict has none: dicts saved before the entry existed).

    Checked: a dict with ``state`` and ``param_groups``; the number of groups and of parameters per group;
    each group's hyperparameters (Muon's checks; a group without Muon's own hyperparameters, e.g. AdamW's,
    is refused, while extra keys such as a learning-rate scheduler's ``initial_lr`` are kept, as
    ``torch.optim`` and :class:`optbook.optim.Muon` keep them); every state entry belongs to a listed
    parameter and holds only a floating-point ``momentum_buffer`` of its parameter's shape; ``skipped_steps`` an
    int ``>= 0``; then everything ``opt.load_state_dict`` checks (``opt.check_state_dict``: the momentum's
    dtype among others), so a dict that passes loads.

    Raises:
        TypeError, ValueError: the first problem found, naming the group, parameter or key.
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise TypeError("Invalid state_dict: expected a dict with 'state' and 'param_groups' (from state_dict() "
                        "or optbook.optim.Muon.state_dict())")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(saved_state, dict):
        raise TypeError("Invalid state_dict: 'param_groups' must be a list and 'state' a dict")
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"Invalid state_dict: it has {len(saved_groups)} param groups, this optimizer has "
                         f"{len(opt.param_groups)}")
    param_of = {}
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise TypeError(f"Invalid state_dict: param group {gi} is not a dict with a 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"Invalid state_dict: param group {gi} has {len(saved['params'])} parameters, this "
                             f"optimizer's has {len(group['params'])}")
        # Extra keys are kept, as torch.optim and optbook.optim.Muon keep them (a scheduler's ``initial_lr``);
        # a group without Muon's own hyperparameters is another optimizer's.
        missing = sorted(k for k in MUON_KEYS if k in group and k not in saved)
        if missing:
            extra = sorted(str(k) for k in set(saved) - set(group))
            raise ValueError(f"Invalid state_dict: param group {gi} has no {missing} (Muon's hyperparameters)"
                             + (f" and has the key(s) {extra}, which Muon's groups do not have" if extra else "")
                             + " (a checkpoint of another optimizer?)")
        check_hyperparameters(opt, {**group, **{k: v for k, v in saved.items() if k != "params"}})
        param_of.update(zip(saved["params"], group["params"]))
    for saved_id, entry in saved_state.items():
        p = param_of.get(saved_id)
        if p is None:
            raise ValueError(f"Invalid state_dict: state for parameter {saved_id!r}, which no group lists")
        if not isinstance(entry, dict) or set(entry) - {"momentum_buffer"}:
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"Invalid state_dict: state[{saved_id!r}] holds {keys}; Muon keeps only "
                             "'momentum_buffer' (a checkpoint of another optimizer?)")
        buf = entry.get("momentum_buffer")
        if buf is not None and (not isinstance(buf, torch.Tensor) or not buf.is_floating_point()
                                or buf.shape != p.shape):
            what = (f"shape {tuple(buf.shape)}, dtype {buf.dtype}" if isinstance(buf, torch.Tensor)
                    else type(buf).__name__)
            raise ValueError(f"Invalid state_dict: momentum_buffer of parameter {saved_id!r} has {what}; the "
                             f"parameter has shape {tuple(p.shape)} (a checkpoint of another model?)")
    skipped = check_int("state_dict['skipped_steps']", state_dict.get("skipped_steps", opt.skipped_steps), 0)
    # Everything the load itself checks (BookOptimizer.load_state_dict calls the same function), so that a
    # caller loading several optimizers (DistributedChain) can check each completely before loading any.
    BookOptimizer.check_state_dict(opt, {"state": saved_state, "param_groups": saved_groups})
    return skipped


def consolidate(opt, local, to):
    """Gather ``local`` (picklable, per rank) on group rank ``to``: the list of every rank's there, ``None``
    elsewhere; ``to=None``: on every rank (``all_gather_object``). A collective.

    Raises:
        TypeError, ValueError: ``to`` is not a rank of the group (on every rank, before communicating).
    """
    if to is None:
        gathered = [None] * opt.world_size
        dist.all_gather_object(gathered, local, group=opt.process_group)
        return gathered
    to = check_int("to", to, 0)
    if to >= opt.world_size:
        raise ValueError(f"Invalid to: expected a rank in 0 .. {opt.world_size - 1}, got {to}")
    gathered = [None] * opt.world_size if opt.rank == to else None
    dist.gather_object(local, gathered, dst=global_rank(opt.process_group, to), group=opt.process_group)
    return gathered


def shard_parts(shards, opt, fmt: str, layout_key: str, layout) -> list[dict]:
    """Check sharded checkpoint files for ``opt`` without loading anything; return them as a list.

    Files that record a layout fingerprint (``"layout"``, :func:`optbook.distributed._comm.layout_fingerprint`)
    are judged by it (:func:`~optbook.distributed._comm.check_layout`): this rank's own file loads when its
    layout is this optimizer's and it is this rank's; the list of every rank's files of one save loads at any
    layout of the same class and parameters (resharding); every file's own entries must agree with the layout
    it records. Files saved before fingerprints are judged by ``layout_key`` as before.

    Args:
        shards: this rank's own dict, or the list of every rank's dicts of one save (any world size).
        opt: the LayerWiseMuon or DistributedMuon loading them (its ``_params``, ``rank``, ``world_size``).
        fmt: the ``"format"`` entry the files must have.
        layout_key, layout: the entry saying which part of the state a file holds (``"owners"`` of
            LayerWiseMuon, ``"pieces"`` ranges of DistributedMuon) and this rank's value of it.

    Raises:
        TypeError: not dicts of format ``fmt`` (and recording no layout of another class).
        ValueError: a file of another class, parameters or (own file) layout, naming both layouts; files of
            two saves; a file whose entries disagree with its layout; an own file of another rank (saying to
            pass the list); a list that is not ranks ``0 .. W - 1`` of one save.
    """
    who = type(opt).__name__
    parts = [shards] if isinstance(shards, dict) else list(shards) if isinstance(shards, (list, tuple)) else []
    mine = layout_fingerprint(opt)
    own = isinstance(shards, dict)
    for k, sd in enumerate(parts):   # another class's file that says what it is: name both layouts
        if isinstance(sd, dict) and sd.get("format") != fmt and isinstance(sd.get("layout"), dict):
            check_layout(sd["layout"], mine, who, own_file=own, where="the file" if own else f"file {k}")
    if not parts or any(not isinstance(sd, dict) or sd.get("format") != fmt for sd in parts):
        raise TypeError(f"Invalid shards: expected this rank's dict from {who}.sharded_state_dict() (format "
                        f"{fmt!r}) or a list of every rank's")
    for k, sd in enumerate(parts):
        theirs = [(tuple(shape), dtype) for shape, dtype in sd["params"]]
        difference = params_difference([mine["params"], theirs])
        if difference is not None:
            where = difference.replace("on ranks [0]", "in this optimizer").replace("on ranks [1]", "in the file")
            raise ValueError(f"Invalid shards: file {k} was saved for other parameters (a checkpoint of another "
                             f"model?): {where}")
    saved = parts[0].get("layout") if own else check_one_save(parts, who)
    if saved is not None:
        check_layout(saved, mine, who, own_file=own, where="the file" if own else "the files")
        if own and shards["rank"] != opt.rank:
            raise ValueError(f"Invalid shards: this file was saved by rank {shards['rank']} of "
                             f"{saved['world_size']}, this is rank {opt.rank}; to reshard, pass the list of every "
                             f"rank's file of that save; the file's layout: {describe_layout(saved)}")
        for sd in parts:
            _agrees_with_layout(sd, saved, layout_key)
        return parts
    if own:
        if (shards["world_size"], shards["rank"], shards[layout_key]) != (opt.world_size, opt.rank, layout):
            raise ValueError(f"Invalid shards: this file was saved by rank {shards['rank']} of "
                             f"{shards['world_size']} (or with another {layout_key}), this is rank {opt.rank} of "
                             f"{opt.world_size}; to reshard, pass the list of every rank's file of that save")
    else:
        size = parts[0]["world_size"]
        if sorted(sd["rank"] for sd in parts) != list(range(size)) or any(sd["world_size"] != size for sd in parts):
            raise ValueError("Invalid shards: expected the files of ranks 0 .. W - 1 of one save at world size W")
    return parts


def _agrees_with_layout(sd: dict, saved: dict, layout_key: str) -> None:
    """A LayerWiseMuon file holds only the matrices its rank owns; a DistributedMuon file the pieces of its
    rank, as the layout it records says.

    Raises:
        ValueError: naming the file's rank, the entry and the layout."""
    rank = sd["rank"]
    if layout_key == "owners":
        owners = saved["owners"]
        bad = sorted((i for i in [*sd["state"], *sd.get("master_params", {})]
                      if not (isinstance(i, int) and 0 <= i < len(owners) and owners[i] == rank)), key=repr)
        ok = list(sd["owners"]) == list(saved["owners"]) and sd["world_size"] == saved["world_size"]
        what = f"state for parameters {bad} that rank {rank} does not own"
    else:
        pieces = [tuple(q) for q in saved["pieces"][rank]] if 0 <= rank < len(saved["pieces"]) else []
        bad = sorted(tuple(m[:3]) for m in sd["momentum"] if tuple(m[:3]) not in pieces)
        ok = [tuple(q) for q in sd["pieces"]] == pieces and sd["world_size"] == saved["world_size"]
        what = f"momentum pieces {bad} that are not rank {rank}'s"
    if bad or not ok:
        raise ValueError(f"Invalid shards: the file of rank {rank} holds "
                         + (what if bad else f"{layout_key} other than the layout it records")
                         + f"; its layout: {describe_layout(saved)}")


def scaled_orthogonal(directions: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """``scale * NS(D)`` for each full matrix ``D``: Muon's update, by the function the single-process
    :func:`optbook.optim.functional.muon` subtracts (:func:`optbook.optim.orthogonalized_blocks`: rescaling, head
    split, batching, Newton–Schulz schedule and scale are Muon's; nothing is re-implemented). A matrix cut
    into several row blocks (``head_split``) is concatenated; otherwise the update may be a view (the
    transpose of a batch entry), not contiguous."""
    options = {k: v for k, v in hyper(group).items() if k not in ("lr", "momentum", "nesterov", "weight_decay")}
    return [blocks[0] if len(blocks) == 1 else torch.cat(blocks)
            for blocks in orthogonalized_blocks(directions, **options)]
