"""Training demo: ``torchrun --nproc_per_node=N -m optbook.distributed.demo [--fsdp2]``.

Trains a small decoder-only transformer (:class:`optbook.models.TinyTransformer`) with
:class:`~optbook.distributed.DistributedOptimizer` around AdamW on a synthetic next-token task (each
sequence counts up by a random stride modulo the vocabulary, so the loss falls quickly). Every rank draws
its own micro-batch; rank 0 prints the loss averaged over the ranks at every step; at the end every rank
compares its parameters with rank 0's, bit for bit, and the script exits with status 1 if any differ.

With ``--fsdp2`` the same model is sharded by PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard`` on every
transformer block, then on the whole model) and trained with :class:`~optbook.distributed.FSDP2Muon` for the
hidden matrices and :class:`optbook.optim.AdamW` for the rest (embeddings, norms, output head: the routing of
:func:`optbook.optim.muon_param_groups`), the global gradient norm clipped over both with
:func:`optbook.clipping.clip_grad_norm_` on the shards (``group`` = the mesh's group). ``--bf16`` then means
FSDP2's ``MixedPrecisionPolicy`` (bfloat16 forward and backward, float32 sharded parameters and gradient
reduction; no loss scaling). Each rank holds only its rows of every parameter, so there is no replica to
compare: the run fails (status 1) when a loss is not finite; the equivalence with one process is what
``tests/test_fsdp2.py`` checks, bitwise in float64.

Three ways to start it (the same code runs in each):

* under ``torchrun`` (one node: ``torchrun --nproc_per_node=4 -m optbook.distributed.demo``; several
  nodes: the same command on every node with ``--nnodes=2 --node_rank=<0 or 1> --rdzv_backend=c10d
  --rdzv_endpoint=<host of node 0>:29500``): it joins the group with
  :func:`optbook.distributed.init_from_env`, with NCCL on GPUs (rank ``r`` on CUDA device ``LOCAL_RANK``)
  and gloo on CPUs;
* ``python -m optbook.distributed.demo --nproc 2``: spawns 2 local gloo processes with
  :func:`optbook.distributed.launch`;
* ``python -m optbook.distributed.demo``: one process (a process group of size 1).

Options: ``--steps``, ``--batch`` (sequences per rank and step), ``--seq``, ``--d-model``, ``--layers``,
``--lr``, ``--weight-decay``, ``--fsdp2``, ``--muon-lr`` (with ``--fsdp2``), ``--clip`` (global gradient-norm clipping, 0 to disable), ``--bf16`` (bfloat16 parameters,
float32 masters, dynamic loss scaling), ``--backend`` (``auto``: NCCL when CUDA is available under
torchrun, else gloo), ``--seed``, ``--nproc``, ``--threads`` (CPU threads per rank).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

__all__ = ["main", "parse_args", "run", "spawned", "train", "train_fsdp2"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m optbook.distributed.demo",
                                description="ZeRO-1 (DistributedOptimizer + AdamW), or with --fsdp2 FSDP2 + Muon + "
                                            "AdamW, on a small transformer; start with torchrun "
                                            "--nproc_per_node=N, or use --nproc N")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step (default 8)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--fsdp2", action="store_true",
                   help="shard with FSDP2 (fully_shard) and train with FSDP2Muon + AdamW instead of ZeRO-1 AdamW")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon learning rate with --fsdp2 (default 0.02)")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm; 0 disables (default 1)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 parameters, float32 masters, loss scaling")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="under torchrun: auto = nccl with CUDA, else gloo; --nproc always uses gloo")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--nproc", type=int, default=1,
                   help="without torchrun: spawn this many local gloo processes (default 1: this process)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default 1)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "vocab", "d_model", "layers", "nproc", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("clip", "lr", "muon_lr", "weight_decay"):
        if not 0 <= getattr(args, name) < float("inf"):   # NaN fails this too
            p.error(f"--{name.replace('_', '-')} must be a finite number >= 0")
    if args.d_model % 4:
        p.error(f"--d-model must be a multiple of 4 (the demo model has 4 attention heads), got {args.d_model}")
    return args


def _batch(args, step: int, rank: int, device) -> torch.Tensor:
    """``(batch, seq + 1)`` token ids: start and stride random per sequence, then counting by the stride."""
    gen = torch.Generator().manual_seed(1_000_003 * args.seed + 7919 * step + rank)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
    return ((start + stride * torch.arange(args.seq + 1)) % args.vocab).to(device)


def train(rank: int, world_size: int, args: argparse.Namespace, device=None) -> dict:
    """Train on every rank of the default process group (already initialised); print from rank 0.

    Returns:
        ``{"losses": mean loss over the ranks per step (floats), "identical": whether every rank holds rank
        0's parameters bit for bit, "numel": parameters, "skipped": skipped steps, "state_bytes": this
        rank's optimizer-state bytes, "world_size": int, "backend": str}``.
    """
    from ..models import TinyTransformer
    from ..precision import DynamicLossScaler
    from .zero1 import DistributedOptimizer

    torch.set_num_threads(args.threads)
    device = torch.device("cpu") if device is None else device
    torch.manual_seed(args.seed)  # the same model on every rank (DistributedOptimizer also broadcasts it)
    model = TinyTransformer(args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=4,
                            max_seq_len=args.seq).to(device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model.to(dtype)
    opt = DistributedOptimizer(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                               max_grad_norm=args.clip or None,
                               loss_scaler=DynamicLossScaler(2.0**16) if args.bf16 else None)
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"ZeRO-1 demo: {world_size} rank(s), backend {dist.get_backend()}, device {device.type}, "
              f"{numel} parameters ({dtype}), AdamW lr {args.lr}, clip {args.clip or 'off'}, "
              f"{args.batch} x {args.seq} tokens per rank and step", flush=True)
    losses = []
    for step in range(args.steps):
        tokens = _batch(args, step, rank, device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab),
                                                 tokens[:, 1:].reshape(-1))
        opt.scale_loss(loss).backward()
        opt.step()
        applied = not opt.found_inf
        opt.zero_grad()
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if rank == 0:
            norm = "" if opt.last_grad_norm is None else f"  grad norm {opt.last_grad_norm:.4f}"
            extra = f"  loss scale {opt.loss_scale:g}" if args.bf16 else ""
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}{norm}{extra}"
                  f"{'' if applied else '  (skipped: inf/NaN)'}", flush=True)
    # every rank compares its parameters with rank 0's, bit for bit
    same = torch.ones(1, device=device)
    for p in model.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        if not torch.equal(ref.view(torch.uint8), p.detach().view(torch.uint8)):
            same.zero_()
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    identical = bool(same.item())
    state_bytes = opt.memory_bytes()["optimizer_state"] + opt.memory_bytes()["master_params"]
    if rank == 0:
        print(f"all {world_size} rank(s) hold identical parameters: {identical}; loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}; optimizer state on rank 0: {state_bytes} bytes "
              f"({state_bytes / numel:.2f} per parameter)", flush=True)
    return {"losses": losses, "identical": identical, "numel": numel, "skipped": opt.skipped_steps,
            "state_bytes": state_bytes, "world_size": world_size, "backend": dist.get_backend()}


def train_fsdp2(rank: int, world_size: int, args: argparse.Namespace, device=None) -> dict:
    """``--fsdp2``: FSDP2 (``fully_shard``) with FSDP2Muon + AdamW on every rank of the default group.

    Returns:
        ``{"losses", "identical": True when every loss was finite (no replica to compare), "numel",
        "skipped": 0, "state_bytes": this rank's optimizer-state bytes (its shards), "world_size", "backend",
        "muon_matrices": matrices Muon updates, "ns_calls": the ones this rank orthogonalised}``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..clipping import clip_grad_norm_
    from ..models import TinyTransformer
    from ..optim import AdamW, muon_param_groups
    from .fsdp2 import FSDP2Muon

    torch.set_num_threads(args.threads)
    device = torch.device("cpu") if device is None else device
    torch.manual_seed(args.seed)  # the same model on every rank before sharding: each keeps its rows
    model = TinyTransformer(args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=4,
                            max_seq_len=args.seq).to(device)
    numel = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(device.type, (world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16
              else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    routing = muon_param_groups(model, weight_decay=args.weight_decay, muon_options={"lr": args.muon_lr},
                                adamw_options={"lr": args.lr})
    muon = FSDP2Muon(routing.muon, momentum=0.95, nesterov=True)
    adamw = AdamW(routing.adamw, betas=(0.9, 0.95))
    params = [p for p in model.parameters()]
    group = mesh.get_group()
    n_muon = sum(len(g["params"]) for g in routing.muon)
    if rank == 0:
        print(f"FSDP2 demo: {world_size} rank(s), backend {dist.get_backend()}, device {device.type}, "
              f"{numel} parameters (float32 shards{', bfloat16 compute' if args.bf16 else ''}), "
              f"Muon lr {args.muon_lr} on {n_muon} matrices, AdamW lr {args.lr} on the rest, "
              f"clip {args.clip or 'off'}, {args.batch} x {args.seq} tokens per rank and step", flush=True)
    losses, finite = [], True
    for step in range(args.steps):
        tokens = _batch(args, step, rank, device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab),
                                                 tokens[:, 1:].reshape(-1))
        loss.backward()   # FSDP2 reduce-scatters the mean gradient: each rank holds its rows of it
        norm = clip_grad_norm_(params, args.clip, group=group) if args.clip else None
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        finite &= bool(torch.isfinite(mean).all())
        if rank == 0:
            extra = "" if norm is None else f"  grad norm {float(norm):.4f}"
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}{extra}", flush=True)
    state_bytes = sum(t.to_local().numel() * t.to_local().element_size() if hasattr(t, "to_local")
                      else t.numel() * t.element_size()
                      for opt in (muon, adamw) for s in opt.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; every loss finite: {finite}; Newton-Schulz on rank 0: "
              f"{muon.ns_calls} matrix steps ({muon.owners.count(0)} of {n_muon} matrices owned); optimizer state "
              f"on rank 0: {state_bytes} bytes ({state_bytes / numel:.2f} per parameter of the whole model)",
              flush=True)
    return {"losses": losses, "identical": finite, "numel": numel, "skipped": 0, "state_bytes": state_bytes,
            "world_size": world_size, "backend": dist.get_backend(), "muon_matrices": n_muon,
            "ns_calls": muon.ns_calls}


def spawned(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """The body of each process started by ``--nproc N`` (via :func:`optbook.distributed.launch`)."""
    return (train_fsdp2 if args.fsdp2 else train)(rank, world_size, args)


def run(argv=None) -> list[dict]:
    """Parse ``argv`` (default: the command line), start the ranks the module docstring describes, train.

    Returns:
        What :func:`train` returned: on every rank of this process under torchrun (one entry), for every
        rank with ``--nproc N`` (N entries, rank order), or for the single process.
    """
    from .launcher import free_port, init_from_env, launch

    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        backend = args.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank, world_size = init_from_env(backend, timeout=300.0)
        device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                  else torch.device("cpu"))
        try:
            return [(train_fsdp2 if args.fsdp2 else train)(rank, world_size, args, device)]
        finally:
            dist.destroy_process_group()
    if args.backend == "nccl":
        raise SystemExit("--backend nccl needs torchrun (one process per GPU); --nproc uses gloo")
    if args.nproc > 1:
        return launch(spawned, args.nproc, args, timeout=300.0)
    import datetime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300))
    try:
        return [(train_fsdp2 if args.fsdp2 else train)(0, 1, args)]
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """:func:`run`, then the exit status: 0 when every rank ended with rank 0's parameters, else 1."""
    return 0 if all(r["identical"] for r in run(argv)) else 1


if __name__ == "__main__":
    sys.exit(main())
