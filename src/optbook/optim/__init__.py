"""Optimizers as ``torch.optim.Optimizer`` subclasses, and the parameter-group helpers.

``SGD`` (chapter 1), ``Adam`` (chapter 2), ``AdamW`` and ``weight_decay_param_groups`` (chapter 3),
``Adafactor``, ``Lion``, ``Shampoo``, ``SOAP`` (chapter 4),
``Muon`` (chapter 6), ``muon_param_groups`` and ``ChainedOptimizer`` (chapter 7).
Each class has a pure functional twin (``sgd``, ``adam``) or helper that holds the math.
"""

from .adafactor import Adafactor
from .adam import Adam, AdamW, adam
from .chained import ChainedOptimizer
from .lion import Lion
from .muon import Muon, muon_scale, split_rows
from .optimizer import BookOptimizer
from .param_groups import ParamInfo, classify_parameters, format_param_groups, weight_decay_param_groups
from .routing import MuonRouting, muon_param_groups
from .sgd import SGD, sgd
from .shampoo import Shampoo
from .soap import SOAP

__all__ = ["SGD", "SOAP", "Adafactor", "Adam", "AdamW", "BookOptimizer", "Lion", "Shampoo", "ChainedOptimizer", "Muon", "MuonRouting", "ParamInfo",
           "adam", "classify_parameters", "format_param_groups", "muon_param_groups", "muon_scale", "sgd",
           "split_rows", "weight_decay_param_groups"]
