"""The optimizer step of a fraction of the parameters, offloaded to a host device. Explained in chapter 16.

Sources: Ren et al. (2021), "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC 21,
arXiv:2101.06840: fp32 optimizer states and the update on the CPU, fp16 gradients down and parameters up);
Megatron-LM core_v0.16.0 ``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``
(``HybridDeviceOptimizer``: the first ``optimizer_offload_fraction`` of the parameters stepped on the CPU).
The code here is our own. :class:`OffloadOptimizer` is also importable from :mod:`optbook.memory`, whose
ledger predicts the bytes it moves.
"""

from __future__ import annotations

import inspect

import torch

from .contract import NonFiniteGradientError, checked_param_groups
from .masters import MastersWrapper
from .optim import AdamW
from ._checks import LOW_PRECISION, check_grad, check_int as _check_int, check_number
from .optim.optimizer import BookOptimizer, all_finite

__all__ = ["OffloadOptimizer"]



class OffloadOptimizer(MastersWrapper):
    """Step a fraction of the parameters on a host device (Megatron-LM's ``HybridDeviceOptimizer`` idea,
    after ZeRO-Offload, Ren et al. 2021).

    The model's parameters and gradients stay where they are (the *device*). The first parameters in
    param-group order, until ``offload_fraction`` of the elements are reached (Megatron's rule), are
    *offloaded*: each gets a copy on ``host`` (float32 for a float16/bfloat16 parameter, its own dtype
    otherwise) that the inner optimizer updates, and whose state (moments, step) lives on the host. The
    other parameters are stepped on the device (on a float32 master when float16/bfloat16). One step::

        for each offloaded p:  staging <- p.grad            device -> host, in p's dtype ("d2h" bytes)
                               host_p.grad <- staging        (float32 cast on the host)
        device optimizer step; then each host sub-group's optimizer step, in order
        for each offloaded p:  staging <- host_p             (one rounding to p's dtype, on the host)
                               p <- staging                  host -> device ("h2d" bytes)

    A float32/float64 parameter needs no staging: its gradient and value are copied directly. The host
    parameters are split into sub-groups of about ``sub_group_numel`` elements, each stepped by its own
    inner optimizer (Megatron-LM core_v0.16.0, with ``overlap_cpu_optimizer_d2h_h2d``, steps one CPU
    optimizer per parameter, so each can start as soon as its own gradient has arrived). Each inner
    optimizer keeps its parameters' state; ``state[p]`` is a view of it, so the bias-correction count
    ``step`` advances once per applied step whichever sub-group ``p`` is in.

    On a GPU (``device`` CUDA, ``host="cpu"``) the staging buffers are pinned and the copies non-blocking;
    the device is synchronised once before the host steps. On a CPU-only machine both sides are the CPU:
    the data flow, the byte counts and the arithmetic are the same, only nothing crosses a bus. The host
    gradient buffers are allocated once and kept between steps (as Megatron's pinned gradient buffers);
    :meth:`zero_grad` clears the model's gradients.

    The step is the template of :class:`~optbook.wrapper.OptimizerWrapper`: validate, gradients down and one
    inf/NaN check (raising :class:`~optbook.contract.NonFiniteGradientError`: there is no loss scaler), the
    inner optimizers' own checks once, their steps, parameters up. Everything they offer is forwarded
    (``train()``/``eval()`` of Schedule-Free move the host copies and write the model from them, hooks,
    pickling, DCP's priming), and the checkpoint layout is :mod:`optbook.masters`' (each copy in its
    parameter's state under ``"master_param"``).

    Args:
        params: tensors or param-group dicts, as for ``optimizer_class``.
        optimizer_class: a ``torch.optim.Optimizer`` class (default :class:`optbook.optim.AdamW`; any
            optimizer whose update of a parameter reads only that parameter's state, e.g. ``Muon``).
        offload_fraction: fraction of the elements to step on the host, in ``[0, 1]`` (Megatron's
            ``optimizer_offload_fraction``).
        host: the host device (default ``"cpu"``).
        sub_group_numel: ``None`` (one host optimizer) or an int ``>= 1``: a new host sub-group starts once
            the current one holds at least this many elements.
        **defaults: hyperparameters for ``optimizer_class``.

    Attributes:
        last_bytes: ``{"d2h": int, "h2d": int}`` bytes copied by the last step; ``total_bytes`` the sums.
        host_optimizers, device_optimizer: the inner optimizers (``device_optimizer`` may be ``None``).
        offloaded: for each parameter in group order, whether it is stepped on the host.
        found_inf, skipped_steps, last_grad_norm: the step contract's reports (:mod:`optbook.contract`). There
            is no loss scaler, so a non-finite gradient raises and no step is skipped: always ``False``, ``0``
            (kept in the state dict) and ``None`` (no norm is computed).

    Who owns the weights (:mod:`optbook.contract`): the optimizer registers itself as the owner of every
    parameter it keeps a copy of (host copies, device float32 masters); a write it did not make is taken
    up into the copy at the next step (:func:`optbook.masters.take_up_`), :func:`optbook.contract.scale_weights_`
    scales the copy and writes the parameter from it.

    Raises:
        TypeError: ``optimizer_class`` not a ``torch.optim.Optimizer`` subclass; ``host`` not a device;
            ``sub_group_numel`` not an int. ValueError: ``offload_fraction`` outside ``[0, 1]``,
            ``sub_group_numel < 1``, what ``optimizer_class`` raises for its arguments. All before anything
            is allocated.
    """

    def __init__(self, params, optimizer_class=AdamW, *, offload_fraction: float = 1.0, host="cpu",
                 sub_group_numel: int | None = None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"Invalid optimizer_class: expected a torch.optim.Optimizer subclass, got "
                            f"{optimizer_class!r}")
        fraction = check_number("offload_fraction", offload_fraction, low=0.0, high=1.0)
        try:
            host = torch.device(host)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"Invalid host: expected a torch.device or device string, got {host!r}") from e
        if sub_group_numel is not None:
            _check_int("sub_group_numel", sub_group_numel, 1)
        groups, filled = checked_param_groups(optimizer_class, params, defaults)
        self.param_groups = [dict(g) for g in groups]
        self.defaults = filled
        self.optimizer_class = optimizer_class
        self.host = host
        self.offload_fraction = fraction
        self.sub_group_numel = sub_group_numel
        self.last_bytes = {"d2h": 0, "h2d": 0}
        self.total_bytes = {"d2h": 0, "h2d": 0}

        params = self.model_params()
        threshold = fraction * sum(p.numel() for p in params)
        moved = 0
        self.offloaded: list[bool] = []
        self._staging: dict = {}   # offloaded low-precision parameter -> (grad staging, param staging)
        self._copies = {}   # (none at all when nothing is offloaded and no parameter is float16/bfloat16)
        with torch.no_grad():
            for p in params:
                off = moved < threshold
                self.offloaded.append(off)
                low = p.dtype in LOW_PRECISION
                if off:
                    moved += p.numel()
                    pin = p.is_cuda and host.type == "cpu"
                    inner = p.detach().to(host, torch.float32 if low else p.dtype, copy=True)
                    inner.grad = torch.empty(inner.shape, dtype=inner.dtype, device=host, pin_memory=pin)
                    if low:
                        self._staging[p] = tuple(torch.empty(p.shape, dtype=p.dtype, device=host,
                                                             pin_memory=pin) for _ in range(2))
                    self._add_copy(p, inner)
                elif low:
                    self._add_copy(p, p.detach().to(torch.float32, copy=True))
        self._on_host = {id(p) for p, off in zip(params, self.offloaded) if off}

        chunks, current, size = [], [], 0
        for p in (p for p in params if id(p) in self._on_host):
            current.append(p)
            size += p.numel()
            if sub_group_numel is not None and size >= sub_group_numel:
                chunks.append(current)
                current, size = [], 0
        if current:
            chunks.append(current)
        self.device_optimizer = None
        self.host_optimizers = []
        self._subs, spec = [], []
        device_members = [p for p in params if id(p) not in self._on_host]
        for members, on_host in [(device_members, False)] + [(c, True) for c in chunks]:
            ids = {id(p) for p in members}
            inner_groups, positions = [], []
            for gi, g in enumerate(self.param_groups):
                where = [pi for pi, p in enumerate(g["params"]) if id(p) in ids]
                if where:
                    inner_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                         "params": [self.copy_of(g["params"][pi]) for pi in where]})
                    positions.append((gi, where))
            if not inner_groups:
                continue
            opt = optimizer_class(inner_groups, **defaults)
            self._subs.append(opt)
            spec.append(positions)
            if on_host:
                self.host_optimizers.append(opt)
            else:
                self.device_optimizer = opt
        self._stepped = None
        self._init_masters(spec)

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The device optimizer (if any), then each host sub-group's, in step order."""
        return list(self._subs)

    @property
    def _params(self) -> list[torch.Tensor]:
        return self.model_params()

    @property
    def _inner(self) -> dict:
        """Model parameter -> the tensor its inner optimizer steps, for those with a copy."""
        return self._copies

    def master_params(self) -> list[torch.Tensor]:
        """The tensor each parameter is stepped on (host copy, device master or itself), in group order."""
        return [self.copy_of(p) for p in self.model_params()]

    def add_param_group(self, param_group: dict) -> None:
        """Not supported: the host copies and inner optimizers are built once.

        Raises:
            NotImplementedError: always (build a new optimizer with every group instead).
        """
        raise NotImplementedError("OffloadOptimizer.add_param_group: host copies and inner optimizers are "
                                  "built at construction; build a new OffloadOptimizer with every group")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (the host gradient buffers are kept, as Megatron's pinned ones)."""
        for p in self.model_params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # --- the phases of the step (optbook.wrapper) -----------------------------------------------------------
    def validate(self) -> None:
        """Every model gradient's layout; for a ``torch.optim`` ``optimizer_class`` (which checks only in its
        constructor) each group's hyperparameters through a throwaway instance over one element. An optbook
        class checks them itself, once, in ``validate_leaves``."""
        if not issubclass(self.optimizer_class, BookOptimizer):
            accepted = inspect.signature(self.optimizer_class).parameters
            for gi, group in enumerate(self.param_groups):
                hyper = {k: v for k, v in group.items() if k != "params" and k in accepted}
                try:
                    self.optimizer_class([torch.zeros(1, requires_grad=True)], **hyper)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"param_groups[{gi}]: {e}") from e
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    check_grad(p, f"param_groups[{gi}]['params'][{pi}]")
        self._stepped = None
        super().validate()

    def _leaf_error(self, error: Exception, k: int, optimizer) -> Exception:
        return type(error)(f"{error} (inner optimizer {k} of the OffloadOptimizer)")

    def prepare_grads(self) -> bool:
        """Take up outside writes; one inf/NaN check over the model's gradients (raises, naming the parameter);
        then gradients down: each one into its copy's ``.grad`` (through the staging buffer when low precision
        on the host). A copy whose parameter has no gradient this step is not stepped."""
        self.take_up_outside_writes()
        named = [(f"param_groups[{gi}]['params'][{pi}]", p) for gi, g in enumerate(self.param_groups)
                 for pi, p in enumerate(g["params"]) if p.grad is not None and p.numel()]
        if named and not all_finite([p.grad for _, p in named]):
            for where, p in named:
                if not bool(torch.isfinite(p.grad).all()):
                    raise NonFiniteGradientError(f"Non-finite gradient of {where} (shape {tuple(p.shape)}): "
                                                 "nothing was written (OffloadOptimizer has no loss scaler)")
        self._copy_grads_down()
        return False

    def _copy_grads_down(self) -> None:
        d2h, gpus = 0, set()   # the GPUs whose copies the host must wait for (each one's own synchronize)
        self._stepped, self._hidden = [], {}
        for p in self.model_params():
            inner, off = self._copies.get(p), id(p) in self._on_host
            if p.grad is None:
                if inner is not None and off:   # not stepped this step (as the device optimizer skips it)
                    self._hidden[p] = inner.grad
                    inner.grad = None
                elif inner is not None:
                    inner.grad = None
                continue
            self._stepped.append(p)
            if inner is None:
                continue
            if not off:   # a device master
                if inner.grad is None:
                    inner.grad = p.grad.to(torch.float32, copy=True)
                else:
                    inner.grad.copy_(p.grad)
                continue
            if inner.grad is None:   # a failed step left it unset
                inner.grad = torch.empty_like(inner)
            if p.is_cuda:
                gpus.add(p.device)
            if p in self._staging:
                self._staging[p][0].copy_(p.grad, non_blocking=p.is_cuda)
            else:
                inner.grad.copy_(p.grad, non_blocking=p.is_cuda)
            d2h += p.grad.numel() * p.grad.element_size()
        for gpu in gpus:
            torch.cuda.synchronize(gpu)
        for p, staging in self._staging.items():
            if p.grad is not None:
                self._copies[p].grad.copy_(staging[0])
        self.last_bytes = {"d2h": d2h, "h2d": 0}

    def step_with_ready_grads(self) -> None:
        super().step_with_ready_grads()
        for p, g in self._hidden.items():   # the host gradient buffers stay allocated
            self._copies[p].grad = g
        self._hidden = {}

    def _write_model(self, param: torch.Tensor, copy: torch.Tensor) -> None:
        """Write ``param`` from its copy (through the staging buffer when low precision on the host)."""
        off = id(param) in self._on_host
        if off and param in self._staging:
            up = self._staging[param][1]
            up.copy_(copy)   # rounding on the host
            param.copy_(up, non_blocking=param.is_cuda)
        else:
            param.copy_(copy, non_blocking=off and param.is_cuda)

    def publish_weights(self) -> None:
        """Parameters up: each parameter stepped this step (every copied one outside a step, after a mode
        switch) from its copy; the byte counters count what crossed."""
        stepped = self._stepped if self._stepped is not None else list(self._copies)
        h2d, gpus = 0, set()
        for p in stepped:
            if p in self._copies:
                self._write_model(p, self._copies[p])
                if id(p) in self._on_host:
                    h2d += p.numel() * p.element_size()
                    if p.is_cuda:
                        gpus.add(p.device)
        for gpu in gpus:
            torch.cuda.synchronize(gpu)
        self._tracker.record(list(self._copies))
        if self._stepped is not None:
            self.last_bytes = {**self.last_bytes, "h2d": h2d}
            self.total_bytes = {k: self.total_bytes[k] + v for k, v in self.last_bytes.items()}
        self._stepped = None

    def prime(self) -> None:
        self._copy_grads_down()
        super().prime()
        for p, g in self._hidden.items():
            self._copies[p].grad = g
        self._hidden, self._stepped = {}, None

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)   # the ids of the unpickled parameters are new
        self._on_host = {id(p) for p, off in zip(self.model_params(), self.offloaded) if off}

    def _repr_options(self) -> str:
        n_off = sum(p.numel() for p, off in zip(self.model_params(), self.offloaded) if off)
        n = sum(p.numel() for p in self.model_params())
        return (f"{self.optimizer_class.__name__}, host={self.host}, offloaded {n_off} of {n} elements in "
                f"{len(self.host_optimizers)} host sub-groups")

    def __repr__(self) -> str:
        return f"OffloadOptimizer({self._repr_options()})"
