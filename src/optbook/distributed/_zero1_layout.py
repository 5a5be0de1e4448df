"""The ZeRO-1 layout: flat per-dtype buffers, buckets, equal shards, and the pieces of parameters each rank
owns (:func:`shard_layout`). Explained in chapter 13; used by :class:`optbook.distributed.DistributedOptimizer`,
which re-exports the public names (``optbook.distributed.zero1``).

The parameters of each dtype live in one contiguous flat buffer, in param-group order; each parameter starts
at a multiple of ``param_alignment`` elements (Megatron: 64). The buffer is cut into buckets (one per dtype
unless ``bucket_size`` is given); each bucket is padded to a multiple of ``lcm(world_size, bucket_alignment)``
elements (Megatron: 128) and split into ``world_size`` equal, contiguous shards **ignoring parameter
boundaries**: a parameter may be split across two or more ranks, and a rank may hold only padding. Rank ``r``
owns shard ``r`` of every bucket; the part of a parameter inside it is a :class:`Piece`.

Source: Megatron-LM's distributed optimizer layout (``megatron/core/distributed/param_and_grad_buffer.py``;
bib key ``megatron2024distopt``). The code here is our own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._comm import check_int

__all__ = ["Bucket", "Layout", "ParamRange", "Piece", "is_power_of_two", "shard_layout"]


@dataclass(frozen=True)
class ParamRange:
    """Where one parameter lives: elements ``start .. start + numel - 1`` of its dtype's flat buffer."""

    index: int          #: position of the parameter in param-group order (the state-dict index)
    dtype: torch.dtype
    bucket: int         #: index into :attr:`Layout.buckets`
    start: int
    numel: int
    shape: tuple

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """Elements ``start .. start + numel - 1`` of the ``dtype`` buffer, split into equal shards."""

    dtype: torch.dtype
    start: int
    numel: int          #: padded: a multiple of lcm(world_size, bucket_alignment) (0 for an empty bucket)
    world_size: int

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    def shard(self, rank: int) -> tuple[int, int]:
        """``(start, end)`` of rank ``rank``'s shard in the dtype's buffer."""
        s = self.start + rank * self.shard_numel
        return s, s + self.shard_numel


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` that rank ``rank`` owns: elements ``param_start .. param_end - 1``
    of the flattened parameter, which are elements ``buffer_start ..`` of its dtype's buffer."""

    index: int
    rank: int
    bucket: int
    param_start: int
    param_end: int
    buffer_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class Layout:
    """The flat buffers, buckets and shards of :func:`shard_layout`."""

    world_size: int
    params: tuple       #: one :class:`ParamRange` per parameter, in param-group order
    buckets: tuple      #: :class:`Bucket` s, grouped by dtype in order of first appearance
    buffer_numel: dict  #: dtype -> elements of its flat buffer (padding included)

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces of parameters rank ``rank`` owns, bucket by bucket, in buffer order (zero-element
        parameters and padding have none)."""
        out = []
        for b, bucket in enumerate(self.buckets):
            lo, hi = bucket.shard(rank)
            for r in self.params:
                if r.bucket != b:
                    continue
                s, e = max(r.start, lo), min(r.end, hi)
                if s < e:
                    out.append(Piece(r.index, rank, b, s - r.start, e - r.start, s))
        return out

    def padding(self, rank: int) -> int:
        """Elements of rank ``rank``'s shards that belong to no parameter."""
        return sum(b.shard_numel for b in self.buckets) - sum(p.numel for p in self.pieces(rank))


def is_power_of_two(x) -> bool:
    """Whether ``x`` (an int or a finite float > 0) is ``2 ** k`` for an integer ``k``."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shard_layout(params, world_size: int, *, bucket_size: int | None = None, param_alignment: int = 64,
                 bucket_alignment: int = 128) -> Layout:
    """Place ``params`` in flat per-dtype buffers, cut into buckets and equal shards (Megatron-LM's layout).

    Args:
        params: tensors (any shapes, including zero elements; only ``shape``, ``numel`` and ``dtype`` are
            read), in param-group order.
        world_size: number of data-parallel ranks, an int ``>= 1``.
        bucket_size: ``None`` (one bucket per dtype) or an int ``>= 1``: a bucket is closed as soon as it
            holds at least this many elements (padding included), as Megatron's ``bucket_size``.
        param_alignment: each parameter starts at a multiple of this many elements (Megatron: 64).
        bucket_alignment: each bucket is padded to a multiple of ``lcm(world_size, bucket_alignment)``
            elements (Megatron: 128), so it splits into ``world_size`` equal shards.

    Returns:
        A :class:`Layout`. A zero-element parameter gets a range of length 0 (and keeps its shape).

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range, named in the message.
    """
    world_size = check_int("world_size", world_size, 1)
    if bucket_size is not None:
        bucket_size = check_int("bucket_size", bucket_size, 1)
    param_alignment = check_int("param_alignment", param_alignment, 1)
    bucket_alignment = check_int("bucket_alignment", bucket_alignment, 1)
    params = list(params)
    multiple = math.lcm(world_size, bucket_alignment)
    ranges: dict[int, ParamRange] = {}
    buckets: list[Bucket] = []
    buffer_numel: dict = {}
    for dtype in dict.fromkeys(p.dtype for p in params):  # dtypes in order of first appearance
        offset = bucket_start = 0
        open_bucket = False

        def close(offset: int, bucket_start: int, dtype: torch.dtype = dtype) -> int:
            numel = _round_up(offset - bucket_start, multiple)
            buckets.append(Bucket(dtype, bucket_start, numel, world_size))
            return bucket_start + numel

        for i, p in enumerate(params):
            if p.dtype != dtype:
                continue
            offset = _round_up(offset, param_alignment)
            ranges[i] = ParamRange(i, dtype, len(buckets), offset, p.numel(), tuple(p.shape))
            offset += p.numel()
            open_bucket = True
            if bucket_size is not None and offset - bucket_start >= bucket_size:
                offset = bucket_start = close(offset, bucket_start)
                open_bucket = False
        if open_bucket:
            offset = close(offset, bucket_start)
        buffer_numel[dtype] = offset
    return Layout(world_size, tuple(ranges[i] for i in range(len(params))), tuple(buckets), buffer_numel)
