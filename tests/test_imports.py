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


def _package_modules() -> list[str]:
    import pkgutil

    return sorted(m.name for m in pkgutil.walk_packages(optbook.__path__, "optbook."))


def test_every_module_is_reachable_by_its_own_name():
    """``import optbook.x.y as m`` gives the module ``optbook.x.y``: no module is hidden by a same-named function
    (``optbook.newton_schulz`` is the function, its module is ``optbook.polar``; ``optbook.optim.muon`` is the
    module, the functional twin is ``optbook.optim.functional.muon``)."""
    import importlib
    import types

    hidden = []
    for name in _package_modules():
        if name.startswith("optbook.kernels._triton"):
            continue  # needs triton, imported only where it is installed
        module = importlib.import_module(name)
        found = optbook
        for part in name.split(".")[1:]:
            found = getattr(found, part)
        if found is not module or not isinstance(found, types.ModuleType):
            hidden.append(f"{name} -> {type(found).__name__}")
    assert not hidden, hidden
    from optbook.optim import muon

    assert muon.SCALE_MODES == ("shape_scaling", "spectral", "unit_rms_norm", "none")


def test_each_functional_twin_is_the_function_its_class_calls():
    import inspect

    from optbook.optim import functional

    for name in functional.__all__:
        fn = getattr(functional, name)
        assert inspect.isfunction(fn), name
        assert fn.__module__.startswith("optbook.optim."), (name, fn.__module__)


def test_no_import_cycle_between_the_package_modules():
    """Imports form no cycle, those inside functions (lazy imports) included."""
    import ast
    import pathlib

    root = pathlib.Path(optbook.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                candidates = [mod] + [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            deps |= {c for c in candidates if c.startswith("optbook")}
        graph[name] = deps
    modules = set(graph)
    graph = {m: {d for d in deps if d in modules and d != m} for m, deps in graph.items()}

    def is_package_init(m):  # an __init__ importing its own submodules is how a package exposes them
        return any(k.startswith(m + ".") for k in modules)

    cycles = []
    colour: dict[str, int] = {}

    def visit(m, stack):
        colour[m] = 1
        for d in sorted(graph[m]):
            if is_package_init(m) and d.startswith(m + "."):
                continue
            if colour.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in colour:
                visit(d, stack + [d])
        colour[m] = 2

    for m in sorted(graph):
        if m not in colour:
            visit(m, [m])
    assert not cycles, cycles
