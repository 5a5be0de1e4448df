"""Optimizers as ``torch.optim.Optimizer`` subclasses, and the parameter-group helpers.

``SGD`` (chapter 1), ``Adam`` (chapter 2), ``AdamW`` and ``weight_decay_param_groups`` (chapter 3),
``Adafactor``, ``Lion``, ``Shampoo``, ``SOAP`` (chapter 4),
``Muon`` (chapter 6; its per-matrix update ``orthogonalized_blocks``, which the distributed Muons call), ``muon_param_groups`` and ``ChainedOptimizer`` (chapter 7), ``compiled_step``
(a ``torch.compile``-d Adam/AdamW step, chapter 15), ``compiled_muon_step`` (the same for Muon); ``NorMuon``, ``AdaMuon``, ``Dion``, ``Scion``,
``ScheduleFreeAdamW`` (chapter 18, with twins ``normuon``, ``adamuon``, ``dion``, ``scion``, ``schedule_free_adamw``).
Each class has a pure functional twin that holds the math (``sgd``, ``adam``, ``lion``, ``adafactor``,
``shampoo``, ``soap``, ``muon``), as ``torch.optim`` does; the class gathers state and calls it.
"""

from .adafactor import Adafactor, adafactor
from .adam import Adam, AdamW, adam
from .adamuon import AdaMuon, adamuon
from .chained import ChainedOptimizer
from .compiled import adam_tensor, compiled_muon_step, compiled_step
from .dion import Dion, dion
from .lion import Lion, lion
from .muon import TURBO_SCHEDULE, Muon, muon, muon_scale, orthogonalized_blocks, split_rows
from .normuon import NorMuon, normuon
from .optimizer import BookOptimizer
from .param_groups import ParamInfo, classify_parameters, format_param_groups, weight_decay_param_groups
from .routing import MuonRouting, muon_param_groups
from .schedule_free import ScheduleFreeAdamW, schedule_free_adamw
from .scion import Scion, scion
from .sgd import SGD, sgd
from .shampoo import Shampoo, shampoo
from .soap import SOAP, soap

__all__ = ["SGD", "SOAP", "Adafactor", "Adam", "AdamW", "BookOptimizer", "Lion", "Shampoo",
           "ChainedOptimizer", "Muon", "MuonRouting", "ParamInfo", "adafactor", "adam", "adam_tensor",
           "classify_parameters", "compiled_muon_step", "compiled_step", "format_param_groups", "lion", "muon",
           "muon_param_groups", "muon_scale", "orthogonalized_blocks", "sgd", "shampoo", "soap", "split_rows", "TURBO_SCHEDULE",
           "weight_decay_param_groups",
           # chapter 18, after Muon
           "AdaMuon", "Dion", "NorMuon", "ScheduleFreeAdamW", "Scion", "adamuon", "dion", "normuon",
           "schedule_free_adamw", "scion"]
