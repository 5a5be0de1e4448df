"""``python -m optbook.distributed.demo``: under torchrun (2 gloo processes), spawned via ``launch``, and in
one process. Each run must end with every rank holding rank 0's parameters bit for bit and a loss lower
than its first."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from optbook.distributed.demo import main, run
from helpers import scaled_timeout

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_torchrun_with_two_processes_trains_and_ends_with_identical_parameters():
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "optbook.distributed.demo", "--steps", "4"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled_timeout(240))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ZeRO-1 demo: 2 rank(s), backend gloo" in out and "torch.float32" in out
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\d+\.\d+)", out, flags=re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0]  # printed once per step: by rank 0 only
    assert "all 2 rank(s) hold identical parameters: True" in out


def test_nproc_spawns_gloo_processes_via_launch_every_rank_agrees_and_the_state_is_sharded():
    runs = run(["--nproc", "2", "--steps", "3", "--bf16"])
    assert len(runs) == 2 and all(r["backend"] == "gloo" for r in runs)
    assert all(r["identical"] and r["world_size"] == 2 and r["skipped"] == 0 for r in runs)
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["losses"][-1] < runs[0]["losses"][0]
    numel = runs[0]["numel"]
    total = sum(r["state_bytes"] for r in runs)
    # float32 master, m, v: each rank about half; together the whole plus padding and step counters (< 1 %)
    assert 12 * numel <= total < 1.01 * 12 * numel
    assert all(abs(r["state_bytes"] - total / 2) < 0.01 * total for r in runs)


def test_without_torchrun_or_nproc_it_runs_in_this_process():
    (r,) = run(["--steps", "3", "--clip", "0"])
    assert r["identical"] and r["world_size"] == 1 and r["losses"][-1] < r["losses"][0]
    assert 8 * r["numel"] <= r["state_bytes"] < 1.01 * 8 * r["numel"]  # float32: m and v
    assert not dist.is_initialized()  # the group of size 1 was destroyed again
    assert main(["--steps", "1"]) == 0



def test_bad_arguments_end_in_a_usage_error_naming_the_option(capsys):
    import pytest

    from optbook.distributed.demo import parse_args

    for argv, option in ((["--lr", "nan"], "--lr"), (["--clip", "inf"], "--clip"), (["--d-model", "30"], "--d-model"),
                         (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2 and f"error: {option} must" in capsys.readouterr().err, option
