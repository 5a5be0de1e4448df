"""Optimizers as ``torch.optim.Optimizer`` subclasses, and the parameter-group helpers.

``SGD`` (chapter 1), ``Adam`` (chapter 2), ``AdamW`` and ``weight_decay_param_groups`` (chapter 3).
Each class has a pure functional twin (``sgd``, ``adam``) that holds the math.
"""

from .adam import Adam, AdamW, adam
from .optimizer import BookOptimizer
from .param_groups import ParamInfo, classify_parameters, format_param_groups, weight_decay_param_groups
from .sgd import SGD, sgd

__all__ = ["SGD", "Adam", "AdamW", "BookOptimizer", "ParamInfo", "adam", "classify_parameters",
           "format_param_groups", "sgd", "weight_decay_param_groups"]
