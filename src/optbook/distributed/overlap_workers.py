"""Overlapping ZeRO-1's parameter all-gather with the forward pass, bucket by bucket. Explained in chapter 13.

After a ZeRO-1 step every rank holds up-to-date values only in its own shard of each bucket; the other
shards must be all-gathered before the forward pass reads them. Gathering every bucket before the forward
exposes the whole communication. Megatron-LM overlaps it: a forward pre-hook on each module waits for the
all-gather of the bucket that holds the module's parameters and, once that one is complete, dispatches the
asynchronous all-gather of the *next* bucket, so that bucket ``k + 1`` travels while bucket ``k``'s layers
compute. Only the first bucket's gather, which nothing precedes, stays exposed.

:func:`overlap_forward` runs that schedule on gloo processes (``async_op=True`` collectives) next to the
synchronous one and records what happened, in order, on every rank.

Source: Megatron-LM core_v0.16.0, ``megatron/core/distributed/param_and_grad_buffer.py``
(``_ParamAndGradBucketGroup.start_param_sync`` / ``finish_param_sync``, ``next_param_gather_bucket_group``)
and ``megatron/core/distributed/distributed_data_parallel.py`` (``_make_forward_pre_hook``); bib key
``megatron2024distopt``. The code here is our own.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..runtime import generator
from ._zero1_layout import shard_layout
from .._checks import check_int

__all__ = ["MODES", "overlap_forward", "overlap_model"]

#: The two schedules :func:`overlap_forward` runs: every gather waited on as it is issued, or overlapped.
MODES = ("sync", "overlap")


def overlap_model(layers: int, width: int, seed: int = 0) -> torch.nn.Sequential:
    """``layers`` float32 blocks ``Linear(width, width) - Tanh``, initialised from ``seed``.

    The seed goes through :func:`optbook.runtime.generator`, so a sweep's ``OPTBOOK_SEED_OFFSET`` shifts it
    (in a spawned worker too: the variable is inherited). The global random state is left alone.
    """
    gen = generator(seed)
    global_state = torch.random.get_rng_state()   # nn.Linear's own initialisation draws from the global RNG
    blocks = []
    for _ in range(layers):
        lin = torch.nn.Linear(width, width)
        with torch.no_grad():
            bound = width ** -0.5
            lin.weight.uniform_(-bound, bound, generator=gen)
            lin.bias.uniform_(-bound, bound, generator=gen)
        blocks += [lin, torch.nn.Tanh()]
    torch.random.set_rng_state(global_state)
    return torch.nn.Sequential(*blocks)


def _check_args(layers, width, batch, repeats, seed) -> None:
    for name, value, low in (("layers", layers, 2), ("width", width, 1), ("batch", batch, 1),
                             ("repeats", repeats, 1), ("seed", seed, 0)):
        check_int(name, value, low)


def overlap_forward(rank: int, world_size: int, *, layers: int = 6, width: int = 512, batch: int = 512,
                    repeats: int = 3, seed: int = 0, group=None) -> dict:
    """ZeRO-1's parameter all-gather before a forward pass: synchronous, then overlapped as in Megatron-LM.

    Every rank builds :func:`overlap_model` ``(layers, width, seed)`` (the same weights everywhere) and moves
    its parameters into one flat float32 buffer laid out by :func:`~optbook.distributed.shard_layout` with
    one bucket per ``Linear`` (``bucket_size = width * width + width``, Megatron's alignments 64 and 128),
    the buckets in forward order. Before each forward pass every element outside this rank's shards is set
    to NaN: the state after a ZeRO-1 step, where only the own shard is up to date (a missing gather would
    show as NaN). Then the forward of a ``(batch, width)`` input drawn from
    ``optbook.runtime.generator(seed + 1)`` runs in each mode:

    ``"sync"``
        a forward pre-hook on each ``Linear`` calls ``all_gather_single`` (``all_gather_into_tensor``) on its
        bucket (``async_op=False``) and the layer computes when it returns: the gathers are all exposed.
    ``"overlap"``
        the first bucket's gather is issued (``async_op=True``) at the start; the pre-hook of ``Linear`` ``k``
        waits on bucket ``k``'s handle and then issues bucket ``k + 1``'s gather before the layer computes
        (Megatron's ``finish_param_sync``: wait, then ``next_param_gather_bucket_group.start_param_sync()``),
        so bucket ``k + 1`` travels during layer ``k``'s compute.

    Each mode runs ``repeats`` times, alternating, after one warm-up pass of each; all ranks enter each pass
    together (a barrier). One thread per process (``torch.set_num_threads(1)``).

    Args:
        rank, world_size: from :func:`~optbook.distributed.launch`.
        layers: number of ``Linear`` blocks (= buckets), an int ``>= 2``.
        width, batch: sizes of the blocks and of the input, ints ``>= 1``.
        repeats: timed passes per mode, an int ``>= 1``.
        seed: non-negative int; shifted by ``OPTBOOK_SEED_OFFSET`` through :mod:`optbook.runtime`.
        group: process group (default: the whole world).

    Returns:
        ``{"outputs": {mode: (batch, width) float32 output of the last pass}, "reference": the same forward
        of the unsharded model in this process, "buffers": {mode: the float32 flat buffer after the last
        pass}, "params": the unsharded model's flat buffer, "events": {mode: the last pass's event log, a
        list of (event, bucket) with event in "start" (gather issued), "wait" (gather complete, after
        ``wait()`` returned), "compute" (layer starts), "done" (layer finished)}, "gather_s": {mode: per
        pass, the seconds spent in the gather calls and waits of the main thread, i.e. the exposed
        communication}, "first_wait_s": {mode: per pass, that time for bucket 0 alone}, "forward_s": {mode:
        per pass, wall seconds of the whole forward}, "median": {"gather_s": ..., "first_wait_s": ...,
        "forward_s": ...} the medians over passes per mode, "buckets": number of buckets, "shard_numel":
        elements per shard of each bucket}``.

    Raises:
        ValueError: an argument out of range (named), before any collective.
    """
    _check_args(layers, width, batch, repeats, seed)
    torch.set_num_threads(1)
    group = group if group is not None else dist.group.WORLD
    d, r = dist.get_world_size(group), dist.get_rank(group)
    model = overlap_model(layers, width, seed)
    x = torch.randn(batch, width, generator=generator(seed + 1))
    with torch.no_grad():
        reference = model(x)
    params = list(model.parameters())
    layout = shard_layout(params, d, bucket_size=width * width + width)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert len(layout.buckets) == len(linears)
    flat = torch.zeros(layout.buffer_numel[torch.float32])
    for p, pr in zip(params, layout.params):
        flat[pr.start:pr.end].copy_(p.detach().reshape(-1))
        p.data = flat[pr.start:pr.end].view(pr.shape)   # the parameters become views of the flat buffer
    full = flat.clone()
    buckets = [flat[b.start:b.end] for b in layout.buckets]
    own = [bucket[r * b.shard_numel:(r + 1) * b.shard_numel] for bucket, b in zip(buckets, layout.buckets)]

    state = {"mode": "sync", "handles": {}, "log": [], "exposed": 0.0, "first": 0.0}

    def gather(k: int, async_op: bool):
        state["log"].append(("start", k))
        return dist.all_gather_single(buckets[k], own[k], group=group, async_op=async_op)

    def make_pre_hook(k: int):
        def pre_hook(module, args):
            t0 = time.perf_counter()
            if state["mode"] == "sync":
                gather(k, async_op=False)
            else:                                              # finish_param_sync of bucket k
                state["handles"].pop(k).wait()
            state["log"].append(("wait", k))
            if state["mode"] == "overlap" and k + 1 < len(buckets):
                state["handles"][k + 1] = gather(k + 1, async_op=True)   # the next bucket's start_param_sync
            spent = time.perf_counter() - t0
            state["exposed"] += spent
            if k == 0:
                state["first"] = spent
            state["log"].append(("compute", k))
        return pre_hook

    def post_hook(module, args, output):
        state["log"].append(("done", module._overlap_bucket))

    for k, lin in enumerate(linears):
        lin._overlap_bucket = k
        lin.register_forward_pre_hook(make_pre_hook(k))
        lin.register_forward_hook(post_hook)

    def one_pass(mode: str):
        with torch.no_grad():
            flat.fill_(float("nan"))
            for mine, b, bucket in zip(own, layout.buckets, buckets):
                mine.copy_(full[b.start:b.end][r * b.shard_numel:(r + 1) * b.shard_numel])
        state.update(mode=mode, handles={}, log=[], exposed=0.0, first=0.0)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if mode == "overlap":
            t1 = time.perf_counter()
            state["handles"][0] = gather(0, async_op=True)     # nothing precedes the first bucket's gather
            state["exposed"] += time.perf_counter() - t1
        with torch.no_grad():
            out = model(x)
        seconds = time.perf_counter() - t0
        return out, seconds

    timings = {m: {"gather_s": [], "first_wait_s": [], "forward_s": []} for m in MODES}
    outputs, buffers, events = {}, {}, {}
    for i in range(repeats + 1):
        for mode in MODES:
            out, seconds = one_pass(mode)
            if i > 0:                                          # pass 0 warms up
                timings[mode]["gather_s"].append(state["exposed"])
                timings[mode]["first_wait_s"].append(state["first"])
                timings[mode]["forward_s"].append(seconds)
            outputs[mode], buffers[mode], events[mode] = out, flat.clone(), list(state["log"])
    median = {key: {m: statistics.median(timings[m][key]) for m in MODES} for key in timings[MODES[0]]}
    return {"outputs": outputs, "reference": reference, "buffers": buffers, "params": full, "events": events,
            "gather_s": {m: timings[m]["gather_s"] for m in MODES},
            "first_wait_s": {m: timings[m]["first_wait_s"] for m in MODES},
            "forward_s": {m: timings[m]["forward_s"] for m in MODES}, "median": median,
            "buckets": len(layout.buckets), "shard_numel": [b.shard_numel for b in layout.buckets]}
