"""tools/gpu_check.py --dry-run: the whole script on the CPU with small shapes."""

import json
import subprocess
import sys
from pathlib import Path
from helpers import scaled_timeout

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_exercises_every_path_and_writes_its_report(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=scaled_timeout(120), check=False,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "dry-run"
    paths = {r["path"] for r in report["results"]}
    assert paths == {"matmul", "gram_symmetric", "batched", "symmetric", "gram"}
    assert all(v is not None and v > 0 for v in report["measured"].values())
    assert done.stdout.strip().splitlines()[-1] == report["verdict"]
    assert report["verdict"].startswith("VERDICT: dry run") and "no verdict" in report["verdict"]
    # every Newton-Schulz path returned a near-orthogonal result (5 simple steps on Gaussian inputs)
    assert all(r["orthogonality_error"] < 0.8 for r in report["results"] if r["orthogonality_error"] is not None)


def test_without_cuda_and_without_dry_run_it_refuses_naming_the_option(tmp_path):
    import torch
    if torch.cuda.is_available():
        return
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=scaled_timeout(60), check=False,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 2 and "--dry-run" in done.stderr
    assert not (tmp_path / "r.json").exists()


FAKE_GPU = """
import runpy, sys
import torch
import optbook.bench, optbook.kernels

torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda device=None: "a test stand-in"
_empty = torch.empty
torch.empty = lambda *a, device=None, **k: _empty(*a, **k)
optbook.kernels.gram_backend = lambda x: "torch"
FRACTION = float(sys.argv.pop(1))   # every path at this fraction of the matmul rate, Gram 1.5x standard


def run_benchmark(shapes, dtypes, *, paths, **kwargs):
    rows = []
    for shape in shapes:
        for path in ("batched", "gram_symmetric", *paths):
            seconds = 1.0 / 1.5 if path == "gram" else 1.0
            rows.append({"path": path, "shape": list(shape), "seconds": seconds, "tflops": 1.0,
                         "fraction_of_matmul": 2.0 if path == "gram_symmetric" else FRACTION,
                         "orthogonality_error": None})
    return rows


optbook.bench.run_benchmark = run_benchmark
sys.argv[0] = sys.argv.pop(1)   # the tool, run as a script with the remaining options
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_fail_verdict_fails_the_command_and_a_pass_does_not(tmp_path):
    """The real script on a stand-in GPU (CUDA calls and the timings replaced): a missed target exits 1."""
    script = tmp_path / "fake_gpu.py"
    script.write_text(FAKE_GPU)
    status = {}
    for fraction in ("0.5", "0.9"):
        out = tmp_path / f"{fraction}.json"
        done = subprocess.run([sys.executable, str(script), fraction, str(ROOT / "tools" / "gpu_check.py"), "--json", str(out)],
                              capture_output=True, text=True, timeout=scaled_timeout(120), check=False,
                              env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
                              cwd=ROOT)
        assert out.exists(), done.stderr[-2000:]
        report = json.loads(out.read_text())
        status[report["verdict"].split(":")[1].strip()] = done.returncode
    assert status == {"FAIL": 1, "PASS": 0}
