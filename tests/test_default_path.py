"""The default CPU step of every optbook optimizer is torch's own whole-tensor operations on the calling
thread: no thread of optbook's own, no fork hook, and a ``TorchDispatchMode`` sees every op of the update
(it is thread-local: an op run on another thread is invisible to it). The non-finite check is one
reduction per device and decides NaN, inf, float16 and overflowing-norm cases exactly.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optbook.optim import SGD, Adam, AdamW
from optbook.optim.optimizer import all_finite
from helpers import scaled_timeout
from test_every_optimizer import FACTORIES

# large enough that every ATen CPU kernel on it is an OpenMP parallel region (>= 32768 elements)
BIG = (256, 256)


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=scaled_timeout(300))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_no_thread_but_the_callers_is_alive_after_a_default_cpu_step(name):
    out = run_python(f"""
        import threading, torch
        torch.set_num_threads(2)
        import sys; sys.path.insert(0, "tests")
        from test_every_optimizer import FACTORIES
        ps = [torch.randn({BIG}, requires_grad=True) for _ in range(2)]
        opt = FACTORIES[{name!r}](ps)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn({BIG})
            opt.step()
        print(sorted(t.name for t in threading.enumerate()))
    """)
    assert out == "['MainThread']"


def test_importing_the_package_installs_no_fork_hook():
    out = run_python("""
        import os, inspect, torch
        calls = []
        original = os.register_at_fork
        def record(**hooks):
            calls.append(inspect.stack()[1].filename)
            return original(**hooks)
        os.register_at_fork = record
        import optbook, optbook.optim, optbook.precision, optbook.memory, optbook.distributed
        print([f for f in calls if "optbook" in f])
    """)
    assert out == "[]"


class OpRecorder(TorchDispatchMode):
    """Records each ATen op seen and whether it wrote into a given tensor."""

    def __init__(self, watched: torch.Tensor):
        super().__init__()
        self.watched = watched
        self.writes: list[str] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(func.overloadpacket.__name__)
        for argument, value in zip(func._schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                values = value if isinstance(value, (list, tuple)) else [value]
                if any(isinstance(v, torch.Tensor) and v.data_ptr() == self.watched.data_ptr() for v in values):
                    self.writes.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_dispatch_mode_sees_the_updates_writes_and_the_non_finite_check(name):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    params = [torch.randn(BIG, requires_grad=True), torch.randn(BIG, requires_grad=True)]
    opt = FACTORIES[name](params)
    for p in params:
        p.grad = torch.randn(p.shape)
    before = params[0].detach().clone()
    recorder = OpRecorder(params[0])
    with recorder:
        opt.step()
    assert not torch.equal(params[0].detach(), before)
    # the update of the large parameter is written by ops the mode saw (a thread-local mode sees none
    # of what another thread runs)
    assert recorder.writes, recorder.ops
    assert "_foreach_norm" in recorder.ops   # the non-finite check (all_finite), on this thread too


def test_the_default_cpu_path_is_foreach_and_bitwise_the_per_tensor_loop():
    torch.manual_seed(1)
    shapes = [BIG, (7,), (3, 5)]
    for cls, kw in ((AdamW, dict(weight_decay=0.1, amsgrad=True)), (Adam, dict(weight_decay=0.01)),
                    (SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.1))):
        runs = []
        for foreach in (None, True, False):
            torch.manual_seed(1)
            ps = [torch.randn(s, requires_grad=True) for s in shapes]
            opt = cls(ps, lr=0.01, foreach=foreach, **kw)
            for _ in range(3):
                for p in ps:
                    p.grad = torch.randn(p.shape)
                opt.step()
            runs.append(ps)
        for a, b, c in zip(*runs):
            assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_decides_each_case_exactly(dtype):
    big = torch.finfo(dtype).max / 2
    assert all_finite([torch.ones(3, dtype=dtype), torch.zeros(0, dtype=dtype)])
    # finite values whose sum of squares overflows: still all finite
    assert all_finite([torch.full((1000,), big, dtype=dtype), torch.ones(2, dtype=torch.float64)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(70_000, dtype=dtype)
        t[-1] = bad
        assert not all_finite([torch.ones(3, dtype=torch.float64), t])
    assert all_finite([])
