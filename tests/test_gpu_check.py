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
