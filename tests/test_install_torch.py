"""tools/install_torch.py, run against a stand-in environment whose ``bin/python`` is a shell script that
logs the pip commands it is given (nothing is downloaded): the CPU wheel index when it answers, the
default index when it does not, the record of which one was used, and a re-install on a changed request."""

import functools
import http.server
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import scaled_timeout

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "install_torch.py"

# `python -m pip ...` is logged (exit status from $PIP_RC, or $PIP_RC_INDEXED when an --index-url is
# given); `python -c ...` prints what `import torch` would report once something was installed.
STUB = """#!/bin/sh
if [ "$1" = "-m" ]; then
  echo "$@" >> "$STUB_LOG"
  case "$*" in *--index-url*) exit "${PIP_RC_INDEXED:-0}";; esac
  exit "${PIP_RC:-0}"
fi
if [ -s "$STUB_LOG" ] || [ -n "$PREINSTALLED" ]; then
  echo "{\\"version\\": \\"${TORCH_VERSION:-2.13.0+cpu}\\", \\"cuda\\": ${TORCH_CUDA:-null}}"; exit 0
fi
exit 1
"""


@pytest.fixture
def venv(tmp_path):
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(STUB)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def run(venv, *args, index_url="http://127.0.0.1:9/whl/cpu", **env):
    """Run the tool; port 9 (discard) on localhost refuses the connection at once: an unreachable index."""
    full = {**os.environ, "STUB_LOG": str(venv / "pip.log"), "OPTBOOK_TORCH_CPU_INDEX": index_url, **env}
    out = subprocess.run([sys.executable, str(TOOL), "--venv", str(venv), "--timeout", "2", *args],
                         capture_output=True, text=True, env=full, timeout=scaled_timeout(60))
    log = (venv / "pip.log").read_text().splitlines() if (venv / "pip.log").exists() else []
    return out, log


@pytest.fixture
def index(tmp_path_factory):
    """A simple index on localhost that answers ``/torch/`` (served from a thread)."""
    root = tmp_path_factory.mktemp("index")
    (root / "torch").mkdir()
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def record(venv):
    return json.loads((venv / "torch-source").read_text())


def test_unreachable_cpu_index_falls_back_to_the_default_index_and_says_so(venv):
    out, log = run(venv)
    assert out.returncode == 0, out.stderr
    assert log == ["-m pip install --quiet torch==2.13.0"]  # no --index-url: pip's default index
    rec = record(venv)
    assert rec["index_used"] == "default"
    assert "did not answer" in rec["reason"] and "127.0.0.1:9" in rec["reason"]
    assert rec["version"] == "2.13.0+cpu" and rec["cuda"] is None
    assert "torch 2.13.0+cpu (CPU build) from pip's default index" in out.stdout


def test_reachable_cpu_index_is_used(venv, index):
    out, log = run(venv, index_url=index)
    assert out.returncode == 0, out.stderr
    assert log == [f"-m pip install --quiet torch==2.13.0 --index-url {index}"]
    rec = record(venv)
    assert rec["index_used"] == index and rec["reason"] == "PyTorch's CPU wheel index"


def test_failed_install_from_the_cpu_index_falls_back(venv, index):
    out, log = run(venv, index_url=index, PIP_RC_INDEXED="1")
    assert out.returncode == 0, out.stderr
    assert log == [f"-m pip install --quiet torch==2.13.0 --index-url {index}",
                   "-m pip install --quiet torch==2.13.0"]
    assert record(venv)["index_used"] == "default"


def test_same_request_does_nothing_a_new_one_reinstalls(venv):
    run(venv)
    out, log = run(venv)
    assert len(log) == 1 and out.stdout == ""  # recorded request unchanged: no pip call
    out, log = run(venv, "--index", "https://download.example/whl/cu128", TORCH_VERSION="2.13.0+cu128",
                   TORCH_CUDA='"12.8"')
    assert out.returncode == 0, out.stderr
    assert log[1] == ("-m pip install --quiet torch==2.13.0 --force-reinstall "
                      "--index-url https://download.example/whl/cu128")
    rec = record(venv)
    assert rec["request"] == {"torch": "torch==2.13.0", "index": "https://download.example/whl/cu128"}
    assert rec["cuda"] == "12.8" and "CUDA 12.8 build" in out.stdout
    out, log = run(venv, "--torch", "", "--index", "")  # empty (make's default): keep the recorded switch
    assert len(log) == 2 and out.stdout == ""


def test_existing_cpu_torch_without_a_record_is_kept(venv):
    out, log = run(venv, PREINSTALLED="1")
    assert out.returncode == 0 and log == []
    assert record(venv)["reason"] == "found installed"


def test_every_index_failing_is_an_error_naming_them(venv):
    out, _ = run(venv, PIP_RC="1")
    assert out.returncode != 0
    assert "could not install torch==2.13.0 from pip's default index" in out.stderr
    assert not (venv / "torch-source").exists()


def test_bad_index_and_missing_venv_are_rejected(venv, tmp_path):
    out, log = run(venv, "--index", "cuda")
    assert out.returncode != 0 and "invalid --index 'cuda'" in out.stderr and log == []
    out = subprocess.run([sys.executable, str(TOOL), "--venv", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--venv" in out.stderr and "no bin/python" in out.stderr
