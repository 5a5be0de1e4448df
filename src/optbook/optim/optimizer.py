"""The small base class every optimizer in :mod:`optbook.optim` shares.

It adds these things to :class:`torch.optim.Optimizer`:

* every parameter group is validated when it is added (``__init__`` and ``add_param_group``), and
  again, with every gradient, at the start of each ``step()`` -- *before* any tensor is written, so
  a ``step()`` that raises leaves parameters and state untouched;
* a gradient holding ``inf`` or ``NaN`` raises :class:`~optbook.contract.NonFiniteGradientError` naming
  the parameter, before any write (the step contract of :mod:`optbook.contract`; ``torch.optim`` writes
  the NaN into the weights), found by one reduction per device over all the step's gradients, on the
  calling thread (optbook starts no thread of its own);
* ``params`` may be ``model.named_parameters()``: the names are kept in each group's ``param_names`` and
  in ``state_dict()``, as torch 2.13 does;
* ``torch.optim`` arguments a class does not take (``maximize``, ``dampening``, ``fused``, ``foreach``,
  ``differentiable``, ``capturable``) are accepted when they ask for nothing it does not do, and refused
  naming the argument and why otherwise (:mod:`optbook.optim._torch_arguments`);
* ``step(closure)`` re-evaluates the closure with gradients enabled, as PyTorch's optimizers do;
* a tensor ``lr`` (one element, any shape or dtype, e.g. ``torch.tensor([0.1])``) is read as the Python
  number ``float(lr)`` at each step, so it gives bitwise the result of that float ``lr`` on every path
  (loop and foreach). The group keeps the tensor, so a scheduler may ``fill_`` it. The same holds for
  every other real-valued hyperparameter a class lists in ``float_options`` (``momentum``,
  ``weight_decay``, ``eps``, each entry of ``betas``, ...); a tensor with more than one element is refused
  with ``ValueError`` ("Tensor lr must be 1-element", as ``torch.optim``), a bool, complex or non-finite
  one too, when the group is added and at each step, naming the argument;
* a parameter with zero elements (e.g. shape ``(0, 3)``) is skipped: it has nothing to update, gets no
  state, and would otherwise make Adafactor's RMS divide by zero or Muon's blocks fail to reshape;
* a state dict saved before an option existed (e.g. ``foreach``, ``head_split``, ``amsgrad``) loads and
  steps: ``__setstate__`` fills each missing option with the constructor's default, the behaviour the
  old version had (as ``torch.optim``'s classes do, one ``setdefault`` per option);
* ``load_state_dict`` checks the whole dict first (layout, counts, hyperparameters, each state tensor's
  shape and dtype, and its values: no ``inf``/``NaN``, no negative entry in a second moment a class lists
  in ``nonnegative_state``) and writes nothing on an error; it copies the state tensors it is given, so the
  loaded optimizer never shares them with the source (``torch.optim.Optimizer.load_state_dict`` keeps a
  same-dtype, same-device tensor as it is: stepping one optimizer then changes the other;
  pytorch/pytorch#196083).

Subclasses implement ``_check_hyperparameters(group)`` and ``_step_group(group)``.
Explained in chapter 1 (SGD and momentum).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import math

import torch

from ..contract import NonFiniteGradientError, closure_loss
from ..wrapper import is_priming_step, record_priming, undo_priming
from .. import _sharded
from .._checks import check_grad, check_matrices, check_params
from ._torch_arguments import take_torch_arguments


def check_state_layout(param_groups: list[dict], state_dict) -> None:
    """Check the layout of an optimizer ``state_dict`` against ``param_groups``, writing nothing.

    Checked: ``state_dict`` is a dict with ``state`` (a dict) and ``param_groups`` (a list of dicts, each
    with a ``params`` list), as many groups as ``param_groups``, as many parameter indices in each group
    as there are parameters, no index twice, and every ``state`` key one of the indices.

    Raises:
        TypeError: a part has the wrong type; ValueError: a count or an index does not fit. The message
        says which.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"Invalid state_dict: expected a dict, got {type(state_dict).__name__}")
    for key, kind in (("state", dict), ("param_groups", list)):
        if key not in state_dict:
            raise ValueError(f"Invalid state_dict: no {key!r} entry (keys: {sorted(map(str, state_dict))})")
        if not isinstance(state_dict[key], kind):
            raise TypeError(f"Invalid state_dict: {key!r} is a {type(state_dict[key]).__name__}, expected a "
                            f"{kind.__name__}")
    saved = state_dict["param_groups"]
    if len(saved) != len(param_groups):
        raise ValueError(f"Invalid state_dict: {len(saved)} param_groups, this optimizer has {len(param_groups)}")
    seen: set = set()
    for gi, (group, g) in enumerate(zip(param_groups, saved)):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            raise TypeError(f"Invalid state_dict: param_groups[{gi}] must be a dict with a 'params' list")
        if len(g["params"]) != len(group["params"]):
            raise ValueError(f"Invalid state_dict: param_groups[{gi}] has {len(g['params'])} parameters, this "
                             f"optimizer's has {len(group['params'])}")
        for index in g["params"]:
            if index in seen:
                raise ValueError(f"Invalid state_dict: parameter index {index!r} is in two places")
            seen.add(index)
    extra = [k for k in state_dict["state"] if k not in seen]
    if extra:
        raise ValueError(f"Invalid state_dict: state for parameter indices {extra[:5]} that no group lists")


_MISSING = object()


def _check_state_scalar(value, kind: str, where: str) -> None:
    """Raise unless ``value`` is a valid loaded state scalar of ``kind`` (see ``BookOptimizer.state_scalars``)."""
    if value is _MISSING:
        raise ValueError(f"Invalid state_dict: {where} is missing (the step needs it)")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    if kind == "count":
        whole = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value == int(value))
        if isinstance(value, bool) or not whole or value < 0:
            raise ValueError(f"Invalid state_dict: {where} is {value!r}; expected a step count, an int >= 0")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Invalid state_dict: {where} is {value!r}; expected a finite number")


def raise_nonfinite(named: list[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`~optbook.contract.NonFiniteGradientError` naming the first ``(name, param)`` whose
    gradient holds ``inf`` or ``NaN``; called once a single check over all of them has failed.

    Args:
        named: ``(name, param)`` pairs, every ``param.grad`` a tensor.
    """
    grads = [p.grad for _, p in named]
    # (non-finite, holds NaN) per entry; for sharded (DTensor) gradients, agreed over every rank of the mesh
    flags = torch.tensor([[float(not bool(torch.isfinite(g).all())), float(bool(g.isnan().any()))]
                          for g in _sharded.local(grads)])
    flags = _sharded.any_flag_across_meshes(flags, _sharded.meshes(grads))
    for (where, p), (bad, nan) in zip(named, flags.tolist()):
        if bad:
            raise NonFiniteGradientError(
                f"Non-finite gradient in {where} (shape {tuple(p.shape)}, holds {'NaN' if nan else 'inf'}): "
                "nothing was written. Without a loss scaler a step with an inf/NaN gradient is an error (the "
                "step contract, optbook.contract); to skip such steps instead, use a loss scaler "
                "(optbook.precision.MixedPrecisionOptimizer)")
    raise NonFiniteGradientError("Non-finite gradient: nothing was written")  # pragma: no cover - a race


def check_statistics_range(optimizer_name: str, named: list[tuple[str, torch.Tensor]],
                           carried: list[torch.Tensor]) -> None:
    """Refuse, before any write, a finite gradient that would overflow ``G G^T``/``G^T G`` statistics.

    Every element of ``G G^T`` and ``G^T G`` -- and every partial sum of the matrix product forming it --
    is at most ``||G||_F^2`` in magnitude (Cauchy–Schwarz), so statistics that hold at most ``c`` in
    magnitude and take ``G G^T`` in as a sum or an EMA (Shampoo's ``L``, ``R``; SOAP's ``L``, ``R`` and its
    rotated second moment) stay finite in their working dtype when ``c + ||G||_F^2`` is at most half of
    that dtype's largest value (half: headroom for rounding). Past that, the statistics become ``inf`` and
    the next eigendecomposition fails -- in the middle of a step, after other parameters were written.

    Args:
        optimizer_name: the class, for the message.
        named: ``(name, param)`` pairs, float16/bfloat16/float32/float64 gradients; a gradient holding
            ``inf``/``NaN`` is passed over (the non-finite check reports it: :meth:`BookOptimizer._validate`,
            or the caller that turned that check off, such as a chain, checks it after its members validate).
        carried: for each pair, a 0-dim tensor bounding the magnitude of what the statistics hold now (on the
            gradient's device; ``0`` when they are overwritten or averaged).

    Raises:
        ValueError: names the first parameter, its gradient's ``||G||_F^2`` and the limit of its working dtype
            (float32 for float16/bfloat16/float32 parameters, float64 for float64 ones).
    """
    device = named[0][1].grad.device
    bounds = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64).square().to(device)
                          + c.to(device=device, dtype=torch.float64) for (_, p), c in zip(named, carried)])
    for (where, p), bound in zip(named, bounds.tolist()):   # one synchronisation for the group
        work = torch.promote_types(p.dtype, torch.float32)
        limit = torch.finfo(work).max / 2
        if not bound <= limit:
            if not bool(torch.isfinite(p.grad).all()):
                continue   # inf/NaN: the non-finite check's case (a caller that turned it off checks it itself)
            square = float(torch.linalg.vector_norm(p.grad, dtype=torch.float64)) ** 2
            raise ValueError(
                f"Invalid gradient in {where} (shape {tuple(p.shape)}): ||G||_F^2 = {square:.3g}, so "
                f"{optimizer_name}'s statistics (G G^T accumulated, at most {bound:.3g} in magnitude) would "
                f"overflow {str(work).removeprefix('torch.')} (limit {limit:.3g}); nothing was written. Scale the "
                "loss down, or clip the gradient first (optbook.clipping.clip_grad_norm_)")


@contextlib.contextmanager
def nonfinite_checked_by_caller(optimizers):
    """Within the block, ``step()`` of each optbook optimizer in ``optimizers`` skips its own
    non-finite-gradient check: the caller has checked every gradient of the step once, for all of them
    (:class:`~optbook.optim.ChainedOptimizer` does, with one global norm). Other validation still runs.

    Args:
        optimizers: an iterable of ``torch.optim.Optimizer``; those that are not
            :class:`BookOptimizer` (``torch.optim``'s, which never check) are left alone.
    """
    books = [o for o in optimizers if isinstance(o, BookOptimizer)]
    saved = [o.refuse_nonfinite_grads for o in books]
    for o in books:
        o.refuse_nonfinite_grads = False
    try:
        yield
    finally:
        for o, flag in zip(books, saved):
            o.refuse_nonfinite_grads = flag


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite: one reduction, and one device synchronisation,
    per device; no thread of its own.

    A tensor's 2-norm is finite when every element is (a NaN or ``inf`` element makes it non-finite), so
    ``torch._foreach_norm(tensors, 2)`` over a device's tensors, stacked (``torch.stack`` promotes them to a
    common dtype) and tested with ``torch.isfinite``, decides the usual case with one ``bool``. Only when
    that fails -- a non-finite element, or a huge finite tensor whose sum of squares overflows -- or when a
    tensor is float16 (whose norm overflows at 65504, as scaled gradients' norms do) is the exact test made:
    the largest magnitude of each tensor (``torch._foreach_norm(tensors, inf)``; a NaN propagates through
    it, ``inf`` is one, and a finite maximum cannot overflow). The 2-norm goes first because on the CPU the inf-norm takes a path about
    10x slower. Empty tensors are skipped.

    ``DTensor`` entries (parameters sharded by FSDP2's ``fully_shard``) are checked on their local shards,
    and the verdict is then agreed over every rank of their device meshes (an ``all_reduce`` of one flag,
    so every rank must call this with its shards of the same tensors): one rank's ``inf`` makes every rank
    return ``False``.
    """
    device_meshes = _sharded.meshes(tensors)
    finite = _local_all_finite(_sharded.local(tensors))
    if device_meshes:  # sharded gradients (FSDP2): one rank's inf is every rank's decision
        flag = torch.tensor([0.0 if finite else 1.0])
        finite = not bool(_sharded.any_flag_across_meshes(flag, device_meshes)[0])
    return finite


def _local_all_finite(tensors: list[torch.Tensor]) -> bool:
    by_device: dict = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    for ts in by_device.values():
        if all(t.dtype != torch.float16 for t in ts):   # a float16 2-norm overflows at 65504
            if bool(torch.isfinite(torch.stack(torch._foreach_norm(ts, 2))).all()):
                continue
        if not bool(torch.isfinite(torch.stack(torch._foreach_norm(ts, float("inf")))).all()):
            return False
    return True


class BookOptimizer(torch.optim.Optimizer):
    """Base class: validation before mutation, closures, and PyTorch's param-group machinery."""

    #: Whether each element is updated from its own gradient and state alone, so that any slice of a flat
    #: buffer steps as the whole parameter does (ZeRO-1 and offload accept only such classes;
    #: :func:`optbook.contract.elementwise`). Each optimizer sets it.
    elementwise = False
    #: Whether the class brings sharded (FSDP2 ``DTensor``) parameters' whole matrices together itself
    #: (:class:`optbook.distributed.FSDP2Muon`); a class that is neither this nor element-wise refuses them.
    gathers_whole_matrices = False

    #: Set by optimizers defined for 2-D matrices only (Shampoo, SOAP): the hint of the error for other shapes.
    matrix_hint: str | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        """Every subclass's constructor takes the ``torch.optim`` arguments it lacks (``maximize``,
        ``dampening``, ``fused``, ``foreach``, ``differentiable``, ``capturable``): dropped when they ask for
        nothing it does not do, refused naming the argument and why otherwise
        (:mod:`optbook.optim._torch_arguments`)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_takes_torch_arguments", False):
            return

        @functools.wraps(init)
        def __init__(self, *args, **kw):
            init(self, *args, **take_torch_arguments(cls, kw))
        __init__._takes_torch_arguments = True
        cls.__init__ = __init__

    def add_param_group(self, param_group: dict) -> None:
        """Add a group as ``torch.optim.Optimizer.add_param_group`` does, after the checks of this class.

        ``params`` may hold ``(name, tensor)`` pairs (``model.named_parameters()``), as in torch 2.13: the
        names go to the group's ``param_names`` list (and so into :meth:`state_dict`), every entry named or
        none (``ValueError`` from torch otherwise).
        """
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch.optim rejects sets with its own message
            params = list(params)
            check_params([p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params])
        tensors = [p[1] if isinstance(p, tuple) else p for p in params] if not isinstance(params, set) else params
        if self.matrix_hint is not None and not isinstance(params, set):
            check_matrices(tensors, type(self).__name__, self.matrix_hint)
        if not (self.elementwise or self.gathers_whole_matrices) and not isinstance(params, set):
            _sharded.refuse_sharded(tensors, type(self).__name__, "updates each tensor as a whole (its update "
                                    "of an element depends on other elements of the matrix)")
        self._check_group({**self.defaults, **param_group, "params": tensors})
        super().add_param_group({**param_group, "params": params})

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        signature = inspect.signature(type(self).__init__).parameters
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if key in signature and key not in group:  # an option newer than the saved state: its default
                    default = signature[key].default
                    group[key] = value if default is inspect.Parameter.empty else default

    def _expected_state(self, p: torch.Tensor, group: dict) -> dict[str, tuple[tuple, torch.dtype, bool]]:
        """The state tensors of ``p``: ``{key: (shape, dtype, required)}``; ``required`` keys must be in a
        non-empty state (the step would fail without them), the others may be missing (created when needed).

        The default: a ``momentum_buffer`` of ``p``'s shape and dtype, optional. Classes with other
        state override it; :meth:`load_state_dict` checks a loaded state against it.
        """
        return {"momentum_buffer": (tuple(p.shape), p.dtype, False)}

    #: The non-tensor entries of a parameter's (non-empty) state that the step reads: ``{key: kind}``, kind
    #: ``"count"`` (an int ``>= 0``; the 0-dim tensor ``torch.optim`` keeps for ``step``, or a float, is accepted
    #: when it holds a whole number, and :meth:`load_state_dict` stores it as an int) or ``"float"`` (a finite real).
    state_scalars: dict[str, str] = {}

    def _check_state_entry(self, state: dict, where: str) -> None:
        """A class's own rule about one parameter's loaded ``state`` beyond shapes and kinds (default: none);
        raises ``ValueError`` naming ``where``."""

    def check_state_dict(self, state_dict) -> None:
        """Check that ``state_dict`` fits this optimizer, writing nothing; :meth:`load_state_dict` calls it.

        Checked: the layout (a dict with ``state`` and ``param_groups``), the number of groups and of
        parameters in each, every parameter index once, every ``state`` key one of them, each group's
        hyperparameters (as ``add_param_group`` checks them), and each state tensor's shape and dtype
        against what this optimizer keeps for that parameter (:meth:`_expected_state`), and their values:
        no ``inf``/``NaN``, no negative entry where the class keeps a second moment (:attr:`nonnegative_state`).

        Raises:
            ValueError: naming the group, the parameter index and the key that do not fit.
            TypeError: a part of the dict has the wrong type.
        """
        check_state_layout(self.param_groups, state_dict)
        loaded: list[tuple[str, str, torch.Tensor]] = []
        for gi, (group, saved) in enumerate(zip(self.param_groups, state_dict["param_groups"])):
            merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
            try:
                self._check_group(merged)
            except (TypeError, ValueError) as e:
                raise type(e)(f"Invalid state_dict: param_groups[{gi}]: {e}") from e
            for pi, (index, p) in enumerate(zip(saved["params"], group["params"])):
                state = state_dict["state"].get(index)
                if not state:
                    continue
                of = f"(param_groups[{gi}]['params'][{pi}], shape {tuple(p.shape)})"
                if not isinstance(state, dict):
                    raise TypeError(f"Invalid state_dict: state[{index!r}] {of} is a {type(state).__name__}, "
                                    "expected a dict")
                expected = self._expected_state(p, merged)
                unknown = sorted(str(k) for k in state if k not in expected and k not in self.state_scalars)
                if unknown:
                    raise ValueError(f"Invalid state_dict: state[{index!r}] {of} has keys {type(self).__name__} "
                                     f"does not keep: {', '.join(unknown)} (a state dict of another optimizer?)")
                for key, kind in self.state_scalars.items():
                    _check_state_scalar(state.get(key, _MISSING), kind, f"state[{index!r}][{key!r}] {of}")
                self._check_state_entry(state, f"state[{index!r}] {of}")
                for key, (shape, dtype, required) in expected.items():
                    value = state.get(key)
                    where = f"state[{index!r}][{key!r}] {of}"
                    if value is None:
                        if required:
                            raise ValueError(f"Invalid state_dict: state[{index!r}] {of} has no {key!r}")
                        continue
                    if not isinstance(value, torch.Tensor):
                        raise TypeError(f"Invalid state_dict: {where} is a {type(value).__name__}, expected a tensor")
                    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                        raise ValueError(f"Invalid state_dict: {where} has shape {tuple(value.shape)} and dtype "
                                         f"{value.dtype}; this optimizer keeps shape {tuple(shape)}, dtype {dtype}")
                    loaded.append((where, key, value))
        self._check_state_values(loaded)

    #: The state keys that hold a quantity ``>= 0`` by construction (a second moment: Adam's ``exp_avg_sq``,
    #: AMSGrad's maximum, Adafactor's factors); :meth:`check_state_dict` refuses a negative entry there (the
    #: step would take its square root: NaN). Each class lists its own.
    nonnegative_state: tuple[str, ...] = ()

    def _check_state_values(self, loaded: list[tuple[str, str, torch.Tensor]]) -> None:
        """Refuse loaded state tensors holding ``inf``/``NaN``, or a negative entry under a key of
        :attr:`nonnegative_state`; ``loaded``: ``(where, key, tensor)`` triples, already of the right shape
        and dtype. One reduction per device decides the usual case (:func:`all_finite`, on this rank's
        shards: no collective); only a failure is located tensor by tensor.

        Raises:
            ValueError: naming the state entry (parameter index and key) and what it holds.
        """
        floating = [(where, key, _sharded.local([v])[0]) for where, key, v in loaded
                    if v.is_floating_point() or v.is_complex()]
        if floating and not _local_all_finite([v for _, _, v in floating]):
            for where, _, v in floating:
                if v.numel() and not bool(torch.isfinite(v).all()):
                    raise ValueError(f"Invalid state_dict: {where} holds {'NaN' if bool(v.isnan().any()) else 'inf'}"
                                     "; the next step would write it into the weights. Nothing was loaded")
        for where, key, v in floating:
            if key in self.nonnegative_state and v.numel() and bool((v < 0).any()):
                raise ValueError(f"Invalid state_dict: {where} has a negative entry ({float(v.min()):.3g}); it is a "
                                 "second moment (>= 0), so the state is corrupt. Nothing was loaded")

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict`` (from :meth:`state_dict`) into this optimizer, all or nothing.

        The whole dict is checked first (:meth:`check_state_dict`); on an error nothing has been
        written. Every tensor is copied (the loaded optimizer never shares a tensor with the source) and
        moved to its parameter's device, its dtype kept (already checked): ``torch.optim`` casts every
        state tensor to the parameter's dtype, which would round a float32 statistic of a bfloat16
        parameter (Shampoo's ``L``) to bfloat16. The load pre- and post-hooks run as in ``torch.optim``.

        Raises:
            ValueError, TypeError: as :meth:`check_state_dict`.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        self.check_state_dict(state_dict)
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        id_map = {i: p for saved, group in zip(saved_groups, self.param_groups)
                  for i, p in zip(saved["params"], group["params"])}
        state: collections.defaultdict = collections.defaultdict(dict)
        for index, value in state_dict["state"].items():
            p = id_map[index]
            state[p] = {k: v.detach().clone().to(p.device) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                        for k, v in value.items()}
            for key, kind in self.state_scalars.items():  # torch.optim's tensor step, read as the int it holds
                if kind == "count" and key in state[p] and not isinstance(state[p][key], int):
                    state[p][key] = int(state[p][key].item() if isinstance(state[p][key], torch.Tensor)
                                        else state[p][key])
        groups = []
        for group, saved in zip(self.param_groups, saved_groups):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            groups.append(saved)
        self.__setstate__({"state": state, "param_groups": groups})
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    #: The real-valued hyperparameters (or pairs of them, like ``betas``) that may be given as one-element
    #: tensors; ``step`` reads each as a Python float. Integer and choice options are not in it.
    float_options: tuple[str, ...] = ("lr",)

    def _read_floats(self, group: dict) -> dict:
        """``group`` with every tensor in ``float_options`` read as ``float`` (a new dict only if needed)."""
        floats = {}
        for key in self.float_options:
            value = group[key]
            if isinstance(value, torch.Tensor):  # validated: one real element
                floats[key] = float(value)
            elif isinstance(value, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in value):
                floats[key] = type(value)(float(x) if isinstance(x, torch.Tensor) else x for x in value)
        return {**group, **floats} if floats else group

    def _check_group(self, group: dict) -> None:
        """Check one group's options: every tensor among :attr:`float_options` has one element (``ValueError``
        naming it, with ``torch.optim``'s words "Tensor lr must be 1-element"), then the class's own checks
        (:meth:`_check_hyperparameters`)."""
        for key in self.float_options:
            value = group.get(key)
            entries = [(key, value)] if isinstance(value, torch.Tensor) else \
                [(f"{key}[{i}]", x) for i, x in enumerate(value)] if isinstance(value, (tuple, list)) else []
            for name, x in entries:
                if isinstance(x, torch.Tensor) and x.numel() != 1:
                    raise ValueError(f"Invalid {name}: Tensor {name} must be 1-element, got shape {tuple(x.shape)}")
        self._check_hyperparameters(group)

    def _check_hyperparameters(self, group: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _step_group(self, group: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    #: Check the step's gradients for ``inf``/``NaN`` in ``step()`` (one reduction per device) and raise
    #: :class:`~optbook.contract.NonFiniteGradientError` before any write: the step contract for an optimizer
    #: without a loss scaler. A caller that has checked every gradient of the step once itself (the chain,
    #: a wrapper) turns it off for the duration of its step with :func:`nonfinite_checked_by_caller`.
    refuse_nonfinite_grads = True

    def _validate(self) -> None:
        """Check every group's hyperparameters and every gradient; raise before any write.

        Non-finite gradients (unless a caller checks them, :func:`nonfinite_checked_by_caller`) are found
        by one check over all the gradients of the step (:func:`all_finite`: one device synchronisation
        per device, not one per tensor); only when it fails are the tensors looked at one by one, to name
        the first offender.

        Raises:
            NonFiniteGradientError: a gradient holds ``inf`` or ``NaN`` (named by group and index).
            ValueError, TypeError: an invalid hyperparameter or gradient (shape, dtype, device, layout).
        """
        checked, by_group = [], []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group)
            named = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}]"
                if "param_names" in group:   # given as model.named_parameters(): the name too
                    where += f" ({group['param_names'][pi]!r})"
                check_grad(p, where)
                if p.numel():
                    named.append((where, p))
            checked += named
            by_group.append((group, named))
        if self.refuse_nonfinite_grads and checked and not all_finite([p.grad for _, p in checked]):
            raise_nonfinite(checked)
        for group, named in by_group:
            if named:
                self._check_gradients(group, named)

    def _check_gradients(self, group: dict, named: list[tuple[str, torch.Tensor]]) -> None:
        """Class-specific checks of one group's finite gradients, run by :meth:`_validate` before any write.

        ``named``: the group's ``(name, param)`` pairs with a non-empty gradient. The default checks
        nothing; Shampoo and SOAP refuse a gradient that would overflow their statistics
        (:func:`check_statistics_range`).
        """

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss; it runs
                with gradients enabled.

        Returns:
            The closure's loss, or ``None``.

        DCP's priming step (``torch.distributed.checkpoint.state_dict`` creating missing state by a step with
        zero gradients and lr 0) is recognised and its state dropped at the next step unless something loaded
        over it (:func:`is_priming_step`, :func:`undo_priming`), so reading a checkpoint before the first step
        does not change training. A wrapper that has validated this step itself (:mod:`optbook.wrapper`)
        steps its inner optimizer without a second validation.

        Raises:
            NonFiniteGradientError: a gradient holds ``inf`` or ``NaN`` (a ``ValueError``; the step
                contract, :mod:`optbook.contract`); nothing has been modified.
            ValueError, TypeError: a hyperparameter or gradient is invalid (see the class
                docstring); nothing has been modified when this happens.
        """
        loss = closure_loss(closure)
        undo_priming(self)
        priming = is_priming_step(self)
        if not getattr(self, "_validated_by_caller", False):   # a wrapper has validated this step once
            self._validate()
        for group in self.param_groups:
            group = self._read_floats(group)
            if any(p.numel() == 0 for p in group["params"]):
                group = {**group, "params": [p for p in group["params"] if p.numel()]}
            self._step_group(group)
        if priming:
            record_priming(self)
        return loss


def check_hyperparameters(optimizer: BookOptimizer, group: dict) -> None:
    """Check one param group's hyperparameters as ``optimizer.step()`` does, without stepping.

    For a wrapper that runs an optbook optimizer's math itself (ZeRO-1, mixed precision, the Muon wrappers'
    loads): called before its first write, so that a bad option set by a scheduler or a checkpoint fails
    with the optimizer's own error. ``group``: a dict with the optimizer's option keys (``"params"`` is
    not looked at).

    Raises:
        TypeError, ValueError: an option is invalid (named, as the optimizer's constructor names it).
    """
    optimizer._check_group(group)
