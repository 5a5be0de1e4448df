"""Run a function on several local processes joined by a ``torch.distributed`` process group.

:func:`launch` is the in-notebook stand-in for ``torchrun``: it starts ``world_size`` fresh Python
processes (``spawn``), joins them into one process group over a free TCP port on 127.0.0.1, runs
``fn(rank, world_size, *args, **kwargs)`` on each, and returns what each rank returned. A failing rank
fails the whole launch, with that rank's traceback, instead of leaving the others waiting forever in a
collective. :func:`init_from_env` is the other way in: a script started by ``torchrun`` joins the group
that ``torchrun`` describes in its environment variables.

Source: PyTorch's ``torch.multiprocessing.spawn`` and the ``tcp://`` / ``env://`` initialisation methods
of ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from .._checks import check_int

__all__ = ["free_port", "init_from_env", "launch"]

#: Seconds the parent allows, on top of ``timeout``, for the workers to start (each imports torch).
STARTUP_GRACE = 30.0

_BACKENDS = ("gloo", "nccl")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it for a socket bound to port 0).

    Another program could take it before the process group binds it; the window is short.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"Invalid timeout: expected a number of seconds, got {timeout!r}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"Invalid timeout: expected a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _check_backend(backend) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"Invalid backend: expected one of {_BACKENDS}, got {backend!r}")
    return backend


def _check_importable(fn) -> None:
    """``fn`` must be found by name in a fresh process: a module-level function of an importable module."""
    if not callable(fn):
        raise TypeError(f"Invalid fn: expected a callable, got {fn!r}")
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if "<" in qualname or module is None:  # <lambda>, <locals>
        raise ValueError(f"Invalid fn: {qualname or fn!r} is not a module-level function, so the spawned "
                         "processes cannot import it; define it at the top level of a module in src/ "
                         "(e.g. optbook.distributed.workers)")
    if module == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ValueError(f"Invalid fn: {qualname} is defined in an interactive session (a notebook cell or "
                         "the REPL), which the spawned processes cannot import; define it in a module under "
                         "src/ (e.g. optbook.distributed.workers) and import it")


def _to_cpu(value):
    """``value`` with every tensor (also inside lists, tuples and dicts) detached and moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _worker(rank, world_size, port, backend, timeout, fn, args, kwargs, results) -> None:
    """Body of each spawned process: join the group, run ``fn``, send ``(rank, ok, payload)`` back.

    The message is sent *before* the group is destroyed: a failing rank's own error then reaches the
    parent ahead of the connection errors its exit causes on the other ranks."""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)   # one device per rank (launch checked there are enough)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle (bytes), not torch's shared-memory tensor passing: this process exits right after.
        message = (rank, True, pickle.dumps(_to_cpu(out)))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the parent with its traceback
        message = (rank, False, traceback.format_exc())
    results.put(message)
    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_reason(code: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"`` for a process's ``exitcode`` (negative: killed by a signal)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _death_line(rank: int, world_size: int, code: int) -> str:
    """The report of a worker that ended without sending a result or a traceback. A signal says it was
    killed; an exit code cannot tell a Python exception raised before :func:`_worker` ran (while the spawned
    process imports the parent's main module: a script without an ``if __name__ == "__main__":`` guard)
    from ``os._exit`` or a crash of the interpreter, so the message says where a traceback would be."""
    if code < 0:
        return (f"optbook.distributed.launch: rank {rank} of {world_size} was killed ({_exit_reason(code)}) "
                "before reporting a result")
    return (f"optbook.distributed.launch: rank {rank} of {world_size} exited ({_exit_reason(code)}) before "
            "reporting a result; a traceback, if any, is on its stderr (an exception while the spawned process "
            "started, e.g. a script that calls launch without an `if __name__ == \"__main__\":` guard, or "
            "os._exit or a crash of the interpreter)")


def _died(procs, reported) -> list[tuple[int, int]]:
    """``(rank, exitcode)`` of the workers that ended abnormally without sending a message (a worker that
    raised sends its traceback and exits with code 0)."""
    return [(r, p.exitcode) for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]


def _failure_report(failures: list, world_size: int, procs, results, reported: set, wait: float = 0.5) -> str:
    """Why the launch failed: workers that ended without reporting a result or a traceback (killed by a
    signal, ``os._exit``, a crash in the interpreter, an exception before the worker ran: their peers then
    raise connection errors, which are a consequence) first, with their exit code or signal; then the
    tracebacks of ranks that raised, in arrival order. Messages and deaths are collected for ``wait`` seconds after the first failure.

    ``failures``: ``[(rank, traceback)]`` received so far; ``reported``: ranks that sent a message."""
    until = time.monotonic() + wait
    while (left := until - time.monotonic()) > 0:
        try:
            other, ok, payload = results.get(timeout=min(left, 0.05))
        except queue_module.Empty:
            continue
        reported.add(other)
        if not ok:
            failures.append((other, payload))
    lines = []
    for r, code in _died(procs, reported):
        lines.append(_death_line(r, world_size, code))
    for k, (r, trace) in enumerate(failures):
        first = k == 0 and not lines
        lines.append(f"{'optbook.distributed.launch: rank' if first else 'Then rank'} {r} of {world_size} "
                     f"raised:\n{trace}")
    return "\n".join(lines)


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # only those started (a failed start must not hide its error)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)


def launch(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 60.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new processes in one process group.

    Each process (``torch.multiprocessing``, start method ``spawn``) calls
    ``torch.distributed.init_process_group(backend, init_method="tcp://127.0.0.1:<free port>", rank=rank,
    world_size=world_size, timeout=timedelta(seconds=timeout))``, so every collective gives up after
    ``timeout`` seconds, then runs ``fn``, then destroys the group.

    Args:
        fn: a module-level function of an importable module, e.g. from :mod:`optbook.distributed.workers`.
            The spawned processes import it by name, so a function defined in a notebook cell, a lambda
            or a nested function cannot be used (``ValueError``). It is called as
            ``fn(rank, world_size, *args, **kwargs)`` with ``rank`` in ``0 .. world_size - 1``.
        world_size: number of processes, an int ``>= 1``.
        *args, **kwargs: passed to ``fn`` on every rank; they must be picklable.
        backend: ``"gloo"`` (CPU; the default) or ``"nccl"`` (one CUDA device per rank: rank ``r`` uses
            device ``r``, so ``world_size`` must not exceed ``torch.cuda.device_count()``; NCCL refuses two
            ranks on one GPU, "Duplicate GPU detected", ``ncclInvalidUsage``).
        timeout: seconds, finite and ``> 0``: the timeout of every collective. The parent waits at most
            ``timeout + STARTUP_GRACE`` seconds (``STARTUP_GRACE`` = 30 s for the imports) for all results,
            then stops the workers and raises.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``. Results travel by pickle, so they must be
        picklable; tensors in them (also inside lists, tuples and dicts) arrive detached and on the CPU.

    Raises:
        TypeError, ValueError: invalid ``fn``, ``world_size``, ``backend`` or ``timeout``, or ``"nccl"``
            without CUDA or with more ranks than CUDA devices.
        RuntimeError: a worker raised (the message names its rank and holds its traceback), ended without
            reporting a result (killed by a signal, ``os._exit``, or an exception while the spawned process
            started, whose traceback is on that process's stderr: the message names that rank and its exit
            code or signal first, ahead of the connection errors its death causes on the other ranks), or did
            not finish before the deadline.
            All workers are stopped first.
    """
    _check_importable(fn)
    check_int("world_size", world_size, 1)
    backend = _check_backend(backend)
    timeout = _check_timeout(timeout)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("Invalid backend: 'nccl' needs CUDA, which is not available here; use 'gloo'")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"Invalid world_size: {world_size} NCCL ranks need {world_size} CUDA devices, this machine "
                         f"has {torch.cuda.device_count()} (NCCL refuses two ranks on one GPU: 'Duplicate GPU "
                         "detected'); use at most that many ranks, or backend='gloo'")

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, name=f"optbook-rank{rank}",
                         args=(rank, world_size, port, backend, timeout, fn, args, kwargs, results))
             for rank in range(world_size)]
    deadline = time.monotonic() + timeout + STARTUP_GRACE
    out: dict[int, object] = {}
    try:
        for p in procs:
            p.start()
        reported: set[int] = set()
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue_module.Empty:
                if _died(procs, reported):  # exited without a result (killed, os._exit, crash in the interpreter)
                    try:
                        rank, ok, payload = results.get(timeout=1.0)  # a last message may still be in flight
                    except queue_module.Empty:
                        raise RuntimeError(_failure_report([], world_size, procs, results, reported)) from None
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RuntimeError(f"optbook.distributed.launch: ranks {missing} of {world_size} did not "
                                       f"finish within {timeout + STARTUP_GRACE:.0f} s (timeout={timeout} s "
                                       f"+ {STARTUP_GRACE:.0f} s to start); they were stopped") from None
                else:
                    continue
            reported.add(rank)
            if not ok:
                raise RuntimeError(_failure_report([(rank, payload)], world_size, procs, results, reported))
            out[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _stop(procs)
        results.close()
        results.join_thread()
    return [out[r] for r in range(world_size)]


def init_from_env(backend: str = "gloo", timeout: float = 60.0) -> tuple[int, int]:
    """Join the process group described by ``torchrun``'s environment; return ``(rank, world_size)``.

    ``torchrun --nproc-per-node=2 script.py`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` for each process; this calls ``torch.distributed.init_process_group(backend,
    init_method="env://", timeout=timedelta(seconds=timeout))`` (with ``"nccl"``, it first selects CUDA
    device ``LOCAL_RANK``). If a group is already initialised it is kept and its rank and size returned.
    Call ``torch.distributed.destroy_process_group()`` at the end of the script.

    Raises:
        RuntimeError: one of those environment variables is missing (the script was not started by
            ``torchrun``; use :func:`launch` instead), naming which.
        ValueError, TypeError: invalid ``backend`` or ``timeout``.
    """
    backend = _check_backend(backend)
    timeout = _check_timeout(timeout)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: the environment lacks {', '.join(missing)}: start the script "
                           "with torchrun (e.g. torchrun --nproc-per-node=2 script.py), or use "
                           "optbook.distributed.launch")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()
