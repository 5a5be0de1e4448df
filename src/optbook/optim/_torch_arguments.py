"""``torch.optim`` arguments that an optbook class does not take: accepted when they ask for what the class
does anyway, refused with the reason otherwise.

Code written for ``torch.optim.Adam`` passes ``foreach=None``, ``maximize=False``, ``differentiable=False``
and so on; moving it to an optbook class should either work unchanged or fail with an error that names the
argument and says why -- not with Python's bare "unexpected keyword argument". Each optbook class takes in
its own signature the ones it supports (``SGD``'s and ``Adam``'s ``fused``, ``maximize`` where torch's twin
has it, ...); :class:`~optbook.optim.BookOptimizer` hands every other one of :data:`TORCH_ARGUMENTS` given
to a constructor to :func:`take_torch_arguments`, which drops it when its value is the no-op and raises
``ValueError`` otherwise. The names and defaults are those of ``torch.optim`` 2.13
(``torch/optim/sgd.py``, ``adam.py``, ``_adafactor.py``).
"""

from __future__ import annotations

import inspect

__all__ = ["TORCH_ARGUMENTS", "take_torch_arguments"]

#: torch argument -> (the values that ask for nothing this class does not do already, why others are refused).
#: ``{cls}`` in a reason is the class's name.
TORCH_ARGUMENTS: dict[str, tuple[tuple, str]] = {
    "maximize": ((False,), "{cls} has no maximize option (torch's twin of it, if any, neither): negate the "
                           "loss to ascend it"),
    "dampening": ((0, 0.0), "{cls} keeps no heavy-ball buffer for torch.optim.SGD's dampening to scale"),
    "fused": ((None, False), "{cls} has no fused kernel in torch (torch has fused=True for SGD, Adam and "
                             "AdamW, and optbook's SGD, Adam and AdamW take it)"),
    "foreach": ((None, False), "{cls} has no torch._foreach_* path: it steps one tensor (or one matrix) at "
                               "a time"),
    "differentiable": ((False,), "{cls}'s step runs under torch.no_grad and writes the parameters and state "
                                 "in place, so autograd cannot run through it (torch's differentiable=True, "
                                 "for learning hyperparameters through the step)"),
    "capturable": ((False,), "{cls} keeps its step counts as Python ints and reads its hyperparameters as "
                             "Python floats on the host each step, so a CUDA graph cannot capture its step "
                             "(torch's capturable=True keeps them as device tensors)"),
}


def take_torch_arguments(cls: type, kwargs: dict) -> dict:
    """``kwargs`` without the :data:`TORCH_ARGUMENTS` that ``cls.__init__`` does not take.

    Raises:
        ValueError: such an argument with a value other than its no-op (``maximize=True``,
            ``differentiable=True``, ``fused=True``, ``foreach=True``, ``capturable=True``, a
            ``dampening`` other than 0), naming the argument, the class and the reason.
    """
    own = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values()):
        return kwargs
    out = dict(kwargs)
    for name, (accepted, why) in TORCH_ARGUMENTS.items():
        if name in out and name not in own:
            value = out.pop(name)
            if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
                raise ValueError(f"Invalid {name}={value!r}: {why.format(cls=cls.__name__)}; accepted here: "
                                 f"{' or '.join(map(repr, dict.fromkeys(accepted)))}")
    return out
