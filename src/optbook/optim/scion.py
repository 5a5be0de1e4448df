"""Scion: steepest descent by a linear minimisation oracle, one norm per layer. Explained in chapter 18.

Source: Pethick, Xie, Erdogan, Antonakopoulos, Silveti-Falls & Cevher (2025), "Training Deep Learning
Models with Norm-Constrained LMOs", arXiv:2502.07529, Algorithm 1 (uSCG: unconstrained; SCG: constrained)
and Table 2 (the operator norms and their LMOs); the authors' code LIONS-EPFL/scion commit
a86f93e67d052068cc83f769ad0b833c867280fc ``scion.py`` (``Spectral``, ``Sign``, the ``scale`` radius, the
update ``p <- (1 - lr) p - lr * scale * lmo(d)``, their ``momentum`` being ``1 -`` ours); read alongside
NVIDIA-NeMo/Emerging-Optimizers ``scion.py``.

Derivation. For a norm ``||.||`` with ball radius ``radius``, the linear minimisation oracle is
``lmo(D) = argmin_{||S|| <= radius} <D, S>``: the step that decreases the linearised loss most among
steps of norm at most ``radius``. It is ``-radius`` times a unit-norm "sign" of ``D`` in that norm::

    spectral (operator l2 -> l2):  lmo(D) = -radius * U V^T              (D = U S V^T; Muon)
    l_inf (element-wise max):      lmo(D) = -radius * sign(D)            (sign descent; Lion with beta1 = beta2)
    l2 / Frobenius:                lmo(D) = -radius * D / ||D||_F        (normalised SGD)

Scion averages gradients first and then steps by the oracle of each layer's own norm::

    M <- lerp(M, G, 1 - momentum);  D = lerp(G, M, momentum) if nesterov else M
    W <- W (1 - lr * weight_decay) + lr * lmo(D)

``weight_decay=0`` is the unconstrained method (uSCG); ``weight_decay=1`` the constrained one (SCG, a
Frank-Wolfe step ``W <- (1 - lr) W + lr * lmo(D)``, which keeps ``||W|| <= radius``). The spectral oracle here
is Muon's: Newton–Schulz after an exact rescale, times ``muon_scale(shape, scale_mode)``; the authors'
``Spectral(normalized=True)`` is ``scale_mode="unit_rms_norm"`` (``sqrt(fan_out / fan_in)``, the default) and
their ``Sign(normalized=True)`` is ``norm="sign"`` with ``radius / fan_in``. The cases, exactly (tested to
1e-12 in float64):

* ``norm="spectral"``, ``radius=1``: :class:`~optbook.optim.Muon` with the same ``momentum``, ``nesterov``,
  ``weight_decay``, ``ns_*`` and ``scale_mode``, ``extra_scale_factor=1``;
* ``norm="sign"``, ``radius=1``: :class:`~optbook.optim.Lion` with ``betas=(momentum, momentum)`` (then
  Lion's interpolation ``lerp(m, g, 1 - beta1)`` is the new EMA itself) and the same ``weight_decay``,
  ``nesterov=False``;
* ``norm="frobenius"``: SGD with ``optbook.optim.SGD``'s EMA momentum whose step is divided by the norm of
  the direction, ``W <- W - lr * radius * D / ||D||_F``.
"""

from __future__ import annotations

import torch

from ._functional import momentum_directions, steps_in_float32
from .._checks import check_lr, check_momentum, check_nesterov, check_number, check_weight_decay
from .muon import momentum_buffers, muon_scale, ns_dtype_name, with_ns_dtype_name
from .normuon import MATRIX_ROUTE, check_orthogonalisation, orthogonalize
from .optimizer import BookOptimizer

__all__ = ["NORMS", "Scion", "lmo_direction", "scion"]

#: The norms whose linear minimisation oracle Scion steps by (a group's ``norm``).
NORMS = ("spectral", "sign", "frobenius")


def lmo_direction(D: torch.Tensor, norm: str, *, ns_steps: int = 5, coefficients="simple",
                  ns_dtype: torch.dtype = torch.bfloat16, scale_mode: str = "unit_rms_norm") -> torch.Tensor:
    """The unit-radius step direction ``-lmo(D)`` of ``norm`` (a new tensor; the update subtracts it).

    Args:
        D: the averaged gradient; ``(fan_out, fan_in)`` for ``"spectral"``, any shape otherwise.
        norm: one of :data:`NORMS`.
        ns_steps, coefficients, ns_dtype, scale_mode: the spectral oracle's Newton–Schulz schedule and
            shape scale (:func:`~optbook.optim.muon_scale`); unused by the other norms.

    Returns:
        ``muon_scale * newton_schulz(D)`` (``"spectral"``, float32 for a low-precision ``D``), ``sign(D)``
        (``"sign"``), or ``D / ||D||_F`` (``"frobenius"``; a zero ``D`` gives zeros).
    """
    if norm == "spectral":
        O = orthogonalize(D, ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype)
        return O.mul_(muon_scale(D.shape, scale_mode))
    if norm == "sign":
        return D.sign()
    norm_value = torch.linalg.vector_norm(D)
    return D / torch.where(norm_value > 0, norm_value, torch.ones_like(norm_value))


@torch.no_grad()
@steps_in_float32(3)
def scion(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor], *,
          lr: float, momentum: float, nesterov: bool, weight_decay: float, norm: str, radius: float = 1.0,
          ns_steps: int = 5, coefficients="simple", ns_dtype: torch.dtype = torch.bfloat16,
          scale_mode: str = "unit_rms_norm") -> None:
    """Apply one Scion step in place (the pure function behind :class:`Scion`), one norm for the list.

    Args:
        params, grads, momentum_buffers: lists of equal-shape tensors, one entry per parameter; the buffers
            (the EMA ``M``) are updated in place.
        lr, momentum, nesterov, weight_decay, norm, radius, ns_steps, coefficients, ns_dtype, scale_mode:
            as in :class:`Scion`; not re-validated here.

    A float16/bfloat16 parameter is stepped in float32 and rounded back once (with its buffer).
    """
    directions = momentum_directions(momentum_buffers, grads, momentum, nesterov)
    for p, d in zip(params, directions):
        u = lmo_direction(d, norm, ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype,
                          scale_mode=scale_mode)
        p.mul_(1 - lr * weight_decay).sub_(u, alpha=lr * radius)


class Scion(BookOptimizer):
    """Scion (Pethick et al. 2025, arXiv:2502.07529, Algorithm 1): each group steps by its norm's LMO.

    The derivation, the oracles and the exact special cases (Muon, Lion/sign descent, normalised SGD) are
    in the module docstring (:mod:`optbook.optim.scion`). Give each layer its norm through param groups,
    e.g. hidden matrices ``norm="spectral"``, the output head ``norm="sign"``, gains ``norm="frobenius"``.

    Args:
        params: real floating-point tensors or param-group dicts; ``norm="spectral"`` needs 2-D tensors.
        lr: learning rate ``>= 0`` (the step size ``gamma`` of Algorithm 1).
        momentum: EMA coefficient in ``[0, 1)`` (the authors' ``momentum`` is ``1 - momentum``).
        nesterov: look-ahead direction ``lerp(G, M, momentum)``; needs ``momentum > 0``.
        weight_decay: ``>= 0``, multiplied by ``lr``; 1 is the constrained (Frank-Wolfe) Scion.
        norm: one of ``"spectral"``, ``"sign"`` (l_inf), ``"frobenius"`` (l2).
        radius: the norm-ball radius ``rho > 0`` (the authors' ``scale``).
        ns_steps, coefficients, ns_dtype: the spectral oracle's Newton–Schulz schedule and dtype.
        scale_mode: the spectral oracle's shape scale (:func:`~optbook.optim.muon_scale`), default
            ``"unit_rms_norm"``, ``sqrt(fan_out / fan_in)``.

    State per parameter: ``momentum_buffer`` (the parameter's shape and dtype). A float16/bfloat16
    parameter is stepped in float32.

    Raises:
        ValueError: a hyperparameter out of range (the message names it), ``norm="spectral"`` with a tensor
            that is not 2-D, a non-finite gradient (:class:`~optbook.contract.NonFiniteGradientError`);
            nothing is written.
        TypeError: as for every optimizer of :mod:`optbook.optim`; ``ns_dtype`` not a floating dtype.
    """

    elementwise = False
    float_options = ("lr", "momentum", "weight_decay", "radius")

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0, norm: str = "spectral", radius: float = 1.0, ns_steps: int = 5,
                 coefficients="simple", ns_dtype: torch.dtype = torch.bfloat16, scale_mode: str = "unit_rms_norm"):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      norm=norm, radius=radius, ns_steps=ns_steps, coefficients=coefficients,
                                      ns_dtype=ns_dtype_name(ns_dtype), scale_mode=scale_mode))

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else params if isinstance(params, set) else list(params)
        # ns_dtype stored as its name (torch.distributed.checkpoint can save a string, not a torch.dtype)
        super().add_param_group({**with_ns_dtype_name(param_group), "params": params})

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        check_nesterov(group["nesterov"], check_momentum(group["momentum"]))
        check_weight_decay(group["weight_decay"])
        check_number("radius", group["radius"], low=0.0, low_open=True)
        if group["norm"] not in NORMS:
            raise ValueError(f"Invalid norm: expected one of {NORMS}, got {group['norm']!r}")
        check_orthogonalisation({**group, "extra_scale_factor": 1.0})
        group["ns_dtype"] = ns_dtype_name(group["ns_dtype"])   # a torch.dtype set later: stored as its name
        if group["norm"] == "spectral":
            for i, p in enumerate(group["params"]):
                if isinstance(p, torch.Tensor) and p.ndim != 2:
                    raise ValueError(f"Invalid norm: 'spectral' needs 2-D matrices, but parameter {i} of this group "
                                     f"has shape {tuple(p.shape)}; give it norm='sign' or 'frobenius' in its own "
                                     f"param group, or {MATRIX_ROUTE}")

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        scion(params, [p.grad for p in params], momentum_buffers(self.state, params), lr=group["lr"],
              momentum=group["momentum"], nesterov=group["nesterov"],
              weight_decay=group["weight_decay"], norm=group["norm"], radius=group["radius"],
              ns_steps=group["ns_steps"], coefficients=group["coefficients"], ns_dtype=group["ns_dtype"],
              scale_mode=group["scale_mode"])
