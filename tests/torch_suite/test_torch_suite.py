"""PyTorch's generic optimizer checks, run on every optbook optimizer class (``make torch-suite``).

Each check below is our own code, written to mirror one test of ``TestOptimRenewed`` in PyTorch's
``test/test_optim.py`` (read at the version stored by the search index; see ``book/appendix_conformance.md``)
and named after it; it runs on the entries of ``torch_suite_infos.ENTRIES``: torch's own ``SGD``, ``Adam``,
``AdamW``, ``Adafactor`` and ``Muon`` (the control, which must pass every check) and every optbook class.
Which entries a check applies to follows the ``OptimizerInfo`` flags, as in torch (``supports_complex``,
``supported_impls``, ``supports_sparse``). A (class, check) pair listed in ``DEVIATIONS`` must fail with its
recorded error; every other pair must pass. ``conftest.py`` counts both and asserts, for every twin, that
optbook's passes equal the control's minus its documented deviations.

``OPTBOOK_TORCH_SUITE_RAW=1`` ignores the deviation table (every failure is reported as a failure: use it with
``-rf`` to list the actual errors).

Tests not mirrored, and why, are listed in ``NOT_MIRRORED`` (rendered in the conformance appendix).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import pathlib
import re
import tempfile
import warnings
from copy import deepcopy

import pytest
import torch
from torch.nn import Parameter
from torch.optim import SGD as TorchSGD
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch_suite_infos import DEVIATIONS, ENTRIES, co

CPU = "cpu"
F32 = torch.float32
RAW = os.environ.get("OPTBOOK_TORCH_SUITE_RAW") == "1"
DEV = {(cls, check): (patterns, reason) for cls, check, patterns, reason in DEVIATIONS}


# ---------------------------------------------------------------- helpers (ours, not torch's)

def _eq(actual, expected, path="", **tol):
    """Recursive equality in the manner of torch's ``TestCase.assertEqual``: tensors with ``assert_close``
    (exact dtype, its default tolerances unless given), numbers close, containers element by element, anything
    else with ``==``."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor), f"{path}: tensor vs non-tensor"
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{path}: {m}", **tol)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), \
            f"{path}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for k in expected:
            _eq(actual[k], expected[k], f"{path}[{k!r}]", **tol)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _eq(a, e, f"{path}[{i}]", **tol)
    elif isinstance(expected, float) and isinstance(actual, (int, float)):
        assert math.isclose(actual, expected, rel_tol=1.3e-6, abs_tol=1e-5) or (math.isnan(actual) and math.isnan(expected)), \
            f"{path}: {actual} != {expected}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


class _Case:
    """The three ``TestCase`` methods torch's ``TensorTracker`` calls."""

    def assertGreater(self, a, b, msg=None):
        assert a > b, msg

    def assertTrue(self, x, msg=None):
        assert x, msg

    def assertEqual(self, a, b, **kw):
        _eq(a, b, **kw)


class SampleFailures(AssertionError):
    """The failures of one check, one ``"[sample] Type: message"`` string per failing sample input."""

    def __init__(self, items: list[str]):
        self.items = items
        super().__init__(f"{len(items)} sample(s) failed: " + " | ".join(items))


class _Failures:
    """Collects the failure of each sample input, so one check reports every failing sample."""

    def __init__(self):
        self.items: list[str] = []

    @contextlib.contextmanager
    def sample(self, desc: str):
        try:
            yield
        except pytest.skip.Exception:
            raise
        except Exception as e:  # noqa: BLE001 - reported, then raised together
            self.items.append(f"[{desc}] {_text(e)}")

    def raise_if_any(self):
        if self.items:
            raise SampleFailures(self.items)


def _text(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:400]}"


def _all_inputs(entry, dtype=F32, skip=()):
    """torch's ``_get_optim_inputs_including_global_cliquey_kwargs`` on the entry's info (CPU)."""
    return co._get_optim_inputs_including_global_cliquey_kwargs(CPU, dtype, entry.info, skip=skip)


def _bias_shape(entry):
    return (10, 1) if entry.matrices_only else (10,)


def _weight_bias(entry, dtype=F32, contiguous=True):
    """torch's (10, 5) weight and (10,) bias; a (10, 1) "bias" for classes that take matrices only."""
    bs = _bias_shape(entry)
    if contiguous:
        return Parameter(torch.randn(10, 5, dtype=dtype)), Parameter(torch.randn(bs, dtype=dtype))
    return (Parameter(torch.randn(10, 5, 2, dtype=dtype)[..., 0]),
            Parameter(torch.randn(*bs, 2, dtype=dtype)[..., 0]))


def _loss(w, b, x):
    return (w.mv(x) + b.reshape(-1)).pow(2).sum()


def _small(entry, shape=(2, 3), **kw):
    """A small parameter, 2-D (2, 3) as torch's checks use; a vector shape becomes a row for matrix classes."""
    if entry.matrices_only and len(shape) == 1:
        shape = (1,) + tuple(shape)
    return torch.randn(shape, **kw)


def _model(entry, dtype=F32):
    """torch's Conv2d + BatchNorm2d model and input; two bias-free Linear layers for matrix classes."""
    torch.manual_seed(1)
    if entry.matrices_only:
        model = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
        x = torch.rand(4, 16, dtype=dtype)
    else:
        model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1))
        x = torch.rand(1, 4, 16, 16, dtype=dtype)
    return model.to(dtype=dtype), x


def _default(entry, name, fallback):
    """The class's default for ``name`` (torch's ``Muon`` decays by default: ``weight_decay=0.1``)."""
    p = inspect.signature(entry.info.optim_cls.__init__).parameters.get(name)
    return fallback if p is None or p.default is inspect.Parameter.empty else p.default


def _step(entry, opt, closure):
    if entry.info.step_requires_closure:
        return opt.step(closure)
    loss = closure()
    opt.step()
    return loss


# ---------------------------------------------------------------- the checks (mirroring TestOptimRenewed)

CHECKS: dict[str, tuple] = {}


def check(applies=lambda e: True, torch_test=None):
    """Register a check; ``applies(entry)`` mirrors the ``@optims(...)`` filter of the torch test."""
    def deco(fn):
        CHECKS[fn.__name__] = (fn, applies, torch_test or f"TestOptimRenewed.{fn.__name__}")
        return fn
    return deco


@check()
def test_optim_infos_do_not_specify_global_cliquey_kwargs(entry):
    for optim_input in entry.info.optim_inputs_func(device=CPU):
        assert not any(f in optim_input.kwargs for f in ("foreach", "fused", "differentiable")), optim_input.desc


@check(lambda e: e.info.optim_error_inputs_func is not None and e.name != "ChainedOptimizer")
def test_errors(entry):
    fails = _Failures()
    for error_input in entry.info.optim_error_inputs_func(device=CPU, dtype=F32):
        oi = error_input.optimizer_error_input
        params, kwargs = oi.params, oi.kwargs
        with fails.sample(oi.desc):
            if error_input.error_on == co.OptimizerErrorEnum.CONSTRUCTION_ERROR:
                act = lambda: entry.make(params, **kwargs)  # noqa: E731
            else:
                opt = entry.make(params, **kwargs)
                act = opt.step
            if issubclass(error_input.error_type, Warning):
                with warnings.catch_warnings(record=True) as ws:
                    warnings.simplefilter("always")
                    act()
                assert any(issubclass(w.category, error_input.error_type)
                           and re.search(error_input.error_regex, str(w.message)) for w in ws), \
                    f"no {error_input.error_type.__name__} matching {error_input.error_regex!r}"
            else:
                with pytest.raises(error_input.error_type, match=error_input.error_regex):
                    act()
    fails.raise_if_any()


@check()
def test_forloop_goes_right_direction(entry):
    fails = _Failures()
    for contiguous in (True, False):
        for with_lrsched in (True, False):
            for sched_ctors in (entry.info.scheduler_inputs if with_lrsched else [None]):
                for oi in entry.info.optim_inputs_func(device=CPU):
                    with fails.sample(f"{oi.desc}, contiguous={contiguous}, lrsched={with_lrsched}"):
                        if "foreach" in entry.info.supported_impls:
                            oi.kwargs["foreach"] = False
                        weight, bias = _weight_bias(entry, contiguous=contiguous)
                        x = torch.randn(5)
                        opt = entry.make([weight, bias], **oi.kwargs)
                        scheds = [s(opt) for s in (sched_ctors or [])]

                        def closure():
                            opt.zero_grad()
                            loss = _loss(weight, bias, x)
                            loss.backward()
                            return loss

                        initial = closure().item()
                        for _ in range(20):
                            loss = _step(entry, opt, closure)
                            for s in scheds:
                                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
                        if oi.kwargs.get("maximize", False):
                            assert closure().item() > initial
                        else:
                            assert closure().item() < initial, f"loss {closure().item():.4g} >= start {initial:.4g}"
    fails.raise_if_any()


@check()
def test_param_group_with_lrscheduler_goes_right_direction(entry):
    fails = _Failures()
    for i, sched_ctors in enumerate(entry.info.scheduler_inputs):
        with fails.sample(f"schedulers #{i}"):
            weight, bias = _weight_bias(entry)
            x = torch.randn(5)
            opt = entry.make([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
            scheds = [s(opt) for s in sched_ctors]

            def closure():
                opt.zero_grad()
                loss = _loss(weight, bias, x)
                loss.backward()
                return loss

            initial = closure().item()
            for _ in range(20):
                loss = opt.step(closure)
                for s in scheds:
                    s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
            assert closure().item() < initial
    fails.raise_if_any()


@check()
def test_tensor_lr(entry):
    fails = _Failures()
    for oi in _all_inputs(entry, skip=("differentiable",)):
        with fails.sample(oi.desc):
            weight, bias = _weight_bias(entry)
            weight_c = weight.detach().clone().requires_grad_(True)
            bias_c = bias.detach().clone().requires_grad_(True)
            x = torch.randn(5)
            kwargs = oi.kwargs
            kwargs.pop("lr", None)
            # torch's check uses 1e-3; 2**-10 is exact in float32, so the tensor and the float are one number.
            # With 1e-3 the two runs start 1e-11 apart, and Dion's column normalisation turns that rounding
            # into full-size directions on the rank-1 gradients of this check (1.6e-3 apart after 5 steps on
            # an AMD EPYC): a property of the algorithm, not of tensor lr.
            kwargs["lr"] = 1.0 if entry.info.step_requires_closure else 2.0 ** -10
            opt_r = entry.make([weight, bias], **kwargs)
            try:
                kwargs["lr"] = torch.tensor(kwargs["lr"])
                opt = entry.make([weight_c, bias_c], **kwargs)
            except ValueError as e:
                assert re.search(".*lr as a Tensor is not supported.*", str(e)), str(e)
                continue

            def closure(o, w, b):
                o.zero_grad()
                loss = _loss(w, b, x)
                loss.backward()
                return loss

            for _ in range(5):
                closure(opt_r, weight, bias)
                closure(opt, weight_c, bias_c)
                opt_r.step()
                opt.step()
                _eq(weight, weight_c)
                _eq(bias, bias_c)
    fails.raise_if_any()


def _rosenbrock(t):
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def _drosenbrock(t):
    x, y = t
    return torch.stack((-400 * x * (y - x**2) - 2 * (1 - x), 200 * (y - x**2)))


ROSENBROCK_STEPS = 300


@check(lambda e: e.info.supports_sparse or e.info.only_supports_sparse_grads)
def test_rosenbrock_sparse(entry):
    """Torch runs 1800 coordinate-descent steps, comparing the sparse-gradient and dense-gradient runs after
    each; we run ``ROSENBROCK_STEPS`` (300) with the same comparison, to keep the suite within its time budget
    (1800 took about 2.5 minutes alone on 2 shared cores)."""
    fails = _Failures()
    dtype = torch.float64
    kwarg_updates, sched_ctors_all = entry.info.metadata_for_sparse
    for with_lrsched in (False, True):
        if with_lrsched and not sched_ctors_all:
            continue
        for oi in _all_inputs(entry, dtype, skip=("differentiable", "fused")):
            with fails.sample(f"{oi.desc}, lrsched={with_lrsched}"):
                kwargs = oi.kwargs
                for k in kwarg_updates:
                    kwargs.pop(k, None)
                if "lr" in kwarg_updates:
                    kwargs["lr"] = kwarg_updates["lr"]
                multi = kwargs.get("foreach", False)
                params_t = [torch.tensor([1.5, 1.5])] + ([torch.tensor([1.5, 1.5], dtype=dtype)] if multi else [])
                params = [Parameter(p) for p in params_t]
                params_c = [Parameter(p.clone()) for p in params_t]
                opt = entry.make(params, **kwargs)
                opt_c = entry.make(params_c, **kwargs)
                scheds = [s(opt) for s in (sched_ctors_all if with_lrsched else [])]
                scheds_c = [s(opt_c) for s in (sched_ctors_all if with_lrsched else [])]
                solution = torch.tensor([1, 1])
                with torch.no_grad():
                    initial_dist = sum(p.dist(solution) for p in params)

                def grad_of(p, sparse, w):
                    g = _drosenbrock(p)
                    if sparse:
                        i = torch.tensor([[0, 0]] if w else [[1, 1]], dtype=torch.int64)
                        v = torch.stack((g[0] / 4.0, g[0] - g[0] / 4.0)) if w else torch.stack((g[1] - g[1] / 4.0, g[1] / 4.0))
                        return torch.sparse_coo_tensor(i, v, (2,), dtype=v.dtype)
                    return torch.tensor([g[0], 0] if w else [0, g[1]], dtype=p.dtype)

                def ev(o, ps, sparse, w):
                    o.zero_grad()
                    loss = sum(_rosenbrock(p) for p in ps)
                    loss.backward()
                    grads = [grad_of(p.detach(), sparse, w) for p in ps]
                    with torch.no_grad():
                        for p, g in zip(ps, grads):
                            p.grad = g.to(p.dtype)
                    return loss

                for it in range(ROSENBROCK_STEPS):
                    w = it % 2
                    opt.step(functools.partial(ev, opt, params, True, w))
                    opt_c.step(functools.partial(ev, opt_c, params_c, False, w))
                    for s, sc in zip(scheds, scheds_c):
                        if isinstance(s, ReduceLROnPlateau):
                            s.step(_rosenbrock(params[0]))
                            sc.step(_rosenbrock(params_c[0]))
                        else:
                            s.step()
                            sc.step()
                    if not all(torch.allclose(p, q, atol=5e-6, rtol=5e-6) for p, q in zip(params, params_c)):
                        _eq(params, params_c, atol=5e-6, rtol=5e-6)   # raises with the details
                if not kwargs.get("maximize", False):
                    assert sum(p.dist(solution) for p in params) <= initial_dist
    fails.raise_if_any()


@check(lambda e: e.info.supports_complex)
def test_complex(entry):
    fails = _Failures()
    for oi in _all_inputs(entry, torch.complex64, skip=("differentiable", "fused")):
        with fails.sample(oi.desc):
            cparams = [torch.randn(10, 5, dtype=torch.complex64, requires_grad=True),
                       torch.randn(10, dtype=torch.complex64, requires_grad=True),
                       torch.randn(10, 5, dtype=F32, requires_grad=True)]
            rparams = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_()
                       for p in cparams]
            copt = entry.make(cparams, **oi.kwargs)
            ropt = entry.make(rparams, **oi.kwargs)
            for _ in range(3):
                grads = [torch.randn_like(p) for p in rparams]
                for p, g in zip(rparams, grads):
                    p.grad = g.clone()
                for p, g in zip(cparams, grads):
                    p.grad = torch.view_as_complex(g.clone()) if p.is_complex() else g.clone()
                ropt.step()
                copt.step()
            _eq([torch.view_as_real(p) if p.is_complex() else p for p in cparams], rparams)
    fails.raise_if_any()


@check(lambda e: e.info.supports_complex)
def test_complex_2d(entry):
    fails = _Failures()
    case = _Case()
    for oi in _all_inputs(entry, torch.complex64, skip=("differentiable", "fused")):
        with fails.sample(oi.desc):
            a1 = torch.randn(2, dtype=torch.complex64, requires_grad=True)
            a1_real = a1.real.detach().clone().requires_grad_()
            a1_imag = a1.imag.detach().clone().requires_grad_()
            o1 = entry.make([a1], **oi.kwargs)
            o2 = entry.make([a1_real, a1_imag], **oi.kwargs)
            reals, imags, greals, gimags, losses = (co.TensorTracker() for _ in range(5))

            def c1():
                o1.zero_grad()
                loss = _rosenbrock(a1).abs()
                loss.backward()
                reals.add(a1.real)
                imags.add(a1.imag)
                greals.add(a1.grad.real)
                gimags.add(a1.grad.imag)
                losses.add(loss)
                return loss

            def c2():
                o2.zero_grad()
                reals.pop_check_set(a1_real, case)
                imags.pop_check_set(a1_imag, case)
                loss = _rosenbrock(torch.complex(a1_real, a1_imag)).abs()
                losses.pop_check_set(loss, case)
                loss.backward()
                greals.pop_check_set(a1_real.grad, case)
                gimags.pop_check_set(a1_imag.grad, case)
                return loss

            for _ in range(3):
                c1()
                c2()
                o1.step()
                o2.step()
                _eq(a1.real, a1_real)
                _eq(a1.imag, a1_imag)
            assert all(t.all_popped() for t in (reals, imags, greals, gimags, losses))
    fails.raise_if_any()


def _compare_between(inputs, models, optimizers, assert_eq_kwargs=None):
    """Seven steps of two runs, a layer frozen at steps 3-4 and no backward at step 2; parameters and every
    state entry compared after each step."""
    tracker = co.TensorTracker(assert_eq_kwargs or {})
    case = _Case()
    for i in range(7):
        state, updated = [], []
        for inp, model, opt in zip(inputs, models, optimizers):
            opt.zero_grad()
            if i == 3:
                model[2].requires_grad_(False)
            if i == 5:
                model[2].requires_grad_(True)
            if i != 2:
                model(inp).sum().backward()
            opt.step()
            state.append(opt.state)
            updated.append(model.parameters())
        og_state, new_state = state
        for og_p, new_p in zip(updated[0], updated[1]):
            tracker.add(og_p)
            tracker.pop_check_set(new_p, case)
            for k in og_state[og_p]:
                tracker.add(og_state[og_p][k])
                tracker.pop_check_set(new_state[new_p][k], case)
    assert tracker.all_popped()


def _derived(entry, dtype, flag):
    fails = _Failures()
    for oi in entry.info.optim_inputs_func(device=CPU, dtype=dtype):
        with fails.sample(oi.desc):
            kwargs = deepcopy(oi.kwargs)
            if kwargs.get("capturable", False):
                continue
            models, opts = [], []
            for value in (False, True):
                kwargs[flag] = value
                x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
                torch.manual_seed(1)
                model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                            torch.nn.Sigmoid()).to(dtype=dtype)
                empty = torch.empty((), dtype=dtype, requires_grad=True)
                empty.grad = torch.rand_like(empty)
                opts.append(entry.make(list(model.parameters()) + [empty], **kwargs))
                models.append(model)
            _compare_between([x, x], models, opts)
    fails.raise_if_any()


@check(lambda e: "foreach" in e.declared_impls and not e.matrices_only)
def test_foreach_matches_forloop(entry):
    _derived(entry, torch.float64, "foreach")


@check(lambda e: "fused" in e.declared_impls and CPU in e.info.supports_fused_on)
def test_fused_matches_forloop(entry):
    """Torch runs float32, float64, bfloat16 and float16 with per-dtype tolerances from its decorators; we run
    float32 and float64 (the tolerances for the half types are not part of the OptimizerInfo we can reuse)."""
    for dtype in (torch.float32, torch.float64):
        _derived(entry, dtype, "fused")


@check()
def test_param_groups_weight_decay(entry):
    fails = _Failures()
    for oi in _all_inputs(entry, skip=("differentiable",)):
        with fails.sample(oi.desc):
            wk = oi.kwargs
            bk = deepcopy(oi.kwargs)
            bk["weight_decay"] = 0.0
            weight, bias = _weight_bias(entry)
            x = torch.randn(5)
            opt = entry.make([dict(params=[weight], **wk), dict(params=[bias], **bk)])
            initial = _loss(weight, bias, x).item()
            for _ in range(20):
                opt.zero_grad()
                loss = _loss(weight, bias, x)
                loss.backward()
                opt.step()
            if oi.kwargs.get("maximize", False):
                assert loss.item() > initial
            else:
                assert loss.item() < initial
    fails.raise_if_any()


@check()
def test_param_groups_lr(entry):
    fails = _Failures()
    for oi in _all_inputs(entry, skip=("differentiable",)):
        with fails.sample(oi.desc):
            if "lr" not in oi.kwargs or oi.kwargs["lr"] == 0:
                oi.kwargs["lr"] = 1e-3
            weight, bias = _weight_bias(entry)
            irrelevant = Parameter(_small(entry, (2,)))
            irrelevant_clone = irrelevant.clone()
            x = torch.randn(5)
            opt = entry.make([dict(params=[weight, bias], **oi.kwargs), dict(params=[irrelevant])], lr=1e-28)
            initial = _loss(weight, bias, x).item()
            for _ in range(20):
                opt.zero_grad()
                loss = _loss(weight, bias, x)
                loss.backward()
                irrelevant.grad = torch.rand_like(irrelevant)
                opt.step()
            if oi.kwargs.get("maximize", False):
                assert loss.item() > initial
            else:
                assert loss.item() < initial
            _eq(irrelevant, irrelevant_clone)
    fails.raise_if_any()


@check()
def test_step_is_noop_when_params_have_no_grad(entry):
    """Torch's version only steps (it computes ``old_params`` and never compares them); ours also asserts
    that the parameters are unchanged, which is what the name says."""
    fails = _Failures()
    params = [_small(entry, (2, 3), requires_grad=False) for _ in range(2)]
    old = [p.detach().clone() for p in params]
    for oi in _all_inputs(entry):
        with fails.sample(oi.desc):
            opt = entry.make(params, **oi.kwargs)
            opt.step(lambda: torch.tensor([1.0]))
            _eq(params, old)
    fails.raise_if_any()


@check()
def test_step_is_noop_for_zero_grads(entry):
    fails = _Failures()
    param = torch.randn((5, 1), requires_grad=True)
    old = param.detach().clone()
    for oi in _all_inputs(entry):
        with fails.sample(oi.desc):
            kwargs = oi.kwargs
            if kwargs.get("weight_decay", _default(entry, "weight_decay", 0)) != 0:
                continue
            if entry.cls_name == "AdamW":
                kwargs["lr"] = torch.tensor(1e-5) if isinstance(kwargs.get("lr", 1e-5), torch.Tensor) else 1e-5
            params = [param.clone()] if kwargs.get("differentiable", False) else [param]
            opt = entry.make(params, **kwargs)
            params[0].grad = torch.zeros_like(params[0])
            opt.step(lambda: torch.tensor([1.0]))
            _eq(old, params[0].detach())
    fails.raise_if_any()


@check()
def test_optimizer_can_be_printed(entry):
    """Torch only calls ``repr``; ours also checks that it lists the first parameter group."""
    fails = _Failures()
    params = [Parameter(_small(entry, (2, 3))) for _ in range(2)]
    for oi in _all_inputs(entry):
        with fails.sample(oi.desc):
            text = repr(entry.make(params, **oi.kwargs))
            assert isinstance(text, str) and "Parameter Group 0" in text, text[:200]
    fails.raise_if_any()


def _named(params, is_named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if is_named else params


def _without_names(sd):
    sd = deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


@check()
def test_state_dict_deterministic(entry):
    """Torch parametrizes ``is_named_optim0`` x ``is_named_optim1``; the four combinations run here in turn."""
    fails = _Failures()
    for named0 in (True, False):
        for named1 in (True, False):
            weight = Parameter(torch.randn(2, 3))
            bias = Parameter(_small(entry, (2,)))
            x = torch.randn(3)

            def fwd_bwd(o, w, b):
                o.zero_grad()
                loss = _loss(w, b, x)
                loss.backward()
                return loss

            for oi in _all_inputs(entry, skip=("differentiable",)):
                with fails.sample(f"{oi.desc}, named={named0}/{named1}"):
                    opt = entry.make(_named([weight, bias], named0), **oi.kwargs)
                    closure = functools.partial(fwd_bwd, opt, weight, bias)
                    for _ in range(10):
                        _step(entry, opt, closure)
                    with torch.no_grad():
                        weight_c = Parameter(weight.clone())
                        bias_c = Parameter(bias.clone())
                    opt_c = entry.make(_named([weight_c, bias_c], named1), **oi.kwargs)
                    closure_c = functools.partial(fwd_bwd, opt_c, weight_c, bias_c)
                    opt_c.load_state_dict(deepcopy(opt.state_dict()))
                    for _ in range(10):
                        closure()
                        closure_c()
                        opt.step()
                        opt_c.step()
                        _eq(weight, weight_c)
                        _eq(bias, bias_c)
                    _eq(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
                    opt_c.param_groups.extend(opt_c.param_groups)
                    _eq(_without_names(opt.state_dict())["param_groups"][-1],
                        _without_names(opt_c.state_dict())["param_groups"][-1])
    fails.raise_if_any()


def _model_fwd_bwd(o, mod, x):
    o.zero_grad()
    loss = mod(x).sum()
    loss.backward()
    return loss


@check()
def test_can_load_older_state_dict(entry):
    fails = _Failures()
    for oi in _all_inputs(entry, skip=("differentiable",)):
        with fails.sample(oi.desc):
            model, x = _model(entry)
            opt = entry.make(model.parameters(), **oi.kwargs)
            for _ in range(3):
                _step(entry, opt, functools.partial(_model_fwd_bwd, opt, model, x))
            old = deepcopy(opt.state_dict())
            for g in old["param_groups"]:
                for flag in entry.info.not_og_supported_flags:
                    g.pop(flag, None)
            opt.load_state_dict(old)
            _step(entry, opt, functools.partial(_model_fwd_bwd, opt, model, x))
    fails.raise_if_any()


@check(lambda e: not e.info.only_supports_sparse_grads)
def test_can_load_from_to_named_state_dict(entry):
    fails = _Failures()
    for named0 in (True, False):
        for named1 in (True, False):
            for oi in _all_inputs(entry, skip=("differentiable",)):
                with fails.sample(f"{oi.desc}, named={named0}/{named1}"):
                    model, x = _model(entry)
                    opt = entry.make(model.named_parameters() if named0 else model.parameters(), **oi.kwargs)
                    for _ in range(3):
                        _step(entry, opt, functools.partial(_model_fwd_bwd, opt, model, x))
                    old = deepcopy(opt.state_dict())
                    opt2 = entry.make(model.named_parameters() if named1 else model.parameters(), **oi.kwargs)
                    opt2.load_state_dict(old)
                    _step(entry, opt2, functools.partial(_model_fwd_bwd, opt2, model, x))
                    if named0 or named1:
                        names = [n for n, _ in model.named_parameters()]
                        assert opt2.state_dict()["param_groups"][0]["param_names"] == names
    fails.raise_if_any()


@check()
def test_save_load_equality_with_weights_only(entry):
    fails = _Failures()
    for is_named in (True, False):
        weight = Parameter(torch.randn(2, 3))
        bias = Parameter(_small(entry, (2,)))
        x = torch.randn(3)

        def fwd_bwd(o):
            o.zero_grad()
            loss = _loss(weight, bias, x)
            loss.backward()
            return loss

        for oi in _all_inputs(entry, skip=("differentiable",)):
            with fails.sample(f"{oi.desc}, named={is_named}"):
                opt = entry.make(_named([weight, bias], is_named), **oi.kwargs)
                for _ in range(3):
                    opt.step(functools.partial(fwd_bwd, opt))
                sd = opt.state_dict()
                with tempfile.TemporaryFile() as f:
                    torch.save(sd, f)
                    f.seek(0)
                    _eq(torch.load(f, weights_only=False), sd)
                    f.seek(0)
                    _eq(torch.load(f, weights_only=True), sd)
    fails.raise_if_any()


@check()
def test_load_nontensor_step(entry):
    fails = _Failures()
    params = [Parameter(_small(entry, (2, 3))) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for oi in _all_inputs(entry, skip=("differentiable",)):
        with fails.sample(oi.desc):
            opt = entry.make(params, **oi.kwargs)
            for _ in range(3):
                opt.step()
            sd = deepcopy(opt.state_dict())
            for s in sd["state"].values():
                if "step" in s and torch.is_tensor(s["step"]):
                    s["step"] = s["step"].item()
            opt.load_state_dict(sd)
            opt.step()
    fails.raise_if_any()


@check()
def test_state_dict_with_cuda_params(entry):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch's test is @onlyCUDA)")
    fails = _Failures()
    for oi in _all_inputs(entry, skip=("differentiable",)):
        if "fused" in oi.kwargs and "cuda" not in entry.info.supports_fused_on:
            continue
        with fails.sample(oi.desc):
            params = [Parameter(_small(entry, (2, 3))) for _ in range(2)]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = entry.make(params, **oi.kwargs)
            for _ in range(3):
                opt.step()
            with torch.no_grad():
                params_cuda = [p.to("cuda") for p in params]
                for p, q in zip(params_cuda, params):
                    p.grad = q.grad.to("cuda")
            opt_cuda = entry.make(params_cuda, **oi.kwargs)
            sd_cpu = deepcopy(opt.state_dict())
            sd_cuda = deepcopy(opt.state_dict())
            opt_cuda.load_state_dict(sd_cuda)
            _eq(sd_cpu, sd_cuda)
            capturable = sd_cpu["param_groups"][0].get("capturable", False)
            fused = sd_cpu["param_groups"][0].get("fused", False)
            for s_cpu, s_cuda in zip(sd_cpu["state"].values(), opt_cuda.state_dict()["state"].values()):
                if "step" in s_cpu and torch.is_tensor(s_cpu["step"]):
                    assert s_cuda["step"].device.type == ("cuda" if capturable or fused else "cpu")
            for _ in range(5):
                opt.step()
                opt_cuda.step()
                _eq([p.cpu() for p in params_cuda], list(params))
    fails.raise_if_any()


def _sd_pre_hook(optimizer):
    optimizer.state["test"] = 1


def _sd_post_hook(optimizer, state_dict):
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def _hook_opts(entry):
    for oi in _all_inputs(entry):
        param = _small(entry, (2, 3)).requires_grad_()
        yield oi.desc, entry.make([param], **oi.kwargs)


@check()
def test_state_dict_pre_hook(entry):
    fails = _Failures()
    for desc, opt in _hook_opts(entry):
        with fails.sample(desc):
            opt.register_state_dict_pre_hook(_sd_pre_hook)
            assert opt.state_dict()["state"]["test"] == 1
    fails.raise_if_any()


@check()
def test_state_dict_post_hook(entry):
    fails = _Failures()
    for desc, opt in _hook_opts(entry):
        with fails.sample(desc):
            opt.register_state_dict_post_hook(_sd_post_hook)
            assert opt.state_dict()["ran_state_dict_pre_hook"] is False
    fails.raise_if_any()


@check()
def test_state_dict_pre_post_hook(entry):
    fails = _Failures()
    for desc, opt in _hook_opts(entry):
        with fails.sample(desc):
            opt.register_state_dict_pre_hook(_sd_pre_hook)
            opt.register_state_dict_post_hook(_sd_post_hook)
            sd = opt.state_dict()
            assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True
    fails.raise_if_any()


def _load_pre_hook1(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(optimizer, state_dict):
    sd = deepcopy(state_dict)
    sd["param_groups"][0]["lr"] = 0.003
    return sd


def _load_post_hook(optimizer):
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


@check()
def test_load_state_dict_pre_hook_and_prepend(entry):
    fails = _Failures()
    for desc, opt in _hook_opts(entry):
        with fails.sample(desc):
            sd = opt.state_dict()
            opt.register_load_state_dict_pre_hook(_load_pre_hook1)
            opt.load_state_dict(sd)
            assert opt.param_groups[0]["lr"] == 0.002
            opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
            opt.load_state_dict(sd)
            assert opt.param_groups[0]["lr"] == 0.002
    fails.raise_if_any()


@check()
def test_load_state_dict_post_hook(entry):
    """Torch's post hook records ``lr == 0.003`` as the sign that a pre hook ran; where the sample's own lr is
    0.003 (SOAP's default) that sign means nothing, and only the post hook's own flag is checked."""
    fails = _Failures()
    for desc, opt in _hook_opts(entry):
        with fails.sample(desc):
            own_lr_is_sign = opt.param_groups[0]["lr"] == 0.003
            opt.register_load_state_dict_post_hook(_load_post_hook)
            opt.load_state_dict(opt.state_dict())
            assert own_lr_is_sign or not opt.state["ran_load_state_dict_pre_hook2"]
            assert opt.state["ran_load_state_dict_post_hook"]
    fails.raise_if_any()


@check()
def test_load_state_dict_pre_post_hook(entry):
    fails = _Failures()
    for desc, opt in _hook_opts(entry):
        with fails.sample(desc):
            opt.register_load_state_dict_pre_hook(_load_pre_hook2)
            opt.register_load_state_dict_post_hook(_load_post_hook)
            opt.load_state_dict(opt.state_dict())
            assert opt.state["ran_load_state_dict_pre_hook2"]
            assert opt.state["ran_load_state_dict_post_hook"]
    fails.raise_if_any()


def _hook_params(entry):
    return [torch.tensor([[1.0, 1.0]]) if entry.matrices_only else torch.tensor([1.0, 1.0])]


def _one_step_hook(entry, register: str, start: int, end: int):
    """torch's step-hook tests: the hook adds 2 at each of two steps, and nothing once removed."""
    fails = _Failures()
    for oi in _all_inputs(entry):
        with fails.sample(oi.desc):
            data = [start]
            opt = entry.make(_hook_params(entry), **oi.kwargs)
            handle = getattr(opt, register)(lambda o, a, k: data.append(data.pop() + 2))
            opt.step()
            opt.step()
            assert data == [end]
            handle.remove()
            opt.step()
            assert data == [end]
    fails.raise_if_any()


@check()
def test_step_post_hook(entry):
    _one_step_hook(entry, "register_step_post_hook", 2, 6)


@check()
def test_step_pre_hook(entry):
    _one_step_hook(entry, "register_step_pre_hook", 5, 9)


@check()
def test_step_all_hooks(entry):
    fails = _Failures()
    for oi in _all_inputs(entry):
        with fails.sample(oi.desc):
            params = _hook_params(entry)
            opt = entry.make(params, **oi.kwargs)
            opt2 = TorchSGD(params)
            data = []
            handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
                       register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
            try:
                for o in (opt, opt2):
                    handles.append(o.register_step_pre_hook(lambda o, a, k: data.append(1)))
                    handles.append(o.register_step_post_hook(lambda o, a, k: data.append(2)))
                opt.step()
                assert data == [0, 1, 2, 5]
                opt2.step()
                assert data == [0, 1, 2, 5] * 2
                opt.step()
                assert data == [0, 1, 2, 5] * 3
            finally:
                for h in handles:
                    h.remove()
            opt.step()
            opt2.step()
            assert data == [0, 1, 2, 5] * 3
    fails.raise_if_any()


@check()
def test_deepcopy_copies_all_public_attrs(entry):
    fails = _Failures()
    params = [Parameter(_small(entry, (2, 3))) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)

    def public(obj):
        return {k for k in obj.__dict__ if not k.startswith("_")}

    for oi in _all_inputs(entry, skip=("differentiable",)):
        with fails.sample(oi.desc):
            opt = entry.make(params, **oi.kwargs)
            for _ in range(3):
                opt.step()
            assert public(opt) == public(deepcopy(opt)), (public(opt) ^ public(deepcopy(opt)))
    fails.raise_if_any()


@check()
def test_non_empty_state(entry):
    fails = _Failures()
    model = torch.nn.Linear(5, 5, bias=not entry.matrices_only)
    x = torch.rand(2, 5)
    for oi in entry.info.optim_inputs_func(device=CPU):
        with fails.sample(oi.desc):
            opt = entry.make(model.parameters(), **oi.kwargs)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            for p, s in opt.state.items():
                assert len(s) > 0, f"empty state for a parameter of shape {tuple(p.shape)}"
    fails.raise_if_any()


@check(lambda e: "differentiable" in e.declared_impls,
       torch_test="TestDifferentiableOptimizer.test_sgd / test_adam / test_adamw (test/optim/test_optim.py)")
def test_differentiable(entry):
    """``differentiable=True``: ``gradcheck`` of one step (parameter after the step as a function of the
    parameter, the gradient and the float state) in float64, from a state primed by one step."""
    p0 = torch.rand(10, dtype=torch.float64)
    g0 = torch.rand(10, dtype=torch.float64)
    kwargs = {"lr": 0.9, "differentiable": True}
    if entry.cls_name == "SGD":
        kwargs["momentum"] = 0.9
    primer = entry.make([p0.clone()], **kwargs)
    primer.param_groups[0]["params"][0].grad = g0.clone()
    primer.step()
    state = {k: v.detach().clone() for k, v in next(iter(primer.state.values())).items()}
    float_keys = [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and v.ndim > 0]

    def fn(p, g, *svals):
        p = p.clone()
        p.grad = g
        opt = entry.make([p], **kwargs)
        opt.state[p].update({k: v.clone() for k, v in {**state, **dict(zip(float_keys, svals))}.items()})
        opt.step()
        return p

    inputs = (p0.clone().requires_grad_(), torch.rand(10, dtype=torch.float64, requires_grad=True),
              *(state[k].clone().requires_grad_() for k in float_keys))
    assert torch.autograd.gradcheck(fn, inputs)


@check(lambda e: e.name != "ChainedOptimizer",
       torch_test="torch.optim.Optimizer.__init__ (no TestOptimRenewed test by this name)")
def test_empty_param_list(entry):
    """torch's base class refuses an empty parameter list with ``ValueError: optimizer got an empty parameter
    list``; a torch optimizer is expected to raise that ValueError too."""
    with pytest.raises(ValueError, match="empty parameter list"):
        entry.make([])


# ---------------------------------------------------------------- instantiation

ITEMS = [(name, e) for name, (fn, applies, _) in CHECKS.items() for e in ENTRIES if applies(e)]


def _run(name: str, entry, request):
    """Run one (class, check). With a ``DEVIATIONS`` row, every failing sample must match one of the row's
    patterns and every pattern must match a failing sample: a fixed cause or a new one fails the row."""
    fn = CHECKS[name][0]
    row = None if (RAW or entry.control) else DEV.get((entry.name, name))
    request.node.user_properties.append(("torch_suite", (entry.name, entry.control, entry.twin, name, row is not None)))
    if row is None:
        fn(entry)
        return
    patterns, reason = row
    try:
        fn(entry)
    except pytest.skip.Exception:
        raise
    except Exception as e:  # noqa: BLE001 - the documented deviation
        items = e.items if isinstance(e, SampleFailures) else [_text(e)]
        unexplained = [i for i in items if not any(re.search(p, i) for p in patterns)]
        unseen = [p for p in patterns if not any(re.search(p, i) for i in items)]
        assert not unexplained, f"{entry.name}/{name}: failures its DEVIATIONS row does not document: {unexplained}"
        assert not unseen, f"{entry.name}/{name}: documented causes that no longer occur (update the row): {unseen}"
        return
    pytest.fail(f"{entry.name}/{name} now passes: delete its row from DEVIATIONS ({reason})")


def _make_test(name):
    @pytest.mark.parametrize("entry", [e for n, e in ITEMS if n == name], ids=lambda e: e.name)
    def test(entry, request):
        _run(name, entry, request)
    test.__name__ = name
    test.__doc__ = CHECKS[name][0].__doc__
    return test


for _name in CHECKS:
    globals()[_name] = _make_test(_name)


def test_deviation_table_names_real_checks():
    """Every row of ``DEVIATIONS`` names an optbook entry and a check that applies to it (no stale rows)."""
    applicable = {(e.name, n) for n, e in ITEMS if not e.control}
    stale = [(c, k) for c, k, _, _ in DEVIATIONS if (c, k) not in applicable]
    assert not stale, stale
    assert len({(c, k) for c, k, _, _ in DEVIATIONS}) == len(DEVIATIONS), "duplicate rows"


# ---------------------------------------------------------------- what is not mirrored, and the appendix tables

#: TestOptimRenewed tests (and one TestDifferentiableOptimizer group) not mirrored here, with the reason
NOT_MIRRORED = [
    ("test_forloop_goes_right_direction_multigpu", "needs two CUDA devices"),
    ("test_mixed_device_dtype", "needs two CUDA devices"),
    ("test_set_default_dtype_works_with_foreach", "CUDA only in torch (`@onlyCUDA`)"),
    ("test_foreach_large_tensor", "CUDA only, 72 GB of device memory"),
    ("test_peak_memory_foreach", "CUDA only: reads the caching allocator's peak-memory statistics"),
    ("test_fused_large_tensor", "64 GB of memory"),
    ("test_fused_does_not_step_if_foundinf", "CUDA only (optbook's SGD, Adam and AdamW hand fused=True to torch's "
     "kernels without a grad_scale; optbook's own `found_inf` contract is tested in tests/test_contract.py)"),
    ("test_cpu_load_state_dict", "runs on non-CPU devices only"),
    ("test_fused_cpu_matches_cuda", "CUDA only"),
    ("test_defaults_changed_to_foreach", "CUDA only, and it patches torch's module-private "
     "`_multi_tensor_<name>` functions, which optbook's classes do not have"),
    ("test_fused_error_on_params_on_meta", "exercises torch's fused kernel's check of a meta-device parameter; "
     "optbook's fused=True refuses a parameter on a device without torch's fused kernels before the kernel runs "
     "(tests/test_fused.py)"),
    ("test_second_order_optims_return_consistent_types", "applies to optimizers whose step requires a closure "
     "(LBFGS); none of optbook's does"),
    ("test_fused_matches_forloop in bfloat16 and float16", "torch's per-dtype tolerances for the half types live in "
     "decorators of the torch test file, not in the OptimizerInfo; float32 and float64 are run"),
    ("test_errors and test_empty_param_list for ChainedOptimizer", "it takes optimizers, not parameters: the "
     "parameter errors are its members' (each run here on its own), and an empty list of optimizers is refused "
     "with ValueError 'expected at least one optimizer'"),
    ("test_rosenbrock_sparse beyond 300 steps", "torch runs 1800 steps; 300 keep the suite within its time "
     "budget (the comparison after every step is the same)"),
    ("TestDifferentiableOptimizer for the other torch classes", "only SGD, Adam and AdamW have optbook twins that "
     "torch declares differentiable"),
]


def render_tables() -> str:
    """The torch-suite tables of the conformance appendix (written into book/appendix_conformance.md)."""
    from torch_suite_infos import CAUSES, DEVIATIONS_BY_CAUSE
    lines = ["**Checks run** (each is ours, named after the torch test it mirrors):", "",
             "| check | mirrors | runs on |", "|---|---|---|"]
    for name, (fn, applies, torch_test) in CHECKS.items():
        on = [e.name for e in ENTRIES if applies(e) and not e.control]
        who = "every class" if len(on) == sum(not e.control for e in ENTRIES) else ", ".join(f"`{n}`" for n in on)
        lines.append(f"| `{name}` | {torch_test} | {who} |")
    lines += ["", "**Not mirrored:**", ""] + [f"* `{n}`: {why}." for n, why in NOT_MIRRORED]
    lines += ["", "**Documented deviations** (one row per cause; `DEVIATIONS_BY_CAUSE` in "
              "`tests/torch_suite/torch_suite_infos.py` lists each (class, check) pair with its causes):", "",
              "| cause | reason | module | (class: checks) |", "|---|---|---|---|"]
    for cause, (_, reason, owner) in CAUSES.items():
        per: dict[str, list[str]] = {}
        for cls, chk, causes in DEVIATIONS_BY_CAUSE:
            if cause in causes:
                per.setdefault(cls, []).append(chk.removeprefix("test_"))
        where = "; ".join(f"`{c}`: {', '.join(v)}" for c, v in per.items())
        lines.append(f"| {cause} | {reason} | {owner} | {where} |")
    lines += ["", f"{len(DEVIATIONS_BY_CAUSE)} (class, check) pairs deviate, each asserted with its causes."]
    return "\n".join(lines) + "\n"


APPENDIX = pathlib.Path(__file__).resolve().parents[2] / "book" / "appendix_conformance.md"
BEGIN = "% torch-suite tables: generated by tests/torch_suite/test_torch_suite.py (OPTBOOK_UPDATE_CONFORMANCE=1)"
END = "% end of the torch-suite tables"


def test_appendix_tables_match_stored_file():
    """The appendix's copy of the checks, the tests not mirrored and the deviations (between ``BEGIN`` and
    ``END`` in book/appendix_conformance.md, written inline so that every build of the book has it) is the one
    this module generates; ``OPTBOOK_UPDATE_CONFORMANCE=1`` rewrites it."""
    page = APPENDIX.read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1, "the appendix lost its torch-suite markers"
    head, rest = page.split(BEGIN)
    body, tail = rest.split(END)
    text = "\n" + render_tables() + "\n"
    if os.environ.get("OPTBOOK_UPDATE_CONFORMANCE") == "1":
        APPENDIX.write_text(head + BEGIN + text + END + tail)
        body = text
    assert body == text, "torch-suite tables changed; rerun with OPTBOOK_UPDATE_CONFORMANCE=1"
