"""Collective-call names and dtype rules shared by the distributed optimizers of :mod:`optbook.distributed`.

Private to the package; the names here are its internal interface (ZeRO-1 and the Muon wrappers import
them, neither imports the other's private names).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._checks import LOW_PRECISION, check_int

__all__ = ["LOW_PRECISION", "all_gather", "check_int", "reduce_scatter"]

# torch 2.13 renamed the two tensor collectives; older versions (the CUDA builds >= 2.9) have the old names.
#: ``all_gather(output, input, group=)``: every rank's ``input`` concatenated into ``output``.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: ``reduce_scatter(output, input, group=)``: rank ``r`` receives the SUM of the ranks' ``input`` chunk ``r``.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
