"""Memory of the optimizer step: predicted bytes per parameter and per rank, bytes measured from the real
tensors, and the step offloaded to a host. Explained in chapter 16.

Sources: Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC20, arXiv:1910.02054), Sec. 3.1 (model states: parameters, gradients, optimizer states) and Sec. 5.1
(stage 1, optimizer-state partitioning); Megatron-LM's distributed-optimizer guide
(``docs/source/api-guide/dist_optimizer.md``: bytes per parameter 18 / 6 + 12/d for bf16 parameters with
fp32 gradients, 20 / 4 + 16/d for fp16 gradients, 16 / 8 + 8/d for fp32 parameters),
``megatron/training/theoretical_memory_usage.py`` (the parameters of the most-loaded model-parallel rank)
and ``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py`` (``HybridDeviceOptimizer``: part of
the step on the CPU); Ren et al. (2021), "ZeRO-Offload: Democratizing Billion-Scale Model Training"
(USENIX ATC 21, arXiv:2101.06840: fp32 optimizer states and the update on the CPU, fp16 gradients down
and parameters up). The code here is our own.

Three things, one concept (where the bytes of a training step live):

* :func:`ledger` predicts, component by component, the bytes one rank holds for a configuration
  (:class:`MemoryConfig`): data parallel (every rank holds everything) or ZeRO-1 / layer-wise sharding
  of the optimizer state over ``dp`` ranks; AdamW or Muon (with a fraction of the parameters routed to
  AdamW); parameter, gradient and state dtypes; float32 masters; tensor and pipeline parallel sizes; a
  fraction of the optimizer state offloaded to the host.
* :func:`measure` counts the bytes of the tensors an optimizer really holds, by role (``params``,
  ``grads``, ``master``, ``main_grads``, ``state``, ``step``, ``staging``): optbook's and ``torch.optim``'s
  optimizers, :class:`optbook.precision.MixedPrecisionOptimizer`,
  :class:`optbook.distributed.DistributedOptimizer`, :class:`optbook.optim.ChainedOptimizer` and
  :class:`OffloadOptimizer`. Bytes are deterministic, so predicted and measured agree exactly.
* :class:`OffloadOptimizer` runs the step of a chosen fraction of the parameters on a host device: per
  step, gradients go down (device to host), the inner optimizer steps host copies, parameters go up.

Units: bytes (ints where they are exact); ``GB = 1e9`` bytes (decimal, as Megatron's worked numbers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from .contract import (NonFiniteGradientError, VersionTracker, checked_param_groups, closure_loss,
                       elementwise, register_owner)
from .optim import SGD, Adam, AdamW, Lion, Muon
from ._checks import FLOATS, LOW_PRECISION, check_dtype, check_grad, check_int as _check_int, check_number
from .optim.optimizer import BookOptimizer, all_finite
from .precision import check_optimizer_state_dict, take_up_

__all__ = ["Component", "Ledger", "Measured", "MemoryConfig", "OPTIMIZERS", "OffloadOptimizer", "ledger", "measure",
           "most_loaded_shard", "peak_device_bytes", "state_tensors"]

#: The optimizer names :class:`MemoryConfig` accepts, and the classes they stand for.
OPTIMIZERS = {"adamw": AdamW, "adam": Adam, "muon": Muon, "sgd": SGD, "lion": Lion}

#: ``torch.optim`` classes have no ``state_tensors`` attribute: their parameter-sized state tensors, as they
#: are by default (PyTorch v2.13.0; Adam's ``amsgrad`` adds one, SGD without momentum keeps none).
_TORCH_STATE_TENSORS = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                        "RMSprop": 1, "Rprop": 2}


def state_tensors(optimizer_class) -> int:
    """How many state tensors of the parameter's size ``optimizer_class`` keeps per parameter.

    Read from the class attribute ``state_tensors`` (AdamW and Adam: 2, ``exp_avg`` and ``exp_avg_sq``; SGD
    with momentum, Muon, Lion: 1). For a ``torch.optim`` class, which has no such attribute, its default
    configuration: SGD, Adagrad, RMSprop 1; Adam, AdamW, Adamax, NAdam, RAdam, Rprop 2.

    Raises:
        TypeError: a class that declares no count (Adafactor, Shampoo, SOAP keep factored state, not
            parameter-sized tensors) and is not one of those ``torch.optim`` classes.
    """
    count = getattr(optimizer_class, "state_tensors", None)
    if count is None and getattr(torch.optim, getattr(optimizer_class, "__name__", ""), None) is optimizer_class:
        count = _TORCH_STATE_TENSORS.get(optimizer_class.__name__)
    if count is None:
        raise TypeError(f"Invalid optimizer: {getattr(optimizer_class, '__name__', optimizer_class)!r} declares "
                        "no state_tensors (parameter-sized state tensors per parameter)")
    return count


SHARDINGS = ("none", "zero1", "layerwise")


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# --- prediction -------------------------------------------------------------------------------------------
def most_loaded_shard(total_params: float, *, tp: int = 1, pp: int = 1, embedding_params: float = 0,
                      untied_embeddings: bool = False) -> float:
    """Parameters on the fullest model-parallel rank (Megatron-LM's ``theoretical_memory_usage.py``).

    The transformer block (``total_params`` minus the embedding, counted twice when untied) is split evenly
    over ``pp`` pipeline stages and ``tp`` tensor-parallel ranks; the first stage also holds the embedding
    (split over ``tp``), and with ``pp == 1`` and untied embeddings the output layer as well::

        ((total - E * (2 if untied else 1)) / pp + E) / tp   (+ E / tp if untied and pp == 1)

    With ``embedding_params = 0`` this is ``total_params / (tp * pp)``, the uniform split.

    Raises:
        TypeError: ``tp``/``pp`` not ints; ValueError: ``tp``/``pp < 1``, a negative count, or an embedding
        larger than the model.
    """
    tp, pp = _check_int("tp", tp, 1), _check_int("pp", pp, 1)
    total = check_number("total_params", total_params, low=0.0)
    emb = check_number("embedding_params", embedding_params, low=0.0)
    copies = 2 if untied_embeddings else 1
    if emb * copies > total:
        raise ValueError(f"Invalid embedding_params: {copies} x {emb:g} exceeds total_params {total:g}")
    shard = ((total - copies * emb) / pp + emb) / tp
    if untied_embeddings and pp == 1:
        shard += emb / tp
    return shard


@dataclass(frozen=True)
class MemoryConfig:
    """What one rank keeps for the optimizer step (the arguments of :func:`ledger`).

    Args:
        optimizer: a name of :data:`OPTIMIZERS` (``"adamw"``, ``"adam"``: 2 state tensors; ``"muon"``,
            ``"sgd"`` with momentum, ``"lion"``: 1) or an optimizer class; the count is
            :func:`state_tensors` of the class.
        sharding: ``"none"`` (data parallel: every rank holds all optimizer state), ``"zero1"`` (Megatron's
            distributed optimizer: master, main gradient and state split over ``dp`` ranks, element-wise
            optimizers only: :func:`optbook.contract.elementwise`) or ``"layerwise"`` (whole matrices owned by one rank each; counted as an even
            split, which load balancing approaches).
        dp: data-parallel ranks sharing the optimizer state (``>= 1``).
        param_dtype: the model parameters' dtype (float16, bfloat16, float32, float64).
        grad_dtype: the gradient buffer's dtype; ``None``: float32 for float16/bfloat16 parameters (Megatron's
            float32 gradient accumulation), else ``param_dtype``.
        master_weights: keep a float32 master of each parameter for the update; ``None``: exactly when the
            parameters are float16/bfloat16. A float32/float64 parameter is its own master.
        state_dtype: the optimizer state's dtype; ``None``: float32 with masters, else ``param_dtype``.
        adamw_fraction: with ``optimizer="muon"``, the fraction of the rank's parameters routed to AdamW
            (embeddings, output head, norms, biases), in ``[0, 1]``.
        offload_fraction: fraction of master, main gradient and state kept on the host, in ``[0, 1]``.

    Raises:
        TypeError / ValueError naming the argument: unknown optimizer or sharding, ``zero1`` with Muon
        (element-wise shards cut through matrices; use ``layerwise``), ``master_weights=True`` with
        float32/float64 parameters, an ``adamw_fraction`` with an optimizer other than Muon, a fraction
        outside ``[0, 1]``.
    """

    optimizer: str | type = "adamw"
    sharding: str = "none"
    dp: int = 1
    param_dtype: torch.dtype = torch.bfloat16
    grad_dtype: torch.dtype | None = None
    master_weights: bool | None = None
    state_dtype: torch.dtype | None = None
    adamw_fraction: float = 0.0
    offload_fraction: float = 0.0

    def __post_init__(self):
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Invalid optimizer: expected one of {sorted(OPTIMIZERS)} or an optimizer class, "
                             f"got {self.optimizer!r}")
        if not isinstance(self.optimizer, (str, type)):
            raise TypeError(f"Invalid optimizer: expected a name or an optimizer class, got {self.optimizer!r}")
        state_tensors(self.optimizer_class)
        if self.sharding not in SHARDINGS:
            raise ValueError(f"Invalid sharding: expected one of {SHARDINGS}, got {self.sharding!r}")
        if self.sharding == "zero1" and not elementwise(self.optimizer_class):
            raise ValueError(f"Invalid sharding: 'zero1' splits the state element-wise, through matrices, and "
                             f"{self.optimizer_class.__name__} is not element-wise (Muon orthogonalises whole "
                             "matrices); use sharding='layerwise' (Megatron-LM rewrites "
                             "--use-distributed-optimizer with Muon to its layer-wise optimizer)")
        _check_int("dp", self.dp, 1)
        check_dtype("param_dtype", self.param_dtype)
        check_dtype("grad_dtype", self.grad_dtype, none_ok=True)
        check_dtype("state_dtype", self.state_dtype, none_ok=True)
        if self.master_weights is not None and not isinstance(self.master_weights, bool):
            raise TypeError(f"Invalid master_weights: expected None or a bool, got {self.master_weights!r}")
        if self.master_weights and self.param_dtype not in LOW_PRECISION:
            raise ValueError(f"Invalid master_weights: a {self.param_dtype} parameter is its own master; "
                             "masters exist for float16/bfloat16 parameters")
        check_number("adamw_fraction", self.adamw_fraction, low=0.0, high=1.0)
        if self.adamw_fraction and self.optimizer_class is not Muon:
            raise ValueError(f"Invalid adamw_fraction: it routes part of a Muon model to AdamW; with "
                             f"optimizer={self.optimizer!r} it must be 0")
        check_number("offload_fraction", self.offload_fraction, low=0.0, high=1.0)

    @property
    def optimizer_class(self) -> type:
        """The class ``optimizer`` names (or is)."""
        return OPTIMIZERS[self.optimizer] if isinstance(self.optimizer, str) else self.optimizer

    @property
    def masters(self) -> bool:
        return self.param_dtype in LOW_PRECISION if self.master_weights is None else self.master_weights

    @property
    def grad(self) -> torch.dtype:
        if self.grad_dtype is not None:
            return self.grad_dtype
        return torch.float32 if self.param_dtype in LOW_PRECISION else self.param_dtype

    @property
    def state(self) -> torch.dtype:
        if self.state_dtype is not None:
            return self.state_dtype
        return torch.float32 if self.masters else self.param_dtype

    @property
    def state_tensors(self) -> float:
        """State tensors per parameter (Muon with ``adamw_fraction`` f: ``(1 - f) * 1 + f * 2``)."""
        k = state_tensors(self.optimizer_class)
        if self.optimizer_class is Muon:
            return (1 - self.adamw_fraction) * k + self.adamw_fraction * state_tensors(AdamW)
        return k


@dataclass(frozen=True)
class Component:
    """One row of a :class:`Ledger`.

    ``bytes_per_param``: bytes per parameter before sharding; ``divisor``: ``dp`` when the row is sharded
    over the data-parallel ranks, else 1; ``host_fraction``: the part of it kept on the host.
    """

    name: str
    bytes_per_param: float
    divisor: int
    host_fraction: float
    params: float

    @property
    def per_param(self) -> float:
        """Bytes per parameter on this rank: ``bytes_per_param / divisor``."""
        return self.bytes_per_param / self.divisor

    @property
    def bytes(self) -> float:
        """Bytes on this rank (device and host): ``params * bytes_per_param / divisor``."""
        return self.params * self.bytes_per_param / self.divisor

    @property
    def host_bytes(self) -> float:
        return self.bytes * self.host_fraction

    @property
    def device_bytes(self) -> float:
        return self.bytes - self.host_bytes


@dataclass(frozen=True)
class Ledger:
    """Predicted bytes of one rank, by component (the rows of :func:`ledger`'s formula; chapter 16).

    Rows: ``params`` (the model's parameters), ``grads`` (the gradient buffer), ``master`` (float32
    masters), ``main_grads`` (the float32 copy of a low-precision gradient the update reads), ``state``
    (moments / momentum). ``optimizer_state_bytes`` is master + state, Megatron's "optimizer state".
    """

    config: MemoryConfig
    params: float                      #: parameters on this model-parallel rank
    components: tuple = field(default=())

    def __getitem__(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; the rows are {[c.name for c in self.components]}")

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes for c in self.components)

    @property
    def device_bytes(self) -> float:
        return sum(c.device_bytes for c in self.components)

    @property
    def host_bytes(self) -> float:
        return sum(c.host_bytes for c in self.components)

    @property
    def bytes_per_param(self) -> float:
        """Device and host bytes per parameter of this rank (e.g. 18, or 6 + 12/d)."""
        return sum(c.per_param for c in self.components)

    @property
    def optimizer_state_bytes(self) -> float:
        """Master weights plus optimizer state on this rank (e.g. 12 bytes per parameter, over ``dp``)."""
        return self["master"].bytes + self["state"].bytes

    def table(self, unit: float = 1e9, unit_name: str = "GB") -> str:
        """A fixed-format text table: component, bytes per parameter, per-rank amount in ``unit_name``."""
        lines = [f"{'component':12} {'B/param':>9} {unit_name + '/rank':>10}"]
        for c in self.components:
            lines.append(f"{c.name:12} {c.per_param:9.4f} {c.bytes / unit:10.4f}")
        lines.append(f"{'total':12} {self.bytes_per_param:9.4f} {self.total_bytes / unit:10.4f}")
        return "\n".join(lines)


def ledger(params: float, config: MemoryConfig | None = None, *, tp: int = 1, pp: int = 1,
           embedding_params: float = 0, untied_embeddings: bool = False, **options) -> Ledger:
    """Predicted bytes per parameter and per rank.

    Per parameter of the rank (``d`` = ``dp`` when sharded, else 1; ``b(x)`` = bytes of dtype ``x``)::

        params      b(param_dtype)
        grads       b(grad_dtype)
        master      4 / d                      (float32 masters)
        main_grads  4 / d                      (masters and a non-float32 gradient buffer)
        state       k * b(state_dtype) / d     (k = 2 for AdamW, 1 for Muon)

    This gives Megatron-LM's table: 18 and 6 + 12/d (bf16 parameters, fp32 gradients), 20 and 4 + 16/d
    (fp16 gradients), 16 and 8 + 8/d (fp32 parameters).

    Args:
        params: the model's total parameter count (a real number ``>= 0``; an int for exact bytes).
        config: a :class:`MemoryConfig`, or ``None`` and its fields as keyword ``options``.
        tp, pp, embedding_params, untied_embeddings: the model-parallel split; the rank holds
            :func:`most_loaded_shard` parameters (``params`` itself when ``tp = pp = 1`` and no embedding).

    Returns:
        A :class:`Ledger`.

    Raises:
        TypeError: both ``config`` and ``options``, or an unknown option; what :class:`MemoryConfig` and
        :func:`most_loaded_shard` raise.
    """
    if config is None:
        config = MemoryConfig(**options)
    elif options:
        raise TypeError(f"Invalid options {sorted(options)}: pass either config or its fields, not both")
    elif not isinstance(config, MemoryConfig):
        raise TypeError(f"Invalid config: expected a MemoryConfig, got {type(config).__name__}")
    n = most_loaded_shard(params, tp=tp, pp=pp, embedding_params=embedding_params,
                          untied_embeddings=untied_embeddings)
    d = config.dp if config.sharding != "none" else 1
    off = config.offload_fraction
    master = 4 if config.masters else 0
    main = 4 if config.masters and config.grad != torch.float32 else 0
    rows = (Component("params", _nbytes(config.param_dtype), 1, 0.0, n),
            Component("grads", _nbytes(config.grad), 1, 0.0, n),
            Component("master", master, d, off, n),
            Component("main_grads", main, d, off, n),
            Component("state", config.state_tensors * _nbytes(config.state), d, off, n))
    return Ledger(config, n, rows)


# --- measurement ------------------------------------------------------------------------------------------
ROLES = ("params", "grads", "master", "main_grads", "state", "step", "staging")


@dataclass
class Measured:
    """Bytes of the tensors an optimizer holds, by role and by device (from :func:`measure`)."""

    bytes: dict = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    devices: dict = field(default_factory=dict)
    tensors: int = 0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def add(self, role: str, t, seen: set) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return
        key = (str(t.device), t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            return
        seen.add(key)
        n = t.numel() * t.element_size()
        self.bytes[role] += n
        self.devices[str(t.device)] = self.devices.get(str(t.device), 0) + n
        self.tensors += 1

    def as_dict(self) -> dict:
        return {"bytes": dict(self.bytes), "devices": dict(self.devices), "tensors": self.tensors}


def _add_state(out: Measured, state, seen: set) -> None:
    for s in state.values():
        for key, v in s.items():
            out.add("step" if key == "step" else "state", v, seen)


def _measure(opt, out: Measured, seen: set) -> None:
    from .optim import ChainedOptimizer
    from .precision import MixedPrecisionOptimizer

    if isinstance(opt, OffloadOptimizer):
        for p in opt._params:
            out.add("params", p, seen)
            out.add("grads", p.grad, seen)
        for inner in opt._inner.values():
            out.add("master", inner, seen)   # a float32 master, or the host copy of a parameter
            out.add("main_grads", inner.grad, seen)
        for staging in opt._staging.values():
            for t in staging:
                out.add("staging", t, seen)
        _add_state(out, opt.state, seen)
        return
    if isinstance(opt, MixedPrecisionOptimizer):
        for p in opt.model_params():
            out.add("params", p, seen)
            out.add("grads", p.grad, seen)
        for m in opt.master_params():
            out.add("master", m, seen)
            out.add("main_grads", m.grad, seen)
        _measure(opt.optimizer, out, seen)
        return
    if isinstance(opt, ChainedOptimizer):
        for member in opt.optimizers:
            _measure(member, out, seen)
        return
    try:
        from .distributed.zero1 import DistributedOptimizer
    except ImportError:  # pragma: no cover - torch without torch.distributed
        DistributedOptimizer = ()
    if DistributedOptimizer and isinstance(opt, DistributedOptimizer):
        for buf in opt.param_buffers.values():
            out.add("params", buf, seen)
        for buf in opt.grad_buffers.values():
            out.add("grads", buf, seen)
        for p in (p for g in opt.param_groups for p in g["params"]):  # autograd's .grad (freed by zero_grad)
            out.add("grads", p.grad, seen)
        for m in opt.master_shards.values():
            out.add("master", m, seen)
        _add_state(out, opt.optimizer.state, seen)
        return
    for group in opt.param_groups:
        for p in group["params"]:
            out.add("params", p, seen)
            out.add("grads", p.grad, seen)
    _add_state(out, opt.state, seen)


def measure(optimizer) -> Measured:
    """Count the bytes of every tensor ``optimizer`` holds, by role, each storage once.

    Roles: ``params`` (model parameters; a :class:`~optbook.distributed.DistributedOptimizer`'s flat
    parameter buffers), ``grads`` (their gradients; its flat gradient buffers), ``master`` (float32
    masters, or an :class:`OffloadOptimizer`'s host copies), ``main_grads`` (the masters' gradients),
    ``state`` (every state tensor but ``step``), ``step`` (``torch.optim``'s per-parameter step tensors;
    optbook keeps an ``int``), ``staging`` (an :class:`OffloadOptimizer`'s transfer buffers).

    Args:
        optimizer: a ``torch.optim.Optimizer`` (optbook's or PyTorch's),
            :class:`~optbook.precision.MixedPrecisionOptimizer`, ``DistributedOptimizer`` (this rank),
            :class:`~optbook.optim.ChainedOptimizer` or :class:`OffloadOptimizer`.

    Returns:
        A :class:`Measured` (``bytes``: role -> int, ``devices``: device -> int).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Invalid optimizer: expected a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    out = Measured()
    _measure(optimizer, out, set())
    return out


def peak_device_bytes(device=None) -> int | None:
    """``torch.cuda.max_memory_allocated(device)`` when CUDA is available, else ``None`` (a CPU has no
    allocator statistics to read)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(device))


# --- offload -----------------------------------------------------------------------------------------------
class OffloadOptimizer(torch.optim.Optimizer):
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
    optimizer per parameter, so each can start as soon as its own gradient has arrived). **Every parameter has exactly one state dict**: ``self.state[p]`` *is* the
    dict the inner optimizer that steps ``p`` uses, so the bias-correction count ``step`` advances once
    per applied step whichever sub-group ``p`` is in. (A count kept per group, as fused Adam kernels do,
    goes wrong when one group is stepped in several pieces or is copied back from a stale group dict;
    Megatron's ``HybridDeviceOptimizer`` publishes the group counter back after each step for that reason.)

    On a GPU (``device`` CUDA, ``host="cpu"``) the staging buffers are pinned and the copies
    non-blocking; the device is synchronised once before the host steps. On a CPU-only machine both sides
    are the CPU: the data flow, the byte counts and the arithmetic are the same, only nothing crosses a bus.
    The host gradient buffers are allocated once and kept between steps (as Megatron's pinned gradient
    buffers); :meth:`zero_grad` clears the model's gradients.

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
    parameter it keeps a copy of (host copies, device float32 masters). A write it did not make (a
    weights-only ``model.load_state_dict``, an in-place edit) is taken up into the copy at the start of the
    next :meth:`step` (:func:`optbook.precision.take_up_`), so it is never undone;
    :func:`optbook.contract.scale_weights_` (used by :func:`optbook.qk_clip_`) scales the copy and writes the
    parameter from it (:meth:`_scale_weights_`).

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
        self._built = False   # add_param_group is allowed while the base class builds the groups
        super().__init__(groups, filled)
        self.optimizer_class = optimizer_class
        self.host = host
        self.offload_fraction = fraction
        self.sub_group_numel = sub_group_numel
        self.last_bytes = {"d2h": 0, "h2d": 0}
        self.total_bytes = {"d2h": 0, "h2d": 0}

        self._params = [p for g in self.param_groups for p in g["params"]]
        threshold = fraction * sum(p.numel() for p in self._params)
        moved = 0
        self.offloaded: list[bool] = []
        self._inner: dict = {}     # model parameter -> the tensor the inner optimizer steps (if not itself)
        self._staging: dict = {}   # offloaded low-precision parameter -> (grad staging, param staging)
        with torch.no_grad():
            for p in self._params:
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
                    self._inner[p] = inner
                elif low:
                    self._inner[p] = p.detach().to(torch.float32, copy=True)

        def inner_groups(members):
            out = []
            for gi, g in enumerate(self.param_groups):
                ps = [self._inner.get(p, p) for p in g["params"] if p in members]
                if ps:
                    out.append(({**{k: v for k, v in g.items() if k != "params"}, "params": ps}, gi))
            return out

        device_members = {p for p, off in zip(self._params, self.offloaded) if not off}
        host_params = [p for p, off in zip(self._params, self.offloaded) if off]
        chunks, current, size = [], [], 0
        for p in host_params:
            current.append(p)
            size += p.numel()
            if sub_group_numel is not None and size >= sub_group_numel:
                chunks.append(current)
                current, size = [], 0
        if current:
            chunks.append(current)
        self._subs = []   # (optimizer, [index of the HDO group for each of its groups])
        self.device_optimizer = None
        self.host_optimizers = []
        for members, on_host in [(device_members, False)] + [(set(c), True) for c in chunks]:
            spec = inner_groups(members)
            if not spec:
                continue
            opt = optimizer_class([g for g, _ in spec], **defaults)
            self._subs.append((opt, [gi for _, gi in spec]))
            if on_host:
                self.host_optimizers.append(opt)
            else:
                self.device_optimizer = opt
        # One state dict per parameter, shared with the optimizer that steps it.
        model_of = {id(self._inner.get(p, p)): p for p in self._params}
        for opt, _ in self._subs:
            for g in opt.param_groups:
                for q in g["params"]:
                    opt.state[q] = self.state[model_of[id(q)]]
        self.found_inf = False
        self.skipped_steps = 0
        self.last_grad_norm = None
        self._tracker = VersionTracker()
        register_owner(list(self._inner), self)
        self._tracker.record(list(self._inner))
        self._built = True

    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing: the host copies and inner optimizers are built once.

        Raises:
            NotImplementedError: after construction (build a new optimizer with every group instead).
        """
        if getattr(self, "_built", False):
            raise NotImplementedError("OffloadOptimizer.add_param_group: host copies and inner optimizers are "
                                      "built at construction; build a new OffloadOptimizer with every group")
        super().add_param_group(param_group)

    # --- the step ---------------------------------------------------------------------------------------
    def _check_group(self, gi: int, group: dict) -> None:
        """The hyperparameters of ``group`` (index ``gi``) as the inner optimizer checks them; raises
        ``TypeError``/``ValueError`` naming the option."""
        books = [opt for opt, _ in self._subs if isinstance(opt, BookOptimizer)]
        if books:
            books[0]._check_hyperparameters(group)
            return
        accepted = inspect.signature(self.optimizer_class).parameters
        hyper = {k: v for k, v in group.items() if k != "params" and k in accepted}
        try:
            self.optimizer_class([torch.zeros(1, requires_grad=True)], **hyper)
        except (TypeError, ValueError) as e:
            raise type(e)(f"param_groups[{gi}]: {e}") from e

    def _validate(self) -> None:
        """Hyperparameters and every model gradient, before anything is written. An optbook inner optimizer
        checks a group with its own ``_check_hyperparameters``; another ``torch.optim`` class checks only in
        its constructor, so the group's hyperparameters are passed to a throwaway instance over one element."""
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    check_grad(p, f"param_groups[{gi}]['params'][{pi}]")
        named = [(f"param_groups[{gi}]['params'][{pi}]", p) for gi, g in enumerate(self.param_groups)
                 for pi, p in enumerate(g["params"]) if p.grad is not None and p.numel()]
        if named and not all_finite([p.grad for _, p in named]):
            for where, p in named:
                if not bool(torch.isfinite(p.grad).all()):
                    raise NonFiniteGradientError(f"Non-finite gradient of {where} (shape {tuple(p.shape)}): "
                                                 "nothing was written (OffloadOptimizer has no loss scaler)")

    @torch.no_grad()
    def step(self, closure=None):
        """One step: gradients down, inner steps (device, then each host sub-group), parameters up.

        Outside writes of the parameters are taken up into their copies first (class docstring).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            optbook.contract.NonFiniteGradientError: a gradient holds ``inf``/``NaN`` (the message names the
                parameter).
            ValueError, TypeError: an invalid hyperparameter (what the inner optimizer's checks or, for a
                ``torch.optim`` class, its constructor raise) or gradient (shape, dtype, device, sparse).
            In every case parameters, state, host copies and byte counters are bitwise unchanged.
        """
        loss = closure_loss(closure)
        self._validate()
        self._take_up_outside_writes()
        for opt, owners in self._subs:   # hyperparameters a scheduler may have changed
            for g, gi in zip(opt.param_groups, owners):
                g.update({k: v for k, v in self.param_groups[gi].items() if k != "params"})
        d2h = h2d = 0
        gpus = set()   # the GPUs whose copies the host must wait for (each one's own synchronize)
        for p, off in zip(self._params, self.offloaded):
            inner = self._inner.get(p)
            if inner is None:
                continue
            if p.grad is None:
                if not off:
                    inner.grad = None
                continue
            if not off:   # a device master
                if inner.grad is None:
                    inner.grad = p.grad.to(torch.float32, copy=True)
                else:
                    inner.grad.copy_(p.grad)
                continue
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
                self._inner[p].grad.copy_(staging[0])
        # A host parameter without a gradient this step is not stepped (as the device optimizer skips it).
        hidden = {}
        for p, off in zip(self._params, self.offloaded):
            if off and p.grad is None:
                hidden[p] = self._inner[p].grad
                self._inner[p].grad = None
        for opt, _ in self._subs:
            opt.step()
        for p, g in hidden.items():
            self._inner[p].grad = g
        for p, off in zip(self._params, self.offloaded):
            if p in self._inner and p.grad is not None:
                self._upload(p, off)
                if off:
                    h2d += p.numel() * p.element_size()
        for gpu in gpus:
            torch.cuda.synchronize(gpu)
        self._tracker.record(list(self._inner))
        self.last_bytes = {"d2h": d2h, "h2d": h2d}
        self.total_bytes = {k: self.total_bytes[k] + v for k, v in self.last_bytes.items()}
        return loss

    def _upload(self, p: torch.Tensor, off: bool) -> None:
        """Write model parameter ``p`` from its copy (through the staging buffer when low precision on the host)."""
        inner = self._inner[p]
        if off and p in self._staging:
            up = self._staging[p][1]
            up.copy_(inner)   # rounding on the host
            p.copy_(up, non_blocking=p.is_cuda)
        else:
            p.copy_(inner, non_blocking=off and p.is_cuda)

    # --- owner of the parameters it keeps copies of (optbook.contract) --------------------------------------
    def _take_up_outside_writes(self) -> None:
        params = list(self._inner)
        changed = [params[i] for i in self._tracker.changed(params)]
        for p in changed:
            take_up_(self._inner[p], p)
        self._tracker.record(changed)

    @torch.no_grad()
    def _scale_weights_(self, param: torch.Tensor, factor) -> None:
        """``copy *= factor`` (float32 or the parameter's wider dtype), then the parameter from the copy.

        Args:
            param: a parameter this optimizer keeps a copy of.
            factor: a Python number or a real tensor broadcastable to ``param.shape`` (a row scaling: shape
                ``(rows, 1)``).
        """
        inner = self._inner.get(param)
        if inner is None:   # stepped in place: an ordinary scaling
            param.mul_(factor)
            return
        if self._tracker.changed([param]):
            take_up_(inner, param)
        inner.mul_(factor.to(inner.device) if isinstance(factor, torch.Tensor) else factor)
        off = self.offloaded[next(i for i, p in enumerate(self._params) if p is param)]
        self._upload(param, off)
        if off and param.is_cuda:
            torch.cuda.synchronize(param.device)
        self._tracker.record([param])

    def master_params(self) -> list[torch.Tensor]:
        """The tensor each parameter is stepped on (host copy, device master or itself), in group order."""
        return [self._inner.get(p, p) for p in self._params]

    def state_dict(self) -> dict:
        """``torch.optim``'s layout over the model parameters (state tensors on the host for offloaded
        parameters), plus ``"master_params"``: the tensors each parameter is stepped on, in group order, and
        ``"skipped_steps"``."""
        sd = super().state_dict()
        sd["master_params"] = [t.detach() for t in self.master_params()]
        sd["skipped_steps"] = self.skipped_steps
        return sd

    def check_state_dict(self, state_dict) -> int:
        """Everything :meth:`load_state_dict` checks, writing nothing; returns the saved ``skipped_steps``.

        Raises:
            ValueError: as :meth:`load_state_dict`.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"Invalid state_dict: expected a dict, got {type(state_dict).__name__}")
        for key in ("state", "param_groups", "master_params"):
            if key not in state_dict:
                raise ValueError(f"Invalid state_dict: missing {key!r} (expected an OffloadOptimizer "
                                 "state dict)")
        targets = self.master_params()
        check_optimizer_state_dict(state_dict, [list(g["params"]) for g in self.param_groups],
                                   [elementwise(self.optimizer_class)] * len(self._params),
                                   [self.state.get(p, {}) for p in self._params])
        for gi, (group, saved) in enumerate(zip(self.param_groups, state_dict["param_groups"])):
            try:
                self._check_group(gi, {**group, **{k: v for k, v in saved.items() if k != "params"}})
            except (TypeError, ValueError) as e:
                raise type(e)(f"Invalid state_dict: param_groups[{gi}]: {e}") from e
        masters = state_dict["master_params"]
        if len(masters) != len(targets):
            raise ValueError(f"Invalid state_dict: it holds {len(masters)} master_params, this optimizer has "
                             f"{len(targets)}")
        for i, (a, b) in enumerate(zip(masters, targets)):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape or not a.is_floating_point():
                raise ValueError(f"Invalid state_dict: master_params[{i}] has shape "
                                 f"{tuple(getattr(a, 'shape', ()))} and dtype {getattr(a, 'dtype', None)}, "
                                 f"expected shape {tuple(b.shape)}, floating point")
        skipped = _check_int("state_dict['skipped_steps']", state_dict.get("skipped_steps", 0), 0)
        return skipped

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a dict from :meth:`state_dict` of an ``OffloadOptimizer`` over the same parameters.

        State tensors go to the device and dtype of the tensor each parameter is stepped on (not the model
        parameter's, as ``torch.optim`` would cast them); each state dict stays shared with its inner
        optimizer.

        A dict saved before ``skipped_steps`` existed loads (as ``0``). The loaded copies are the truth
        afterwards: the model parameters are written from them.

        Raises:
            ValueError: not a dict or a missing key; another number of groups or of parameters in a group; a
                master of another shape or not floating point; a state tensor that is not floating point or,
                for an element-wise ``optimizer_class``, of another shape than its parameter
                (:func:`optbook.precision.check_optimizer_state_dict`); a bad ``skipped_steps``. All found
                before anything is written: parameters, copies and state are then bitwise unchanged.
        """
        skipped = self.check_state_dict(state_dict)
        targets = self.master_params()
        saved = state_dict["param_groups"]
        masters = state_dict["master_params"]
        with torch.no_grad():
            for g, sg in zip(self.param_groups, saved):
                g.update({k: v for k, v in sg.items() if k != "params"})
            for i, (p, target) in enumerate(zip(self._params, targets)):
                new = {}
                for k, v in state_dict["state"].get(i, {}).items():
                    if isinstance(v, torch.Tensor) and k != "step" and v.is_floating_point():
                        v = v.to(target.device, target.dtype, copy=True)
                    elif isinstance(v, torch.Tensor):
                        v = v.clone()
                    new[k] = v
                self.state[p].clear()
                self.state[p].update(new)   # the same dict object: still shared with the inner optimizer
                target.copy_(masters[i])
                if target is not p:
                    p.copy_(target)
        self._tracker.record(list(self._inner))
        self.skipped_steps = skipped

    def __repr__(self) -> str:
        n_off = sum(p.numel() for p, off in zip(self._params, self.offloaded) if off)
        n = sum(p.numel() for p in self._params)
        return (f"OffloadOptimizer({self.optimizer_class.__name__}, host={self.host}, offloaded {n_off} "
                f"of {n} elements in {len(self.host_optimizers)} host sub-groups)")
