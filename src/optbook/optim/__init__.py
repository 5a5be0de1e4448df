"""Optimizers as ``torch.optim.Optimizer`` subclasses, and the parameter-group helpers.

``SGD`` (chapter 1), ``Adam`` (chapter 2), ``AdamW`` and ``weight_decay_param_groups`` (chapter 3),
``Adafactor``, ``Lion``, ``Shampoo``, ``SOAP`` (chapter 4),
``Muon`` (chapter 6; its per-matrix update ``orthogonalized_blocks``, which the distributed Muons call),
``muon_param_groups`` and ``ChainedOptimizer`` (chapter 7), ``compiled_step`` (a ``torch.compile``-d step for
Adam, AdamW, SGD, Lion, Adafactor and Schedule-Free, chapter 15), ``compiled_muon_step`` (the same for Muon);
``NorMuon``, ``AdaMuon``, ``Dion``, ``Dion2``, ``Scion``, ``ScheduleFreeAdamW`` (chapter 18).
Each class has a pure functional twin that holds the math, in :mod:`optbook.optim.functional` (``sgd``, ``adam``,
``lion``, ``adafactor``, ``shampoo``, ``soap``, ``muon``, ``normuon``, ``adamuon``, ``dion``, ``dion2``, ``scion``,
``schedule_free_adamw``), as ``torch.optim._functional``; the class gathers state and calls it. So
``optbook.optim.<name>`` is always the module of that name.
"""

from . import functional
from .adafactor import Adafactor
from .adam import Adam, AdamW
from .adamuon import AdaMuon
from .chained import ChainedOptimizer
from .compiled import adam_tensor, compiled_muon_step, compiled_step
from .dion import Dion
from .dion2 import Dion2
from .lion import Lion
from .muon import TURBO_SCHEDULE, Muon, muon_scale, orthogonalized_blocks, split_rows
from .normuon import NorMuon
from .optimizer import BookOptimizer
from .param_groups import ParamInfo, classify_parameters, format_param_groups, weight_decay_param_groups
from .routing import MuonRouting, muon_param_groups
from .schedule_free import ScheduleFreeAdamW
from .scion import Scion
from .sgd import SGD
from .shampoo import Shampoo
from .soap import SOAP

__all__ = ["SGD", "SOAP", "Adafactor", "Adam", "AdamW", "BookOptimizer", "Lion", "Shampoo",
           "ChainedOptimizer", "Muon", "MuonRouting", "ParamInfo", "adam_tensor",
           "classify_parameters", "compiled_muon_step", "compiled_step", "format_param_groups", "functional",
           "muon_param_groups", "muon_scale", "orthogonalized_blocks", "split_rows", "TURBO_SCHEDULE",
           "weight_decay_param_groups",
           # chapter 18, after Muon
           "AdaMuon", "Dion", "Dion2", "NorMuon", "ScheduleFreeAdamW", "Scion"]
