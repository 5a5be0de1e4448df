"""The CPU block path of Adam/AdamW (optbook.optim._blocks): tensors cut into blocks stepped by worker
threads must give bitwise the whole-tensor result (the foreach path), leave the caller's thread settings
alone, hand a worker's error to the caller, and survive fork."""

import multiprocessing
import threading

import pytest
import torch

from optbook.optim import Adam, AdamW
from optbook.optim import _blocks
from optbook.optim._blocks import BLOCK, for_blocks
from helpers import scaled_timeout

# a multi-block matrix with a partial last block, a 1-D tensor of exactly two blocks, one just over the
# small-tensor threshold (one partial block), and small ones batched through foreach
SHAPES = [(3 * BLOCK // 1000 + 7, 1000), (2 * BLOCK,), (32768 + 5,), (64, 3), (17,)]


def trajectories(cls, dtype, steps=4, threads=2, **options):
    """Parameters after ``steps`` steps of the block path (foreach=False) and of the foreach path."""
    torch.manual_seed(0)
    start = [torch.randn(s, dtype=dtype) for s in SHAPES]
    grads = [[torch.randn(s, dtype=dtype) for s in SHAPES] for _ in range(steps)]
    results = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for foreach in (False, True):
            params = [p.clone().requires_grad_() for p in start]
            opt = cls(params, lr=1e-2, foreach=foreach, **options)
            for gs in grads:
                for p, g in zip(params, gs):
                    p.grad = g.clone()
                opt.step()
            results.append((params, opt))
    finally:
        torch.set_num_threads(previous)
    return results


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cls, options", [
    (AdamW, dict(weight_decay=0.1)),
    (AdamW, dict(weight_decay=0.1, amsgrad=True, maximize=True)),
    (Adam, dict(weight_decay=0.01)),
], ids=["adamw", "adamw-amsgrad-maximize", "adam-l2"])
def test_block_path_is_bitwise_the_whole_tensor_path(cls, options, dtype, threads):
    (blocked, opt_b), (whole, opt_w) = trajectories(cls, dtype, threads=threads, **options)
    for p, q in zip(blocked, whole):
        assert torch.equal(p, q)
        for key in opt_w.state[q]:
            if torch.is_tensor(opt_w.state[q][key]):
                assert torch.equal(opt_b.state[p][key], opt_w.state[q][key]), key


def test_block_path_equals_torch_adamw_on_large_tensors():
    torch.manual_seed(1)
    ours = [torch.randn(s, dtype=torch.float64).requires_grad_() for s in SHAPES]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = AdamW(ours, lr=1e-2, weight_decay=0.1, foreach=False)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, dtype=p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    assert max(float((p - q).detach().abs().max()) for p, q in zip(ours, ref)) <= 1e-12


def test_non_contiguous_parameter_takes_the_whole_tensor_path_with_the_same_result():
    torch.manual_seed(2)
    base = torch.randn(1000, 700)
    transposed = base.t().contiguous().t().requires_grad_()  # a non-contiguous leaf: no flat view
    plain = base.clone().requires_grad_()
    assert not transposed.is_contiguous()
    grads = [torch.randn(1000, 700) for _ in range(3)]
    for p in (transposed, plain):
        opt = AdamW([p], lr=1e-2, foreach=False)
        for g in grads:
            p.grad = g.clone().t().contiguous().t() if p is transposed else g.clone()
            opt.step()
    assert torch.equal(transposed, plain)


def test_blocks_change_no_element_whatever_their_boundaries():
    # element-wise kernels give every element the same bits in a block of any size and alignment as in
    # the whole tensor (the vector loop and its scalar tail agree); odd block sizes are the hard case
    torch.manual_seed(3)
    n = 100_003
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v = v.abs()

    def lines(p, g, m, v, s):
        p.mul_(0.999)
        m.lerp_(g, 0.1)
        v.mul_(0.95).addcmul_(g, g, value=0.05)
        torch.sqrt(v, out=s)
        s.add_(1e-8)
        p.addcdiv_(m, s, value=-1e-3)

    whole = [t.clone() for t in (p, g, m, v)]
    lines(*whole, torch.empty(n))
    for block in (64, 1000, 4097):
        parts = [t.clone() for t in (p, g, m, v)]
        for_blocks(lambda i, *views: lines(*views), [parts], block=block)
        for a, b in zip(parts, whole):
            assert torch.equal(a, b)


def test_workers_run_single_threaded_and_leave_the_callers_threads_alone():
    seen = []

    def work(i, x, scratch):
        seen.append((threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))
        x.add_(1)

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.zeros(4 * 1024)
        for_blocks(work, [[x]], block=1024)
        assert torch.equal(x, torch.ones_like(x))
        assert {name for name, _, _ in seen} <= {"optbook-block-0", "optbook-block-1"}
        assert len({name for name, _, _ in seen}) == 2
        assert all(n == 1 and not grad for _, n, grad in seen)
        assert torch.get_num_threads() == 2
        # a thread started afterwards begins from the caller's setting, not the workers' 1
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2]
    finally:
        torch.set_num_threads(previous)


def test_one_thread_runs_in_the_caller():
    names = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for_blocks(lambda i, x, s: names.append(threading.current_thread().name), [[torch.zeros(4096)]],
                   block=1024)
    finally:
        torch.set_num_threads(previous)
    assert names == [threading.current_thread().name] * 4


def test_a_workers_error_reaches_the_caller_and_the_workers_keep_serving():
    def work(i, x, scratch):
        if x[0] == 2:
            raise RuntimeError("block failed")
        x.add_(1)

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.arange(4.0).repeat_interleave(1024)
        with pytest.raises(RuntimeError, match="block failed"):
            for_blocks(work, [[x]], block=1024)
        y = torch.zeros(4096)
        for_blocks(lambda i, y, s: y.add_(1), [[y]], block=1024)
        assert torch.equal(y, torch.ones(4096))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("row, message", [
    ([torch.zeros(10), torch.zeros(11)], "one size"),
    ([torch.zeros(4, 4).t()], "contiguous"),
])
def test_bad_rows_are_refused_by_index(row, message):
    ok = [torch.zeros(3)]
    with pytest.raises(ValueError, match=rf"rows\[1\].*{message}"):
        for_blocks(lambda *a: None, [ok, row])


def _blocks_in_child(queue):
    # GNU OpenMP cannot run a parallel region in a forked child of a process that ran one (a torch
    # limitation, not ours: DataLoader workers set one thread for the same reason), so the child's own
    # thread stays on one; the block workers run single-threaded kernels and may be used
    fresh = _blocks._workers.workers == []
    torch.set_num_threads(2)
    names = []
    x = torch.zeros(4096)
    for_blocks(lambda i, x, s: (names.append(threading.current_thread().name), x.add_(1)), [[x]], block=1024)
    torch.set_num_threads(1)
    params = [torch.ones(3 * BLOCK).requires_grad_()]
    params[0].grad = torch.ones(3 * BLOCK)
    AdamW(params, lr=0.5, weight_decay=0.0, foreach=False).step()
    queue.put((fresh, sorted(set(names)), float(x.sum()), float(params[0][0].detach())))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform")
def test_a_forked_child_makes_its_own_workers():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for_blocks(lambda i, x, s: x.add_(1), [[torch.zeros(4096)]], block=1024)  # parent's workers exist
        assert len(_blocks._workers.workers) >= 2
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_blocks_in_child, args=(queue,))
        child.start()
        try:
            fresh, names, total, value = queue.get(timeout=scaled_timeout(60))
        finally:
            child.join(timeout=scaled_timeout(10))
            if child.is_alive():
                child.kill()
    finally:
        torch.set_num_threads(previous)
    assert child.exitcode == 0
    assert fresh and names == ["optbook-block-0", "optbook-block-1"] and total == 4096
    assert value == pytest.approx(0.5, abs=1e-6)   # first Adam step: lr * sign(g)


def test_extra_work_runs_once_on_a_worker_next_to_the_blocks():
    calls = []
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.zeros(4096)
        for_blocks(lambda i, x, s: x.add_(1), [[x]], block=1024,
                   extra=[(lambda: calls.append((threading.current_thread().name, torch.get_num_threads())), 10)])
        assert torch.equal(x, torch.ones(4096))
        assert len(calls) == 1 and calls[0][0].startswith("optbook-block-") and calls[0][1] == 1
        with pytest.raises(ZeroDivisionError):
            for_blocks(lambda *a: None, [], extra=[(lambda: 1 / 0, 1), (lambda: None, 1)])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_kill"), reason="needs signal.pthread_kill")
def test_an_interrupted_wait_returns_only_after_every_worker_is_done():
    # Ctrl-C in a notebook while the workers step: the KeyboardInterrupt reaches the caller only once no
    # worker writes any more, and the next call is not confused by the interrupted one's results
    import signal
    import time

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the test interrupts the main thread")
    main = threading.main_thread().ident

    def work(i, x, scratch):
        if x[0] == 0:
            signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.3)
        x.add_(1)

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    # Python's own SIGINT handler (a shell's background job starts with SIGINT ignored, and then Python
    # installs none)
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        x = torch.arange(2.0).repeat_interleave(1024)
        with pytest.raises(KeyboardInterrupt):
            for_blocks(work, [[x]], block=1024)
        assert torch.equal(x, torch.arange(2.0).repeat_interleave(1024) + 1)  # both blocks written
        y = torch.zeros(4096)
        for_blocks(lambda i, y, s: y.add_(1), [[y]], block=1024)
        assert torch.equal(y, torch.ones(4096))
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        torch.set_num_threads(previous)


def test_a_step_inside_inference_mode_works_as_on_the_foreach_path():
    # state created inside inference_mode is an inference tensor: the workers must update it in that mode
    results = []
    for foreach in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(3 * BLOCK))
        small = torch.nn.Parameter(torch.randn(100))
        p.grad, small.grad = torch.randn_like(p), torch.randn_like(small)
        opt = AdamW([p, small], lr=1e-2, foreach=foreach)
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            with torch.inference_mode():
                opt.step()
                opt.step()
        finally:
            torch.set_num_threads(previous)
        results.append((p.detach().clone(), opt.state[p]["exp_avg_sq"].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_flushed_denormals_on_the_caller_are_flushed_on_the_workers():
    # torch.set_flush_denormal is per thread: the workers follow the stepping thread's setting at each step
    # (torch's own 2-thread kernels do not: there only the calling thread's half of a tensor is flushed)
    def run(threads, foreach):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            p = torch.nn.Parameter(torch.ones(3 * BLOCK))
            small = torch.nn.Parameter(torch.ones(100))
            opt = AdamW([p, small], lr=1e-3, foreach=foreach)
            for step in range(3):
                torch.set_flush_denormal(step >= 1)
                p.grad = torch.full_like(p, 1e-21)        # g * g = 1e-42, a float32 denormal
                small.grad = torch.full_like(small, 1e-21)
                opt.step()
        finally:
            torch.set_flush_denormal(False)
            torch.set_num_threads(previous)
        return opt.state[p]["exp_avg_sq"], opt.state[small]["exp_avg_sq"]

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    one_thread = run(1, True)
    assert int((one_thread[0] == 0).sum()) == 3 * BLOCK       # flushed: the check can fail
    for a, b in zip(run(2, False), one_thread):
        assert torch.equal(a, b)


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="needs signal.setitimer")
def test_interrupts_at_random_moments_never_hang_a_step_nor_leave_workers_writing():
    import faulthandler
    import random
    import signal
    import time

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")

    def interrupt(*_):
        raise KeyboardInterrupt

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    previous_handler = signal.signal(signal.SIGALRM, interrupt)
    faulthandler.dump_traceback_later(scaled_timeout(120), exit=True)    # a hang fails the run instead of stalling it
    try:
        p = torch.nn.Parameter(torch.randn(8 * BLOCK))
        q = torch.nn.Parameter(torch.randn(500))
        p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
        opt = AdamW([p, q], lr=1e-3, foreach=False)
        opt.step()
        rng = random.Random(0)
        interrupted = 0
        for _ in range(150):
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-4, 1e-2))
            try:
                opt.step()
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupted += 1
                snapshot = p.detach().clone()
                time.sleep(0.01)
                assert torch.equal(snapshot, p.detach()), "a worker wrote after the interrupt returned"
        assert interrupted > 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous_handler)
        torch.set_num_threads(previous_threads)


def _blocked_adamw_and_twin():
    """A parameter large enough for the block path, its AdamW (loop path: blocks), and a twin to step
    with the foreach path as the reference."""
    p = torch.nn.Parameter(torch.randn(8 * BLOCK))
    p.grad = torch.randn_like(p)
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    return p, q, AdamW([p], lr=1e-3, foreach=False)


def test_an_interrupt_while_listing_a_new_worker_leaves_the_workers_usable(monkeypatch):
    """Each worker is listed by one append of its (thread, inbox) pair: an interrupt right after that append
    (or before it) leaves every listed worker with its inbox, and the next step runs (when a thread and its
    inbox were two appends, an interrupt between them left a thread without an inbox and every later step
    spinning on an IndexError)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    workers = _blocks._Workers()
    monkeypatch.setattr(_blocks, "_workers", workers)

    class InterruptAfterAppend(list):
        fired = False

        def append(self, item):
            super().append(item)
            if not InterruptAfterAppend.fired and len(self) == 2:
                InterruptAfterAppend.fired = True
                raise KeyboardInterrupt

    workers.workers = InterruptAfterAppend()
    try:
        p, q, opt = _blocked_adamw_and_twin()
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert InterruptAfterAppend.fired and all(len(w) == 2 for w in workers.workers)
        assert torch.get_num_threads() == 2
        opt.step()   # a first step that runs (the interrupted one wrote nothing: it stopped before the hand-out)
        reference = AdamW([q], lr=1e-3, foreach=True)
        reference.step()
        assert torch.equal(p.detach(), q.detach())
    finally:
        torch.set_num_threads(previous)


def test_an_interrupt_between_a_workers_start_and_its_listing_leaves_no_idle_thread(monkeypatch):
    """A worker whose thread has started when an interrupt comes, before it is listed, is listed on the way
    out: the next step uses it instead of starting another, so no idle thread is left behind."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    workers = _blocks._Workers()
    monkeypatch.setattr(_blocks, "_workers", workers)

    class InterruptFirstReadyWait(_blocks._Tally):
        fired = False

        def wait(self):
            if self.expected == 1 and not InterruptFirstReadyWait.fired:
                InterruptFirstReadyWait.fired = True
                raise KeyboardInterrupt   # the first worker's thread has started, it is not listed yet
            super().wait()

    monkeypatch.setattr(_blocks, "_Tally", InterruptFirstReadyWait)
    try:
        p, q, opt = _blocked_adamw_and_twin()
        threads_before = threading.active_count()
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert InterruptFirstReadyWait.fired
        assert len(workers.workers) == 1 and workers.workers[0][0].is_alive()
        assert torch.get_num_threads() == 2
        opt.step()
        assert len(workers.workers) == 2 and [w[0].name for w in workers.workers] == [
            "optbook-block-0", "optbook-block-1"]
        assert threading.active_count() == threads_before + 2   # the interrupted start left no extra thread
        reference = AdamW([q], lr=1e-3, foreach=True)
        reference.step()
        assert torch.equal(p.detach(), q.detach())
    finally:
        torch.set_num_threads(previous)
