"""The one step contract every optimizer and wrapper of :mod:`optbook` follows. Explained in chapter 10.

This module is the contract's home: its rules are written here once, and the pieces every class needs to
follow them (the owner registry, the outside-write check, the non-finite error, the element-wise rule) are
defined here and nowhere else. The step itself is written once too, as code: the template ``step()`` of
:class:`optbook.wrapper.OptimizerWrapper`, which every wrapper subclasses (its phases after Megatron-LM's
``prepare_grads`` -> clip -> ``step_with_ready_grads``), and :class:`optbook.masters.MastersWrapper` for the
wrappers that keep a copy of the weights (one checkpoint layout for those copies).

Who owns the weights
    The model's parameters are the weights the user sees. A wrapper that keeps its own copy of them -- the
    float32 masters of :class:`~optbook.precision.MixedPrecisionOptimizer`, the master shards of
    :class:`~optbook.distributed.DistributedOptimizer`, the pieces of
    :class:`~optbook.distributed.DistributedMuon`, the host copies of :class:`~optbook.memory.OffloadOptimizer`
    -- is the *owner* of those parameters: it registers itself with :func:`register_owner`, and its copy is
    the truth its next ``step()`` starts from.

An outside write is never silently undone
    Every in-place write to a tensor bumps its version counter (``tensor._version``, a host integer: reading
    it costs no device synchronisation). An owner records each parameter's version after its own writes
    (:class:`VersionTracker`); at the start of ``step()`` a changed version is a write it did not make (a
    weights-only ``model.load_state_dict``, a user's in-place edit, :func:`optbook.qk_clip_`). The owner takes
    it up -- copies the parameter into its copy -- before anything else, so it never writes stale weights
    over it. An edit that must not lose the master's low bits goes through :func:`scale_weights_`, which
    :func:`optbook.qk_clip_` uses: the owner scales its (float32) copy and writes the model's parameter from it.
    Replacing a parameter's data (``p.data = other``) moves its data address, which the owner records too.
    One write is not seen: an in-place write through ``p.data`` (``p.data.copy_(x)``), which PyTorch counts
    on a separate version counter by design (that is what ``.data`` is for); write under
    ``torch.no_grad()`` instead, as ``nn.init`` and ``load_state_dict`` do.

Non-finite gradients: one policy per kind of step
    * No loss scaler (every optimizer of :mod:`optbook.optim`, the chain, every wrapper built without one):
      ``step()`` raises :class:`NonFiniteGradientError` naming the parameter, before anything is written, so
      the run stops where the fault is (Megatron-LM's default ``--check-for-nan-in-loss-and-grad``;
      ``torch.optim`` does not check and writes the NaN into the weights). The check is one reduction per
      device (:func:`optbook.optim.optimizer.all_finite`).
    * With a loss scaler: the step is skipped -- nothing but the scaler changes -- and reported:
      ``found_inf`` is ``True`` and ``skipped_steps`` grows (``torch.amp.GradScaler.step``; Megatron-LM's
      ``MixedPrecisionOptimizer.step``).
    * A finite gradient whose square overflows (``||G||_F^2`` beyond the working dtype): element-wise
      classes step it, as ``torch.optim`` does (Adam's ``v`` becomes ``inf``, its update 0); Shampoo and SOAP,
      whose ``G G^T`` statistics would become ``inf`` and make the eigendecomposition fail halfway through the
      step, raise a ``ValueError`` naming the parameter before any write
      (:func:`optbook.optim.optimizer.check_statistics_range`).

What ``step()`` returns and reports
    ``step(closure=None)`` returns the closure's loss or ``None``, as ``torch.optim.Optimizer.step``. Every
    wrapper reports the last step in attributes: ``found_inf`` (bool: the last step was skipped for a
    non-finite gradient; a step that raises leaves it ``False``), ``skipped_steps`` (int, since
    construction, kept in its state dict) and ``last_grad_norm`` (float: the global gradient norm before
    clipping where the class computes one, else ``None``).

What ``load_state_dict`` guarantees
    The whole dict is validated first -- parameter count, group layout, state shapes and dtypes, every
    member of a chain, every inner optimizer's part through its own ``check_state_dict``, every copy of the
    weights (shape, dtype, no ``inf``/``NaN``) -- and on any error nothing has been written.

Distributed wrappers
    At construction every rank's parameter shapes and dtypes are compared (one collective); a difference is
    an error naming the first parameter that differs and the ranks that disagree.

Sources: ``torch.optim.Optimizer`` (torch 2.x ``torch/optim/optimizer.py``: ``step`` returns the closure's
loss, the step hooks, ``load_state_dict``); ``torch.amp.GradScaler.step`` (a skipped step); Megatron-LM
core_r0.13.0 ``megatron/core/optimizer/optimizer.py`` (``MixedPrecisionOptimizer.step``: found_inf and the
skipped update, ``ChainedOptimizer``) and ``megatron/training/arguments.py``
(``--check-for-nan-in-loss-and-grad``).

The table: one row per kind of class (:data:`CONTRACT`, rendered by :func:`contract_table`; appended
here from the data, so the two cannot differ). "Takes no scaler": the class has no loss-scaler argument
(wrap a single-process optimizer in :class:`~optbook.precision.MixedPrecisionOptimizer` to skip such
steps); a chain's ``found_inf`` is always ``False`` and its ``skipped_steps`` 0 (it raises, never skips).

"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._checks import check_params

__all__ = [
    "COLUMNS",
    "CONTRACT",
    "ContractRow",
    "NonFiniteGradientError",
    "VersionTracker",
    "checked_param_groups",
    "closure_loss",
    "contract_table",
    "elementwise",
    "owner_of",
    "register_owner",
    "scale_weights_",
]


class NonFiniteGradientError(ValueError, FloatingPointError):
    """A gradient holds NaN or inf and no loss scaler is there to skip the step; nothing was written.

    A subclass of :class:`ValueError` (what optbook raised before it existed) and of
    :class:`FloatingPointError`.
    """


# --- who owns a parameter -----------------------------------------------------------------------------------
# parameter -> weak reference to the wrapper holding the copy ``step()`` starts from. Keyed weakly by the
# tensor object's identity (``weakref.WeakKeyDictionary`` compares keys with ``==``, element-wise for a
# tensor), so a dropped model or wrapper leaves no entry behind.
_OWNERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def register_owner(params, owner) -> None:
    """Record ``owner`` as the holder of the copy of each tensor in ``params`` that its steps start from.

    The owner must implement ``_scale_weights_(param, factor)`` (see :func:`scale_weights_`). A later
    registration of the same parameter replaces the earlier one (the newest wrapper built over it).
    """
    ref = weakref.ref(owner)
    for p in params:
        _OWNERS[p] = ref


def owner_of(param: torch.Tensor):
    """The live wrapper registered for ``param`` with :func:`register_owner`, or ``None``."""
    ref = _OWNERS.get(param)
    return None if ref is None else ref()


@torch.no_grad()
def scale_weights_(param: torch.Tensor, factor) -> None:
    """Multiply the weights of ``param`` by ``factor``, in the copy its owner steps from.

    Args:
        param: a model parameter.
        factor: a Python number or a tensor broadcastable to ``param.shape`` (for a row scaling, shape
            ``(rows, 1)``); applied in float32 or wider.

    With no owner the parameter is multiplied in place. With an owner, the owner scales its copy (the
    float32 master, the local shard, the host copy) and writes the model's parameter from it, as its next
    step would; for a distributed owner this is collective (every rank calls it with the same factor).
    A parameter sharded by FSDP2 (a ``DTensor``) multiplies its local shard by the factor's matching part
    (the factor expanded to the whole parameter's shape and cut as the parameter is: every rank must pass
    the same factor); nothing is communicated.
    """
    owner = owner_of(param)
    if owner is not None:
        owner._scale_weights_(param, factor)
        return
    placements = getattr(param, "placements", None)
    if placements is not None:   # a DTensor
        from torch.distributed.tensor import distribute_tensor

        full = torch.as_tensor(factor, device=param.device).expand(param.shape).contiguous()
        factor = distribute_tensor(full, param.device_mesh, placements, src_data_rank=None)
    param.mul_(factor)


def _where(p: torch.Tensor):
    """``p``'s version counter and data address: an in-place write moves the first, ``p.data = other`` the
    second. ``None`` for the address of a tensor subclass that has none of its own (a ``DTensor``)."""
    try:
        return p._version, p.data_ptr()
    except RuntimeError:
        return p._version, None


class VersionTracker:
    """The version each parameter had after the owner's last write, to see writes it did not make.

    ``record(params)`` after every write of the owner; ``changed(params)`` lists the indices of those whose
    ``_version`` (an in-place write) or data address (``p.data = other``) moved since. Host integers only:
    no device synchronisation. Not seen: an in-place write through ``p.data`` (``p.data.copy_(x)``), which
    PyTorch counts on a separate version counter on purpose; write under ``torch.no_grad()`` instead, as
    ``nn.init`` and ``load_state_dict`` do.
    """

    def __init__(self) -> None:
        self._versions: dict[int, tuple] = {}

    def record(self, params) -> None:
        for p in params:
            self._versions[id(p)] = _where(p)

    def changed(self, params) -> list[int]:
        return [i for i, p in enumerate(params) if self._versions.get(id(p)) != _where(p)]


# --- which optimizers a flat shard can step -----------------------------------------------------------------
def _torch_elementwise() -> tuple:
    o = torch.optim
    return tuple(getattr(o, n) for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop",
                                         "Rprop", "ASGD") if hasattr(o, n))


def elementwise(optimizer_class) -> bool:
    """Whether ``optimizer_class`` updates every element from that element's own gradient and state alone.

    Such an optimizer steps any slice of a flat buffer exactly as it steps the whole parameter (ZeRO-1,
    offload). Read from the class attribute ``elementwise`` (every optimizer of :mod:`optbook.optim` sets
    it); for ``torch.optim`` an allow-list of its element-wise classes (SGD, Adam, AdamW, Adamax, NAdam,
    RAdam, Adagrad, RMSprop, Rprop, ASGD); any other class is not element-wise.
    """
    flag = getattr(optimizer_class, "elementwise", None)
    if flag is not None:
        return bool(flag)
    return optimizer_class in _torch_elementwise()  # the class itself: a subclass may change the math


def closure_loss(closure):
    """The first act of every ``step(closure)``: call ``closure`` (which recomputes the loss and the
    gradients) with autograd enabled, as ``torch.optim`` optimizers do, and return its loss; ``None``
    without a closure. Whatever the closure raises propagates before the step has written anything."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def checked_param_groups(optimizer_class, params, defaults: dict) -> tuple[list[dict], dict]:
    """The param groups a wrapper that steps ``optimizer_class`` itself is built on (ZeRO-1, offload).

    ``optimizer_class(params, **defaults)`` is built once and dropped: the class checks its own
    hyperparameters and parameters (raising its own ``TypeError``/``ValueError`` before the wrapper changes
    anything) and fills every group's missing options from its defaults. Returns ``(param_groups,
    defaults)`` of that instance, the parameters themselves (not copies) in the groups.

    Raises:
        TypeError, ValueError: what ``optimizer_class`` raises; a parameter listed twice in a group
            (:func:`optbook._checks.check_params`).
    """
    template = optimizer_class(params, **defaults)
    for group in template.param_groups:   # torch.optim only warns about a parameter listed twice in a group
        check_params(group["params"])
    return template.param_groups, template.defaults


# --- the contract as data ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContractRow:
    """One kind of class of the step contract (a row of :data:`CONTRACT`).

    Attributes:
        kind: the class (or, for ``"plain optimizer"``, every optimizer of :mod:`optbook.optim`).
        owns_weights: ``"no"``, or ``"yes: <its copy>"`` (it is registered with :func:`register_owner`).
        nonfinite_without_scaler: what ``step()`` does with an ``inf``/``NaN`` gradient and no loss scaler.
        nonfinite_with_scaler: the same with a loss scaler (``"takes no scaler"``: no such argument).
        step_returns: what ``step(closure=None)`` returns.
        reports: the attributes describing the last step (``found_inf``, ``skipped_steps``,
            ``last_grad_norm``); empty for a plain optimizer.
        load: what ``load_state_dict`` guarantees.
    """

    kind: str
    owns_weights: str
    nonfinite_without_scaler: str
    nonfinite_with_scaler: str
    step_returns: str
    reports: tuple[str, ...]
    load: str

    @property
    def owner(self) -> bool:
        """Whether the class keeps its own copy of the weights (and registers as their owner)."""
        return self.owns_weights.startswith("yes")

    @property
    def takes_loss_scaler(self) -> bool:
        """Whether the class can be built with a loss scaler (and then skips non-finite steps)."""
        return self.nonfinite_with_scaler != "takes no scaler"


_REPORTS = ("found_inf", "skipped_steps", "last_grad_norm")
_RAISES = "raises NonFiniteGradientError, nothing written"
_RAISES_ALL = "raises NonFiniteGradientError on every rank, nothing written"
_SKIPS = "skips: only the scaler changes; found_inf, skipped_steps += 1"
_LOSS = "the closure's loss or None"
_LOAD = "whole dict checked first; nothing written on error"

#: The step contract, one row per kind of class (:class:`ContractRow`); :func:`contract_table` renders it.
CONTRACT: tuple[ContractRow, ...] = (
    ContractRow("plain optimizer", "no", _RAISES, "takes no scaler", _LOSS, (), _LOAD),
    ContractRow("ChainedOptimizer", "no", _RAISES + " (one check over every member)", "takes no scaler", _LOSS,
                _REPORTS, _LOAD + " (every member)"),
    ContractRow("MixedPrecisionOptimizer", "yes: float32 master weights", _RAISES, _SKIPS, _LOSS, _REPORTS, _LOAD),
    ContractRow("DistributedOptimizer", "yes: float32 master shards (ZeRO-1)", _RAISES_ALL,
                _SKIPS + ", on every rank", _LOSS, _REPORTS, _LOAD),
    ContractRow("LayerWiseMuon", "no", _RAISES_ALL, "takes no scaler", _LOSS, _REPORTS, _LOAD),
    ContractRow("DistributedMuon", "yes: its flat pieces", _RAISES_ALL, "takes no scaler", _LOSS, _REPORTS, _LOAD),
    ContractRow("DistributedChain", "yes: the master shards of its ZeRO-1 member", _RAISES_ALL, "takes no scaler",
                _LOSS, _REPORTS, _LOAD + " (both members)"),
    ContractRow("OffloadOptimizer", "yes: host copies", _RAISES, "takes no scaler", _LOSS, _REPORTS, _LOAD),
)

#: Column headings of :func:`contract_table`, in the order of :class:`ContractRow`'s fields.
COLUMNS = ("class", "owns a copy of the weights?", "non-finite gradient, no loss scaler",
           "non-finite gradient, with a loss scaler", "step() returns", "reports", "load_state_dict")


def contract_table() -> str:
    """:data:`CONTRACT` as a Markdown table (one line per row; deterministic text).

    ``reports`` lists the attribute names; a chain's ``found_inf`` is always ``False`` and its
    ``skipped_steps`` always 0 (it never skips: it raises).
    """
    def cells(row: ContractRow) -> list[str]:
        reports = ", ".join(f"`{r}`" for r in row.reports) or "--"
        return [f"`{row.kind}`" if row.kind != "plain optimizer" else "plain optimizer (`optbook.optim`)",
                row.owns_weights, row.nonfinite_without_scaler, row.nonfinite_with_scaler, row.step_returns,
                reports, row.load]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in CONTRACT]
    return "\n".join(lines)


__doc__ = (__doc__ or "") + contract_table() + "\n"
