"""An element-wise CPU step run over blocks of its tensors on worker threads, one hand-off per step.

Why (measured in ``benchmarks/bench_adamw.py``, README): on the CPU every ATen operation over a tensor of
32768 elements or more (from 128 elements for ``sqrt``, which goes through the vector-math library) is
one OpenMP parallel region, and with ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep; the setting every
``make`` target uses) each region pays for waking the sleeping threads: about 80 microseconds on the
2-core machine measured, more than the work of a region over a small tensor. An optimizer written as one
operation per line pays that once per line per tensor: torch's for-loop AdamW ran no faster on two
threads than on one. Here the tensors are cut into blocks of :data:`BLOCK` elements (1 MiB of float32 per
tensor), the blocks dealt out to ``torch.get_num_threads()`` persistent worker threads in contiguous runs
of equal element count, and each worker runs every line of the step on one block after the other with
single-threaded kernels (its intra-op thread count is 1). The threads are woken once per step. Element-wise
kernels compute each element by the same instructions whatever the block boundaries (the vector loop and
its scalar tail agree bitwise; a test checks it), so the result is bitwise the result of the whole-tensor
operations.

This is the CPU counterpart of the chunking in ``torch._foreach_*``'s CUDA kernels (``multi_tensor_apply``
in ``aten/src/ATen/native/cuda/MultiTensorApply.cuh``): cut every tensor into chunks, run one fused piece
of work per chunk.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Sequence

import torch

__all__ = ["BLOCK", "GRAIN", "for_blocks", "usable"]

#: Below this many elements an element-wise ATen CPU kernel runs on the calling thread (ATen's
#: ``at::internal::GRAIN_SIZE``); ``sqrt`` and the other vector-math functions split far smaller tensors.
GRAIN = 32768

#: Elements per block: 1 MiB of float32 per tensor. Smaller blocks mean more Python calls, and the two
#: workers then wait on each other for Python's interpreter lock more often (one measurement of AdamW's
#: step on 2 threads: 50 ms at 64 Ki elements, 42 at 128 Ki, 38 at 256 Ki, 37 at 1 Mi); larger ones leave
#: the last worker's share less even.
BLOCK = 1 << 18


def usable(row: Sequence[torch.Tensor]) -> bool:
    """Whether one parameter's tensors (``p``, ``g``, its state...) can be cut into blocks: all on the
    CPU and contiguous (so that a flat view of each exists and element ``i`` of every view is element
    ``i`` of the others)."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in row)


class _Tally:
    """How many shares have finished, and their errors: the workers write it and the caller only waits on
    it, so an interrupted wait loses nothing.

    The caller waits on a plain lock that the last share's worker releases, not on a
    ``threading.Condition``: an interrupt (``KeyboardInterrupt``) raised inside ``Condition.wait`` while it
    re-acquires its lock leaves the lock un-acquired, and the ``with`` block around it then fails with
    "cannot release un-acquired lock" (seen with random ``SIGALRM`` interrupts on a loaded 2-core machine)."""

    def __init__(self, expected: int) -> None:
        self.lock = threading.Lock()        # guards the counts below (held by a worker for a few operations)
        self.expected = expected
        self.errors: list[BaseException] = []
        self.done = 0
        self.finished = threading.Lock()    # held until every expected share has finished
        if expected:
            self.finished.acquire()

    def finish(self, error: BaseException | None = None) -> None:
        with self.lock:
            self.done += 1
            if error is not None:
                self.errors.append(error)
            if self.done == self.expected:   # (counted before the release: an interrupted wait reads it)
                self.finished.release()

    def wait(self) -> None:
        """Until every expected share has finished, also through interruptions (``KeyboardInterrupt``): the
        first one is raised after the wait, so that no worker writes once the caller has control back. An
        interrupt at any point of the loop leaves the count to end it."""
        interrupted = None
        while self.done < self.expected:
            try:
                if self.finished.acquire(timeout=0.1):   # one C call; a timeout re-reads the count
                    self.finished.release()
            except BaseException as error:  # noqa: BLE001 -- raised once the workers are done
                interrupted = interrupted or error
        if interrupted is not None:
            raise interrupted


class _Job:
    """One run's shares and settings: worker ``i`` runs share ``i``, once, however many times it is handed
    the job (the caller hands it out again after an interrupt that may have come just after a hand-out)."""

    def __init__(self, shares: list[list[tuple[Callable, tuple]]], settings: tuple[bool, bool]) -> None:
        self.shares, self.settings = shares, settings
        self.tally = _Tally(len(shares))
        self.lock = threading.Lock()
        self.claimed = [False] * len(shares)

    def claim(self, index: int) -> bool:
        with self.lock:
            if self.claimed[index]:
                return False
            self.claimed[index] = True
            return True


def _thread_settings() -> tuple[bool, bool]:
    """The calling thread's settings that change what an in-place kernel does and that a new thread does not
    inherit: inference mode (state created under it may only be updated under it) and flush-to-zero of
    denormals (``torch.set_flush_denormal``, which has no getter: probed with one tiny multiply)."""
    return (torch.is_inference_mode_enabled(),
            bool((torch.tensor([1e-40], dtype=torch.float32) * 1.0)[0] == 0))


class _Workers:
    """Persistent daemon threads, each with one intra-op thread and autograd off, fed one task list per
    step under the stepping thread's inference mode and denormal flushing. Created on first use; a forked
    child process starts without them (threads do not survive ``fork``) and makes its own."""

    def __init__(self) -> None:
        # (thread, inbox) pairs, each listed by one list.append: an interrupt cannot list half a worker
        self.workers: list[tuple[threading.Thread, queue.SimpleQueue]] = []
        self.lock = threading.Lock()  # one step at a time (two threads stepping share the workers)

    def ensure(self, n: int) -> None:
        if len(self.workers) >= n:
            return
        caller = torch.get_num_threads()
        worker = ready = None
        try:
            while len(self.workers) < n:   # one at a time: only started, ready workers are listed
                index, inbox, ready = len(self.workers), queue.SimpleQueue(), _Tally(1)
                worker = (threading.Thread(target=self._serve, args=(index, inbox, ready), daemon=True,
                                           name=f"optbook-block-{index}"), inbox)
                worker[0].start()
                ready.wait()   # it has set its own thread count (and, as a side effect, the process default)
                self.workers.append(worker)
        finally:
            # an interrupt just after a start: let that thread set its count before ours is put back below,
            # and list it (its index is still the next one: the caller holds the step lock), so that no idle
            # thread is left behind
            if worker is not None and worker[0].ident is not None and (
                    not self.workers or self.workers[-1] is not worker):
                ready.wait()
                self.workers.append(worker)
            # torch.set_num_threads also sets the default that threads created later start from: put the
            # caller's number back there (a worker's own setting is its thread's and stays 1)
            torch.set_num_threads(caller)

    @staticmethod
    def _serve(index: int, inbox: queue.SimpleQueue, ready: _Tally) -> None:
        torch.get_num_threads()    # take the process default first, so that it cannot overwrite ours later
        torch.set_num_threads(1)   # this thread's kernels run on it alone
        torch.set_grad_enabled(False)
        ready.finish()
        while True:
            job = inbox.get()
            inference, flush = job.settings
            torch.set_flush_denormal(flush)
            if job.claim(index):
                try:
                    # (not inference_mode(False): that context turns autograd back on)
                    with torch.inference_mode() if inference else contextlib.nullcontext():
                        for function, args in job.shares[index]:
                            function(*args)
                    job.tally.finish()
                except BaseException as error:  # noqa: BLE001 -- handed to the stepping thread, raised there
                    job.tally.finish(error)

    def run(self, shares: list[list[tuple[Callable, tuple]]]) -> None:
        """Run share ``i``'s ``function(*args)`` calls in order on worker ``i``, under the calling thread's
        inference mode and denormal flushing; raise the first error.

        Returns only when every share has finished, also when the caller is interrupted
        (``KeyboardInterrupt`` in a notebook) while handing out the job or waiting: the interruption is raised
        after that, so that no worker writes into the tensors once the caller has the control back. One loop
        does both, and an interrupt anywhere in it only restarts it: the remaining hand-outs are made (one
        interrupted just after its ``put`` is made again, which the worker ignores) and the wait resumes."""
        settings = _thread_settings()
        with self.lock:
            self.ensure(len(shares))
            job = _Job(shares, settings)
            posted, interrupted = 0, None
            while True:
                try:
                    while posted < len(shares):
                        self.workers[posted][1].put(job)
                        posted += 1
                    job.tally.wait()
                    break
                except BaseException as error:  # noqa: BLE001 -- raised once the workers are done
                    interrupted = interrupted or error
        if interrupted is not None:
            raise interrupted
        if job.tally.errors:
            raise job.tally.errors[0]


_workers = _Workers()


def _reset_after_fork() -> None:
    global _workers
    _workers = _Workers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def for_blocks(work: Callable, rows: Sequence[Sequence[torch.Tensor]], *, block: int = BLOCK,
               extra: Sequence[tuple[Callable[[], None], int]] = ()) -> None:
    """Call ``work(i, *views, scratch)`` for every block of every row, the blocks spread over worker threads.

    Args:
        work: the step's lines for one block, writing in place into the views. ``i`` is the row's index in
            ``rows`` (to look up per-parameter numbers such as a bias correction); ``views`` are flat views
            of the same ``block`` (or fewer, at a row's end) elements of each tensor of the row; ``scratch``
            is a buffer of as many elements and the dtype of the row's first tensor, private to the thread.
            It runs with autograd off and one intra-op thread; it must touch nothing outside its views.
        rows: one sequence of tensors per parameter, each satisfying :func:`usable`, all of a row with
            the same number of elements.
        block: elements per block (a multiple of 64 keeps every block's vector loop aligned as in the
            whole tensor).
        extra: more work for the workers, as ``(function, elements)``: each function is called once with no
            argument, in a worker, under the same settings, and counts as ``elements`` in the dealing. The
            optimizers hand their small tensors' ``torch._foreach_*`` lines over this way: on the calling
            thread their ``sqrt`` alone woke the threads once per tensor (66 tensors: 5.6 ms of a step, 0.8 ms
            on a worker, measured on the README's benchmark tensors).

    Raises:
        ValueError: a row whose tensors differ in number of elements, or that is not :func:`usable`.
        Whatever ``work`` or an ``extra`` function raises, after every worker has finished its share
        (blocks already done stay done).

    With ``torch.get_num_threads() == 1``, or a single task, everything runs in the calling thread.
    """
    tasks: list[tuple[int, Callable, tuple]] = [(elements, function, ()) for function, elements in extra]
    for i, row in enumerate(rows):
        n = row[0].numel()
        if any(t.numel() != n for t in row) or not usable(row):
            raise ValueError(f"Invalid rows[{i}]: blocks need contiguous CPU tensors of one size, "
                             f"got {[(tuple(t.shape), t.device.type, t.is_contiguous()) for t in row]}")
        flat = [t.view(-1) for t in row]
        tasks += [(min(block, n - start), _BlockCall(work, block), (i, *(f[start:start + block] for f in flat)))
                  for start in range(0, n, block)]
    if not tasks:
        return
    n_workers = min(torch.get_num_threads(), len(tasks))
    if n_workers <= 1:
        with torch.no_grad():
            for _, function, args in tasks:
                function(*args)
        return
    # contiguous runs of about equal element count, one per worker
    total = max(sum(elements for elements, _, _ in tasks), 1)
    shares: list[list[tuple[Callable, tuple]]] = [[] for _ in range(n_workers)]
    done = 0
    for elements, function, args in tasks:
        shares[min(done * n_workers // total, n_workers - 1)].append((function, args))
        done += elements
    _workers.run([share for share in shares if share])


class _BlockCall:
    """``work(i, *views, scratch)`` with the calling thread's scratch buffer for the views' dtype."""

    def __init__(self, work: Callable, block: int) -> None:
        self.work, self.block = work, block

    def __call__(self, i: int, *views: torch.Tensor) -> None:
        self.work(i, *views, _scratch(views[0].dtype, self.block)[:views[0].numel()])


_local = threading.local()


def _scratch(dtype: torch.dtype, size: int) -> torch.Tensor:
    """A buffer of ``size`` elements of ``dtype``, kept per thread from one step to the next (a fresh
    megabyte per step would be a fresh mapping and its page faults)."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < size:
        buffer = buffers[dtype] = torch.empty(size, dtype=dtype)
    return buffer
