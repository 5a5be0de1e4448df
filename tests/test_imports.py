"""``import optbook.optim`` and ``import optbook.clipping`` need torch only; ``import optbook`` still gives
every submodule."""

import os
import subprocess
import sys

import optbook
from helpers import scaled_timeout


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=scaled_timeout(120))


def test_importing_the_optimizers_and_clipping_pulls_in_neither_matplotlib_nor_sklearn():
    done = _run("import optbook.optim, optbook.clipping, sys; "
                "assert 'matplotlib' not in sys.modules and 'sklearn' not in sys.modules, "
                "sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'sklearn'))")
    assert done.returncode == 0, done.stderr


def test_the_package_still_exposes_every_submodule_on_first_use():
    for name in ("clipping", "data", "diagnostics", "distributed", "models", "optim", "plotting", "runtime",
                 "schedules", "training"):
        assert getattr(optbook, name).__name__ == f"optbook.{name}"
    assert callable(optbook.newton_schulz) and callable(optbook.qk_clip_)
    assert set(optbook.__all__) <= set(dir(optbook))
