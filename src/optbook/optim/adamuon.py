"""AdaMuon: an element-wise second moment on Muon's orthogonalised update. Explained in chapter 18.

Source: Si, Zhang & Shen (2025), "AdaMuon: Adaptive Muon Optimizer", arXiv:2507.11005. Two versions:

- ``version="2025-08"`` (default, the current one): arXiv v2 (its abstract: "a sign-stabilized orthogonal
  update, where the momentum is first sign-transformed before orthogonalization") and the authors' code
  Chongjie-Si/AdaMuon commit 369f0b3bd9d97f82bb8ba81664207ac513e233b0 (August 2025),
  ``gpt2/models/optimizers/adamuon.py``: ``O = NS(sign(D))``; ``v`` an EMA of ``O * O`` *without* bias
  correction, with the momentum coefficient as its decay (the code reuses ``group["momentum"]``: our
  ``beta2`` defaults to the same 0.95); ``A = O / (sqrt(v) + eps)``; the step ``lr * 0.2 sqrt(mn) A /
  (||A||_F + eps)``.
- ``version="2025-07"``: arXiv v1 and the authors' first code, commit
  3b84e03186b7c58a5e4bf70175896bea7f4c5d4f ``adamuon.py``: ``O = NS(D)`` (no sign), ``v`` with bias
  correction and decay ``beta2`` (0.999 there: pass ``beta2=0.999`` to reproduce it), the same rescale.

Both: EMA momentum with Nesterov, ``eps`` outside the root, the rescale to ``sqrt(min(m, n)) / (||.||_F +
eps)`` and the step ``lr * 0.2 * sqrt(max(m, n))`` (together ``0.2 sqrt(mn) / (||A||_F + eps)``, the
current code's form). Read alongside NVIDIA-NeMo/Emerging-Optimizers ``adaptive_muon.py``
(``moment2_method="adamuon"``, no bias correction) and pytorch-optimizer 4.1.0 ``AdaMuon`` (no Nesterov,
no sign: the July version).

Derivation. Adam divides each coordinate of the momentum by the RMS of its history; Muon replaces the
momentum by its polar factor ``O``, whose entries all have RMS ``1/sqrt(max(m, n))`` on average but not
one by one. AdaMuon applies Adam's second moment to ``O`` itself, then restores a fixed overall size so
that the learning rate keeps Muon's (or AdamW's) meaning::

    M <- lerp(M, G, 1 - momentum);  D = lerp(G, M, momentum) if nesterov else M    (Muon, chapter 6)
    O <- newton_schulz(sign(D))   ("2025-08";  newton_schulz(D) in "2025-07")     (m, n) = (fan_out, fan_in)
    v <- beta2 v + (1 - beta2) O * O                        element-wise, (m, n)
    A <- O / (sqrt(v) + eps)      ("2025-08";  O / (sqrt(v / (1 - beta2**t)) + eps) in "2025-07")
    A <- A * sqrt(min(m, n)) / (||A||_F + eps)              ||A||_F = ||polar(D)||_F for a full-rank D
    W <- W (1 - lr * weight_decay) - lr * scale * A         scale = muon_scale(shape, scale_mode, ...)

With the defaults ``scale_mode="spectral", extra_scale_factor=0.2`` the update has RMS exactly ``0.2 lr``
(``||A||_F = sqrt(min(m, n))`` before the ``0.2 sqrt(max(m, n))``): the paper's "RMS-aligned" rescaling,
which lets AdaMuon reuse an AdamW learning rate.
"""

from __future__ import annotations

import math

import torch

from ._functional import momentum_directions, steps_in_float32
from .muon import ns_dtype_name
from .matrix_views import check_group_shapes
from .normuon import MATRIX_ROUTE, SecondMomentMuon, check_second_moment_muon, orthogonalize, step_matrices

__all__ = ["ADAMUON_VERSIONS", "AdaMuon", "adamuon"]

#: The versions of AdaMuon (module docstring): the current one first (the default).
ADAMUON_VERSIONS = ("2025-08", "2025-07")


@torch.no_grad()
@steps_in_float32(4)
def adamuon(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
            exp_avg_sqs: list[torch.Tensor], steps: list[int], *, lr: float, momentum: float, nesterov: bool,
            beta2: float, weight_decay: float, eps: float, ns_steps: int = 5, coefficients="simple",
            ns_dtype: torch.dtype = torch.bfloat16, scale_mode: str = "spectral",
            extra_scale_factor: float = 0.2, version: str = "2025-08", matrix_view: str = "matrix") -> None:
    """Apply one AdaMuon step in place (the pure function behind :class:`AdaMuon`).

    Args:
        params, grads, momentum_buffers, exp_avg_sqs: lists of ``(fan_out, fan_in)`` tensors, one entry per
            parameter, or of tensors that ``matrix_view`` sees as matrices
            (:mod:`optbook.optim.matrix_views`); the buffers (``M`` and ``v``) are updated in place.
        steps: the step number ``t >= 1`` of each parameter, after counting this step.
        lr, momentum, nesterov, beta2, weight_decay, eps, ns_steps, coefficients, ns_dtype, scale_mode,
            extra_scale_factor, version, matrix_view: as in :class:`AdaMuon`; not re-validated here.

    A float16/bfloat16 parameter is stepped in float32 and rounded back once (with its buffers). Each
    matrix of a flattened or stacked tensor is stepped as a parameter of that matrix's shape would be: the
    rescale ``sqrt(min(m, n))`` and the scale read the matrix's ``(m, n)``, so a flattened ``(out, in, kh,
    kw)`` kernel's update has RMS ``0.2 * lr`` with the defaults, as a matrix's (the step timm's AdaMuon
    made 5.7x to 512x too small; :mod:`optbook.optim.matrix_views`).
    """
    directions = momentum_directions(momentum_buffers, grads, momentum, nesterov)
    current = version == "2025-08"

    def normalised(k: int, dm: torch.Tensor, vm: torch.Tensor) -> torch.Tensor:
        O = orthogonalize(torch.sign(dm) if current else dm, ns_steps=ns_steps, coefficients=coefficients,
                          ns_dtype=ns_dtype).to(params[k].dtype)
        vm.mul_(beta2).addcmul_(O, O, value=1 - beta2)
        A = O.div_((vm.sqrt() if current else (vm / (1 - beta2 ** steps[k])).sqrt_()).add_(eps))
        return A.mul_(math.sqrt(min(dm.shape)) / (torch.linalg.vector_norm(A) + eps))

    step_matrices(params, directions, exp_avg_sqs, matrix_view, normalised, lr=lr, weight_decay=weight_decay,
                  scale_mode=scale_mode, extra_scale_factor=extra_scale_factor)


class AdaMuon(SecondMomentMuon):
    """AdaMuon (Si, Zhang & Shen 2025, arXiv:2507.11005, Algorithm 1): Adam's second moment on Muon's update.

    The derivation and the update are in the module docstring (:mod:`optbook.optim.adamuon`).

    Args:
        params: 2-D real floating-point tensors ``(fan_out, fan_in)`` (or what ``matrix_view`` steps), or
            param-group dicts.
        lr: learning rate ``>= 0``; with the default scale the update's RMS is ``0.2 * lr``.
        momentum: EMA coefficient of the first moment, in ``[0, 1)``.
        nesterov: look-ahead direction ``lerp(G, M, momentum)`` (the authors' default); needs ``momentum > 0``.
        beta2: EMA coefficient of the element-wise second moment, in ``[0, 1)``; default 0.95, the current
            authors' code's (its momentum coefficient); 0.999 in the July 2025 code.
        weight_decay: decoupled decay ``>= 0``, multiplied by ``lr``.
        eps: added to ``sqrt(v_hat)`` (outside the root) and to the Frobenius norm of the rescale, ``> 0``.
        ns_steps, coefficients, ns_dtype: the Newton–Schulz schedule and its dtype, as in
            :class:`~optbook.optim.Muon`.
        version: ``"2025-08"`` (default: sign before Newton–Schulz, no bias correction) or ``"2025-07"``
            (the first version, arXiv v1); see the module docstring.
        scale_mode, extra_scale_factor: the shape scale of :func:`~optbook.optim.muon_scale`; the defaults
            (``"spectral"``, ``0.2``) are the paper's ``0.2 * sqrt(max(m, n))``.
        matrix_view: ``"matrix"`` (default: 2-D tensors only), ``"flatten"`` (conv kernels as
            ``(out, in*kh*kw)``) or ``"stacked"`` (``(*E, M, N)`` as ``prod(E)`` matrices), as
            :class:`~optbook.optim.Muon`'s (:mod:`optbook.optim.matrix_views`); ``(m, n)`` above is each
            matrix stepped.

    Tiny gradients: every non-zero gradient, rounding noise included, gets a full-size step (a float64
    gradient of Frobenius norm 2e-16 or 1.6e-19 moves the weights as far as one of norm 1). This is the
    algorithm, not the orthogonalisation's floor: ``O / (sqrt(v_hat) + eps)`` has entries of size about 1
    whatever the size of ``O``, and the rescale to ``sqrt(min(m, n)) / ||A||_F`` restores the full norm,
    so no floor in Newton–Schulz (``torch.optim.Muon``'s ``eps``; :class:`~optbook.optim.Muon`'s
    ``scale_invariant=False``) could shrink it; the reference code behaves the same way.

    State per parameter: ``step`` (``int``), ``momentum_buffer`` and ``exp_avg_sq`` (the parameter's shape
    and dtype). A float16/bfloat16 parameter is stepped in float32.

    Raises:
        ValueError, TypeError: those of every matrix optimizer (:mod:`optbook.optim.matrix_views`: a shape
            ``matrix_view`` cannot step, a hyperparameter out of range, a non-finite gradient), before
            anything is written; TypeError also for ``ns_dtype`` not a floating dtype.
    """

    state_scalars = {"step": "count"}

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, beta2: float = 0.95,
                 weight_decay: float = 0.0, eps: float = 1e-8, ns_steps: int = 5, coefficients="simple",
                 ns_dtype: torch.dtype = torch.bfloat16, scale_mode: str = "spectral",
                 extra_scale_factor: float = 0.2, version: str = "2025-08", matrix_view: str = "matrix"):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, beta2=beta2,
                                      weight_decay=weight_decay, eps=eps, ns_steps=ns_steps,
                                      coefficients=coefficients, ns_dtype=ns_dtype_name(ns_dtype),
                                      scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                                      version=version, matrix_view=matrix_view))

    def _check_hyperparameters(self, group: dict) -> None:
        check_second_moment_muon(group)
        group.setdefault("version", "2025-07")   # a group saved before the option existed: the version it ran
        if group["version"] not in ADAMUON_VERSIONS:
            raise ValueError(f"Invalid version: expected one of {ADAMUON_VERSIONS}, got {group['version']!r}")
        check_group_shapes(group, "AdaMuon", MATRIX_ROUTE)

    def _expected_state(self, p, group):
        like = (tuple(p.shape), p.dtype, True)
        return {"momentum_buffer": like, "exp_avg_sq": like}

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:   # one dict.update: an interrupt (Ctrl-C) cannot leave half a state behind
                state.update(step=0, momentum_buffer=torch.zeros_like(p, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            state["step"] += 1
        adamuon(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params], [self.state[p]["step"] for p in params],
                lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"], beta2=group["beta2"],
                weight_decay=group["weight_decay"], eps=group["eps"], ns_steps=group["ns_steps"],
                coefficients=group["coefficients"], ns_dtype=group["ns_dtype"], scale_mode=group["scale_mode"],
                extra_scale_factor=group["extra_scale_factor"], version=group.get("version", "2025-07"),
                matrix_view=group.get("matrix_view", "matrix"))
