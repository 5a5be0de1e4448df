"""The small base class every optimizer in :mod:`optbook.optim` shares.

It adds these things to :class:`torch.optim.Optimizer`:

* every parameter group is validated when it is added (``__init__`` and ``add_param_group``), and
  again, with every gradient, at the start of each ``step()`` -- *before* any tensor is written, so
  a ``step()`` that raises leaves parameters and state untouched;
* ``step(closure)`` re-evaluates the closure with gradients enabled, as PyTorch's optimizers do;
* a tensor ``lr`` (one element, any shape or dtype, e.g. ``torch.tensor([0.1])``) is read as the Python
  number ``float(lr)`` at each step, so it gives bitwise the result of that float ``lr`` on every path
  (loop and foreach). The group keeps the tensor, so a scheduler may ``fill_`` it. The same holds for
  every other real-valued hyperparameter a class lists in ``float_options`` (``momentum``,
  ``weight_decay``, ``eps``, each entry of ``betas``, ...); a tensor with more than one element, a
  bool, complex or non-finite one is refused when the group is added, naming the argument;
* a parameter with zero elements (e.g. shape ``(0, 3)``) is skipped: it has nothing to update, gets no
  state, and would otherwise make Adafactor's RMS divide by zero or Muon's blocks fail to reshape;
* a state dict saved before an option existed (e.g. ``foreach``, ``head_split``, ``amsgrad``) loads and
  steps: ``__setstate__`` fills each missing option with the constructor's default, the behaviour the
  old version had (as ``torch.optim``'s classes do, one ``setdefault`` per option);
* ``load_state_dict`` copies the state tensors it is given, so the loaded optimizer never shares them
  with the source (``torch.optim.Optimizer.load_state_dict`` keeps a same-dtype, same-device tensor
  as it is: stepping one optimizer then changes the other; pytorch/pytorch#196083).

Subclasses implement ``_check_hyperparameters(group)`` and ``_step_group(group)``.
Explained in chapter 1 (SGD and momentum).
"""

from __future__ import annotations

import copy
import inspect

import torch

from ._validation import check_grad, check_matrices, check_params


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every (non-empty) tensor is finite, in one reduction per device.

    The largest absolute value of a tensor (``torch._foreach_norm`` with ``ord=inf``, one fused launch
    per device) is finite exactly when every element is: a NaN propagates through the maximum and
    ``+-inf`` gives ``inf``; a large finite value cannot overflow a maximum.
    """
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    return all(bool(torch.isfinite(torch.stack(torch._foreach_norm(ts, float("inf")))).all())
               for ts in by_device.values())


class BookOptimizer(torch.optim.Optimizer):
    """Base class: validation before mutation, closures, and PyTorch's param-group machinery."""

    #: Whether each element is updated from its own gradient and state alone, so that any slice of a flat
    #: buffer steps as the whole parameter does (ZeRO-1 and offload accept only such classes;
    #: :func:`optbook.contract.elementwise`). Each optimizer sets it.
    elementwise = False

    #: Set by optimizers defined for 2-D matrices only (Shampoo, SOAP): the hint of the error for other shapes.
    matrix_hint: str | None = None

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch.optim rejects sets with its own message
            params = list(params)
            check_params(params)
        if self.matrix_hint is not None and not isinstance(params, set):
            check_matrices(params, type(self).__name__, self.matrix_hint)
        self._check_hyperparameters({**self.defaults, **param_group})
        super().add_param_group({**param_group, "params": params})

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        signature = inspect.signature(type(self).__init__).parameters
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if key in signature and key not in group:  # an option newer than the saved state: its default
                    default = signature[key].default
                    group[key] = value if default is inspect.Parameter.empty else default

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict`` (from :meth:`state_dict`) into this optimizer, copying every tensor.

        Raises:
            ValueError: as :meth:`torch.optim.Optimizer.load_state_dict` (group or parameter counts differ).
        """
        super().load_state_dict(copy.deepcopy(state_dict))

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

    def _check_hyperparameters(self, group: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _step_group(self, group: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    #: Refuse non-finite gradients before any write. Set by optimizers whose state a NaN would poison
    #: for good (Muon's normalisation, Shampoo's and SOAP's factors).
    refuse_nonfinite_grads = False

    def _validate(self) -> None:
        """Check every group's hyperparameters and every gradient; raise before any write.

        Non-finite gradients (when ``refuse_nonfinite_grads``) are found by one check over all the
        gradients of the step (one device synchronisation per device, not one per tensor); only when it
        fails are the tensors looked at one by one, to name the first offender.
        """
        checked = []
        for gi, group in enumerate(self.param_groups):
            self._check_hyperparameters(group)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}]"
                check_grad(p, where)
                if p.numel():
                    checked.append((where, p))
        if self.refuse_nonfinite_grads and checked and not all_finite([p.grad for _, p in checked]):
            for where, p in checked:
                if not bool(torch.isfinite(p.grad).all()):
                    raise ValueError(f"Non-finite gradient in {where} (shape {tuple(p.shape)}): skip this step "
                                     "(see the loss scaler); nothing was changed")

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss; it runs
                with gradients enabled.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError, TypeError: a hyperparameter or gradient is invalid (see the class
                docstring); nothing has been modified when this happens.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate()
        for group in self.param_groups:
            group = self._read_floats(group)
            if any(p.numel() == 0 for p in group["params"]):
                group = {**group, "params": [p for p in group["params"] if p.numel()]}
            self._step_group(group)
        return loss
