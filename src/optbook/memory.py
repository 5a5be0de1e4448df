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
* :class:`OffloadOptimizer` (defined in :mod:`optbook.offload`, importable from here) runs the step of a
  chosen fraction of the parameters on a host device: per step, gradients go down (device to host), the
  inner optimizer steps host copies, parameters go up.

Units: bytes (ints where they are exact); ``GB = 1e9`` bytes (decimal, as Megatron's worked numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .contract import elementwise
from .offload import OffloadOptimizer
from .optim import SGD, Adam, AdamW, ChainedOptimizer, Lion, Muon
from .precision import MixedPrecisionOptimizer
from ._checks import LOW_PRECISION, check_dtype, check_int as _check_int, check_number

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


def _column_sum(column: str, doc: str) -> property:
    """A :class:`Ledger` property: the sum of ``column`` of every :class:`Component` row, in their order."""
    return property(lambda self: sum(getattr(c, column) for c in self.components), doc=doc)


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

    total_bytes = _column_sum("bytes", "Bytes on this rank, device and host, over every row.")
    device_bytes = _column_sum("device_bytes", "Bytes on this rank's device, over every row.")
    host_bytes = _column_sum("host_bytes", "Bytes of this rank kept on the host, over every row.")
    bytes_per_param = _column_sum("per_param", "Device and host bytes per parameter of this rank (e.g. 18, or "
                                  "6 + 12/d).")

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
    if hasattr(opt, "param_buffers") and hasattr(opt, "grad_buffers"):   # ZeRO-1's flat buffers
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
