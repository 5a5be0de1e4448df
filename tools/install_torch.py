#!/usr/bin/env python3
"""Install PyTorch into the project's virtual environment and record which build it got.

``make setup`` (and every target that depends on it) runs this before ``pip install -r requirements.txt``::

    python tools/install_torch.py --venv .venv --torch "torch==2.13.0" --index cpu

``--index`` picks where the wheel comes from:

* ``cpu`` (the default of ``make``): PyTorch's CPU wheel index, https://download.pytorch.org/whl/cpu,
  when it answers within ``--timeout`` seconds and the install from it succeeds; otherwise pip's default
  index (PyPI or the mirror pip is configured with). On Linux x86-64 PyPI's ``torch`` wheel is the CUDA
  build (several GB), on macOS and Windows it is the CPU build;
* ``default``: pip's default index only (on Linux x86-64: the CUDA build that PyPI ships);
* any URL, e.g. ``https://download.pytorch.org/whl/cu128``: that index only.

The outcome goes to ``<venv>/torch-source`` (and is printed): the request, the index used and why, and
the installed ``torch.__version__`` and ``torch.version.cuda``. When the file already records the same
request, nothing is done, so ``make`` stays fast; a different ``--torch`` or ``--index`` re-installs torch
into the existing environment (``make torch-cuda``, ``make TORCH=... TORCH_INDEX=... setup``).

Only the standard library is used: this runs with the interpreter that created the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

CPU_INDEX = os.environ.get("OPTBOOK_TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")
RECORD_NAME = "torch-source"
DEFAULT_TORCH = "torch==2.13.0"


def reachable(url: str, timeout: float) -> tuple[bool, str]:
    """Whether ``url`` (a simple index) answers ``torch/`` within ``timeout`` seconds; the reason if not."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as response:
            return response.status < 400, f"HTTP {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def pip_install(python: Path, spec: str, index_url: str | None, force: bool) -> int:
    cmd = [str(python), "-m", "pip", "install", "--quiet", spec]
    if force:  # another build of the same version counts as installed for pip otherwise
        cmd.append("--force-reinstall")
    if index_url is not None:
        cmd += ["--index-url", index_url]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def installed(python: Path) -> dict:
    out = subprocess.run([str(python), "-c", "import json, torch; print(json.dumps("
                          "{'version': torch.__version__, 'cuda': torch.version.cuda}))"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"version": None, "cuda": None}
    return json.loads(out.stdout.strip().splitlines()[-1])


def install(venv: Path, spec: str | None, index: str | None, timeout: float) -> dict:
    """Install ``spec`` into ``venv`` from ``index`` (see the module docstring); return the record written.

    ``spec`` or ``index`` None (or empty): what ``<venv>/torch-source`` recorded, else ``torch==2.13.0`` and
    ``cpu``; so a switch made once (``make torch-cuda``) holds for every later ``make``.

    Raises:
        SystemExit: pip failed on every index tried (the message names them), or ``index`` is invalid.
    """
    python = venv / "bin" / "python"
    record_path = venv / RECORD_NAME
    try:
        old = json.loads(record_path.read_text()) if record_path.exists() else None
    except ValueError:
        old = {}
    previous = (old or {}).get("request", {})
    request = {"torch": spec or previous.get("torch", DEFAULT_TORCH), "index": index or previous.get("index", "cpu")}
    spec, index = request["torch"], request["index"]
    if old is not None:
        if old.get("request") == request and old.get("version"):
            return old
    else:  # an environment made before this record existed: keep a CPU torch that fits the request
        found = installed(python)
        pinned = spec.partition("==")[2].strip() if spec.replace(" ", "").startswith("torch==") else None
        if (index == "cpu" and found["version"] and found["cuda"] is None
                and (pinned is None or found["version"].split("+")[0] == pinned)):
            record = {"request": request, "index_used": "unknown", "reason": "found installed", **found}
            record_path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"torch {found['version']} (CPU build) was already installed; recorded in {record_path}")
            return record
    if index == "cpu":
        ok, why = reachable(CPU_INDEX, timeout)
        tries = [(CPU_INDEX, "PyTorch's CPU wheel index")] if ok else []
        tries.append((None, "pip's default index" + ("" if ok else f" (the CPU wheel index {CPU_INDEX} "
                                                                   f"did not answer: {why})")))
    elif index == "default":
        tries = [(None, "pip's default index")]
    elif index.startswith(("http://", "https://", "file://")):
        tries = [(index, "the index given")]
    else:
        raise SystemExit(f"install_torch.py: invalid --index {index!r}: expected cpu, default or a URL")
    force = installed(python)["version"] is not None
    for url, label in tries:
        if pip_install(python, spec, url, force) == 0:
            record = {"request": request, "index_used": url or "default", "reason": label, **installed(python)}
            break
        print(f"install_torch.py: installing {spec} from {label} failed", file=sys.stderr)
    else:
        raise SystemExit(f"install_torch.py: could not install {spec} from "
                         + " or ".join(label for _, label in tries))
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    build = f"CUDA {record['cuda']}" if record.get("cuda") else "CPU"
    print(f"torch {record['version']} ({build} build) from {label}; recorded in {record_path}", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(".venv"), help="the virtual environment (default .venv)")
    parser.add_argument("--torch", default="", help="pip requirement (default: as recorded, else torch==2.13.0)")
    parser.add_argument("--index", default="", help="cpu, default, or an index URL (default: as recorded, else cpu)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the CPU wheel index before using the default one (default 5)")
    args = parser.parse_args(argv)
    if not (args.venv / "bin" / "python").exists():
        parser.error(f"--venv {args.venv}: no bin/python in it (create it first: python3 -m venv {args.venv})")
    install(args.venv, args.torch, args.index, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
