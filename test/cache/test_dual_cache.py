"""Context Cache and Action Cache against the dense engine (tiny preset, random weights)."""

from __future__ import annotations

import math

import pytest
import torch

from vla_runtime.cache.action_cache import ActionCache, ActionCacheBuffers
from vla_runtime.cache.entry import PreparedEntry, reconstruct_entry
from vla_runtime.cache.masks import ContributionRecorder, group_masks, profile_masks, validate_groups
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.dense import DenseEngine, ModelInputs
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.testing.observations import random_inputs


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    return init_random_(Pi05Model(preset("pi05-tiny")), seed=7)


def _entry(model: Pi05Model, x: ModelInputs, rho_n: float, seed: int = 0) -> PreparedEntry:
    cfg = model.cfg
    model.setup_caches(1)
    entry = reconstruct_entry(model, ("ep", 0), x.images[0], x.image_mask[0], x.tokens[0], x.token_mask[0], None)
    image_tokens, _ = model.embed_images(x.images)
    prefix = model.build_prefix(image_tokens, x.image_mask, x.tokens, x.token_mask)
    with torch.no_grad():
        model.prefill(prefix)
        noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(seed))
        entry.masks = profile_masks(model, prefix, noise, CacheConfig().validate(cfg.num_steps).groups, rho_n)
    return entry


def _run(engine, x, noise, entry=None):
    return engine.infer(x, noise=noise, select=None if entry is None else (lambda f, i: entry))


@pytest.fixture(scope="module")
def scene(model):
    cfg = model.cfg
    ref = random_inputs(cfg, 1)
    cur = random_inputs(cfg, 2, base=ref.images, jitter=0.3)
    noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(3))
    return ref, cur, noise


def test_full_ratios_reproduce_dense(model, scene):
    ref, cur, noise = scene
    entry = _entry(model, ref, rho_n=1.0)
    dense = DenseEngine(model).infer(cur, noise=noise).actions
    cached = CachedEngine(model, CacheConfig(rho_p=1.0, rho_n=1.0))
    out = _run(cached, cur, noise, entry)
    assert out.reference is entry
    torch.testing.assert_close(out.actions, dense, atol=1e-4, rtol=1e-4)
    assert cached.last_context.recomputed == [entry.visual_tokens] * (model.cfg.vlm.depth - 1)


def test_partial_ratios_change_the_answer_beyond_rounding(model, scene):
    ref, cur, noise = scene
    entry = _entry(model, ref, rho_n=0.5)
    dense = DenseEngine(model).infer(cur, noise=noise).actions
    cached = CachedEngine(model, CacheConfig(rho_p=0.4, rho_n=0.5))
    out = _run(cached, cur, noise, entry).actions
    # The value itself is checked against the plain formulas in test/engine/test_cached.py; here
    # only that the partial ratios change it by more than float rounding: the floor is the same
    # cached code path at full ratios (every token and neuron recomputed), which differs from the
    # dense engine by summation order alone.
    full_engine = CachedEngine(model, CacheConfig(rho_p=1.0, rho_n=1.0))
    full = _run(full_engine, cur, noise, _entry(model, ref, rho_n=1.0)).actions
    rounding = float((full - dense).norm() / dense.norm())
    rel = float((out - dense).norm() / dense.norm())
    assert rel > 10 * rounding, (rel, rounding)
    pv = entry.visual_tokens
    assert cached.last_context.recomputed == [math.ceil(0.4 * pv)] * (model.cfg.vlm.depth - 1)


def test_reusing_its_own_states_is_exact_for_the_context_cache(model, scene):
    """Against a reference recorded from the very same observation, reused rows are the true rows."""
    ref, _, noise = scene
    entry = _entry(model, ref, rho_n=0.5)
    dense = DenseEngine(model).infer(ref, noise=noise).actions
    cached = CachedEngine(model, CacheConfig(rho_p=0.2, action_cache=False))
    torch.testing.assert_close(_run(cached, ref, noise, entry).actions, dense, atol=1e-5, rtol=1e-5)


def test_no_reference_or_other_camera_layout_runs_dense(model, scene):
    ref, cur, noise = scene
    entry = _entry(model, ref, rho_n=0.5)
    dense = DenseEngine(model).infer(cur, noise=noise).actions
    cached = CachedEngine(model, CacheConfig(action_cache=False))
    assert torch.equal(_run(cached, cur, noise, None).actions, dense)
    entry.image_mask = torch.tensor([True, False])
    assert torch.equal(_run(cached, cur, noise, entry).actions, dense)
    assert cached.last_context is None


def test_anchor_update_is_exact_with_all_neurons_and_follows_eq4_otherwise(model):
    """Every expert layer, two groups, a different mask per layer and per group: each layer's
    non-anchor step is y_a + (h_t[M] - h_a[M]) @ W_down[M] with M that layer's own mask.

    Tolerance: both sides are float32 and differ only in summation order (gathered rows vs
    the blocked MLP, then the same K-term down product): |y| ~ 1e-2 at these weights and a sum of
    at most H = 128 terms reorders to within H * u * sum|terms| < 128 * 6e-8 * 0.1 ~ 1e-6; 1e-5
    leaves a margin. A wrong layer's or group's mask moves the output by ~|y| (checked below)."""
    cfg = model.cfg
    depth, h = cfg.expert.depth, cfg.expert.mlp_dim
    g = torch.Generator().manual_seed(0)
    x_anchor = [torch.randn(1, cfg.chunk_size, cfg.expert.width, generator=g) for _ in range(depth)]
    x_t = [x + 0.3 * torch.randn(x.shape, generator=g) for x in x_anchor]
    model.setup_caches(1)
    ws = model.workspace.narrow(1)
    groups = ((0, 5), (5, 10))

    def run(k, masks, step):
        """Anchor of step's group, then ``step`` itself, over every layer in order."""
        buf = ActionCacheBuffers(cfg, k, torch.float32, torch.device("cpu"))
        ac = ActionCache(buf, masks, groups, cfg.num_steps)
        anchor = max(a for a, _ in groups if a <= step)
        with torch.no_grad():
            for layer in range(depth):
                ac(layer, anchor, model.expert_layers[layer].mlp, x_anchor[layer], ws)
            return [ac(layer, step, model.expert_layers[layer].mlp, x_t[layer], ws)[0].clone()
                    for layer in range(depth)]

    def eq4(layer, m):
        mlp = model.expert_layers[layer].mlp
        act_a, act_t = torch.empty(cfg.chunk_size, h), torch.empty(cfg.chunk_size, h)
        y_a = mlp(x_anchor[layer], act_out=act_a)[0].clone()
        mlp(x_t[layer], act_out=act_t)
        return y_a + (act_t[:, m] - act_a[:, m]) @ mlp.down_t[m]

    with torch.no_grad():
        all_neurons = torch.arange(h).expand(2, depth, h).contiguous()
        for layer, got in enumerate(run(h, all_neurons, 1)):
            torch.testing.assert_close(got, model.expert_layers[layer].mlp(x_t[layer])[0], atol=1e-5, rtol=1e-5)
        masks = torch.stack([torch.stack([torch.randperm(h, generator=g)[: h // 4].sort().values
                                          for _ in range(depth)]) for _ in groups])
        assert all(not torch.equal(masks[0, 0], masks[gi, li]) for gi in range(2) for li in range(depth)
                   if (gi, li) != (0, 0))
        for step, group in ((1, 0), (7, 1)):
            got = run(h // 4, masks, step)
            for layer in range(depth):
                want = eq4(layer, masks[group, layer])
                torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=1e-5)
                if layer > 0:   # the check can tell layer 0's mask from this layer's own
                    assert float((eq4(layer, masks[group, 0]) - want).abs().max()) > 1e-3


def test_group_masks_unite_per_step_top_k_then_rerank():
    # 2 steps, 1 layer, 6 neurons, K = 2 (rho 1/3).
    scores = torch.tensor([[[9., 8., 0., 0., 7., 0.]], [[0., 0., 5., 9., 7.5, 0.]]])
    masks = group_masks(scores, ((0, 2),), rho_n=2 / 6)
    # per-step top-2: {0,1} and {3,4}; union {0,1,3,4}; sums 9, 8, 9, 14.5 -> top-2 = {4, 0 or 3}
    got = set(masks[0, 0].tolist())
    assert 4 in got and got <= {0, 3, 4} and len(got) == 2
    assert masks.shape == (1, 1, 2)
    with pytest.raises(ValueError, match="tile"):
        validate_groups(((0, 4), (5, 10)), 10)


def test_contribution_scores_follow_eq1(model):
    cfg = model.cfg
    model.setup_caches(1)
    rec = ContributionRecorder(model)
    x = torch.randn(1, cfg.chunk_size, cfg.expert.width)
    ws = model.workspace.narrow(1)
    mlp = model.expert_layers[1].mlp
    with torch.no_grad():
        rec(1, 3, mlp, x, ws)
        act = torch.empty(cfg.chunk_size, cfg.expert.mlp_dim)
        mlp(x, act_out=act)
    expected = act.abs().sum(0) * mlp.down_t.norm(dim=1)
    torch.testing.assert_close(rec.scores[3, 1], expected)
    assert rec.scores[0].abs().sum() == 0
