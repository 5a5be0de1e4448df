"""Several processes, one training run. Explained in chapters 12 and 13.

:func:`launch` runs a function on several local processes joined by a ``torch.distributed`` process group
(the notebooks' stand-in for ``torchrun``); :func:`init_from_env` joins the group of a script started by
``torchrun``. :class:`DistributedOptimizer` is ZeRO-1 (chapter 13): each rank keeps the optimizer state of
one shard of a flat parameter buffer. The functions the chapters run on every rank live in
:mod:`optbook.distributed.workers`: spawned processes import them by name, so they cannot be defined in a
notebook cell. ``python -m optbook.distributed.demo`` (:mod:`optbook.distributed.demo`) trains a small
transformer with :class:`DistributedOptimizer` under ``torchrun`` (NCCL or gloo), or on local gloo
processes.
"""

from .launch import init_from_env, launch
from .zero1 import DistributedOptimizer, shard_layout

__all__ = ["DistributedOptimizer", "init_from_env", "launch", "shard_layout"]
