"""Rank programs that only the tests run (``launch`` imports them by name in spawned processes).

``launch`` checks that ``fn`` is a module-level function; the spawned processes get the parent's
``sys.path`` (``multiprocessing``'s spawn preparation data), in which pytest put ``tests/`` (rootdir-based
``prepend`` import mode, no ``__init__.py``), so ``import zero1_ranks`` works there as here.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist


# --- launch ---------------------------------------------------------------------------------------------
def die_on_rank(rank: int, world_size: int, bad_rank: int = 1, how: str = "exit") -> int:
    """Rank ``bad_rank`` ends without a Python exception (``how``: ``"exit"`` is ``os._exit(3)``, ``"kill"``
    is ``SIGKILL`` to itself) after a barrier, while the others wait in an all-reduce it never joins (their
    gloo connection to it is then reset)."""
    dist.barrier()
    if rank == bad_rank:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return rank
