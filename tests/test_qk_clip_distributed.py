"""QK-clip (MuonClip) in a data-parallel stack, on gloo: the per-head maxima reduced once per step (one packed
MAX all-reduce) over ranks x micro-batches x activation recompute, the clip applied to ZeRO-1's flat float32
masters and to FSDP2's sharded rows, bitwise the single-process MuonClip (model + optimizer +
``optbook.qk_clip_`` per step). Rank programs: tests/qk_clip_ranks.py.

The failure modes: torchtitan pull request #4243 (one packed MAX all-reduce of every layer's and head's
maxima per optimizer step, over gradient accumulation and activation recompute); NVIDIA/Megatron-LM pull
request #7382 (qk_clip crashed on hybrid stacks -- layers without attention -- and under the distributed
optimizer, whose fp32 master is a flat shard).
"""

from __future__ import annotations

import pytest
import torch

from helpers import scaled_timeout
from optbook.distributed import launch
from optbook.models import attention_modules

#: Elements of the packed all-reduce: an error slot, then the 4 + 2 + 8 heads of the hybrid model.
PACKED = 1 + 4 + 2 + 8


def test_qk_clip_collectives_per_step_one_packed_max_and_zero1_masters_bitwise_single_process():
    """2 ranks, 2 micro-batches each, recompute, ZeRO-1 (AdamW, float32) on a model whose attention layers
    have 4, 2 and 8 heads and one layer none. Per step the forwards and backwards issue no collective and
    qk_clip_ exactly one MAX all-reduce of 15 float64 values, then one gather of the one bucket (2
    broadcasts on gloo) for all the clipped weights; the weights stay bitwise the single-process run's.
    Before: the maxima were stacked (layers of different head counts raised), and ZeRO-1 gathered its
    bucket again for every clipped weight."""
    from qk_clip_ranks import zero1_stack

    for r in launch(zero1_stack, 2, timeout=scaled_timeout(240.0)):
        assert r["buckets"] == 1
        assert all(c > 0 for c in r["clipped"]), r["clipped"]
        assert r["fwd_bwd_calls"] == [[]] * 3
        assert r["clip_max"] == [[PACKED]] * 3
        assert r["clip_calls"] == [["all_reduce", "broadcast", "broadcast"]] * 3
        assert r["reports"] == [True] * 3 and r["equal"] == [True] * 3, r


@pytest.mark.parametrize("sizes", [(3, 2, 1), (4, 2, 0)], ids=["uneven", "empty-rank"])
def test_qk_clip_on_bfloat16_zero1_masters_with_an_uneven_batch_is_bitwise_mixed_precision_muonclip(sizes):
    """3 ranks holding 3, 2 and 1 sequences (two, two and one micro-batches) -- or 4, 2 and none: rank 2
    runs no forward and joins the MAX with nothing recorded --, recompute, bfloat16 weights: ZeRO-1's float32
    master shards and the weights equal MixedPrecisionOptimizer(AdamW)'s bitwise after every step and clip
    (gradients: the reference's, see zero1_stack)."""
    from qk_clip_ranks import zero1_stack

    reports = launch(zero1_stack, 3, dtype=torch.bfloat16, sizes=sizes, grads="reference",
                     timeout=scaled_timeout(240.0))
    for r in reports:
        assert all(c > 0 for c in r["clipped"]) and r["clip_max"] == [[PACKED]] * 3, r
        assert r["reports"] == [True] * 3 and r["equal"] == [True] * 3, r


@pytest.mark.parametrize("world_size", [2, 3])
def test_qk_clip_collectives_per_step_on_fsdp2_shards_is_bitwise_single_process_muonclip(world_size):
    """FSDP2 (fully_shard, recompute inside each sharded block), FSDP2Muon + AdamW, each rank's own
    micro-batches (uneven at 3 ranks): one MAX all-reduce per step over the forwards, backwards and
    qk_clip_ (the clip itself communicates nothing else: each rank scales its own rows), and the clipped
    local rows give whole weights bitwise the single-process Muon + AdamW + qk_clip_ run's."""
    from qk_clip_ranks import fsdp2_stack

    for r in launch(fsdp2_stack, world_size, timeout=scaled_timeout(300.0)):
        assert all(c > 0 for c in r["clipped"]), r["clipped"]
        assert r["max_per_step"] == [[PACKED]] * 3 and r["clip_calls"] == [["all_reduce"]] * 3
        assert r["reports"] == [True] * 3 and r["equal"] == [True] * 3, r


def test_unusable_maxima_on_one_rank_raise_on_every_rank_and_a_rank_without_data_joins_the_max():
    """A NaN on one rank (gloo's MAX can drop it), an inf, a wrong length on one rank, a rank with no
    forward, no forward anywhere: every rank ends alike, and nothing is written where it raises. Before: the
    NaN was dropped and both ranks clipped, and a rank with nothing recorded raised alone while the other
    waited in the all-reduce."""
    from qk_clip_ranks import refusals

    r0, r1 = launch(refusals, 2, timeout=scaled_timeout(120.0))
    for case in ("nan", "inf"):
        for r in (r0, r1):
            kind, message, unchanged, _ = r[case]
            assert kind == "ValueError" and "non-finite" in message and unchanged, (case, r[case])
    assert r1["short"][:2] == ("ValueError", "Attention layer 0: 3 recorded maxima for 4 heads")
    assert r0["short"][0] == "ValueError" and "rank 1 of the process group" in r0["short"][1]
    assert r0["short"][2] and r1["short"][2]
    # rank 1 recorded nothing: rank 0's maxima are the group's, both clip alike
    assert r0["no_forward_on_one_rank"][:3] == r1["no_forward_on_one_rank"][:3] == (None, None, False)
    assert r0["no_forward_on_one_rank"][3] == r1["no_forward_on_one_rank"][3] > 0
    for r in (r0, r1):
        kind, message, unchanged, _ = r["no_forward"]
        assert kind == "RuntimeError" and "on any rank" in message and unchanged
    for r in (r0, r1):   # ZeRO-1 refuses bad scalings before any write or collective
        assert r["zero1"]["foreign"][0].startswith("Invalid param: a tensor of shape (16, 16)")
        assert r["zero1"]["twice"][0].startswith("Invalid pairs: parameter ")
        assert r["zero1"]["shape"][0].startswith("Invalid factor: shape (17, 1) does not broadcast")
        assert all(unchanged and calls == 0 for _, unchanged, calls in r["zero1"].values()), r["zero1"]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recompute_records_the_same_max_logits_bitwise(use_reentrant):
    """torch.utils.checkpoint runs each block's forward again in the backward; the running maximum of the
    same logits twice is the same maximum, bitwise, and the gradients are those of the plain run."""
    from qk_clip_ranks import hybrid_model, loss_of, micro_batches, recomputed, shares

    plain, ckpt = hybrid_model(), recomputed(hybrid_model(), use_reentrant=use_reentrant)
    calls = {"plain": 0, "ckpt": 0}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        for attn in attention_modules(model):
            attn.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    for tokens in micro_batches(0, 0, shares(1, (4,))):
        loss_of(plain, tokens).backward()
        loss_of(ckpt, tokens).backward()
    assert calls == {"plain": 2 * 3, "ckpt": 2 * 2 * 3}   # 2 micro-batches, 3 attention layers, recomputed
    for a, b in zip(attention_modules(plain), attention_modules(ckpt), strict=True):
        assert a.max_logits.dtype == torch.float64 and torch.equal(a.max_logits, b.max_logits)
    pairs = zip(plain.parameters(), ckpt.parameters(), strict=True)
    assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
