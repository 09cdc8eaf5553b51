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
    expert layer the gathered gate/up rows [2K, W], down rows [K, W], anchor output [T, W] and
    anchor activations [T, K]; once the full activations [T, H] and the step's gate/up [T, 2K]."""
    cfg = model.cfg
    e, t = cfg.expert, cfg.chunk_size
    buf = ActionCacheBuffers(cfg, K, dtype, torch.device("cpu"))
    tensors = (buf.w_gate_up, buf.w_down, buf.y_anchor, buf.h_anchor, buf.act, buf.gate_up)
    assert all(x.dtype == dtype for x in tensors)
    assert [tuple(x.shape) for x in tensors] == [(e.depth, 2 * K, e.width), (e.depth, K, e.width),
                                                 (e.depth, t, e.width), (e.depth, t, K), (t, e.mlp_dim), (t, 2 * K)]
    elements = e.depth * (2 * K * e.width + K * e.width + t * e.width + t * K) + t * e.mlp_dim + t * 2 * K
    assert buf.nbytes() == elements * (torch.finfo(dtype).bits // 8)


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
