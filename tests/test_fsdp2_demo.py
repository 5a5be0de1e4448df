"""``python -m optbook.distributed.demo --fsdp2`` (FSDP2 + FSDP2Muon + AdamW) under torchrun and via ``--nproc``,
and ``optbook.clipping.clip_grad_norm_`` on FSDP2's sharded gradients (the demo's global clip)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp2_ranks import clip_on_shards
from optbook.distributed import launch
from optbook.distributed.demo import run
from helpers import scaled_timeout

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_torchrun_fsdp2_demo_trains_muon_and_adamw_on_shards():
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "optbook.distributed.demo", "--fsdp2", "--steps", "4"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled_timeout(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FSDP2 demo: 2 rank(s), backend gloo" in out and "on 12 matrices" in out
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\d+\.\d+)", out, flags=re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "every loss finite: True" in out


@pytest.mark.parametrize("bf16", [False, True])
def test_nproc_fsdp2_demo_shards_the_state_and_orthogonalises_each_matrix_once_per_step(bf16):
    steps = 3
    runs = run(["--fsdp2", "--nproc", "3", "--steps", str(steps)] + (["--bf16"] if bf16 else []))
    (single,) = run(["--fsdp2", "--steps", "1"])
    assert len(runs) == 3 and all(r["identical"] and r["world_size"] == 3 for r in runs)
    assert runs[0]["losses"] == runs[1]["losses"] == runs[2]["losses"] and runs[0]["losses"][-1] < runs[0]["losses"][0]
    assert sum(r["ns_calls"] for r in runs) == steps * runs[0]["muon_matrices"] == steps * 12
    # the ranks' optimizer states are the rows of the one-process state: together exactly its bytes
    assert sum(r["state_bytes"] for r in runs) == single["state_bytes"]
    assert max(r["state_bytes"] for r in runs) < 0.5 * single["state_bytes"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_clip_grad_norm_on_dtensor_shards_is_the_single_process_clip(world_size):
    for r in launch(clip_on_shards, world_size, timeout=scaled_timeout(180.0)):
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-12 * r["ref_norm"] and r["ref_norm"] > 0.05
        assert r["grads_close"]
        assert r["refused_without_group"] == (world_size > 1) and r["untouched_after_refusal"]
