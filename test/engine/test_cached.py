"""The cached engine against the rMuscle formulas written out plainly (pi05-tiny, random weights).

The pipeline tests (test/nodes) take their expected chunks from a ``CachedEngine`` run in the
test process, so they can only show that the processes reproduce that engine; whether the engine
computes the Context Cache and Action Cache rules correctly is established here, independently:
each rule is written directly in torch from the model's weights (un-blocked gate/up/down, no
gather buffers, no kernels, no ``ActionCache``/``ContextCache`` code) and plugged into the model's
own prefill/denoise loops in place of the FFN. Attention, norms and the Euler loop are shared with
the dense engine, which test/engine/test_dense.py and the LeRobot parity oracle check on their own.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from vla_runtime.cache.entry import PreparedEntry, reconstruct_entry
from vla_runtime.cache.masks import profile_masks
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.dense import DenseEngine, ModelInputs
from vla_runtime.models.config import preset
from vla_runtime.models.gemma import GemmaMLP
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.testing.observations import random_inputs

U32 = 2.0 ** -24   # float32 unit roundoff


def plain_weights(mlp: GemmaMLP) -> tuple[Tensor, Tensor, Tensor]:
    """(gate [H, W], up [H, W], down [H, W]) un-blocked from the fused layout (see GemmaMLP)."""
    blocks, two_b, w = mlp.gate_up.shape
    b = two_b // 2
    gate = mlp.gate_up[:, :b].reshape(blocks * b, w)
    up = mlp.gate_up[:, b:].reshape(blocks * b, w)
    return gate, up, mlp.down_t


def plain_act(mlp: GemmaMLP, x: Tensor) -> Tensor:
    """h = gelu_tanh(x gate^T) * (x up^T), [rows, H]."""
    gate, up, _ = plain_weights(mlp)
    x2 = x.reshape(-1, x.shape[-1])
    return F.gelu(x2 @ gate.t(), approximate="tanh") * (x2 @ up.t())


class PlainContext:
    """rMuscle Eq. 2-3: per VLM layer, the ceil(rho_p * Pv) visual tokens whose FFN input drifted
    most from the reference's (RMS(x - ref) / RMS(x)) and every non-visual token are recomputed;
    the other visual tokens take the reference's FFN output."""

    def __init__(self, entry: PreparedEntry, rho_p: float):
        self.entry, self.rho_p = entry, rho_p

    def __call__(self, layer: int, mlp: GemmaMLP, x: Tensor) -> Tensor:
        pv = self.entry.visual_tokens
        cur, ref = x[0, :pv], self.entry.ffn_in[layer]
        drift = (cur - ref).pow(2).mean(-1).sqrt() / cur.pow(2).mean(-1).sqrt().clamp_min(1e-6)
        k = math.ceil(self.rho_p * pv)
        recompute = torch.zeros(pv, dtype=torch.bool)
        recompute[drift.argsort(descending=True)[:k]] = True
        dense = (plain_act(mlp, x) @ mlp.down_t).view_as(x)
        out = dense.clone()
        out[0, :pv] = torch.where(recompute[:, None], dense[0, :pv], self.entry.ffn_out[layer])
        return out


class PlainAction:
    """rMuscle Eq. 4: the group's first step runs densely and keeps y_a and h_a; a later step of
    the group outputs y_a + (h_t[M] - h_a[M]) @ W_down[M], M the group's mask of *that* layer."""

    def __init__(self, masks: Tensor, groups: tuple[tuple[int, int], ...]):
        self.masks, self.groups = masks, groups
        self.anchor: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer: int, step: int, mlp: GemmaMLP, x: Tensor, ws) -> Tensor:
        g = next(i for i, (a, b) in enumerate(self.groups) if a <= step < b)
        m = self.masks[g, layer]
        h = plain_act(mlp, x)
        if step == self.groups[g][0]:
            y = h @ mlp.down_t
            self.anchor[layer] = (y, h[:, m])
            return y.view_as(x)
        y_a, h_a = self.anchor[layer]
        return (y_a + (h[:, m] - h_a) @ mlp.down_t[m]).view_as(x)


@torch.no_grad()
def plain_cached(model: Pi05Model, x: ModelInputs, noise: Tensor, entry: PreparedEntry, cache: CacheConfig) -> Tensor:
    model.setup_caches(1)
    image_tokens, _ = model.embed_images(x.images)
    prefix = model.build_prefix(image_tokens, x.image_mask, x.tokens, x.token_mask)
    model.prefill(prefix, ffn=PlainContext(entry, cache.rho_p) if cache.context_cache else None)
    groups = cache.validate(model.cfg.num_steps).groups
    return model.denoise(prefix, noise, ffn=PlainAction(entry.masks, groups) if cache.action_cache else None)


def _scene(model: Pi05Model, groups) -> tuple[ModelInputs, Tensor, PreparedEntry]:
    """A current call (the reference's images jittered), its noise, and the reference's entry
    with masks profiled over ``groups`` on another noise draw."""
    cfg = model.cfg
    ref = random_inputs(cfg, 1)
    cur = random_inputs(cfg, 2, base=ref.images, jitter=0.3)
    noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(3))
    model.setup_caches(1)
    entry = reconstruct_entry(model, ("ep", 0), ref.images[0], ref.image_mask[0], ref.tokens[0], ref.token_mask[0],
                              None)
    with torch.no_grad():
        image_tokens, _ = model.embed_images(ref.images)
        prefix = model.build_prefix(image_tokens, ref.image_mask, ref.tokens, ref.token_mask)
        model.prefill(prefix)
        ref_noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(0))
        entry.masks = profile_masks(model, prefix, ref_noise, groups, 0.5)
    return cur, noise, entry


@pytest.fixture(scope="module")
def setup():
    # std 0.1 instead of init_random_'s 0.02: with larger weights the FFNs carry a larger share of
    # the residual stream, so what the caches skip moves the actions well above float rounding
    # (with 0.02 a wrong mask moves them by ~1e-5 relative only).
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=7, std=0.1)
    cur, noise, entry = _scene(model, CacheConfig().validate(model.cfg.num_steps).groups)
    return model, cur, noise, entry


def _tolerance(model: Pi05Model, dense: Tensor) -> float:
    """Absolute tolerance between two float32 evaluations of the same formula in another order.

    Both sides compute the same real numbers; they differ only in float32 summation order
    (GemmaMLP sums neurons block by block, the cache sums gathered rows, the plain side sums all
    H neurons in one matmul) and in which fused op rounds an intermediate. A sum of n terms
    evaluated in two orders differs by at most 2 * gamma_n * sum|terms|, gamma_n ~ n * u
    (Higham, Accuracy and Stability, 3.1); with random-sign terms the typical error is
    sqrt(n) * u * sum|terms|. The longest sum is the VLM MLP's H = 256 neurons, so per FFN
    output a relative error of about sqrt(256) * u = 16 u. That error enters the residual stream
    at each of (VLM depth - 1) + 10 steps * expert depth FFN calls and reaches the actions
    through the Euler sum; at these weights every layer's Jacobian has norm O(1), so errors add
    rather than multiply: 16 u * (2 + 30) ~ 512 u relative to the action scale. A factor 4 over
    that estimate for the attention softmax and norms (each an O(width) sum of the same kind)
    gives the tolerance: ~2048 u * max|action| (about 1.2e-4 * max|action|).
    """
    calls = (model.cfg.vlm.depth - 1) + model.cfg.num_steps * model.cfg.expert.depth
    per_ffn = math.sqrt(max(model.cfg.vlm.mlp_dim, model.cfg.expert.mlp_dim)) * U32
    return 4 * per_ffn * calls * float(dense.abs().max())


@pytest.mark.parametrize("halves", [(True, False), (False, True), (True, True)], ids=["context", "action", "both"])
def test_cached_engine_follows_the_plain_formulas(setup, halves):
    model, cur, noise, entry = setup
    cache = CacheConfig(rho_p=0.4, rho_n=0.5, context_cache=halves[0], action_cache=halves[1])
    dense = DenseEngine(model).infer(cur, noise=noise).actions
    got = CachedEngine(model, cache).infer(cur, noise=noise, select=lambda f, i: entry).actions
    want = plain_cached(model, cur, noise, entry, cache)
    tol = _tolerance(model, dense)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    # The check has teeth: the caches move the answer by far more than the tolerance, so a wrong
    # token choice, a wrong layer's mask or dropped neurons would show.
    assert float((want - dense).abs().max()) > 20 * tol


def test_per_layer_masks_differ_in_the_profiled_entry(setup):
    """The engine check above exercises distinct masks per layer and group (else a layer reading
    another layer's mask would go unseen)."""
    _, _, _, entry = setup
    m = entry.masks
    assert m.shape[1] >= 2
    for g in range(m.shape[0]):
        assert not torch.equal(m[g, 0], m[g, 1])
    assert not torch.equal(m[0, 0], m[1, 0])


def test_a_model_of_another_step_count_gets_two_groups_over_its_steps_by_default():
    """``CacheConfig()`` leaves the groups to the model: on a 6-step model the engine anchors at
    steps 0 and 3 and follows the plain formulas there, where a fixed pi0.5 tiling (0-5, 5-10)
    would be refused for not tiling six steps."""
    model = init_random_(Pi05Model(replace(preset("pi05-tiny"), num_steps=6)), seed=7, std=0.1)
    engine = CachedEngine(model, CacheConfig(rho_p=0.4, rho_n=0.5))
    assert engine.cache.groups == ((0, 3), (3, 6))
    cur, noise, entry = _scene(model, ((0, 3), (3, 6)))
    got = engine.infer(cur, noise=noise, select=lambda f, i: entry).actions
    want = plain_cached(model, cur, noise, entry, CacheConfig(rho_p=0.4, rho_n=0.5, groups=((0, 3), (3, 6))))
    dense = DenseEngine(model).infer(cur, noise=noise).actions
    torch.testing.assert_close(got, want, atol=_tolerance(model, dense), rtol=0)
