"""Several processes, one training run. Explained in chapter 12.

:func:`launch` runs a function on several local processes joined by a ``torch.distributed`` process group
(the notebooks' stand-in for ``torchrun``); :func:`init_from_env` joins the group of a script started by
``torchrun``. The functions the chapters run on every rank live in :mod:`optbook.distributed.workers`:
spawned processes import them by name, so they cannot be defined in a notebook cell.
"""

from .launch import init_from_env, launch

__all__ = ["init_from_env", "launch"]
