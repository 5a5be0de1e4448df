"""Shared test fixtures: a reproducible multi-group problem to drive optimizers side by side."""

import copy
import importlib.util
import os
from pathlib import Path

import torch

#: The one setting behind every timeout of the tests (a launch's collective timeout, a subprocess's limit, a
#: wait for a worker): each is a base value in seconds, sized for an idle 2-core machine, times this factor.
#: ``OPTBOOK_TEST_TIMEOUT_SCALE`` (default 3: room for a machine shared with other jobs) sets it; a timeout
#: only bounds how long a hung run waits before it fails, so a generous one costs nothing when all is well.
TIMEOUT_SCALE = float(os.environ.get("OPTBOOK_TEST_TIMEOUT_SCALE", "3"))
if not TIMEOUT_SCALE > 0:
    raise ValueError(f"OPTBOOK_TEST_TIMEOUT_SCALE must be a number > 0, got {TIMEOUT_SCALE}")


def scaled_timeout(seconds: float) -> float:
    """``seconds`` (a timeout's base value) times :data:`TIMEOUT_SCALE` (``OPTBOOK_TEST_TIMEOUT_SCALE``)."""
    return seconds * TIMEOUT_SCALE


def make_params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (3,), (4, 4, 2), (1,)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def grads_for(step, params, seed=1):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def groups(params, **second):
    """Two groups with different hyperparameters: [0, 1] and [2, 3]."""
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def run(opt, params, steps, start=0, lr_schedule=None, seed=1):
    """Drive ``opt`` with the deterministic gradients of steps ``start .. start+steps-1``."""
    for t in range(start, start + steps):
        if lr_schedule is not None:
            for gi, group in enumerate(opt.param_groups):
                group["lr"] = lr_schedule(t, gi)
        for p, g in zip(params, grads_for(t, params, seed)):
            p.grad = g.clone()
        opt.step()


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def deepcopy_state(opt):
    return copy.deepcopy(opt.state_dict())


def toc_files(toc: dict) -> list[str]:
    """Every page of a Jupyter Book ``_toc.yml`` (already parsed), root first, sections after their chapter."""

    def walk(entries):
        for entry in entries:
            yield entry["file"]
            yield from walk(entry.get("sections", []))

    return [toc["root"]] + [f for part in toc.get("parts", []) for f in walk(part["chapters"])]


#: The pages that hold generated sections (``<!-- NAME:start -->`` ... ``<!-- NAME:end -->``): the README and
#: the book's API page (the step contract and the composition matrix moved there from the README).
GENERATED_PAGES = ("README.md", "book/api_contract.md", "CONTRIBUTING.md", "benchmarks/README.md")


def check_readme_section(name: str, generated: str, path=None) -> None:
    """Compare the section between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` of the page that holds it
    (``path``, else the one of :data:`GENERATED_PAGES` with the markers) with ``generated`` (the section's
    body); ``OPTBOOK_UPDATE_README=1`` rewrites the section instead."""
    import os
    import pathlib

    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if path is None:
        root = pathlib.Path(__file__).resolve().parent.parent
        holders = [root / p for p in GENERATED_PAGES if (root / p).is_file() and start in (root / p).read_text()]
        assert len(holders) == 1, f"the section {name} should be on exactly one of {GENERATED_PAGES}: {holders}"
        path = holders[0]
    path = pathlib.Path(path)
    text = path.read_text()
    i, j = text.index(start) + len(start), text.index(end)
    body = "\n" + generated.strip("\n") + "\n"
    if os.environ.get("OPTBOOK_UPDATE_README") == "1":
        path.write_text(text[:i] + body + text[j:])
    else:
        assert text[i:j] == body, f"{path}'s {name} section is stale: rerun with OPTBOOK_UPDATE_README=1"


def load_tool(name: str):
    """The script ``tools/<name>.py`` imported as a module (the tools are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ParamsModel(torch.nn.Module):
    """A module holding the given parameters (for ``torch.distributed.checkpoint.state_dict``, which reads an
    optimizer's state through a model's named parameters)."""

    def __init__(self, params):
        super().__init__()
        self.weights = torch.nn.ParameterList(params)
