"""What the torch suite runs: one ``Entry`` per optimizer class, and the table of documented deviations.

PyTorch tests its optimizers with ``TestOptimRenewed`` (``test/test_optim.py``), parametrized by the
``OptimizerInfo`` entries of ``torch.testing._internal.common_optimizers`` (shipped in the torch wheel; the
test file is not). ``test_torch_suite.py`` holds our own checks that mirror ``TestOptimRenewed``'s, each named
after the torch test it mirrors; this module says what they run on:

* the **control**: torch's own ``SGD``, ``Adam``, ``AdamW``, ``Adafactor`` and ``Muon`` with torch's own
  ``OptimizerInfo`` (sample inputs, schedulers, supported implementations, flags), unchanged;
* optbook's **twins** of those five: the same ``OptimizerInfo`` with the class swapped in, the sample inputs
  mapped where the conventions differ (``SGD``'s momentum buffer is an EMA: torch's ``lr`` is divided by
  ``1 - momentum``; torch's default ``lr=1e-3`` is passed to ``SGD``, whose ``lr`` is required; ``Muon``'s
  ``ns_coefficients`` triple becomes ``coefficients``), and ``supported_impls`` cut to the global flags the class
  accepts (the flags torch declares still decide which checks apply, so a missing ``fused`` shows as a failing
  ``test_fused_matches_forloop``);
* optbook's other classes with ``OptimizerInfo`` entries of our own, and ``ChainedOptimizer`` (Muon on the
  matrices, AdamW on the rest) through a small factory.

``DEVIATIONS`` is the one table of (class, check, error, reason) for every optbook failure: for those pairs
the check asserts that it still fails with the recorded error (so a fix shows as a failing row to delete).

Importing ``common_optimizers`` needs the small ``expecttest`` package (a torch test dependency that torch's
wheel does not install); without it a stand-in module with the two names ``common_utils`` uses
(``expecttest.TestCase``, ``expecttest.ACCEPT``) is registered first.
"""

from __future__ import annotations

import copy
import sys
import types
import unittest
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

try:  # pragma: no cover - depends on the environment
    import expecttest  # noqa: F401
except ImportError:  # torch's wheel does not depend on it; common_utils only subclasses its TestCase
    _shim = types.ModuleType("expecttest")
    _shim.TestCase = unittest.TestCase
    _shim.ACCEPT = False
    sys.modules["expecttest"] = _shim

from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR  # noqa: E402
from torch.testing._internal import common_optimizers as co  # noqa: E402

import optbook.optim as ob  # noqa: E402

TORCH_DB = {info.optim_cls.__name__: info for info in co.optim_db}
TWINS = ("SGD", "Adam", "AdamW", "Adafactor", "Muon")
#: classes that take 2-D matrices only (torch.optim.Muon too): the checks give them a (10, 1) "bias"
MATRICES_ONLY = {"Muon", "NorMuon", "AdaMuon", "Dion", "Shampoo", "SOAP", "Scion"}


@dataclass
class Entry:
    """One optimizer under test.

    ``name`` is the test id (``torch.SGD`` for the control, ``SGD`` for optbook's), ``info`` the
    ``OptimizerInfo`` (its ``supported_impls`` are the global flags ``make`` accepts), ``declared_impls`` the
    flags the checks expect (torch's, for twins), ``map_kwargs`` turns a sample's kwargs (or one param group's)
    into the class's own, ``matrices_only`` marks classes that refuse 1-D tensors."""

    name: str
    cls_name: str
    info: co.OptimizerInfo
    control: bool
    declared_impls: tuple[str, ...]
    map_kwargs: Callable[[dict], dict] = lambda kw: kw
    matrices_only: bool = False
    twin: str | None = None           # the torch class this is a twin of (for the pass-count comparison)
    extra: dict = field(default_factory=dict)

    def make(self, params, **kwargs):
        """Build the optimizer: ``params`` as given (tensors, named pairs or group dicts, group dicts mapped)."""
        if isinstance(params, list) and params and isinstance(params[0], dict):
            params = [self.map_kwargs(dict(g)) for g in params]
        return self.info.optim_cls(params, **self.map_kwargs(dict(kwargs)))


def _swap(info: co.OptimizerInfo, cls, impls: tuple[str, ...]) -> co.OptimizerInfo:
    new = copy.copy(info)
    new.optim_cls = cls
    new.supported_impls = impls
    return new


def _sgd_kwargs(kw: dict) -> dict:
    """torch's SGD sample -> optbook's: our buffer is an EMA, ``(1 - momentum)`` times torch's sum, so the
    same steps take ``lr / (1 - momentum)``; torch's default ``lr`` (1e-3) is passed (ours is required). A
    param-group dict keeps its own ``lr`` absent when it has none (the optimizer default applies)."""
    is_group = "params" in kw
    if "lr" not in kw and not is_group:
        kw["lr"] = 1e-3
    mu = kw.get("momentum", 0.0)
    if "lr" in kw and mu:
        kw["lr"] = kw["lr"] / (1 - mu)
    return kw


def _muon_kwargs(kw: dict) -> dict:
    """torch's Muon sample -> optbook's: ``ns_coefficients=(a, b, c)`` is ``coefficients=[(a, b, c)] * ns_steps``."""
    if "ns_coefficients" in kw:
        kw["coefficients"] = [tuple(kw.pop("ns_coefficients"))] * kw.get("ns_steps", 5)
    return kw


def _inputs(*samples: tuple[str, dict]) -> Callable:
    """An ``optim_inputs_func`` from ``(desc, kwargs)`` pairs (fresh tensors on every call)."""
    def func(device=None, dtype=None):
        return [co.OptimizerInput(params=None, kwargs=copy.deepcopy(kw), desc=desc) for desc, kw in samples]
    return func


def _error_inputs(device, dtype):
    """The generic error inputs torch checks for every optimizer (params type, duplicates, tensor lr shape,
    names); optbook's classes without a torch twin get these and no class-specific ones."""
    return co.get_error_inputs_for_all_optims(device, dtype)


_SCHEDULERS = ([lambda opt: StepLR(opt, gamma=0.9, step_size=10), lambda opt: ReduceLROnPlateau(opt)],)


def _own(cls, *samples, **flags) -> co.OptimizerInfo:
    return co.OptimizerInfo(cls, optim_inputs_func=_inputs(*samples), optim_error_inputs_func=_error_inputs,
                            scheduler_inputs=_SCHEDULERS, supported_impls=(), not_og_supported_flags=(),
                            supports_complex=False, **flags)


class ChainedMuonAdamW:
    """``ChainedOptimizer([Muon(2-D tensors), AdamW(the rest)])`` built from one ``params`` argument, as the
    checks call an optimizer class; param-group dicts are split the same way, each keeping its options."""

    __name__ = "ChainedOptimizer"

    def __new__(cls, params, lr=0.02, weight_decay=0.0):
        params = list(params)
        if params and isinstance(params[0], dict):
            groups = params
        else:
            groups = [{"params": params}]
        muon, adamw = [], []
        for g in groups:
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            rest = {k: v for k, v in g.items() if k != "params"}
            mats = [p for p in ps if (p[1] if isinstance(p, tuple) else p).ndim == 2]
            others = [p for p in ps if (p[1] if isinstance(p, tuple) else p).ndim != 2]
            if mats:
                muon.append(dict(params=mats, **rest))
            if others:
                adamw.append(dict(params=others, **rest))
        members = []
        if muon:
            members.append(ob.Muon(muon, lr=lr, weight_decay=weight_decay))
        if adamw:
            members.append(ob.AdamW(adamw, lr=lr * 0.05, weight_decay=weight_decay))
        return ob.ChainedOptimizer(members)


def _entries() -> list[Entry]:
    out = []
    own_impls = {"SGD": ("foreach",), "Adam": ("foreach",), "AdamW": ("foreach",), "Adafactor": (), "Muon": ()}
    maps = {"SGD": _sgd_kwargs, "Muon": _muon_kwargs}
    for name in TWINS:
        info = TORCH_DB[name]
        out.append(Entry(f"torch.{name}", name, info, True, info.supported_impls,
                         matrices_only=name in MATRICES_ONLY))
    for name in TWINS:
        info = TORCH_DB[name]
        out.append(Entry(name, name, _swap(info, getattr(ob, name), own_impls[name]), False, info.supported_impls,
                         map_kwargs=maps.get(name, lambda kw: kw), matrices_only=name in MATRICES_ONLY,
                         twin=f"torch.{name}"))
    tensor_lr = ("tensor lr", {"lr": torch.tensor(1e-3)})
    own = {
        "Lion": _own(ob.Lion, ("default", {}), ("non-default lr", {"lr": 1e-3}), tensor_lr,
                     ("weight_decay", {"weight_decay": 0.1}), ("betas", {"betas": (0.9, 0.99)})),
        "Shampoo": _own(ob.Shampoo, ("default", {}), ("non-default lr", {"lr": 1e-2}), tensor_lr,
                        ("weight_decay", {"weight_decay": 0.1}), ("momentum and beta2", {"momentum": 0.9, "beta2": 0.99}),
                        ("precondition_frequency", {"precondition_frequency": 2, "eps": 1e-6})),
        "SOAP": _own(ob.SOAP, ("default", {}), ("non-default lr", {"lr": 1e-2}), tensor_lr,
                     ("weight_decay", {"weight_decay": 0.1}), ("precondition_frequency", {"precondition_frequency": 1})),
        "NorMuon": _own(ob.NorMuon, ("default", {}), ("non-default lr", {"lr": 1e-2}), tensor_lr,
                        ("weight_decay", {"weight_decay": 0.1}), ("beta2", {"beta2": 0.99, "nesterov": False})),
        "AdaMuon": _own(ob.AdaMuon, ("default", {}), ("non-default lr", {"lr": 1e-2}), tensor_lr,
                        ("weight_decay", {"weight_decay": 0.1}), ("no nesterov", {"nesterov": False})),
        "Dion": _own(ob.Dion, ("default", {}), ("non-default lr", {"lr": 2e-2}), tensor_lr,
                     ("weight_decay", {"weight_decay": 0.1}), ("low rank", {"rank_fraction": 0.5})),
        "Scion": _own(ob.Scion, ("default", {}), ("non-default lr", {"lr": 1e-2}), tensor_lr,
                      ("weight_decay", {"weight_decay": 0.1}), ("nesterov", {"nesterov": True})),
        "ScheduleFreeAdamW": _own(ob.ScheduleFreeAdamW, ("default", {}), ("non-default lr", {"lr": 1e-2}), tensor_lr,
                                  ("weight_decay", {"weight_decay": 0.1}), ("warmup", {"warmup_steps": 5})),
        "ChainedOptimizer": _own(ChainedMuonAdamW, ("default", {}), ("non-default lr", {"lr": 1e-2}),
                                 ("weight_decay", {"weight_decay": 0.1})),
    }
    for name, info in own.items():
        out.append(Entry(name, name, info, False, info.supported_impls, matrices_only=name in MATRICES_ONLY))
    return out


ENTRIES = _entries()
BY_NAME = {e.name: e for e in ENTRIES}

#: Why an optbook class fails a check: name -> (pattern searched in each failing sample's "[sample] Type:
#: message", reason, the module of src/optbook where the fix belongs). Used by the rows of ``DEVIATIONS`` below.
CAUSES: dict[str, tuple[str, str, str]] = {
    "NAMED": (r"element 0 is a tuple",
              "refuses `model.named_parameters()` (TypeError 'Invalid params: element 0 is a tuple'); torch 2.13 "
              "accepts (name, tensor) pairs and records `param_names` in each group", "optim/optimizer.py"),
    "DUPLICATE": (r"\[a param group cannot have duplicate parameters\] ValueError",
                  "a parameter listed twice in one group raises ValueError; torch warns (UserWarning 'a parameter "
                  "group with duplicate parameters') and goes on", "optim/optimizer.py"),
    "NONE_PARAMS": (r"TypeError: 'NoneType' object is not iterable",
                    "`params=None` with an invalid hyperparameter: torch checks the hyperparameters first and raises "
                    "its ValueError; optbook iterates `params` first and fails with an unclear TypeError",
                    "optim/optimizer.py"),
    "GROUP_KEY": (r"\[maximize[^\]]*\] AssertionError: assert [-\d.e]+ > [-\d.e]+",
                  "a param-group dict with an option the class does not have (`maximize`) is accepted silently and "
                  "ignored (the run minimises); torch's twin maximises", "optim/optimizer.py (group validation)"),
    "MAXIMIZE": (r"unexpected keyword argument 'maximize'",
                 "no `maximize` argument (torch's twin has one): TypeError from Python, not an error that names the "
                 "torch argument and says why", "optim/sgd.py, optim/adafactor.py"),
    "DAMPENING": (r"unexpected keyword argument 'dampening'",
                  "no `dampening` (torch.optim.SGD has it; our EMA buffer is the dampening=momentum form)",
                  "optim/sgd.py"),
    "FOREACH": (r"unexpected keyword argument 'foreach'",
                "no `foreach` argument (torch.optim.Adafactor declares a foreach implementation)", "optim/adafactor.py"),
    "FUSED": (r"unexpected keyword argument 'fused'",
              "no `fused` implementation (torch's twin has a fused CPU kernel)", "optim/sgd.py, optim/adam.py"),
    "DIFFERENTIABLE": (r"unexpected keyword argument 'differentiable'",
                       "no `differentiable=True` mode (the step cannot be differentiated through)",
                       "optim/sgd.py, optim/adam.py"),
    "COMPLEX": (r"has dtype torch.complex64; expected a real floating-point dtype",
                "refuses complex parameters (TypeError); torch's twin steps them as `view_as_real` pairs "
                "(torch.optim.Adafactor and Muon refuse them too, but with another error type/message)",
                "optim/sgd.py, adam.py, adafactor.py, muon.py"),
    "SPARSE": (r"sparse gradients are not supported",
               "refuses sparse gradients (torch.optim.SGD supports them)", "optim/sgd.py"),
    "EMPTY_STATE": (r"empty state for a parameter",
                    "SGD(momentum=0) leaves an empty `{}` per parameter in `state` (torch leaves `state` empty)",
                    "optim/sgd.py"),
    "INT_STEP": (r"'int' object has no attribute 'detach'",
                 "`state['step']` is a Python int (torch keeps a tensor), so torch's state-by-state comparison of the "
                 "foreach and for-loop runs cannot track it", "optim/adam.py"),
    "MUON_2D": (r"\[only support 2D parameters\]",
                "a 3-D tensor is refused with ValueError, but not with torch's message 'Muon only supports 2D "
                "parameters'", "optim/muon.py"),
    "ADJUST_LR": (r"unexpected keyword argument 'adjust_lr_fn'",
                  "no `adjust_lr_fn` (ours is `scale_mode`: 'shape_scaling' is torch's 'original')",
                  "optim/muon.py"),
    "CHAINED_STATE": (r"not a parameter of any optimizer in the chain",
                      "`ChainedOptimizer.state` accepts parameter keys only, so the state-dict hooks that store "
                      "other keys (as torch's hook tests do) raise KeyError", "optim/chained.py"),
    "CHAINED_HOOKS": (r"assert \[0, 1, 0, 5",
                      "global step hooks fire for the chain and again for each member optimizer "
                      "(order [0, 1, 0, 5, 2, 5] instead of [0, 1, 2, 5])", "optim/chained.py"),
}

# The one table of documented deviations: (optbook class, check, causes). For these pairs the check must
# still fail, every failing sample must match one of the row's causes, and every cause must still occur; the
# harness counts them apart from the passes. When an owner's fix lands, the row's test fails and the lead deletes
# the row (or the fixed cause from it).
DEVIATIONS_BY_CAUSE: list[tuple[str, str, tuple[str, ...]]] = [
    ("AdaMuon", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("AdaMuon", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("AdaMuon", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("AdaMuon", "test_state_dict_deterministic", ("NAMED",)),
    ("Adafactor", "test_can_load_from_to_named_state_dict", ("MAXIMIZE", "NAMED",)),
    ("Adafactor", "test_can_load_older_state_dict", ("MAXIMIZE",)),
    ("Adafactor", "test_deepcopy_copies_all_public_attrs", ("MAXIMIZE",)),
    ("Adafactor", "test_errors", ("COMPLEX", "DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("Adafactor", "test_foreach_matches_forloop", ("FOREACH", "MAXIMIZE",)),
    ("Adafactor", "test_forloop_goes_right_direction", ("MAXIMIZE",)),
    ("Adafactor", "test_load_nontensor_step", ("MAXIMIZE",)),
    ("Adafactor", "test_load_state_dict_post_hook", ("MAXIMIZE",)),
    ("Adafactor", "test_load_state_dict_pre_hook_and_prepend", ("MAXIMIZE",)),
    ("Adafactor", "test_load_state_dict_pre_post_hook", ("MAXIMIZE",)),
    ("Adafactor", "test_non_empty_state", ("MAXIMIZE",)),
    ("Adafactor", "test_optimizer_can_be_printed", ("MAXIMIZE",)),
    ("Adafactor", "test_param_groups_lr", ("GROUP_KEY",)),
    ("Adafactor", "test_param_groups_weight_decay", ("GROUP_KEY",)),
    ("Adafactor", "test_save_load_equality_with_weights_only", ("MAXIMIZE", "NAMED",)),
    ("Adafactor", "test_state_dict_deterministic", ("MAXIMIZE", "NAMED",)),
    ("Adafactor", "test_state_dict_post_hook", ("MAXIMIZE",)),
    ("Adafactor", "test_state_dict_pre_hook", ("MAXIMIZE",)),
    ("Adafactor", "test_state_dict_pre_post_hook", ("MAXIMIZE",)),
    ("Adafactor", "test_step_all_hooks", ("MAXIMIZE",)),
    ("Adafactor", "test_step_is_noop_when_params_have_no_grad", ("MAXIMIZE",)),
    ("Adafactor", "test_step_post_hook", ("MAXIMIZE",)),
    ("Adafactor", "test_step_pre_hook", ("MAXIMIZE",)),
    ("Adafactor", "test_tensor_lr", ("MAXIMIZE",)),
    ("Adam", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("Adam", "test_complex", ("COMPLEX",)),
    ("Adam", "test_complex_2d", ("COMPLEX",)),
    ("Adam", "test_differentiable", ("DIFFERENTIABLE",)),
    ("Adam", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("Adam", "test_foreach_matches_forloop", ("INT_STEP",)),
    ("Adam", "test_fused_matches_forloop", ("FUSED",)),
    ("Adam", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("Adam", "test_state_dict_deterministic", ("NAMED",)),
    ("AdamW", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("AdamW", "test_complex", ("COMPLEX",)),
    ("AdamW", "test_complex_2d", ("COMPLEX",)),
    ("AdamW", "test_differentiable", ("DIFFERENTIABLE",)),
    ("AdamW", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("AdamW", "test_foreach_matches_forloop", ("INT_STEP",)),
    ("AdamW", "test_fused_matches_forloop", ("FUSED",)),
    ("AdamW", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("AdamW", "test_state_dict_deterministic", ("NAMED",)),
    ("ChainedOptimizer", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("ChainedOptimizer", "test_load_state_dict_post_hook", ("CHAINED_STATE",)),
    ("ChainedOptimizer", "test_load_state_dict_pre_post_hook", ("CHAINED_STATE",)),
    ("ChainedOptimizer", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("ChainedOptimizer", "test_state_dict_deterministic", ("NAMED",)),
    ("ChainedOptimizer", "test_state_dict_pre_hook", ("CHAINED_STATE",)),
    ("ChainedOptimizer", "test_state_dict_pre_post_hook", ("CHAINED_STATE",)),
    ("ChainedOptimizer", "test_step_all_hooks", ("CHAINED_HOOKS",)),
    ("Dion", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("Dion", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("Dion", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("Dion", "test_state_dict_deterministic", ("NAMED",)),
    ("Lion", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("Lion", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("Lion", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("Lion", "test_state_dict_deterministic", ("NAMED",)),
    ("Muon", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("Muon", "test_errors", ("ADJUST_LR", "COMPLEX", "DUPLICATE", "MUON_2D", "NAMED", "NONE_PARAMS",)),
    ("Muon", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("Muon", "test_state_dict_deterministic", ("NAMED",)),
    ("NorMuon", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("NorMuon", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("NorMuon", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("NorMuon", "test_state_dict_deterministic", ("NAMED",)),
    ("SGD", "test_can_load_from_to_named_state_dict", ("DAMPENING", "MAXIMIZE", "NAMED",)),
    ("SGD", "test_can_load_older_state_dict", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_complex", ("COMPLEX", "DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_complex_2d", ("COMPLEX", "DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_deepcopy_copies_all_public_attrs", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_differentiable", ("DIFFERENTIABLE",)),
    ("SGD", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("SGD", "test_foreach_matches_forloop", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_forloop_goes_right_direction", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_fused_matches_forloop", ("DAMPENING", "FUSED", "MAXIMIZE",)),
    ("SGD", "test_load_nontensor_step", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_load_state_dict_post_hook", ("MAXIMIZE",)),
    ("SGD", "test_load_state_dict_pre_hook_and_prepend", ("MAXIMIZE",)),
    ("SGD", "test_load_state_dict_pre_post_hook", ("MAXIMIZE",)),
    ("SGD", "test_non_empty_state", ("DAMPENING", "EMPTY_STATE", "MAXIMIZE",)),
    ("SGD", "test_optimizer_can_be_printed", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_param_groups_lr", ("GROUP_KEY",)),
    ("SGD", "test_param_groups_weight_decay", ("GROUP_KEY",)),
    ("SGD", "test_rosenbrock_sparse", ("DAMPENING", "SPARSE",)),
    ("SGD", "test_save_load_equality_with_weights_only", ("DAMPENING", "MAXIMIZE", "NAMED",)),
    ("SGD", "test_state_dict_deterministic", ("DAMPENING", "MAXIMIZE", "NAMED",)),
    ("SGD", "test_state_dict_post_hook", ("MAXIMIZE",)),
    ("SGD", "test_state_dict_pre_hook", ("MAXIMIZE",)),
    ("SGD", "test_state_dict_pre_post_hook", ("MAXIMIZE",)),
    ("SGD", "test_step_all_hooks", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_step_is_noop_for_zero_grads", ("DAMPENING",)),
    ("SGD", "test_step_is_noop_when_params_have_no_grad", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_step_post_hook", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_step_pre_hook", ("DAMPENING", "MAXIMIZE",)),
    ("SGD", "test_tensor_lr", ("DAMPENING", "MAXIMIZE",)),
    ("SOAP", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("SOAP", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("SOAP", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("SOAP", "test_state_dict_deterministic", ("NAMED",)),
    ("ScheduleFreeAdamW", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("ScheduleFreeAdamW", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("ScheduleFreeAdamW", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("ScheduleFreeAdamW", "test_state_dict_deterministic", ("NAMED",)),
    ("Scion", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("Scion", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("Scion", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("Scion", "test_state_dict_deterministic", ("NAMED",)),
    ("Shampoo", "test_can_load_from_to_named_state_dict", ("NAMED",)),
    ("Shampoo", "test_errors", ("DUPLICATE", "NAMED", "NONE_PARAMS",)),
    ("Shampoo", "test_save_load_equality_with_weights_only", ("NAMED",)),
    ("Shampoo", "test_state_dict_deterministic", ("NAMED",)),
]

#: (class, check, patterns, reason) as the harness reads it
DEVIATIONS: list[tuple[str, str, tuple[str, ...], str]] = [
    (cls, check, tuple(CAUSES[c][0] for c in causes), "; ".join(CAUSES[c][1] for c in causes))
    for cls, check, causes in DEVIATIONS_BY_CAUSE
]
