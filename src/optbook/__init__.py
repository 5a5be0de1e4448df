"""optbook: the package behind *Optimizers, Derived*.

Modules mirror the chapters: :mod:`optbook.optim` (the optimizers), :mod:`optbook.data`,
:mod:`optbook.models`, :mod:`optbook.training`, :mod:`optbook.plotting`, :mod:`optbook.runtime`.
"""

from . import data, models, optim, plotting, runtime, training

__version__ = "0.1.0"
__all__ = ["data", "models", "optim", "plotting", "runtime", "training"]
