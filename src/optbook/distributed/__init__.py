"""Several processes, one training run. Explained in chapters 12, 13 and 14.

:func:`launch` runs a function on several local processes joined by a ``torch.distributed`` process group
(the notebooks' stand-in for ``torchrun``); :func:`init_from_env` joins the group of a script started by
``torchrun``. :class:`DistributedOptimizer` is ZeRO-1 (chapter 13): each rank keeps the optimizer state of
one shard of a flat parameter buffer. The functions the chapters run on every rank live in
:mod:`optbook.distributed.workers`: spawned processes import them by name, so they cannot be defined in a
notebook cell. Chapter 14: :class:`LayerWiseMuon` (whole matrices per rank, LPT bin packing of
:mod:`~optbook.distributed.assignment`; :mod:`~optbook.distributed.layerwise_muon`), :class:`DistributedMuon` (Moonlight's ZeRO-1 shards with a
gather of each full matrix; :mod:`~optbook.distributed.distributed_muon`), :class:`DistributedChain` (one
global gradient norm with a ZeRO-1 AdamW; :mod:`~optbook.distributed.chain`) and
:func:`tensor_parallel_newton_schulz` (Newton–Schulz on tensor-parallel shards). :class:`FSDP2Muon`: Muon on
parameters sharded by PyTorch's FSDP2 (``fully_shard``) on 1-D and 2-D device meshes (HSDP, TP x FSDP,
expert-parallel stacks), each matrix through an owner rank in one all-to-all each way
(:mod:`~optbook.distributed.fsdp2`; the plan: :class:`MeshExchange` of
:mod:`~optbook.distributed.mesh_exchange`).
Each wrapper's step is made of public phases named as Megatron-LM's (``prepare_grads``, ``clip_grads``,
``step_with_ready_grads``, ``publish_weights``), which :class:`DistributedChain` composes; what they agree on
across ranks goes through one module, ``optbook.distributed._comm``.
``python -m optbook.distributed.demo`` (:mod:`optbook.distributed.demo`) trains a small
transformer with :class:`DistributedOptimizer` under ``torchrun`` (NCCL or gloo), or on local gloo
processes.
"""

from .chain import DistributedChain
from .distributed_muon import DistributedMuon, zero1_comm_bytes
from .fsdp2 import FSDP2Muon
from .launcher import init_from_env, launch
from .mesh_exchange import MeshExchange, local_element_indices
from .layerwise_muon import LayerWiseMuon, lpt_assign, ns_cost, rank_loads, round_robin_assign
from .tp_newton_schulz import TP_MODES, tensor_parallel_newton_schulz
from .zero1 import DistributedOptimizer, shard_layout

__all__ = ["TP_MODES", "DistributedChain", "DistributedMuon", "DistributedOptimizer", "FSDP2Muon",
           "LayerWiseMuon", "MeshExchange", "init_from_env", "launch", "local_element_indices", "lpt_assign",
           "ns_cost", "rank_loads", "round_robin_assign", "shard_layout", "tensor_parallel_newton_schulz",
           "zero1_comm_bytes"]
