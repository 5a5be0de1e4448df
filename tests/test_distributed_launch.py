"""optbook.distributed.launch with two gloo processes: the sharded clip agrees with one process, and a
failing rank fails the launch quickly with its rank and traceback instead of hanging."""

import multiprocessing

import pytest
import torch
from zero1_ranks import die_on_rank, raise_on_rank

from optbook.clipping import get_grad_norm
from optbook.distributed import launch
from optbook.distributed.workers import clip_problem, sharded_clip_worker
from helpers import scaled_timeout

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def sharded():
    """Both ranks' reports from one launch (each launch spends a few seconds importing torch twice)."""
    return launch(sharded_clip_worker, WORLD_SIZE, seed=3, max_norm=1.0, timeout=scaled_timeout(30.0))


def test_launch_returns_one_result_per_rank_in_rank_order(sharded):
    assert [r["rank"] for r in sharded] == [0, 1]
    assert [r["owned"] for r in sharded] == [[0, 2, 4], [1, 3, 5]]
    assert all(t.device.type == "cpu" and not t.requires_grad for r in sharded for t in r["clipped"])


def test_all_reduced_norm_equals_the_single_process_norm(sharded):
    params, replicated = clip_problem(seed=3)
    single = get_grad_norm(params + [replicated]).item()
    for r in sharded:
        assert r["full_norm"] == single
        assert r["group_norm"] == pytest.approx(single, rel=1e-12)
        assert r["clip_norm"] == pytest.approx(single, rel=1e-12)


def test_the_local_norm_alone_is_wrong(sharded):
    for r in sharded:
        assert r["local_norm"] < 0.9 * r["full_norm"]
    # the two ranks' local squares add up to the true square plus the replicated gradient counted twice
    _, replicated = clip_problem(seed=3)
    total = sum(r["local_norm"] ** 2 for r in sharded) - replicated.grad.square().sum().item()
    assert total == pytest.approx(sharded[0]["full_norm"] ** 2, rel=1e-12)


def test_the_replicated_parameter_is_counted_once(sharded):
    _, replicated = clip_problem(seed=3)
    extra = replicated.grad.square().sum().item()  # counted once more when unmarked, on rank 1
    for r in sharded:
        assert r["unmarked_norm"] ** 2 == pytest.approx(r["full_norm"] ** 2 + extra, rel=1e-12)


def test_sharded_clip_matches_torch_nn_utils_clip_grad_norm_in_one_process(sharded):
    params, replicated = clip_problem(seed=3)
    torch.nn.utils.clip_grad_norm_(params + [replicated], 1.0)  # the single-process reference
    for r in sharded:
        for i, g in zip(r["owned"], r["clipped"]):
            torch.testing.assert_close(g, params[i].grad, rtol=1e-14, atol=0)
        torch.testing.assert_close(r["clipped_replicated"], replicated.grad, rtol=1e-14, atol=0)


def test_a_failing_rank_fails_the_launch_with_its_rank_and_traceback_without_hanging():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 raised") as info:
        launch(raise_on_rank, WORLD_SIZE, bad_rank=1, timeout=scaled_timeout(120.0))
    assert "ValueError: rank 1 fails on purpose" in str(info.value) and "Traceback" in str(info.value)
    # Rank 0, left waiting in its barrier, was stopped by the launch as soon as rank 1's
    # error arrived: the report has no timeout of its own (nor the launch's "did not finish"),
    # and no process of the launch is left.
    assert "Timed out" not in str(info.value) and "did not finish" not in str(info.value)
    assert not multiprocessing.active_children()


def test_functions_a_spawned_process_cannot_import_are_refused_before_starting():
    with pytest.raises(ValueError, match="module-level"):
        launch(lambda rank, world_size: rank, WORLD_SIZE)

    def nested(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="module-level"):
        launch(nested, WORLD_SIZE)


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(world_size=0), ValueError, "world_size"),
    (dict(world_size=True), TypeError, "world_size"),
    (dict(backend="mpi"), ValueError, "backend"),
    (dict(timeout=0.0), ValueError, "timeout"),
    (dict(timeout=float("inf")), ValueError, "timeout"),
    (dict(timeout="60"), TypeError, "timeout"),
])
def test_bad_arguments_are_refused_before_starting(kwargs, error, word):
    kwargs = {"world_size": WORLD_SIZE, **kwargs}
    with pytest.raises(error, match=word):
        launch(raise_on_rank, **kwargs)


def test_nccl_with_more_ranks_than_gpus_is_refused_before_starting(monkeypatch):
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected", ncclInvalidUsage, when the communicator is
    # created: NCCL's init.cc), so the round-robin rank % device_count that launch used could never work; a
    # machine with one GPU is simulated (nothing is spawned, CUDA is never touched)
    import multiprocessing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(multiprocessing.get_context("spawn"), "Process",
                        lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match=r"world_size: 2 NCCL ranks need 2 CUDA devices, this machine has 1"):
        launch(raise_on_rank, 2, backend="nccl")


def test_init_from_env_names_the_missing_variables(monkeypatch):
    from optbook.distributed import init_from_env

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_from_env()


def test_a_process_that_fails_to_start_reports_its_own_error(monkeypatch):
    # The second process's start() raises: launch must re-raise that error, not "can only join a started
    # process" from stopping the processes that never started.
    import multiprocessing.context

    real_start, calls = multiprocessing.context.SpawnProcess.start, []

    def start(self):
        calls.append(self)
        if len(calls) == 2:
            raise OSError("cannot start the second process")
        return real_start(self)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    with pytest.raises(OSError, match="cannot start the second process"):
        launch(raise_on_rank, 2, bad_rank=5, timeout=scaled_timeout(20.0))


@pytest.mark.parametrize("how, reason", [("exit", "exited (exit code 3)"), ("kill", "was killed (signal SIGKILL)")])
def test_a_rank_that_dies_without_an_exception_is_named_with_its_exit_code_or_signal(how, reason):
    with pytest.raises(RuntimeError) as info:
        launch(die_on_rank, 2, bad_rank=1, how=how, timeout=scaled_timeout(60.0))
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(f"optbook.distributed.launch: rank 1 of 2 {reason} before reporting a result")
    assert ("a traceback, if any, is on its stderr" in first_line) == (how == "exit")


def test_a_script_without_a_main_guard_is_not_reported_as_dying_without_a_python_exception(tmp_path):
    # Each spawned child imports the parent's script as its main module; without the guard, the child's own
    # launch() raises there (multiprocessing's bootstrapping error), before the worker runs: exit code 1.
    import os
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text("from optbook.distributed import launch\n"
                      "from optbook.distributed.workers import clip_problem\n"
                      "launch(clip_problem, 2, timeout=20.0)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=scaled_timeout(120),
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode != 0
    assert "bootstrapping phase" in run.stderr  # the children's own traceback, on stderr
    report = [line for line in run.stderr.splitlines() if "optbook.distributed.launch: rank" in line]
    assert report and "without a Python exception" not in run.stderr, run.stderr[-2000:]
    assert "exited (exit code 1) before reporting a result; a traceback, if any, is on its stderr" in report[0]
