"""pytest configuration for the whole repository (tests/ and the notebooks in book/).

Notebooks listed in ``sweeps/pending.txt`` have measured claims that have not yet been through the seed
and kernel sweep (see ``sweeps/README.md``): their stored trajectory numbers match only the CPU they were
executed on, so nbval does not run them until they are converted. The list is meant to shrink to nothing.

nbval's timeouts (a cell's, a kernel's start; ``pyproject.toml`` sets the cell's base value) are scaled by
the one setting behind every timeout of the tests, ``OPTBOOK_TEST_TIMEOUT_SCALE`` (``tests/helpers.py``).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def pending_notebooks() -> dict[str, str]:
    """``{notebook stem: reason}`` from ``sweeps/pending.txt`` (lines ``stem: reason``; ``#`` comments)."""
    path = ROOT / "sweeps" / "pending.txt"
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.split("#", 1)[0].strip()
        if line:
            stem, _, reason = line.partition(":")
            out[stem.strip()] = reason.strip()
    return out


def _timeout_scale() -> float:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_optbook_test_helpers", ROOT / "tests" / "helpers.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers.TIMEOUT_SCALE


def pytest_configure(config):
    """Scale nbval's cell and kernel-start timeouts by ``OPTBOOK_TEST_TIMEOUT_SCALE``."""
    scale = _timeout_scale()
    for name in ("nbval_cell_timeout", "nbval_kernel_startup_timeout"):
        if getattr(config.option, name, None):
            setattr(config.option, name, getattr(config.option, name) * scale)


collect_ignore = [f"book/{stem}.ipynb" for stem in pending_notebooks()]
