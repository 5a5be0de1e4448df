"""optbook: the package behind *Optimizers, Derived*.

Modules mirror the chapters: :mod:`optbook.optim` (the optimizers), :mod:`optbook.polar`, :mod:`optbook.qk_clip`,
:mod:`optbook.clipping`, :mod:`optbook.contract` (the step contract every class follows), :mod:`optbook.distributed`, :mod:`optbook.precision`,
:mod:`optbook.schedules`, :mod:`optbook.diagnostics`, :mod:`optbook.data`, :mod:`optbook.models`, :mod:`optbook.training`, :mod:`optbook.plotting`,
:mod:`optbook.runtime`, :mod:`optbook.testing`, :mod:`optbook.bench`, :mod:`optbook.kernels`, :mod:`optbook.memory`,
:mod:`optbook.interactive` (the offline interactive figures).

Only the torch-only core (:mod:`optbook.optim`, :mod:`optbook.polar`, :mod:`optbook.qk_clip`,
:mod:`optbook.precision`) is imported eagerly. The other submodules are imported on first attribute access
(``optbook.plotting``, ``optbook.data``, ...; PEP 562 module ``__getattr__``), so ``import optbook.optim`` needs
torch only: no matplotlib, no scikit-learn.
"""

import importlib

from . import optim, precision
from .polar import newton_schulz, ns_schedule, polar_express_coefficients, polar_factor
from .qk_clip import qk_clip_

__version__ = "0.1.0"
__all__ = ["bench", "clipping", "contract", "data", "diagnostics", "distributed", "interactive", "kernels", "memory", "models",
           "newton_schulz", "ns_schedule", "optim", "plotting", "polar", "polar_express_coefficients", "polar_factor",
           "precision", "qk_clip_",
           "runtime", "schedules", "testing", "training"]

#: Submodules imported on first use (they pull in matplotlib, scikit-learn, numpy or torch.distributed).
_LAZY_SUBMODULES = ("bench", "capstone", "clipping", "contract", "data", "diagnostics", "distributed", "interactive", "kernels",
                    "loss_scaling", "masters", "memory", "models", "offload", "plotting", "runtime", "schedules",
                    "testing", "text", "training", "wrapper")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # also sets it as an attribute of the package
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
