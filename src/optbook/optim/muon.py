"""Muon: momentum orthogonalised by Newton–Schulz. Explained in chapters 6 and 7.

Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024);
Liu et al. (2025), "Muon is Scalable for LLM Training" (Moonlight, arXiv:2502.16982)
eq. 3-4 for decoupled decay and RMS matching; PyTorch's ``torch/optim/_muon.py`` for the
``adjust_lr_fn`` conventions. Per-head orthogonalisation splits a Q/K/V weight into one block per head.

For a 2-D parameter ``W`` of shape ``(fan_out, fan_in)`` (PyTorch layout) with gradient ``G``::

    M <- lerp(M, G, 1 - momentum)                         (EMA momentum, as chapter 1)
    D <- lerp(G, M, momentum)  if nesterov  else  M
    O <- newton_schulz(D)      (per row block when the group sets ``head_split``)
    W <- W - lr * (scale * O + weight_decay * W)

``scale`` by ``scale_mode`` for a (block) shape ``(A, B) = (fan_out, fan_in)``, times
``extra_scale_factor``: ``"shape_scaling"`` sqrt(max(1, A/B)) (Keller; ``torch.optim.Muon``'s
``"original"``), ``"spectral"`` sqrt(max(A, B)) (with ``extra_scale_factor=0.2`` Moonlight's
RMS matching, ``torch.optim.Muon``'s ``"match_rms_adamw"``), ``"unit_rms_norm"`` sqrt(A/B) (the
RMS->RMS steepest-descent scale), ``"none"`` 1.

A conv kernel or a stack of matrices is stepped as the matrices its group's ``matrix_view`` names
(:mod:`optbook.optim.matrix_views`), each with the scale of its own shape.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections import defaultdict
from collections.abc import Sequence

import torch

from ..polar import PRECONDITIONERS, newton_schulz, ns_schedule
from ._functional import momentum_directions
from .._checks import check_lr, check_momentum, check_nesterov, check_number, check_weight_decay
from .matrix_views import MatrixWork, check_matrix_view, matrix_shape, matrix_view_of
from .optimizer import BookOptimizer

__all__ = ["Muon", "SCALE_MODES", "TURBO_SCHEDULE", "muon", "muon_scale", "split_rows"]

SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm", "none")
#: The dtypes Newton–Schulz may iterate in.
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: How a param group stores ``ns_dtype``: the dtype's name, a string, which ``torch.distributed.checkpoint``'s
#: ``get_optimizer_state_dict`` can flatten and save (it refuses a ``torch.dtype`` value in a group).
NS_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                  torch.float64: "float64"}


def ns_dtype_name(value) -> str:
    """The name under which a param group stores ``ns_dtype``, from a ``torch.dtype`` or its name.

    Raises:
        TypeError: neither one of :data:`NS_DTYPES` nor one of their names (``"bfloat16"``, ``"float16"``,
            ``"float32"``, ``"float64"``).
    """
    if isinstance(value, torch.dtype) and value in NS_DTYPE_NAMES:
        return NS_DTYPE_NAMES[value]
    if isinstance(value, str) and value in NS_DTYPE_NAMES.values():
        return value
    raise TypeError(f"Invalid ns_dtype: expected one of {NS_DTYPES} (a floating dtype matmul supports) or its "
                    f"name ({', '.join(repr(n) for n in NS_DTYPE_NAMES.values())}), got {value!r}")


def as_ns_dtype(value) -> torch.dtype:
    """``ns_dtype`` as a ``torch.dtype`` (from the dtype or its name; not re-validated)."""
    return getattr(torch, value) if isinstance(value, str) else value


def with_ns_dtype_name(param_group: dict) -> dict:
    """``param_group`` with its ``ns_dtype`` (if any) stored as its name (:func:`ns_dtype_name`)."""
    if "ns_dtype" in param_group:
        return {**param_group, "ns_dtype": ns_dtype_name(param_group["ns_dtype"])}
    return param_group
#: How Newton–Schulz forms its symmetric products (``newton_schulz``'s ``gram``).
GRAMS = ("plain", "symmetric")
#: Which Newton–Schulz iteration Muon runs (``ns_algorithm``); ``"auto"``: Gram Newton–Schulz for blocks of
#: aspect ratio ``>= GRAM_ASPECT`` (5 steps: 1.29x fewer FLOPs at 4:1, 1.44x at 8:1), the standard one otherwise.
NS_ALGORITHMS = ("standard", "gram", "auto")

#: The schedule for ``ns_precondition="aol"``: the last four of the five ``"polar_express"`` triples, the first
#: dropped because AOL's rescaling does its work (Turbo-Muon, arXiv:2512.04632, sec. 3). Use with ``ns_steps=4``.
TURBO_SCHEDULE = tuple(tuple(t) for t in ns_schedule("polar_express", 5)[1:])
GRAM_ASPECT = 4
#: Where Muon's error sends tensors it does not step.
MUON_ROUTE = ("route embeddings, norms, biases and other tensors to AdamW, e.g. with "
              "optbook.optim.muon_param_groups(model)")


def muon_scale(shape: Sequence[int], scale_mode: str = "shape_scaling", extra_scale_factor: float = 1.0) -> float:
    """The factor multiplying the orthogonalised update of a ``(fan_out, fan_in)`` block.

    Raises:
        ValueError: unknown ``scale_mode``, a shape that is not 2-D, or an ``extra_scale_factor`` that is not
            finite or is negative (a negative scale would turn every step into ascent).
        TypeError: ``extra_scale_factor`` is not a real number.
    """
    if len(shape) != 2:
        raise ValueError(f"Invalid shape: expected (fan_out, fan_in), got {tuple(shape)}")
    A, B = shape
    if scale_mode == "shape_scaling":
        s = math.sqrt(max(1.0, A / B))
    elif scale_mode == "spectral":
        s = math.sqrt(max(A, B))
    elif scale_mode == "unit_rms_norm":
        s = math.sqrt(A / B)
    elif scale_mode == "none":
        s = 1.0
    else:
        raise ValueError(f"Invalid scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
    return s * check_number("extra_scale_factor", extra_scale_factor, low=0.0)


def split_rows(rows: int, head_split) -> list[int]:
    """Row counts of the blocks a ``(rows, cols)`` matrix is cut into before orthogonalisation.

    ``head_split``: ``None`` (one block), an int ``H`` (``H`` equal blocks: one per head), or a
    sequence of row counts (e.g. ``(q_rows, k_rows, v_rows)`` of a fused QKV projection, GQA's
    unequal blocks included).

    Raises:
        ValueError: the blocks do not tile the rows exactly.
        TypeError: ``head_split`` is neither ``None``, an int nor a sequence of integers.
    """
    if head_split is None:
        return [rows]
    if isinstance(head_split, int) and not isinstance(head_split, bool):
        if head_split < 1 or rows % head_split:
            raise ValueError(f"Invalid head_split: {head_split} heads do not divide the {rows} rows")
        return [rows // head_split] * head_split
    try:   # operator.index: an int (or an integer tensor/array scalar), never a float truncated
        sizes = [operator.index(s) for s in head_split]
        if any(isinstance(s, bool) for s in head_split):
            raise TypeError
    except TypeError:
        raise TypeError(f"Invalid head_split: expected None, an int or a sequence of integer row counts, "
                        f"got {head_split!r}") from None
    if any(s < 1 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"Invalid head_split: block sizes {sizes} must be positive and sum to the {rows} rows")
    return sizes


def check_scale_invariant(group: dict) -> None:
    """``group["scale_invariant"]`` must be a bool (absent: ``True``, a group saved before the option existed).

    Raises:
        TypeError: anything but ``True`` or ``False``.
    """
    group.setdefault("scale_invariant", True)
    if not isinstance(group["scale_invariant"], bool):
        raise TypeError(f"Invalid scale_invariant: expected True or False, got {group['scale_invariant']!r}")


def exact_rescale(D: torch.Tensor, *, overwrite: bool = False) -> torch.Tensor:
    """``D`` times a power of two per matrix so that its largest absolute entry lies in ``[0.5, 1)``.

    Multiplying by a power of two is exact, so Newton-Schulz's normalisation ``X / max(||X||_F, eps)``
    gives bitwise the same ``X`` as before whenever ``||D||_F >= eps``; what changes is that a small ``D``
    (a gradient shrunk by a global clip, ``||D||_F < eps``) no longer falls under the ``eps`` floor, whose
    division would shrink the whole update (by 0.77 at a clip factor of 1e-6, 0.068 at 1e-8). The
    orthogonalised direction of ``D`` is then the same for every non-zero scale of ``D``; a zero matrix
    stays zero. (This is about one matrix: a clip that scales some steps' gradients and not others still
    changes what the momentum, and so ``D``, is made of.)

    Args:
        D: ``(..., m, n)`` real floating tensor.
        overwrite: scale a float32/float64 ``D`` in place and return it (as SciPy's ``overwrite_a``: for a
            ``D`` the caller no longer needs; saves a copy). No effect on float16/bfloat16.

    Returns:
        A tensor of ``D``'s shape (new, or ``D`` itself with ``overwrite``), in float32 for a float16/bfloat16
        ``D`` (scaling float16 down could flush its small entries to zero), else in ``D``'s dtype. Exponents
        below -126 are clamped, so a subnormal ``D`` is scaled by at most ``2**126``.
    """
    if torch.compiler.is_compiling():   # Inductor fuses |D| into the reduction: one pass
        amax = D.abs().amax(dim=(-2, -1), keepdim=True)
    else:   # eager: max |D| as max(max D, -min D), two reductions and no |D| tensor (the same value)
        amax = torch.maximum(D.amax(dim=(-2, -1), keepdim=True), D.amin(dim=(-2, -1), keepdim=True).neg_())
    exponent = torch.frexp(amax.float()).exponent.clamp_(min=-126, max=127)
    scale = torch.exp2(-exponent.float())
    if overwrite and D.dtype in (torch.float32, torch.float64):
        return D.mul_(scale)
    return D * scale  # float16/bfloat16 go to float32: no entry is lost


@torch.no_grad()
def muon(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor], *, lr: float,
         momentum: float, nesterov: bool, weight_decay: float, ns_steps: int = 5, coefficients="simple",
         scale_mode: str = "shape_scaling", extra_scale_factor: float = 1.0, eps: float = 1e-7,
         ns_dtype: torch.dtype = torch.bfloat16, head_split=None, gram: str = "plain",
         ns_algorithm: str = "standard", ns_precondition: str | None = None, scale_invariant: bool = True,
         matrix_view: str = "matrix") -> None:
    """Apply one Muon step in place (the pure function behind :class:`Muon`).

    Args:
        params, grads, momentum_buffers: lists of equal-shape tensors, one entry per parameter: ``(fan_out,
            fan_in)`` matrices, or tensors that ``matrix_view`` sees as matrices
            (:mod:`optbook.optim.matrix_views`); ``momentum_buffers`` (the EMA ``M``) is updated in place.
        lr, momentum, nesterov, weight_decay, ns_steps, coefficients, scale_mode, extra_scale_factor,
            eps, ns_dtype, head_split, gram, ns_algorithm, ns_precondition, scale_invariant, matrix_view: as
            in :class:`Muon`; not re-validated here.

    ``lr``, ``momentum`` and ``weight_decay`` may also be 0-d tensors (what
    :func:`optbook.optim.compiled_muon_step` passes, so that a new value is new data for a compiled graph,
    not a new constant).

    The updates come from :func:`orthogonalized_blocks` (same-shape blocks batched); each block's update is
    subtracted straight from its rows of the parameter (no concatenation).
    """
    if not params:
        return
    directions = momentum_directions(momentum_buffers, grads, momentum, nesterov)
    updates = orthogonalized_blocks(directions, ns_steps=ns_steps, coefficients=coefficients, scale_mode=scale_mode,
                                    extra_scale_factor=extra_scale_factor, eps=eps, ns_dtype=ns_dtype,
                                    head_split=head_split, gram=gram, ns_algorithm=ns_algorithm,
                                    ns_precondition=ns_precondition, scale_invariant=scale_invariant,
                                    matrix_view=matrix_view)
    if matrix_view == "matrix":
        for p, blocks in zip(params, updates):
            p.mul_(1 - lr * weight_decay)
            _subtract_blocks(p, blocks, lr)
        return
    work = MatrixWork(matrix_view)   # a channels_last kernel: stepped on a contiguous copy, copied back
    for p, blocks in zip(params, updates):
        p.mul_(1 - lr * weight_decay)
        targets = work.work(p)
        per = len(blocks) // len(targets)   # every matrix of one tensor is cut into as many row blocks
        for k, target in enumerate(targets):
            _subtract_blocks(target, blocks[k * per:(k + 1) * per], lr)
    work.write_back()


def _subtract_blocks(p: torch.Tensor, blocks: list[torch.Tensor], lr) -> None:
    """``p[rows of block k] -= lr * block k`` for the row blocks of one matrix ``p``, in order."""
    row = 0
    for o in blocks:  # each block straight into its rows of p: no concatenated copy
        rows = p.narrow(0, row, o.shape[0])
        if isinstance(lr, torch.Tensor):   # a 0-d tensor (a compiled step): data, not a graph constant
            rows.addcmul_(o, lr, value=-1)
        else:
            rows.sub_(o, alpha=lr)
        row += o.shape[0]


def orthogonalized_blocks(directions: list[torch.Tensor], *, ns_steps: int = 5, coefficients="simple",
                          scale_mode: str = "shape_scaling", extra_scale_factor: float = 1.0, eps: float = 1e-7,
                          ns_dtype: torch.dtype = torch.bfloat16, head_split=None, gram: str = "plain",
                          ns_algorithm: str = "standard", ns_precondition: str | None = None,
                          scale_invariant: bool = True,
                          matrix_view: str = "matrix") -> list[list[torch.Tensor]]:
    """Muon's update ``scale * O`` of each direction, per row block (what :func:`muon` subtracts).

    Args:
        directions: ``(fan_out, fan_in)`` tensors (the momentum's step directions), or tensors that
            ``matrix_view`` sees as matrices (:mod:`optbook.optim.matrix_views`); only read.
        ns_steps, ..., ns_precondition, matrix_view: as in :class:`Muon`; not re-validated here.

    Returns:
        For each direction, the list of its row blocks' updates (``split_rows(rows, head_split)`` of each of
        its matrices, the matrices in order: one for ``"matrix"`` and ``"flatten"``, ``prod(E)`` for a stack
        ``(*E, M, N)``), each of the block's shape and the direction's dtype: ``muon_scale(block) *
        newton_schulz(block)``, so a flattened kernel's scale is that of ``(out, in*kh*kw)``. An update may be
        a view of a batch (a tall block is the transpose of a wide one), not contiguous.

    Blocks of equal shape up to a transpose (an MLP's ``(4d, d)`` and ``(d, 4d)``) are orthogonalised in
    one batched :func:`optbook.newton_schulz` call; a block whose shape no other block shares is passed as
    it is (no stack). The distributed Muons call this on the whole matrices they gather, so every element
    sees the single-process arithmetic.
    """
    # cut into row blocks (views) and gather them by shape up to a transpose: a tall (4d, d) block goes into
    # the same batch as the wide (d, 4d) ones, transposed (newton_schulz works on the wide orientation
    # anyway, and the polar factor of X^T is the transpose of X's). A shape held by several blocks is
    # stacked into one batch, one held by a single block goes in as it is.
    ns_dtype = as_ns_dtype(ns_dtype)
    if matrix_view != "matrix":   # each direction's matrices (a channels_last one's from a contiguous copy)
        read = MatrixWork(matrix_view).read
        per_direction = [read(d) for d in directions]
        flat = orthogonalized_blocks([m for ms in per_direction for m in ms], ns_steps=ns_steps,
                                     coefficients=coefficients, scale_mode=scale_mode,
                                     extra_scale_factor=extra_scale_factor, eps=eps, ns_dtype=ns_dtype,
                                     head_split=head_split, gram=gram, ns_algorithm=ns_algorithm,
                                     ns_precondition=ns_precondition, scale_invariant=scale_invariant)
        out, k = [], 0
        for ms in per_direction:
            out.append([b for bs in flat[k:k + len(ms)] for b in bs])
            k += len(ms)
        return out
    blocks = [list(d.split(split_rows(d.shape[0], head_split), dim=0)) for d in directions]
    by_shape = defaultdict(list)
    for i, bs in enumerate(blocks):
        for j, b in enumerate(bs):
            by_shape[min(b.shape), max(b.shape)].append((i, j, b.shape[0] > b.shape[1]))
    ortho = [[None] * len(bs) for bs in blocks]
    for (m, n), where in by_shape.items():
        wide = [blocks[i][j].mT if tall else blocks[i][j] for i, j, tall in where]
        # (contiguous either way, so that a block's norm is summed in the same order alone and in a stack)
        batch = wide[0].contiguous() if len(where) == 1 else torch.stack(wide)
        fresh = len(where) > 1 or batch is not wide[0]   # a copy (contiguous() of a view): ours to overwrite
        algorithm = ns_algorithm if ns_algorithm != "auto" else ("gram" if n >= GRAM_ASPECT * m else "standard")
        # exact rescale: a new tensor or the copy, either way scratch for NS; without it NS's own eps floor acts
        X = exact_rescale(batch, overwrite=fresh) if scale_invariant else batch
        O = newton_schulz(X, steps=ns_steps, coefficients=coefficients, eps=eps, dtype=ns_dtype, gram=gram,
                          algorithm=algorithm, precondition=ns_precondition, overwrite=scale_invariant or fresh)
        for k, (i, j, tall) in enumerate(where):
            o = O if len(where) == 1 else O[k]
            o = o.mT if tall else o
            scale = muon_scale(tuple(o.shape), scale_mode, extra_scale_factor)
            if scale != 1.0:   # (x * 1.0 is x: the pass is skipped)
                o.mul_(scale)  # O is a fresh tensor
            ortho[i][j] = o
    return ortho


def momentum_buffers(state, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's ``state[p]["momentum_buffer"]``, made (zeros of the parameter's shape, dtype and
    memory format) where it has none yet: the lazy state of Muon and Scion."""
    for p in params:
        if "momentum_buffer" not in state[p]:
            state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return [state[p]["momentum_buffer"] for p in params]


class Muon(BookOptimizer):
    """Muon for hidden-layer weights: matrices, and conv kernels or stacks of matrices when a group says so
    (``matrix_view``); use :func:`muon_param_groups` to route the rest to AdamW.

    Args:
        params: real floating-point tensors, or param-group dicts: 2-D ``(fan_out, fan_in)`` matrices, or
            tensors the group's ``matrix_view`` sees as matrices.
        lr: learning rate ``>= 0`` (0.02 is Keller's default with ``shape_scaling``).
        momentum: EMA coefficient in ``[0, 1)``.
        nesterov: use ``lerp(G, M, momentum)`` as the direction; needs ``momentum > 0`` (pass
            ``nesterov=False`` with ``momentum=0``).
        weight_decay: decoupled decay ``>= 0``, multiplied by ``lr`` (Moonlight eq. 3).
        ns_steps, coefficients: the Newton–Schulz schedule (:func:`optbook.ns_schedule`).
        scale_mode, extra_scale_factor: the update scale (module docstring).
        eps: Newton–Schulz normaliser floor ``> 0``. With ``scale_invariant=True`` (default) Muon first
            rescales each block by a power of two (:func:`exact_rescale`), so the floor only ever acts on a
            zero block and the update does not depend on the scale of the momentum it orthogonalises. A global
            gradient clip, however strong, therefore leaves the update unchanged on the first step, or when
            every step's gradient is scaled by the same factor. A clip that fires on some steps only does
            change later updates: the momentum then adds a clipped gradient to unclipped ones, so the clipped
            step counts less (with ``momentum=0.95``, clipping only the second gradient by 0.01 turns the
            second update to a cosine of about 0.40 with the unclipped run's), which is what the clip is for
            (chapter 12).
        ns_dtype: dtype of the iteration (bf16 by default): bfloat16, float16, float32 or float64, as a
            ``torch.dtype`` or its name. Param groups store the name (``"bfloat16"``, ...;
            :func:`ns_dtype_name`), so that ``torch.distributed.checkpoint`` can save them:
            ``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True`` refuses a
            ``torch.dtype`` value ("Unexpected value type"). The step is the same either way.
        scale_invariant: ``True`` (default): the exact power-of-two rescale before Newton–Schulz, so every
            non-zero direction, however small, gets a full-size update. This includes a gradient that is only
            rounding noise: a float64 gradient of Frobenius norm 2e-16 or 1.6e-19 gets a step of the size of a
            real one. ``torch.optim.Muon`` (torch 2.13, ``torch/optim/_muon.py``,
            ``_zeropower_via_newtonschulz``: ``X.div_(X.norm().clamp(min=eps))``, ``eps=1e-7``) shrinks such
            steps instead: measured on a random 8 x 6 float64 gradient, to 4.3e-8 of a real step at norm 2e-16
            and 3.4e-11 at 1.6e-19. We decided for scale invariance by default, because the book's global
            gradient clip (chapter 12) relies on it: with torch's floor a clip factor of 1e-8 on a momentum of
            norm 0.1 shrinks Muon's update 15-fold, and no absolute floor tells such a clipped gradient from
            rounding noise. ``False``: no rescale, Newton–Schulz's own floor ``X / max(||X||_F, eps)`` acts as
            torch's does: a direction with ``||D||_F < eps`` gets a step shrunk by about ``||D||_F / eps``
            (and a polynomial's gain), one at or above ``eps`` bitwise the step of ``True`` (a power of two
            changes no bit of ``D / ||D||_F``).
        head_split: per-group row split before orthogonalisation (:func:`split_rows`);
            ``muon_param_groups(model, split="head")`` sets it from the attention modules' head layouts.
        gram: how Newton–Schulz forms its symmetric products, passed to :func:`optbook.newton_schulz`:
            ``"plain"`` (default, torch's ``bmm``) or ``"symmetric"`` (the Triton kernels of
            :mod:`optbook.kernels`, which compute only the tiles on and below the diagonal; on a CPU
            they run under ``TRITON_INTERPRET=1`` and otherwise fall back to torch's products;
            chapter 15). ``"symmetric"`` needs ``ns_dtype`` float16, bfloat16 or float32.
        ns_algorithm: ``"standard"`` (default), ``"gram"`` (Gram Newton–Schulz with its default restarts,
            :func:`optbook.newton_schulz`'s ``algorithm``: the same polynomials, other roundings) or
            ``"auto"`` (Gram for blocks with aspect ratio ``>= 4``, such as an MLP's 4d x d matrices).
        ns_precondition: ``None`` (default) or ``"aol"``: AOL's diagonal rescaling before the first
            Newton–Schulz step (:func:`optbook.newton_schulz`'s ``precondition``; Boissin et al. 2025,
            *Turbo-Muon*, arXiv:2512.04632), which lets a schedule drop its first step: with
            ``ns_steps=4`` and the last four ``"polar_express"`` triples (:data:`TURBO_SCHEDULE`) the update is at
            least as close to the polar factor as torch's 5-step default on random matrices, with 4/5 of
            the products (``benchmarks/bench_muon.py`` measures both). Different mathematics: the polar
            factor of ``D X`` (a row-rescaled input), approximated.
        matrix_view: how the group's tensors are seen as matrices (:mod:`optbook.optim.matrix_views`):
            ``"matrix"`` (default: 2-D tensors only; any other shape is refused, nothing is guessed),
            ``"flatten"`` (``(out, *rest)`` stepped as ``(out, prod(rest))``: conv kernels, contiguous or
            ``channels_last``, bitwise the same step) or ``"stacked"`` (``(*E, M, N)`` as ``prod(E)`` matrices
            ``(M, N)``: MoE experts, per-head weights; bitwise the step of the ``prod(E)`` matrices given as
            separate parameters of one group). The scale (``scale_mode``) and ``head_split`` apply to each
            matrix stepped: ``(out, in*kh*kw)`` for a flattened kernel, ``(M, N)`` for each matrix of a stack.
            :class:`Muon`, :class:`optbook.distributed.LayerWiseMuon` (whole tensors per rank) and
            :class:`optbook.distributed.FSDP2Muon` step the last two; ``DistributedMuon`` refuses them.

    Blocks of equal shape (up to a transpose) across the group are orthogonalised in one batched call.
    State per parameter: ``momentum_buffer`` (the parameter's shape and dtype).

    Raises:
        ValueError: a parameter whose shape ``matrix_view`` cannot step (under the default, one that is
            not 2-D: the message names its shape, points to ``muon_param_groups`` and, for 3 or more
            dimensions, to ``matrix_view``; ``"stacked"`` on a 2-D tensor), bad hyperparameters, a
            ``head_split`` that does not divide the rows (also when a group's ``head_split`` or
            ``matrix_view`` is edited later: checked at every step), or a non-finite gradient (raised before
            anything changes: skip such a step, chapter 11); an
            unknown ``gram`` or ``ns_algorithm``, or ``gram="symmetric"`` with ``ns_dtype=torch.float64``.
        TypeError: as for every optimizer of :mod:`optbook.optim`; ``ns_dtype`` not a floating dtype.
    """

    # each may be a one-element tensor, read as a float at each step (BookOptimizer.float_options)
    float_options = ("lr", "momentum", "weight_decay", "extra_scale_factor", "eps")

    #: Whether a subclass with a step of its own steps every ``matrix_view``: ``False`` (default) for such a
    #: subclass takes ``"matrix"`` only (:meth:`_check_shapes`); a subclass whose step hands whole tensors to
    #: :func:`muon` sets it ``True`` (:class:`optbook.distributed.LayerWiseMuon`,
    #: :class:`optbook.distributed.FSDP2Muon`). Muon itself steps every view whatever its value.
    steps_matrix_views = False

    state_tensors = 1  #: parameter-sized state tensors (the momentum buffer), for optbook.memory

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5, coefficients="simple",
                 scale_mode: str = "shape_scaling", extra_scale_factor: float = 1.0, *, eps: float = 1e-7,
                 ns_dtype: torch.dtype = torch.bfloat16, head_split=None, gram: str = "plain",
                 ns_algorithm: str = "standard", ns_precondition: str | None = None,
                 scale_invariant: bool = True, matrix_view: str = "matrix"):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, coefficients=coefficients, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor, eps=eps, ns_dtype=ns_dtype_name(ns_dtype),
                        head_split=head_split, gram=gram, ns_algorithm=ns_algorithm,
                        ns_precondition=ns_precondition, scale_invariant=scale_invariant,
                        matrix_view=matrix_view)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, set):   # as torch.optim: a set's order changes between runs (state dicts map by order)
            raise TypeError("Invalid params: optimizer parameters need to be organized in ordered collections, but "
                            "the ordering of tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group = with_ns_dtype_name(param_group)
        group = {**self.defaults, **param_group}
        self._check_shapes(group, [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params])
        super().add_param_group({**param_group, "params": params})

    def _check_shapes(self, group: dict, params: list) -> None:
        """Every tensor of ``params`` has a shape the group's ``matrix_view`` steps, whose matrices'
        rows ``head_split`` divides; a subclass with a step of its own takes ``"matrix"`` only unless it
        sets :attr:`steps_matrix_views` (``DistributedMuon``, whose element shards ignore the boundaries
        of the matrices in a tensor, does not)."""
        view = matrix_view_of(group)
        # (unwrapped: torch.optim wraps a class's step in its profiling hook when the first instance is made)
        if (view != "matrix" and not self.steps_matrix_views
                and inspect.unwrap(type(self).step) is not inspect.unwrap(BookOptimizer.step)):
            shapes = [tuple(p.shape) for p in params if isinstance(p, torch.Tensor)]
            raise ValueError(f"Invalid matrix_view: {type(self).__name__} steps 2-D matrices only "
                             f"(matrix_view='matrix'), got {view!r} for parameters of shapes {shapes}; "
                             "optbook.optim.Muon steps the others in one process, "
                             "optbook.distributed.LayerWiseMuon with whole tensors per rank, "
                             "optbook.distributed.FSDP2Muon on fully_shard (DTensor) parameters, or leave "
                             "them to AdamW (muon_param_groups' default)")
        check_matrix_view(params, view, type(self).__name__, MUON_ROUTE)
        for p in params:
            if isinstance(p, torch.Tensor):
                split_rows(matrix_shape(p.shape, view)[0], group["head_split"])

    def _check_hyperparameters(self, group: dict) -> None:
        check_lr(group["lr"])
        momentum = check_momentum(group["momentum"])
        check_weight_decay(group["weight_decay"])
        check_number("extra_scale_factor", group["extra_scale_factor"], low=0.0)
        check_number("eps", group["eps"], low=0.0, low_open=True)
        try:
            ns_schedule(group["coefficients"], group["ns_steps"])
        except ValueError as e:  # name the optimizer's argument, not the schedule's
            raise ValueError(str(e).replace("Invalid steps", "Invalid ns_steps")) from None
        muon_scale((1, 1), group["scale_mode"])
        check_nesterov(group["nesterov"], momentum)
        group["ns_dtype"] = ns_dtype_name(group["ns_dtype"])   # a torch.dtype set on the group later: its name
        check_scale_invariant(group)
        if group["gram"] not in GRAMS:
            raise ValueError(f"Invalid gram: expected one of {GRAMS}, got {group['gram']!r}")
        if group["ns_algorithm"] not in NS_ALGORITHMS:
            raise ValueError(f"Invalid ns_algorithm: expected one of {NS_ALGORITHMS}, got {group['ns_algorithm']!r}")
        if group["ns_precondition"] not in PRECONDITIONERS:
            raise ValueError(f"Invalid ns_precondition: expected one of {PRECONDITIONERS}, got "
                             f"{group['ns_precondition']!r}")
        if group["gram"] == "symmetric" and group["ns_dtype"] == "float64":
            raise ValueError("Invalid gram: 'symmetric' needs ns_dtype float16, bfloat16 or float32, got "
                             "torch.float64 (the Triton kernels have no float64 path)")
        # head_split or matrix_view may have been edited since the group was added
        self._check_shapes(group, group.get("params", ()))

    #: ``None`` (the eager :func:`muon`), or the ``torch.compile``-d :func:`muon` that
    #: :func:`optbook.optim.compiled_muon_step` installs: ``step()`` then runs it, ``lr`` passed as a 0-d tensor.
    compiled_kernel = None

    def _step_group(self, group: dict, update=muon) -> None:
        """One group's step through ``update`` (:func:`muon`, or :attr:`compiled_kernel` when one is installed)."""
        params = [p for p in group["params"] if p.grad is not None]
        if update is muon and self.compiled_kernel is not None and params:
            update = self.compiled_kernel
            # lr as a 0-d tensor on the parameters' device: a new value is new data, not a new graph
            # (momentum and weight_decay likewise, float64 so that a float64 parameter loses nothing: a warm-up
            # of the momentum or a decay schedule runs in the one graph)
            device = params[0].device
            group = {**group, "lr": torch.tensor(float(group["lr"]), dtype=torch.float32, device=device),
                     "momentum": torch.tensor(float(group["momentum"]), dtype=torch.float64, device=device),
                     "weight_decay": torch.tensor(float(group["weight_decay"]), dtype=torch.float64, device=device)}
        update(params, [p.grad for p in params], momentum_buffers(self.state, params), lr=group["lr"],
             momentum=group["momentum"], nesterov=group["nesterov"],
             weight_decay=group["weight_decay"], ns_steps=group["ns_steps"], coefficients=group["coefficients"],
             scale_mode=group["scale_mode"], extra_scale_factor=group["extra_scale_factor"], eps=group["eps"],
             ns_dtype=group["ns_dtype"], head_split=group["head_split"], gram=group["gram"],
             ns_algorithm=group["ns_algorithm"], ns_precondition=group["ns_precondition"],
             scale_invariant=group.get("scale_invariant", True),
             matrix_view=group.get("matrix_view", "matrix"))
