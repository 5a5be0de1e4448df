"""Bytes on the wire: what each collective delivers to each rank, counted at the PyTorch dispatcher. Chapter 14.

:class:`CommCounter` sees every ``c10d`` tensor collective that ``torch.distributed`` issues inside a ``with``
block, from any module (ZeRO-1's ``DistributedOptimizer``, ``LayerWiseMuon``, ``DistributedMuon``, a plain
``all_reduce``), and adds up the bytes each one delivers to this rank. The wrappers' own ``comm_bytes``
counters are tallies they keep of their buffers; this counts the calls that actually ran, so the two can be
compared.
"""

from __future__ import annotations

from fractions import Fraction

import torch.distributed as dist

__all__ = ["COUNTED_OPS", "CommCounter", "all_reduce_received"]


def all_reduce_received(nbytes: int, world_size: int):
    """Bytes one rank receives in a ring all-reduce of ``nbytes`` bytes over ``world_size`` ranks:
    ``2 (d - 1) / d * nbytes`` (a reduce-scatter then an all-gather of chunks of ``1/d``; bandwidth-optimal).

    Returns:
        an ``int`` when the value is whole, else a :class:`fractions.Fraction` (exact either way).
    """
    got = Fraction(2 * (world_size - 1) * nbytes, world_size)
    return int(got) if got.denominator == 1 else got


#: The tensor collectives :class:`CommCounter` counts (torch's ``c10d`` operators, as the dispatcher sees them).
COUNTED_OPS = ("allreduce_", "broadcast_", "_allgather_base_", "_reduce_scatter_base_", "alltoall_base_", "gather_",
               "scatter_")


class CommCounter:
    """Count the bytes every collective delivers to this rank, at the PyTorch dispatcher (a
    ``TorchDispatchMode`` that sees each ``c10d`` operator ``torch.distributed`` issues, whatever module called
    it; :mod:`torch.distributed`'s own ``CommDebugMode`` counts calls, not bytes). Use on every rank::

        with CommCounter() as counter:
            opt.step()
        counter.received   # {"all_reduce": Fraction, "broadcast": int, "all_gather": int, ...} bytes

    What a call delivers to this rank (``d`` ranks in its group; bytes are elements times element size):

    * ``all_gather(out, in)`` (``all_gather_single`` / ``all_gather_into_tensor``): the other ranks' pieces, ``bytes(out) - bytes(in)`` (exact for any algorithm);
    * ``all_to_all_single(out, in, output_split_sizes)``: the pieces from the other ranks, exact;
    * ``broadcast(t, src)``: ``bytes(t)`` on every rank but ``src``, exact;
    * ``gather(t, dst)``: on ``dst``, the other ranks' tensors, ``(d - 1) bytes(t)``; elsewhere nothing, exact;
    * ``scatter(out, src)``: ``bytes(out)`` on every rank but ``src``, exact;
    * ``reduce_scatter(out, in)``: ``(d - 1) bytes(out)``: the ring (and the direct exchange) receives
      ``d - 1`` partial chunks of the output's size;
    * ``all_reduce(t)``: ``2 (d - 1) / d bytes(t)`` (:func:`all_reduce_received`): the ring, a
      reduce-scatter then an all-gather of chunks of ``1/d``, bandwidth-optimal.

    The first five are the bytes of other ranks' data that land in this rank's output, whatever algorithm
    the backend uses; the two reductions are the ring's (gloo and NCCL pick their algorithm by size).

    Collectives of a one-rank group deliver nothing. Other ``c10d`` operators (barriers, list collectives,
    object collectives, point-to-point) are counted by number in :attr:`other_calls`, not by bytes.

    Attributes:
        received: ``{name: bytes}`` summed over the calls inside the ``with`` block.
        calls: ``[(name, dtype, bytes)]`` one entry per counted call, in order.
        other_calls: the number of uncounted ``c10d`` calls.
    """

    _NAMES = {"allreduce_": "all_reduce", "broadcast_": "broadcast", "_allgather_base_": "all_gather",
              "_reduce_scatter_base_": "reduce_scatter", "alltoall_base_": "all_to_all", "gather_": "gather",
              "scatter_": "scatter"}

    def __init__(self):
        self.received: dict = {}
        self.calls: list = []
        self.other_calls = 0
        self._mode = None

    def __enter__(self) -> "CommCounter":
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace == "c10d":
                    counter._record(func, args, kwargs)
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    def _record(self, func, args, kwargs) -> None:
        op = func._schema.name.split("::")[-1]
        if op not in self._NAMES:
            self.other_calls += 1
            return
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
        bound.update(kwargs)
        group = dist.ProcessGroup.unbox(bound["process_group"])
        d, me = group.size(), group.rank()
        if op in ("allreduce_", "broadcast_"):
            (t,) = bound["tensors"]
        elif op == "gather_":
            (t,) = bound["input_tensors"]
        elif op == "scatter_":
            (t,) = bound["output_tensors"]
        else:
            t = bound["output"] if op == "alltoall_base_" else bound["output_tensor"]
        size = t.element_size()
        if d == 1:
            got = 0
        elif op == "allreduce_":
            got = all_reduce_received(t.numel() * size, d)
        elif op == "broadcast_":
            got = 0 if bound["root_rank"] == me else t.numel() * size
        elif op == "_allgather_base_":
            got = (t.numel() - bound["input_tensor"].numel()) * size
        elif op == "_reduce_scatter_base_":
            got = (d - 1) * t.numel() * size
        elif op == "gather_":   # the root receives every other rank's input (equal sizes, as gather requires)
            got = (d - 1) * t.numel() * size if bound["root_rank"] == me else 0
        elif op == "scatter_":  # every rank but the root receives its piece
            got = 0 if bound["root_rank"] == me else t.numel() * size
        else:  # alltoall_base_
            splits = list(bound["output_split_sizes"]) or [t.numel() // d] * d
            row = t.numel() // max(1, sum(splits)) if sum(splits) else 0
            got = (sum(splits) - splits[me]) * row * size
        name = self._NAMES[op]
        self.received[name] = self.received.get(name, 0) + got
        self.calls.append((name, t.dtype, got))

    @property
    def total(self):
        """Bytes received by every counted call together."""
        return sum(self.received.values())
