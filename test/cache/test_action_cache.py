"""Action Cache (``vla_runtime.cache.action_cache``): its buffers, the mask shapes it accepts, the
group a step belongs to, and which weights a non-anchor step reads. Eq. 4 over every layer and
two groups is in test/cache/test_dual_cache.py; these tests pin what the mutation run
(docs/mutation.md) found unchecked.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from vla_runtime.cache.action_cache import ActionCache, ActionCacheBuffers
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_

K = 8


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    m = init_random_(Pi05Model(preset("pi05-tiny")), seed=11)
    m.setup_caches(1)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buffers_have_the_runtime_dtype_and_the_bytes_they_report(model, dtype):
    """``nbytes`` feeds the memory report (``cache-bench``'s ``action_cache_buffers_bytes``): per
    expert layer the anchor output [T, W] and anchor activations [T, K]; once the full activations
    [T, H] and the step's gate/up [T, 2K]; then, per (group, layer) gathered so far, its gate/up
    rows [2K, W] and down rows [K, W] (allocated at the first gather, in the runtime dtype)."""
    cfg = model.cfg
    e, t = cfg.expert, cfg.chunk_size
    buf = ActionCacheBuffers(cfg, K, dtype, torch.device("cpu"))
    tensors = (buf.y_anchor, buf.h_anchor, buf.act, buf.gate_up)
    assert all(x.dtype == dtype for x in tensors)
    assert [tuple(x.shape) for x in tensors] == [(e.depth, t, e.width), (e.depth, t, K), (t, e.mlp_dim), (t, 2 * K)]
    fixed = e.depth * (t * e.width + t * K) + t * e.mlp_dim + t * 2 * K
    size = torch.finfo(dtype).bits // 8
    assert buf.nbytes() == fixed * size
    mlp = copy.deepcopy(model.expert_layers[0].mlp).to(dtype)
    up, down = buf.gathered_weights(1, 0, mlp, torch.arange(K))
    assert up.dtype == down.dtype == dtype and tuple(up.shape) == (2 * K, e.width) and tuple(down.shape) == (K, e.width)
    assert buf.nbytes() == (fixed + 3 * K * e.width) * size


@pytest.mark.parametrize("shape", [(3, 2, K), (2, 2, K + 1), (2, K), (2, 2, K, 1)])
def test_masks_of_the_wrong_shape_are_refused_naming_both_shapes(model, shape):
    buf = ActionCacheBuffers(model.cfg, K, torch.float32, torch.device("cpu"))
    want = re.escape(f"masks must be [2, depth, {K}], got {shape}")
    with pytest.raises(ValueError, match=want):
        ActionCache(buf, torch.zeros(shape, dtype=torch.int64), ((0, 5), (5, 10)), 10)


def _eq4(mlp, x_anchor, x_t, m):
    """y_a + (h_t[M] - h_a[M]) @ W_down[M], from the full dense MLP."""
    cfg_h = mlp.down_t.shape[0]
    act_a, act_t = torch.empty(x_t.shape[1], cfg_h), torch.empty(x_t.shape[1], cfg_h)
    y_a = mlp(x_anchor, act_out=act_a)[0].clone()
    mlp(x_t, act_out=act_t)
    return y_a + (act_t[:, m] - act_a[:, m]) @ mlp.down_t[m]


def test_three_groups_each_step_uses_its_own_groups_mask(model):
    """Groups (0, 3), (3, 6), (6, 10): step 7 belongs to the third group, so the anchor at step 6
    and step 7 both use mask 2 (a step-to-group table built from the group ends alone would put
    step 7 in group 1). float32 on both sides, summation order apart: 1e-5 as in
    test_dual_cache.py; the masks differ enough to move the output by > 1e-3."""
    cfg = model.cfg
    h = cfg.expert.mlp_dim
    g = torch.Generator().manual_seed(2)
    masks = torch.stack([torch.stack([torch.randperm(h, generator=g)[:K].sort().values
                                      for _ in range(cfg.expert.depth)]) for _ in range(3)])
    groups = ((0, 3), (3, 6), (6, 10))
    ac = ActionCache(ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu")), masks, groups, 10)
    mlp, ws = model.expert_layers[0].mlp, model.workspace.narrow(1)
    x_a = torch.randn(1, cfg.chunk_size, cfg.expert.width, generator=g)
    x_t = x_a + 0.3 * torch.randn(x_a.shape, generator=g)
    with torch.no_grad():
        ac(0, 6, mlp, x_a, ws)
        got = ac(0, 7, mlp, x_t, ws)[0].clone()
        want = _eq4(mlp, x_a, x_t, masks[2, 0])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert float((_eq4(mlp, x_a, x_t, masks[1, 0]) - want).abs().max()) > 1e-3


def test_a_non_anchor_step_reads_the_weights_gathered_at_its_anchor(model):
    """Without the CUDA kernel the anchor gathers M's gate/up/down rows into compact buffers once
    per group and later steps read those, not the layer's full weights: a later step given a copy
    of the MLP whose weights were zeroed still follows Eq. 4 with the anchor's weights (a step
    that gathered again would read zeros). Tolerance as above."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(4)
    masks = torch.stack([torch.stack([torch.randperm(cfg.expert.mlp_dim, generator=g)[:K].sort().values
                                      for _ in range(cfg.expert.depth)]) for _ in range(2)])
    ac = ActionCache(ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu")), masks, ((0, 5), (5, 10)), 10)
    assert not ac.in_place                                   # CPU tensors: the torch fallback
    mlp, ws = model.expert_layers[1].mlp, model.workspace.narrow(1)
    zeroed = copy.deepcopy(mlp)
    with torch.no_grad():
        for p in zeroed.parameters():       # gate_up and down_t among them
            p.zero_()
        x_a = torch.randn(1, cfg.chunk_size, cfg.expert.width, generator=g)
        x_t = x_a + 0.3 * torch.randn(x_a.shape, generator=g)
        ac(1, 5, mlp, x_a, ws)
        got = ac(1, 8, zeroed, x_t, ws)[0].clone()
        torch.testing.assert_close(got, _eq4(mlp, x_a, x_t, masks[1, 1]), atol=1e-5, rtol=1e-5)


def test_a_batch_of_two_is_refused_saying_why(model):
    cfg = model.cfg
    masks = torch.zeros(2, cfg.expert.depth, K, dtype=torch.int64)
    ac = ActionCache(ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu")), masks, ((0, 5), (5, 10)), 10)
    with pytest.raises(ValueError, match=r"the Action Cache serves one observation at a time \(batch 1\)"):
        ac(0, 1, model.expert_layers[0].mlp, torch.zeros(2, cfg.chunk_size, cfg.expert.width), model.workspace)


def _masks(cfg, seed: int, groups: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(cfg.expert.mlp_dim, generator=g)[:K]
                                     for _ in range(cfg.expert.depth)]) for _ in range(groups)])


def _denoise_mlps(model, buf, masks, x_a, x_t):
    """Every layer's anchor (step 0 and 5) then one later step per group (3 and 8): the outputs."""
    ac = ActionCache(buf, masks, ((0, 5), (5, 10)), 10)
    ws, out = model.workspace.narrow(1), []
    with torch.no_grad():
        for anchor, later in ((0, 3), (5, 8)):
            for layer, block in enumerate(model.expert_layers):
                ac(layer, anchor, block.mlp, x_a, ws)
                out.append(ac(layer, later, block.mlp, x_t, ws)[0].clone())
    return torch.stack(out)


def test_a_call_whose_masks_repeat_reuses_the_weights_gathered_before_and_gets_the_same_actions(model):
    """Calls with masks A, A, B, A, A on one set of buffers: each gathers only the (group, layer)s
    whose neuron set changed since that (group, layer)'s last gather (2 groups x depth at the first
    A, none at the repeat, all again at B and back at A; one layer's mask changed: one gather), and
    every call's outputs are bit-identical to fresh buffers' (a reuse reading rows of another mask,
    another group's or a stale layer's, would differ by far more than rounding: the masks share few
    neurons)."""
    cfg = model.cfg
    depth = cfg.expert.depth
    a, b = _masks(cfg, 1), _masks(cfg, 2)
    a_one_layer = a.clone()
    a_one_layer[1, depth - 1] = b[1, depth - 1]
    g = torch.Generator().manual_seed(3)
    x_a = torch.randn(1, cfg.chunk_size, cfg.expert.width, generator=g)
    x_t = x_a + 0.3 * torch.randn(x_a.shape, generator=g)
    buf = ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu"))
    gathers = []
    for masks in (a, a, b, a, a_one_layer):
        before = buf.gathers
        got = _denoise_mlps(model, buf, masks.clone(), x_a, x_t)
        gathers.append(buf.gathers - before)
        fresh = _denoise_mlps(model, ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu")), masks, x_a, x_t)
        assert torch.equal(got, fresh)
    assert gathers == [2 * depth, 0, 2 * depth, 2 * depth, 1]
    assert float((_denoise_mlps(model, ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu")), b, x_a, x_t)
                  - got).abs().max()) > 1e-3


def test_weights_changed_in_place_or_another_model_are_gathered_again(model):
    """The buffers remember the weights they copied, not only the neurons: the same masks over a
    model whose weights were changed in place since, or over another model's MLPs, gather again
    and follow those weights (a reuse would keep the old rows: the outputs would not change)."""
    cfg = model.cfg
    masks = _masks(cfg, 5)
    g = torch.Generator().manual_seed(6)
    x_a = torch.randn(1, cfg.chunk_size, cfg.expert.width, generator=g)
    x_t = x_a + 0.3 * torch.randn(x_a.shape, generator=g)
    other = copy.deepcopy(model)
    buf = ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu"))
    first = _denoise_mlps(other, buf, masks, x_a, x_t)
    with torch.no_grad():
        for block in other.expert_layers:
            block.mlp.down_t.mul_(2.0)
    before = buf.gathers
    doubled = _denoise_mlps(other, buf, masks, x_a, x_t)
    assert buf.gathers - before == 2 * cfg.expert.depth
    assert torch.equal(doubled, _denoise_mlps(other, ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu")),
                                              masks, x_a, x_t))
    before = buf.gathers
    back = _denoise_mlps(model, buf, masks, x_a, x_t)
    assert buf.gathers - before == 2 * cfg.expert.depth
    assert torch.equal(back, first)


def test_a_later_step_is_the_masked_ffn_kernel_over_the_anchors_gathered_rows_bit_for_bit(model):
    """The step reads views made once (``StepScratch``, the per-layer anchor rows, the transposed
    gate/up rows) instead of indexing per step: the same operations as ``kernels.masked_ffn``
    given the anchor's folded output and M's rows, so the result is identical to the bit, in
    every layer and both groups (an off-by-one view, the up half taken for the gate or another
    layer's anchor row, would differ by far more than rounding)."""
    from vla_runtime import kernels
    from vla_runtime.kernels.fallback import gather_masked_weights

    cfg = model.cfg
    masks = _masks(cfg, 7)
    g = torch.Generator().manual_seed(8)
    x_a = torch.randn(1, cfg.chunk_size, cfg.expert.width, generator=g)
    x_t = x_a + 0.3 * torch.randn(x_a.shape, generator=g)
    buf = ActionCacheBuffers(cfg, K, torch.float32, torch.device("cpu"))
    ac = ActionCache(buf, masks, ((0, 5), (5, 10)), 10)
    ws = model.workspace.narrow(1)
    with torch.no_grad():
        for group, (anchor, later) in enumerate(((0, 3), (5, 8))):
            for layer, block in enumerate(model.expert_layers):
                ac(layer, anchor, block.mlp, x_a, ws)
            for layer, block in enumerate(model.expert_layers):
                got = ac(layer, later, block.mlp, x_t, ws)[0].clone()
                want = kernels.masked_ffn(x_t[0], block.mlp.gate_up, block.mlp.down_t, masks[group, layer],
                                          y_anchor=buf.y_anchor[layer].clone(),
                                          gathered=gather_masked_weights(block.mlp.gate_up, block.mlp.down_t,
                                                                         masks[group, layer]))
                assert torch.equal(got, want), (group, layer)
