"""optbook: the package behind *Optimizers, Derived*.

Modules mirror the chapters: :mod:`optbook.optim` (the optimizers), :mod:`optbook.newton_schulz`, :mod:`optbook.qk_clip`,
:mod:`optbook.schedules`, :mod:`optbook.diagnostics`, :mod:`optbook.data`, :mod:`optbook.models`, :mod:`optbook.training`, :mod:`optbook.plotting`,
:mod:`optbook.runtime`, :mod:`optbook.testing`.
"""

from . import data, diagnostics, models, optim, plotting, runtime, schedules, testing, training
from .newton_schulz import newton_schulz, ns_schedule, polar_factor
from .qk_clip import qk_clip_

__version__ = "0.1.0"
__all__ = ["data", "diagnostics", "models", "newton_schulz", "ns_schedule", "optim", "plotting", "polar_factor", "qk_clip_",
           "runtime", "schedules", "testing", "training"]
