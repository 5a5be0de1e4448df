"""Tests that hold on a loaded machine: no test compares an elapsed time with a number of seconds (a
stopwatch fails when other jobs share the cores, not when the code is wrong), and every timeout in the tests
comes from one setting, ``OPTBOOK_TEST_TIMEOUT_SCALE`` (``helpers.scaled_timeout``)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TIMEOUT_SCALE, scaled_timeout

TESTS = Path(__file__).resolve().parent
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns", "process_time"}


def _calls_a_clock(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CLOCKS
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "time" for n in ast.walk(node))


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def stopwatch_comparisons(source: str) -> list[int]:
    """Lines where an elapsed time (an expression that reads ``time.monotonic()``, ``time.perf_counter()``,
    ``time.time()``..., or a name assigned from one) is compared with a number of seconds written out. A
    deadline against a scaled timeout (``time.monotonic() - start < PAGE_TIMEOUT``) is a timeout, not a
    stopwatch, and is not listed."""
    tree = ast.parse(source)
    timed = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _calls_a_clock(n.value)
             for t in n.targets if isinstance(t, ast.Name)}

    def elapsed(node):
        return _calls_a_clock(node) or any(isinstance(n, ast.Name) and n.id in timed for n in ast.walk(node))

    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            if any(elapsed(s) for s in sides) and any(_is_number(s) for s in sides):
                lines.append(n.lineno)
    return lines


def literal_timeouts(source: str) -> list[int]:
    """Lines that pass ``timeout=<a number>`` to a call (``dict(timeout=0.0)``, an invalid argument checked
    by a test, excepted): each such timeout must go through ``scaled_timeout``."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and not (isinstance(n.func, ast.Name) and n.func.id == "dict")
            for k in n.keywords if k.arg == "timeout" and _is_number(k.value)]


def test_the_checks_find_a_stopwatch_and_a_literal_timeout():
    source = ("import time\nstart = time.monotonic()\nlaunch(f, 2, timeout=120.0)\n"
              "assert time.monotonic() - start < 60.0\nseconds = time.perf_counter() - start\nassert seconds < 60\n"
              "while time.monotonic() - start < PAGE_TIMEOUT:\n    pass\nlaunch(f, 2, timeout=scaled_timeout(120.0))\n"
              "check(dict(timeout=0.0))\n")
    assert stopwatch_comparisons(source) == [4, 6]
    assert literal_timeouts(source) == [3]


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_no_test_compares_elapsed_time_and_every_timeout_is_scaled(path):
    source = path.read_text(encoding="utf-8")
    assert not stopwatch_comparisons(source), f"{path.name}: elapsed time compared with seconds at lines " \
                                               f"{stopwatch_comparisons(source)}: test what happened instead"
    assert not literal_timeouts(source), f"{path.name}: timeout=<number> at lines {literal_timeouts(source)}: " \
                                         "use helpers.scaled_timeout(seconds)"


def test_the_scale_comes_from_the_environment_with_a_generous_default():
    assert scaled_timeout(10.0) == 10.0 * TIMEOUT_SCALE
    code = "import helpers; print(helpers.TIMEOUT_SCALE, helpers.scaled_timeout(90.0))"
    env_of = {"unset": {}, "5": {"OPTBOOK_TEST_TIMEOUT_SCALE": "5"}}
    out = {}
    for key, extra in env_of.items():
        env = {k: v for k, v in os.environ.items() if k != "OPTBOOK_TEST_TIMEOUT_SCALE"} | extra
        done = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True, env=env,
                              timeout=scaled_timeout(60))
        assert done.returncode == 0, done.stderr
        out[key] = done.stdout.split()
    assert out == {"unset": ["3.0", "270.0"], "5": ["5.0", "450.0"]}
    env = {**os.environ, "OPTBOOK_TEST_TIMEOUT_SCALE": "0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True, env=env,
                          timeout=scaled_timeout(60))
    assert done.returncode != 0 and "OPTBOOK_TEST_TIMEOUT_SCALE must be a number > 0" in done.stderr


def test_the_readme_names_the_setting_and_its_default():
    readme = (TESTS.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### The tests"):readme.index("\n## ", readme.index("### The tests"))]
    assert "`OPTBOOK_TEST_TIMEOUT_SCALE`" in section
    default = os.environ.get("OPTBOOK_TEST_TIMEOUT_SCALE")
    if default is None:
        assert f"(default {TIMEOUT_SCALE:g})" in section


def test_nbval_timeouts_are_scaled_by_the_same_setting(pytestconfig):
    """pyproject.toml's --nbval-cell-timeout (and nbval's kernel start) times OPTBOOK_TEST_TIMEOUT_SCALE."""
    import re

    base = float(re.search(r"--nbval-cell-timeout=(\d+)", (TESTS.parent / "pyproject.toml").read_text()).group(1))
    if pytestconfig.getoption("nbval_cell_timeout", default=None) is None:
        pytest.skip("nbval is not loaded in this run")
    if "--nbval-cell-timeout=" in " ".join(pytestconfig.invocation_params.args):
        pytest.skip("the cell timeout was given on the command line")
    addopts = pytestconfig.getini("addopts")
    if any(a.startswith("--nbval-cell-timeout=") for a in addopts):
        assert pytestconfig.option.nbval_cell_timeout == base * TIMEOUT_SCALE
