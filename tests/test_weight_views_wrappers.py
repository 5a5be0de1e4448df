"""Conv kernels (``matrix_view="flatten"``, also ``channels_last``) and stacks (``matrix_view="stacked"``,
also with ``head_split``, also ``(L, E, M, N)``) inside every wrapper a Muon can meet, against one
single-process reference:
:class:`optbook.optim.Muon` with the same ``matrix_view`` on the mean gradient.

Each wrapper either gives bitwise the reference's weights (float32 and float64; under mixed precision the
float32 masters, and the bfloat16 model is each master rounded once) or refuses the view with an error that
names the argument and says what to use instead:

* single process (here): :class:`~optbook.optim.ChainedOptimizer`, :class:`~optbook.offload.OffloadOptimizer`
  (host copies, device copies, nothing offloaded), :class:`~optbook.precision.MixedPrecisionOptimizer`
  (bfloat16 model), ``state_dict`` save and load, and ``torch.distributed.checkpoint``'s
  ``get_optimizer_state_dict``/``set_optimizer_state_dict`` (a one-rank gloo group);
* on gloo (``weight_views_ranks.suite``, one launch of 4 processes, then one of 2): ``FSDP2Muon`` on conv
  kernels ``fully_shard``-ed on a 1-D mesh and on an HSDP 2-D mesh (real forward and backward passes
  included), on stacks sharded by experts, by rows and on both dimensions of a 2-D mesh, its ``state_dict``,
  DCP across mesh shapes and world sizes (saved on HSDP 2 x 2 at 4 ranks, resumed on a 1-D mesh of 4 and of
  2); ``LayerWiseMuon`` (each tensor owned whole by one rank: float32, float64, a bfloat16 model against
  ``MixedPrecisionOptimizer(Muon)``; ``state_dict``; ``sharded_state_dict`` saved at 4 ranks and resumed at
  2; an edited ``matrix_view`` followed) and ``DistributedChain`` with a LayerWiseMuon member;
  ``DistributedMuon`` (element shards) and ZeRO-1's ``DistributedOptimizer`` refuse the views.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from weight_views_ranks import FSDP2_CASES, HP, VIEWS, grads_of, suite, view_options, weights_of

from helpers import ParamsModel, scaled_timeout
from optbook.distributed import launch, lpt_assign
from optbook.offload import OffloadOptimizer
from optbook.optim import AdamW, ChainedOptimizer, Muon
from optbook.precision import MixedPrecisionOptimizer

DTYPES = [torch.float32, torch.float64]
STEPS = 3


def _dense(dtype):
    """A plain matrix beside the viewed tensor: the wrappers see two parameters (two host sub-groups, a
    device and a host copy)."""
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(20), dtype=dtype)


def _muon(params, view, dtype, **extra):
    """Muon over ``[viewed tensor, dense matrix]``: the viewed tensor in a group with its ``matrix_view``."""
    return Muon([{"params": params[:1], **view_options(view)}, {"params": params[1:], "lr": 0.03}],
                ns_dtype=dtype, **HP, **extra)


def _reference(view, dtype):
    """Single-process Muon on the viewed tensor and the dense matrix after :data:`STEPS` steps."""
    params = [weights_of(view, dtype).requires_grad_(), _dense(dtype).requires_grad_()]
    opt = _muon(params, view, dtype)
    for k in range(STEPS):
        _set_grads(params, view, k)
        opt.step()
    return [p.detach() for p in params]


def _set_grads(params, view, k, low=False):
    """Step ``k``'s gradients; ``low``: drawn in float32 and rounded to bfloat16 (a bfloat16 model's)."""
    for i, p in enumerate(params):
        g = grads_of(view, p.shape, torch.float32 if low else p.dtype, k, i)
        p.grad = g.to(torch.bfloat16) if low else g


def _wrapped(wrapper, params, view, dtype):
    if wrapper == "chain":
        bias = torch.nn.Parameter(torch.zeros(3, dtype=dtype))   # an AdamW member, never given a gradient
        return ChainedOptimizer([_muon(params, view, dtype), AdamW([bias], lr=0.01)])
    if wrapper.startswith("offload"):
        fraction = {"offload": 1.0, "offload-half": 0.5, "offload-none": 0.0}[wrapper]
        return OffloadOptimizer([{"params": params[:1], **view_options(view)},
                                 {"params": params[1:], "lr": 0.03}], Muon, offload_fraction=fraction,
                                sub_group_numel=1, ns_dtype=dtype, **HP)
    assert wrapper == "plain"
    return _muon(params, view, dtype)


WRAPPERS = ["plain", "chain", "offload", "offload-half", "offload-none"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_single_process_wrappers_step_views_bitwise_as_muon(wrapper, view, dtype):
    # "offload-none" (offload_fraction=0.0, float32/float64 parameters: nothing offloaded, no copy) raised
    # AttributeError: 'OffloadOptimizer' object has no attribute '_copies' at construction
    ref = _reference(view, dtype)
    params = [weights_of(view, dtype).requires_grad_(), _dense(dtype).requires_grad_()]
    fmt = torch.channels_last if view.endswith("channels_last") else torch.contiguous_format
    opt = _wrapped(wrapper, params, view, dtype)
    for k in range(STEPS):
        _set_grads(params, view, k)
        opt.step()
    assert params[0].is_contiguous(memory_format=fmt)       # stepped in place: the layout is kept
    for p, r in zip(params, ref):
        assert torch.equal(p.detach(), r), (wrapper, view)
    assert not torch.equal(params[0].detach(), weights_of(view, dtype))   # it moved


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("wrapper", ["mixed", "mixed-chain", "offload", "offload-none"])
def test_bfloat16_models_views_step_float32_copies_bitwise_as_float32_muon(wrapper, view):
    """A bfloat16 model: the float32 copies (MixedPrecisionOptimizer's masters, OffloadOptimizer's host or
    device copies) are bitwise float32 Muon on the bfloat16 weights and gradients cast to float32, and the
    model is each copy rounded to bfloat16."""
    bf16, f32 = torch.bfloat16, torch.float32
    start = [weights_of(view, f32).to(bf16), _dense(f32).to(bf16)]
    ref_params = [t.to(f32).requires_grad_() for t in start]
    ref = _muon(ref_params, view, f32)
    params = [t.clone(memory_format=torch.preserve_format).requires_grad_() for t in start]
    if wrapper == "mixed":
        opt = MixedPrecisionOptimizer(_muon(params, view, f32))
    elif wrapper == "mixed-chain":
        opt = MixedPrecisionOptimizer(ChainedOptimizer([_muon(params, view, f32),
                                                        AdamW([torch.zeros(3, requires_grad=True)])]))
    else:
        opt = OffloadOptimizer([{"params": params[:1], **view_options(view)},
                                {"params": params[1:], "lr": 0.03}], Muon,
                               offload_fraction=1.0 if wrapper == "offload" else 0.0, ns_dtype=f32, **HP)
    for k in range(STEPS):
        _set_grads(params, view, k, low=True)
        for p, r in zip(params, ref_params):
            r.grad = p.grad.to(f32)
        ref.step()
        opt.step()
    for p, r in zip(params, ref_params):
        assert torch.equal(opt.copy_of(p).detach(), r.detach()), (wrapper, view)
        assert torch.equal(p.detach(), r.detach().to(bf16)), (wrapper, view)


def _round_trip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_saved_state_dict_resumes_views_bitwise(wrapper, view, dtype):
    """Two steps, ``state_dict`` through ``torch.save``/``torch.load``, a fresh wrapper on the weights
    loads it, one more step: the uninterrupted reference's weights."""
    ref = _reference(view, dtype)
    params = [weights_of(view, dtype).requires_grad_(), _dense(dtype).requires_grad_()]
    opt = _wrapped(wrapper, params, view, dtype)
    for k in range(STEPS - 1):
        _set_grads(params, view, k)
        opt.step()
    saved = _round_trip(opt.state_dict())
    resumed = [p.detach().clone(memory_format=torch.preserve_format).requires_grad_() for p in params]
    fresh = _wrapped(wrapper, resumed, view, dtype)
    fresh.load_state_dict(saved)
    _set_grads(resumed, view, STEPS - 1)
    fresh.step()
    for p, r in zip(resumed, ref):
        assert torch.equal(p.detach(), r), (wrapper, view)




@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("wrapper", ["plain", "chain", "offload-half", "mixed"])
def test_dcp_get_and_set_optimizer_state_dict_resume_views_bitwise(dcp, wrapper, view):
    """``get_optimizer_state_dict`` before the last step, a fresh wrapper on fresh weights,
    ``set_optimizer_state_dict``, the last step: the uninterrupted run's weights, which are the reference's
    (float64; ``"mixed"``: a bfloat16 model, whose float32 masters are float32 Muon's)."""
    low = wrapper == "mixed"
    dtype = torch.float32 if low else torch.float64
    start = [weights_of(view, dtype), _dense(dtype)]
    if low:
        start = [t.to(torch.bfloat16) for t in start]
        ref = [t.to(dtype).requires_grad_() for t in start]
        ref_opt = _muon(ref, view, dtype)
    else:
        ref = _reference(view, dtype)

    def build(ps):
        opt = MixedPrecisionOptimizer(_muon(ps, view, dtype)) if low else _wrapped(wrapper, ps, view, dtype)
        return opt, ParamsModel([p for g in opt.param_groups for p in g["params"]])   # the chain's AdamW bias too

    outs = []
    for resume in (False, True):
        params = [torch.nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in start]
        opt, model = build(params)
        for k in range(STEPS):
            if resume and k == STEPS - 1:
                saved = copy.deepcopy(dcp.get_optimizer_state_dict(model, opt))
                params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format))
                          for p in params]
                opt, model = build(params)
                dcp.set_optimizer_state_dict(model, opt, saved)
            _set_grads(params, view, k, low=low)
            for p in model.parameters():   # the chain's AdamW bias: a state for DCP to save (strict)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if low and not resume:
                for p, r in zip(params, ref):
                    r.grad = p.grad.to(dtype)
                ref_opt.step()
            opt.step()
        outs.append([p.detach() for p in params])
    for a, b, r in zip(*outs, ref):
        assert torch.equal(a, b), (wrapper, view)
        assert torch.equal(b, r.detach().to(b.dtype)), (wrapper, view)


# ------------------------------------------------------------ on gloo: FSDP2Muon and the distributed Muons

@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dcp_views"))
    # 4 first: it writes the checkpoints the 2-rank launch resumes from
    return {d: launch(suite, d, ckpt_dir=ckpt, timeout=scaled_timeout(300.0)) for d in (4, 2)}


def _rows(reports, case, sizes=(4, 2)):
    for d in sizes:
        for rank, rep in enumerate(reports[d]):
            row = rep[case]
            assert "error" not in row, f"{case} at {d} ranks, rank {rank}:\n{row.get('error')}"
            yield d, rank, row


@pytest.mark.parametrize("case", FSDP2_CASES)
def test_fsdp2muon_mesh_steps_kernels_and_stacks_bitwise_as_muon(reports, case):
    for d, rank, row in _rows(reports, case):
        assert row["layout"], (case, d, rank)       # each rank's elements are the reference's before a step
        assert row["params"], (case, d, rank)       # ... and after every step
        assert row["state"], (case, d, rank)        # momentum (a DTensor placed as its parameter)
        assert row["moved"], (case, d, rank)
        assert row["units"] == UNITS[case.rsplit("/", 1)[0]], (case, d, rank)


#: The matrices FSDP2Muon steps (its ``units``): a Linear ``(8, 6)``; one per conv kernel, ``(out,
#: in*kh*kw)``; ``E`` per stack, ``(M, N)`` each.
_CONVS = [[8, 36], [3, 72], [5, 3]]
_STACKS = [[4, 6]] * 3 + [[8, 4]] * 3 + [[4, 6]] * 4
UNITS = {**{f"conv/{lay}": [[8, 6]] + _CONVS for lay in ("1d", "hsdp", "2d", "cl")}, "conv/backward": _CONVS,
         **{f"stack/{lay}": [[8, 6]] + _STACKS for lay in ("1d", "hsdp", "rows", "2d")}}


def test_fsdp2muon_mesh_views_placements_are_the_parallel_apis(reports):
    """fully_shard on the 2 x 2 HSDP mesh gives (Replicate(), Shard(dim=0)); the stacks are cut by
    experts, by rows and on both dimensions of a 2-D mesh."""
    rows = {case: next(_rows(reports, case, (4,)))[2] for case in FSDP2_CASES}
    assert set(rows["conv/hsdp/float64"]["placements"][:2]) == {"(Replicate(), Shard(dim=0))"}
    assert rows["stack/2d/float64"]["placements"][-1] == "(Shard(dim=0), Shard(dim=1))"
    assert rows["stack/rows/float64"]["placements"][-3:] == ["(Shard(dim=1),)"] * 2 + ["(Shard(dim=2),)"]


def test_fsdp2muon_state_dict_of_views_resumes_bitwise(reports):
    for d, rank, row in _rows(reports, "state_dict"):
        assert row["equal"] and row["momentum"], (d, rank)


def test_fsdp2muon_mesh_dcp_of_views_resumes_across_mesh_shapes_and_world_sizes(reports):
    """Saved after 2 steps on HSDP 2 x 2 (4 ranks); resumed on a 1-D mesh of 4 and on a 1-D mesh of 2:
    weights and momentum bitwise the uninterrupted single-process Muon's after the last step."""
    for case, sizes in (("dcp/save", (4,)), ("dcp/load", (4, 2))):
        for d, rank, row in _rows(reports, case, sizes):
            assert row["equal"] and row["momentum"], (case, d, rank)


def test_fsdp2muon_follows_an_edited_head_split_and_refuses_an_edited_matrix_view(reports):
    """Muon reads a group's ``head_split`` and ``matrix_view`` at every step. FSDP2Muon follows an edited
    ``head_split`` bitwise (and ``"flatten"`` set on a 2-D weight's group: the same matrix); its owners
    and all-to-all plan cut each tensor into the matrices of its view at construction, so an edited
    ``matrix_view`` is refused at the step, naming the argument and the parameter, with nothing written.
    (It stepped the old view's matrices: a silently different result.)"""
    for d, rank, row in _rows(reports, "edit"):
        assert row["head_split"], (d, rank)
        message, untouched = row["matrix_view"]
        assert message.startswith("Invalid matrix_view: parameter 1 (param_groups[1]['params'][0], shape "
                                  "(3, 4, 6)) was planned as matrix_view='stacked'"), (d, rank, message)
        assert "now says 'flatten'" in message and "build a new FSDP2Muon" in message, message
        assert untouched, (d, rank)
        message, view = row["load"]   # a state dict of another view: refused at the load, nothing loaded
        assert message.startswith("ValueError: Invalid state_dict: param_groups[1]: Invalid matrix_view"), \
            message
        assert view == "stacked", (d, rank)


def test_fsdp2_refuses_a_channels_last_kernel_itself(reports):
    """``fully_shard`` of a ``channels_last`` Conv2d raises in torch itself (nothing for the optimizer to
    step); a ``channels_last`` kernel laid out with ``distribute_tensor`` is stepped bitwise (above)."""
    for _, _, row in _rows(reports, "refusals", (2,)):
        assert row["fully_shard_channels_last"].startswith("NotImplementedError")
        assert "non-contiguous" in row["fully_shard_channels_last"]


#: LayerWiseMuon's ``costs`` of ``weight_views_ranks.OWNED``: ns_cost ``max(m, n) * min(m, n)**2`` of each
#: matrix the view steps, times their number: a Linear (8, 6); kernels as (out, in*kh*kw): (8, 36), (3, 72),
#: (5, 3); stacks: 3 x (4, 6), 3 x 2 heads (4, 4) (head_split=2 of (8, 4)), 2 * 2 x (4, 6).
OWNED_COSTS = [8 * 6**2, 36 * 8**2, 72 * 3**2, 5 * 3**2, 3 * 6 * 4**2, 3 * 2 * 4 * 4**2, 4 * 6 * 4**2]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_layerwise_muon_owns_kernels_and_stacks_whole_and_steps_them_bitwise_as_muon(reports, dtype):
    """Each tensor owned by one rank (LPT on the cost of its view's matrices), stepped bitwise as
    single-process Muon on the mean gradient after every step: weights on every rank, the owner's momentum
    and (bfloat16 model) float32 master, which is ``MixedPrecisionOptimizer(Muon)``'s; through a
    ``state_dict`` into a fresh LayerWiseMuon and a ``matrix_view`` edited before the last step. (On main
    before this, LayerWiseMuon refused both views at construction.)"""
    for d, rank, row in _rows(reports, f"layerwise/{dtype}"):
        assert row["costs"] == OWNED_COSTS, (d, rank, row["costs"])
        assert row["owners"] == lpt_assign(OWNED_COSTS, d), (d, rank, row["owners"])
        assert row["equal"] and row["moved"], (d, rank)
        assert row["channels_last"], (d, rank)    # the channels_last kernel keeps its layout


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_layerwise_muon_sharded_checkpoint_of_views_resumes_at_another_world_size(reports, dtype):
    """Every rank's ``sharded_state_dict`` saved at 4 ranks, the list loaded at 2 (other owners): the
    remaining steps bitwise the uninterrupted single-process Muon's."""
    for d, rank, row in _rows(reports, f"layerwise/{dtype}/resharded", (2,)):
        assert row["equal"], (d, rank)


def test_distributed_chain_with_a_layerwise_muon_member_steps_views_bitwise(reports):
    for d, rank, row in _rows(reports, "chain"):
        assert row["equal"] and row["bias_moved"], (d, rank)


@pytest.mark.parametrize("view", ["flatten", "stacked"])
def test_distributed_muon_refuses_the_views_naming_matrix_view_and_the_ways_out(reports, view):
    """DistributedMuon's element shards ignore the boundaries of the matrices in a tensor: it refuses the
    views at construction and names the optimizers that step them."""
    for _, _, row in _rows(reports, "refusals", (2,)):
        message = row[f"DistributedMuon/{view}"]
        assert message.startswith("ValueError: Invalid matrix_view: DistributedMuon steps 2-D matrices "
                                  "only"), message
        assert f"got {view!r}" in message and "optbook.optim.Muon" in message, message
        assert "optbook.distributed.LayerWiseMuon" in message and "FSDP2Muon" in message, message


def test_zero1_refuses_muon_as_its_optimizer_class(reports):
    for _, _, row in _rows(reports, "refusals", (2,)):
        message = row["DistributedOptimizer"]
        assert message.startswith("ValueError: Invalid optimizer_class:"), message
        assert "element-wise" in message, message


def test_mixed_precision_refuses_fsdp2muon(reports):
    for _, _, row in _rows(reports, "refusals", (2,)):
        message = row["MixedPrecisionOptimizer"]
        assert message.startswith("TypeError: Invalid optimizer: FSDP2Muon"), message
        assert "MixedPrecisionPolicy" in message, message
