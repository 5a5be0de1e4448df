"""The functional twins of :mod:`optbook.optim`'s optimizers: each class's math as a pure function.

As in ``torch.optim._functional``, each function takes lists of tensors (parameters, gradients, state) and
the hyperparameters as numbers, and updates the tensors in place; the class of the same name gathers its
state and calls it. A notebook can call the function directly and a test can compare it. They live in this
namespace, not in :mod:`optbook.optim`, so that ``optbook.optim.<name>`` is always the module of that name
(``optbook.optim.muon`` is the module that holds :class:`~optbook.optim.Muon`, ``optbook.optim.functional.muon``
its update).

The matrix optimizers' twins (``muon``, ``normuon``, ``adamuon``, ``dion``, ``dion2``) take the class's
``matrix_view`` (:mod:`optbook.optim.matrix_views`): ``"matrix"`` by default, ``"flatten"`` for conv kernels
stepped as ``(out, in*kh*kw)``, ``"stacked"`` for ``(*E, M, N)`` stacks stepped as their matrices.

========================  =====================================  =========
function                  class                                  chapter
========================  =====================================  =========
``sgd``                   :class:`~optbook.optim.SGD`            1
``adam``                  :class:`~optbook.optim.Adam`, ``AdamW``  2, 3
``adafactor``             :class:`~optbook.optim.Adafactor`      4
``lion``                  :class:`~optbook.optim.Lion`           4
``shampoo``               :class:`~optbook.optim.Shampoo`        4
``soap``                  :class:`~optbook.optim.SOAP`           4
``muon``                  :class:`~optbook.optim.Muon`           6
``normuon``               :class:`~optbook.optim.NorMuon`        18
``adamuon``               :class:`~optbook.optim.AdaMuon`        18
``dion``                  :class:`~optbook.optim.Dion`           18
``dion2``                 :class:`~optbook.optim.Dion2`          18
``scion``                 :class:`~optbook.optim.Scion`          18
``schedule_free_adamw``   :class:`~optbook.optim.ScheduleFreeAdamW`  18
========================  =====================================  =========
"""

from .adafactor import adafactor
from .adam import adam
from .adamuon import adamuon
from .dion import dion
from .dion2 import dion2
from .lion import lion
from .muon import muon
from .normuon import normuon
from .schedule_free import schedule_free_adamw
from .scion import scion
from .sgd import sgd
from .shampoo import shampoo
from .soap import soap

__all__ = ["adafactor", "adam", "adamuon", "dion", "dion2", "lion", "muon", "normuon", "schedule_free_adamw", "scion", "sgd",
           "shampoo", "soap"]
