"""Argument checks shared by the whole package: the ground floor that every other module may import.

It imports nothing of :mod:`optbook`. Each check raises before anything is changed, with a message that names the argument and what was
expected. Optimizers call the hyperparameter checks in ``__init__`` *and* again at the start of
``step()`` for every group (a scheduler or a user may have edited ``param_groups`` since), and the
tensor checks for every parameter before the first tensor is touched, so a failed ``step()`` leaves
parameters and optimizer state exactly as they were.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _is_real_number(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (int, float))


#: Parameter dtypes whose update is computed in float32 and written back once (and whose wrappers keep
#: float32 masters). The one definition of "low precision" in the package.
LOW_PRECISION = (torch.float16, torch.bfloat16)

#: The floating-point dtypes a parameter, a master copy or optimizer state may have.
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max


def check_number(name: str, value, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """Return ``float(value)`` after checking it is a finite real number in the given interval.

    Raises:
        TypeError: ``value`` is not a real number (bool, complex, str, multi-element tensor).
        ValueError: ``value`` is NaN, infinite, beyond float32's range (an int: beyond int64's), or outside
            the interval; the message names ``name``.
    """
    if not _is_real_number(value):
        raise TypeError(f"Invalid {name}: expected a real number, got {value!r} ({type(value).__name__})")
    if isinstance(value, int) and abs(value) > _INT64_MAX:
        raise ValueError(f"Invalid {name}: {value} does not fit torch's 64-bit scalar arguments; expected a float")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"Invalid {name}: expected a finite number, got {x}")
    if abs(x) > _FLOAT32_MAX:  # the step multiplies float32 tensors by it: torch refuses such a scalar mid-step
        raise ValueError(f"Invalid {name}: expected a number within float32's range (|{name}| <= 3.4e38), got {x}")
    if low is not None and (x <= low if low_open else x < low):
        raise ValueError(f"Invalid {name}: expected {name} {'>' if low_open else '>='} {low}, got {x}")
    if high is not None and (x >= high if high_open else x > high):
        raise ValueError(f"Invalid {name}: expected {name} {'<' if high_open else '<='} {high}, got {x}")
    return x


def check_int(name: str, value, low: int) -> int:
    """``value`` as an int ``>= low``; ``TypeError`` for a non-int (``bool`` included), ``ValueError`` below."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Invalid {name}: expected an int >= {low}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"Invalid {name}: expected an int >= {low}, got {value}")
    if value > _INT64_MAX:
        raise ValueError(f"Invalid {name}: {value} does not fit a 64-bit integer")
    return value


def check_dtype(name: str, value, allowed: tuple = FLOATS, *, none_ok: bool = False):
    """``value`` must be one of the ``torch.dtype`` values in ``allowed`` (or ``None`` when ``none_ok``).

    Raises:
        TypeError: ``value`` is not a ``torch.dtype`` (a string such as ``"bfloat16"`` included).
        ValueError: a dtype outside ``allowed``; the message names ``name`` and lists ``allowed``.
    """
    if value is None and none_ok:
        return None
    if not isinstance(value, torch.dtype):
        raise TypeError(f"Invalid {name}: expected a torch.dtype, got {value!r} ({type(value).__name__})")
    if value not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"Invalid {name}: expected one of {names}, got {str(value).replace('torch.', '')}")
    return value


def check_lr(lr) -> float:
    """``lr`` must be a finite number >= 0: a Python number or a one-element real tensor (any shape).

    A tensor ``lr`` is read as ``float(lr)`` by :meth:`BookOptimizer.step`."""
    return check_number("lr", lr, low=0.0)


def check_eps(eps) -> float:
    """``eps`` must be a finite number > 0."""
    return check_number("eps", eps, low=0.0, low_open=True)


def check_weight_decay(weight_decay) -> float:
    """``weight_decay`` must be a finite number >= 0."""
    return check_number("weight_decay", weight_decay, low=0.0)


def check_momentum(momentum, name: str = "momentum") -> float:
    """``momentum`` must lie in [0, 1)."""
    return check_number(name, momentum, low=0.0, high=1.0, high_open=True)


def check_betas(betas) -> tuple[float, float]:
    """``betas`` must be a pair ``(beta1, beta2)``, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"Invalid betas: expected a pair (beta1, beta2), got {betas!r}")
    return (check_number("betas[0]", betas[0], low=0.0, high=1.0, high_open=True),
            check_number("betas[1]", betas[1], low=0.0, high=1.0, high_open=True))


def check_bool(name: str, value) -> bool:
    """``value`` must be a ``bool``.

    Raises:
        TypeError: naming ``name``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}: expected a bool, got {value!r}")
    return value


def check_nesterov(nesterov, momentum: float) -> bool:
    """``nesterov`` must be a bool, and ``True`` only with ``momentum > 0`` (as ``torch.optim.SGD``)."""
    if not isinstance(nesterov, bool):
        raise TypeError(f"Invalid nesterov: expected a bool, got {nesterov!r}")
    if nesterov and momentum == 0:
        raise ValueError("Invalid nesterov: nesterov=True needs momentum > 0 (with momentum 0 it is plain "
                         "SGD, and torch.optim.SGD refuses it too); pass nesterov=False")
    return nesterov


def check_foreach(foreach) -> bool | None:
    """``foreach`` must be ``None`` (choose by device), ``True`` or ``False``."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"Invalid foreach: expected None, True or False, got {foreach!r}")
    return foreach


def check_precondition_frequency(f) -> int:
    """``precondition_frequency`` must be an int >= 1 (Shampoo and SOAP)."""
    return check_int("precondition_frequency", f, 1)


def check_matrices(params: Iterable, optimizer: str, hint: str) -> None:
    """Every tensor in ``params`` must be 2-D (Muon, Shampoo and SOAP update matrices only).

    Args:
        params: the tensors of one param group (non-tensors are left to ``torch.optim``'s own checks).
        optimizer: the class name, for the message.
        hint: where the other tensors should go, appended to the message.

    Raises:
        ValueError: naming the offending parameter's index and shape.
    """
    for i, p in enumerate(params):
        if isinstance(p, torch.Tensor) and p.ndim != 2:
            raise ValueError(f"{optimizer} updates 2-D matrices only, but parameter {i} of this group has shape "
                             f"{tuple(p.shape)}; {hint}")


def check_params(params: Iterable[torch.Tensor]) -> None:
    """Every parameter must be a real floating-point tensor (not integer, bool or complex), each once.

    A parameter listed twice in one group would be stepped twice per ``step()`` by some optimizers and once
    by others (``torch.optim`` only warns, "in future, this will cause an error"); the wrappers, which keep
    one copy per entry, would disagree with the optimizer they wrap. So it is refused.

    Raises:
        TypeError: naming the offending parameter's index, dtype and shape.
        ValueError: a parameter appears twice (both indices named).
    """
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"Invalid params: element {i} is a {type(p).__name__}, expected a torch.Tensor")
        if p.is_complex() or not p.is_floating_point():
            raise TypeError(
                f"Invalid params: parameter {i} of shape {tuple(p.shape)} has dtype {p.dtype}; "
                "expected a real floating-point dtype (float16, bfloat16, float32 or float64)"
            )
        if id(p) in seen:
            raise ValueError(f"Invalid params: parameter {i} (shape {tuple(p.shape)}) is the same tensor as "
                             f"parameter {seen[id(p)]}; list each parameter once")
        seen[id(p)] = i


def check_grad(p: torch.Tensor, where: str) -> None:
    """A gradient must be dense, real, and match its parameter's shape, dtype and device.

    Raises:
        TypeError: sparse or complex gradient, or a dtype that differs from the parameter's.
        ValueError: a shape or device that differs from the parameter's.
    """
    g = p.grad
    if g.is_sparse or g.layout != torch.strided:
        raise TypeError(
            f"Invalid grad of {where} (shape {tuple(p.shape)}): sparse gradients are not "
            "supported; use dense gradients (e.g. nn.Embedding(sparse=False))"
        )
    if g.dtype != p.dtype:
        raise TypeError(f"Invalid grad of {where}: dtype {g.dtype} differs from the parameter's {p.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"Invalid grad of {where}: shape {tuple(g.shape)} differs from the "
                         f"parameter's {tuple(p.shape)}")
    if g.device != p.device:
        raise ValueError(f"Invalid grad of {where}: device {g.device} differs from the parameter's {p.device}")


#: What to do with a tensor that is not 2-D, for the matrix optimizers Shampoo and SOAP.
MATRIX_HINT = ("give 0-D/1-D/3-D tensors to AdamW (e.g. via optbook.optim.muon_param_groups) or reshape them")
