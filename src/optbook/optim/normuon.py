"""NorMuon: Muon with a per-neuron second moment of the orthogonalised update. Explained in chapter 18.

Source: Li et al. (2025), "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491,
Algorithm 1; the reference code microsoft/dion commit 0333cc1136cd456b3fe3a56407d4ff104cfef604
``dion/normuon.py`` (``_normuon_normalization_core``: the row mean of ``O * O``, ``sqrt(v) + 1e-8``, the
Frobenius norm of ``O`` restored afterwards), which modded-nanogpt's NorMuon records follow.

Derivation. Muon's update ``O = polar(M)`` has every singular value 1, but its *rows* (one per output
neuron of a ``(fan_out, fan_in)`` weight) can have very different norms: ``||O_i||^2 = sum_k U_ik^2`` over
the kept singular directions. Adam equalises coordinates by dividing by the RMS of their history; NorMuon
does the same per neuron, with one statistic per row instead of one per element (memory ``fan_out``, not
``fan_out * fan_in``)::

    M <- lerp(M, G, 1 - momentum);  D = lerp(G, M, momentum) if nesterov else M    (Muon, chapter 6)
    O <- newton_schulz(D)                                  (fan_out, fan_in)
    v <- lerp(v, mean_j O_ij^2, 1 - beta2)                 (fan_out, 1): per-neuron second moment
    N <- O / (sqrt(v) + eps)                               rows equalised
    N <- N * ||O||_F / max(||N||_F, eps)                   the Frobenius norm of O restored
    W <- W (1 - lr * weight_decay) - lr * scale * N        scale = muon_scale(shape, scale_mode, ...)

The rescale keeps Muon's step size (the ``scale_mode`` conventions of :func:`optbook.optim.muon_scale`
apply unchanged); the paper's Algorithm 1 instead sets the update's RMS to ``0.2`` (``scale_mode="spectral",
extra_scale_factor=0.2`` gives the same RMS when ``O`` has full rank: ``||O||_F = sqrt(min(m, n))``).
No bias correction of ``v``: the normalisation is scale invariant row-to-row and the Frobenius rescale
removes the common factor ``1 - beta2**t``.
"""

from __future__ import annotations

import torch

from ..polar import newton_schulz, ns_schedule
from ._functional import momentum_directions, steps_in_float32
from .._checks import check_eps, check_lr, check_momentum, check_nesterov, check_number, check_weight_decay
from .muon import (as_ns_dtype, check_scale_invariant, exact_rescale, muon_scale, ns_dtype_name,
                   with_ns_dtype_name)
from .matrix_views import MatrixWork, batch_shape, check_group_shapes, matrix_shape
from .optimizer import BookOptimizer

__all__ = ["NorMuon", "check_orthogonalisation", "normuon", "orthogonalize"]

#: Where the matrix optimizers of chapter 18 send tensors that are not 2-D.
MATRIX_ROUTE = "route embeddings, norms, biases and other tensors to AdamW, e.g. with optbook.optim.muon_param_groups(model)"


def orthogonalize(D: torch.Tensor, *, ns_steps: int, coefficients, ns_dtype: torch.dtype,
                  scale_invariant: bool = True) -> torch.Tensor:
    """Muon's orthogonalisation of one direction: :func:`optbook.newton_schulz` of ``D`` after the exact
    power-of-two rescale (:func:`optbook.optim.muon.exact_rescale`), as :func:`optbook.optim.functional.muon` does.

    Args:
        D: ``(m, n)`` real floating tensor.
        ns_steps, coefficients, ns_dtype: the Newton–Schulz schedule and the dtype it runs in.
        scale_invariant: ``False`` skips the rescale, so that Newton–Schulz's floor
            ``D / max(||D||_F, 1e-7)`` (``torch.optim.Muon``'s ``eps``) shrinks a direction below 1e-7.

    Returns:
        A new ``(m, n)`` tensor, float32 for a float16/bfloat16 ``D``, else ``D``'s dtype.
    """
    return newton_schulz(exact_rescale(D) if scale_invariant else D, steps=ns_steps, coefficients=coefficients,
                         eps=1e-7, dtype=as_ns_dtype(ns_dtype))


def check_orthogonalisation(group: dict) -> None:
    """Check the Newton–Schulz and scale options of a group (``ns_steps``, ``coefficients``, ``ns_dtype``,
    ``scale_mode``, ``extra_scale_factor``), as :class:`~optbook.optim.Muon` does.

    Raises:
        ValueError: a bad schedule or ``scale_mode``; TypeError: ``ns_dtype`` not a matmul dtype.
    """
    try:
        ns_schedule(group["coefficients"], group["ns_steps"])
    except ValueError as e:  # name the optimizer's argument, not the schedule's
        raise ValueError(str(e).replace("Invalid steps", "Invalid ns_steps")) from None
    muon_scale((1, 1), group["scale_mode"])
    check_number("extra_scale_factor", group["extra_scale_factor"], low=0.0)
    group["ns_dtype"] = ns_dtype_name(group["ns_dtype"])   # stored as its name (DCP can save a string)
    check_scale_invariant(group)


def variance_shape(shape, matrix_view: str) -> tuple[int, ...]:
    """The shape of NorMuon's per-neuron ``variance`` for a parameter of ``shape``: one entry per row of
    each matrix stepped, ``(rows, 1)``, or ``(*E, M, 1)`` for a stack."""
    return (*batch_shape(shape, matrix_view), matrix_shape(shape, matrix_view)[0], 1)


@torch.no_grad()
@steps_in_float32(4)
def normuon(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
            variance_buffers: list[torch.Tensor], *, lr: float, momentum: float, nesterov: bool, beta2: float,
            weight_decay: float, eps: float, ns_steps: int = 5, coefficients="simple",
            ns_dtype: torch.dtype = torch.bfloat16, scale_mode: str = "shape_scaling",
            extra_scale_factor: float = 1.0, scale_invariant: bool = True,
            matrix_view: str = "matrix") -> None:
    """Apply one NorMuon step in place (the pure function behind :class:`NorMuon`).

    Args:
        params, grads, momentum_buffers: lists of ``(fan_out, fan_in)`` tensors, one entry per parameter, or
            of tensors that ``matrix_view`` sees as matrices (:mod:`optbook.optim.matrix_views`).
        variance_buffers: one ``(fan_out, 1)`` tensor per matrix (the per-neuron ``v``; ``(*E, M, 1)`` for a
            stack ``(*E, M, N)``), updated in place.
        lr, momentum, nesterov, beta2, weight_decay, eps, ns_steps, coefficients, ns_dtype, scale_mode,
            extra_scale_factor, scale_invariant, matrix_view: as in :class:`NorMuon`; not re-validated here.

    A float16/bfloat16 parameter is stepped in float32 and rounded back once (with its buffers). Each
    matrix of a flattened or stacked tensor is stepped as a parameter of that matrix's shape would be.
    """
    directions = momentum_directions(momentum_buffers, grads, momentum, nesterov)

    def normalised(k: int, dm: torch.Tensor, vm: torch.Tensor) -> torch.Tensor:
        O = orthogonalize(dm, ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype,
                          scale_invariant=scale_invariant).to(params[k].dtype)
        vm.lerp_((O * O).mean(dim=1, keepdim=True), 1 - beta2)
        N = O / (vm.sqrt() + eps)
        return N.mul_(torch.linalg.vector_norm(O) / torch.linalg.vector_norm(N).clamp_min(eps))

    step_matrices(params, directions, variance_buffers, matrix_view, normalised, lr=lr, weight_decay=weight_decay,
                  scale_mode=scale_mode, extra_scale_factor=extra_scale_factor)


def step_matrices(params: list[torch.Tensor], directions: list[torch.Tensor], buffers: list[torch.Tensor],
                  matrix_view: str, normalised, *, lr: float, weight_decay: float, scale_mode: str,
                  extra_scale_factor: float) -> None:
    """The loop NorMuon and AdaMuon share: each parameter ``p`` decays by ``1 - lr * weight_decay``, then each
    matrix ``pm`` it steps (:class:`~optbook.optim.matrix_views.MatrixWork`: a channels_last kernel is
    stepped on a contiguous copy, copied back) moves by ``-lr * muon_scale(pm.shape) * U``, where
    ``U = normalised(k, dm, vm)``: ``k`` the parameter's index, ``dm`` its direction's matrix, ``vm`` its
    second-moment buffer's (updated in place by ``normalised``); ``U`` in the parameter's dtype."""
    work = MatrixWork(matrix_view)
    for k, (p, d, v) in enumerate(zip(params, directions, buffers)):
        p.mul_(1 - lr * weight_decay)
        for pm, dm, vm in zip(work.work(p), work.read(d), work.work(v)):
            pm.sub_(normalised(k, dm, vm), alpha=lr * muon_scale(pm.shape, scale_mode, extra_scale_factor))
    work.write_back()


#: The float hyperparameters of NorMuon and AdaMuon (``BookOptimizer.float_options``: read as Python floats
#: at each step), those :func:`check_second_moment_muon` checks.
SECOND_MOMENT_FLOATS = ("lr", "momentum", "beta2", "weight_decay", "eps", "extra_scale_factor")


def check_second_moment_muon(group: dict) -> None:
    """The checks NorMuon and AdaMuon share: ``lr``, ``momentum`` and ``nesterov``, ``beta2`` in ``[0, 1)``,
    ``weight_decay``, ``eps``, and the Newton–Schulz and scale options (:func:`check_orthogonalisation`).

    Raises:
        ValueError, TypeError: the first bad value, named.
    """
    check_lr(group["lr"])
    check_nesterov(group["nesterov"], check_momentum(group["momentum"]))
    check_momentum(group["beta2"], "beta2")
    check_weight_decay(group["weight_decay"])
    check_eps(group["eps"])
    check_orthogonalisation(group)


class SecondMomentMuon(BookOptimizer):
    """What NorMuon and AdaMuon share as classes: not element-wise (a second moment of the orthogonalised
    update), the float hyperparameters :data:`SECOND_MOMENT_FLOATS`, ``ns_dtype`` kept in the groups by its
    name (``torch.distributed.checkpoint`` saves a string, not a ``torch.dtype``)."""

    elementwise = False
    float_options = SECOND_MOMENT_FLOATS

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(with_ns_dtype_name(param_group))


class NorMuon(SecondMomentMuon):
    """NorMuon (Li et al. 2025, arXiv:2510.05491, Algorithm 1): Muon with a per-neuron second moment.

    The derivation and the update are in the module docstring (:mod:`optbook.optim.normuon`).

    Args:
        params: 2-D real floating-point tensors ``(fan_out, fan_in)`` (or what ``matrix_view`` steps), or
            param-group dicts.
        lr: learning rate ``>= 0``.
        momentum: EMA coefficient of the first moment, in ``[0, 1)``.
        nesterov: look-ahead direction ``lerp(G, M, momentum)``; needs ``momentum > 0``.
        beta2: EMA coefficient of the per-neuron second moment, in ``[0, 1)`` (0.95 in the paper).
        weight_decay: decoupled decay ``>= 0``, multiplied by ``lr``.
        eps: added to ``sqrt(v)`` and the floor of the Frobenius rescale, ``> 0``.
        ns_steps, coefficients, ns_dtype: the Newton–Schulz schedule and its dtype, as in
            :class:`~optbook.optim.Muon`.
        scale_invariant: the exact power-of-two rescale before Newton–Schulz (default ``True``: every
            non-zero direction gets a full-size step, rounding noise included) or ``False`` (Newton–Schulz's
            floor ``D / max(||D||_F, 1e-7)``, as ``torch.optim.Muon``'s ``eps``, shrinks a direction below
            1e-7); the decision and its numbers are at :class:`~optbook.optim.Muon`'s ``scale_invariant``.
        scale_mode, extra_scale_factor: the shape scale of :func:`~optbook.optim.muon_scale`.
        matrix_view: ``"matrix"`` (default: 2-D tensors only), ``"flatten"`` (conv kernels as
            ``(out, in*kh*kw)``) or ``"stacked"`` (``(*E, M, N)`` as ``prod(E)`` matrices), as
            :class:`~optbook.optim.Muon`'s (:mod:`optbook.optim.matrix_views`); the scale and the per-neuron
            statistic are those of each matrix stepped.

    State per parameter: ``momentum_buffer`` (the parameter's shape and dtype) and ``variance``
    (``(fan_out, 1)``; ``(out, 1)`` for a flattened kernel, ``(*E, M, 1)`` for a stack; the parameter's
    dtype). A float16/bfloat16 parameter is stepped in float32.

    Raises:
        ValueError, TypeError: those of every matrix optimizer (:mod:`optbook.optim.matrix_views`: a shape
            ``matrix_view`` cannot step, a hyperparameter out of range, a non-finite gradient), before
            anything is written; TypeError also for ``ns_dtype`` not a floating dtype.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, beta2: float = 0.95,
                 weight_decay: float = 0.0, eps: float = 1e-8, ns_steps: int = 5, coefficients="simple",
                 ns_dtype: torch.dtype = torch.bfloat16, scale_mode: str = "shape_scaling",
                 extra_scale_factor: float = 1.0, scale_invariant: bool = True, matrix_view: str = "matrix"):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, beta2=beta2,
                                      weight_decay=weight_decay, eps=eps, ns_steps=ns_steps,
                                      coefficients=coefficients, ns_dtype=ns_dtype_name(ns_dtype),
                                      scale_mode=scale_mode,
                                      extra_scale_factor=extra_scale_factor, scale_invariant=scale_invariant,
                                      matrix_view=matrix_view))

    def _check_hyperparameters(self, group: dict) -> None:
        check_second_moment_muon(group)
        check_group_shapes(group, "NorMuon", MATRIX_ROUTE)

    def _expected_state(self, p, group):
        return {"momentum_buffer": (tuple(p.shape), p.dtype, True),
                "variance": (variance_shape(p.shape, group.get("matrix_view", "matrix")), p.dtype, True)}

    def _step_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                view = group.get("matrix_view", "matrix")
                self.state[p]["variance"] = p.new_zeros(variance_shape(p.shape, view))
        normuon(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
                [self.state[p]["variance"] for p in params], lr=group["lr"], momentum=group["momentum"],
                nesterov=group["nesterov"], beta2=group["beta2"], weight_decay=group["weight_decay"],
                eps=group["eps"], ns_steps=group["ns_steps"], coefficients=group["coefficients"],
                ns_dtype=group["ns_dtype"], scale_mode=group["scale_mode"],
                extra_scale_factor=group["extra_scale_factor"],
                scale_invariant=group.get("scale_invariant", True),
                matrix_view=group.get("matrix_view", "matrix"))
