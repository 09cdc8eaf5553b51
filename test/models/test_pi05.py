"""The optimised pi0.5 forward against a deliberately naive restatement of the model.

The reference below recomputes everything every step: padded prefix (padding and absent cameras
included, masked), both Gemma stacks run jointly over prefix + action tokens with a full 2-D
attention mask, every layer complete, unfused weights. Agreement shows that the KV cache, the
dropped padding, the skipped last VLM layer, the fused projections and the tabulated time
modulation are exact rewrites, not approximations.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, euler_times, init_random_


def _rms(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, base=10000.0):  # x [B, T, H, D]
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[..., None] * inv  # [B, T, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None], torch.cat([ang.sin(), ang.sin()], -1)[:, :, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _split_qkv(layer_attn, c):
    w = layer_attn.qkv_weight
    return w[: c.q_dim], w[c.q_dim: c.q_dim + c.kv_dim], w[c.q_dim + c.kv_dim:]


def _mlp(mlp, x):
    b, w = mlp.block, x.shape[-1]
    gate, up = mlp.gate_up[:, :b].reshape(-1, w), mlp.gate_up[:, b:].reshape(-1, w)
    return F.linear(F.gelu(F.linear(x, gate), approximate="tanh") * F.linear(x, up), mlp.down_t.t())


def reference_sample(m: Pi05Model, images, image_mask, tokens, token_mask, noise):
    cfg = m.cfg
    b, n = images.shape[:2]
    p = cfg.num_image_tokens
    feats, _ = m.vision(images.flatten(0, 1))
    img = m.projector(feats).reshape(b, n * p, -1)
    lang = m.embed_tokens(tokens) * math.sqrt(cfg.vlm.width)
    prefix0 = torch.cat([img, lang], 1)
    pmask = torch.cat([image_mask.repeat_interleave(p, 1), token_mask], 1)
    lp, t_len = prefix0.shape[1], cfg.chunk_size
    pos = torch.cat([pmask.long().cumsum(1) - 1, pmask.long().sum(1, keepdim=True) + torch.arange(t_len)], 1)
    allowed = torch.zeros(b, lp + t_len, lp + t_len, dtype=torch.bool)
    allowed[:, :lp, :lp] = pmask[:, None, :]          # prefix: bidirectional over valid prefix keys
    allowed[:, lp:, :lp] = pmask[:, None, :]          # actions see the valid prefix ...
    allowed[:, lp:, lp:] = True                       # ... and each other
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]
    c, e = cfg.vlm, cfg.expert
    x_t, dt = noise.clone(), -1.0 / cfg.num_steps
    for k, t in enumerate(euler_times(cfg.num_steps)):
        assert abs(t - (1.0 + k * dt)) < 1e-6
        frac = torch.linspace(0, 1, e.width // 2, dtype=torch.float64)
        period = cfg.min_period * (cfg.max_period / cfg.min_period) ** frac
        ang = (2 * math.pi / period) * t
        temb = torch.cat([ang.sin(), ang.cos()]).float()[None]
        cond = F.silu(m.time_mlp_out(F.silu(m.time_mlp_in(temb))))
        xp, xs = prefix0, m.action_in_proj(x_t)
        for vl, el in zip(m.vlm_layers, m.expert_layers):
            s1, sh1, g1 = el.input_mod(cond)[:, None].chunk(3, -1)
            hp = _rms(xp) * (1 + vl.input_norm.weight)
            hs = _rms(xs) * (1 + s1) + sh1
            qs, ks, vs = [], [], []
            for h, attn in ((hp, vl.attn), (hs, el.attn)):
                wq, wk, wv = _split_qkv(attn, c)
                qs.append(F.linear(h, wq)); ks.append(F.linear(h, wk)); vs.append(F.linear(h, wv))
            q = _rope(torch.cat(qs, 1).view(b, lp + t_len, c.num_heads, c.head_dim), pos).transpose(1, 2)
            k_ = _rope(torch.cat(ks, 1).view(b, lp + t_len, 1, c.head_dim), pos).transpose(1, 2)
            v_ = torch.cat(vs, 1).view(b, lp + t_len, 1, c.head_dim).transpose(1, 2)
            scores = (q @ k_.transpose(-1, -2)) / math.sqrt(c.head_dim) + bias
            ctx = (scores.softmax(-1) @ v_).transpose(1, 2).reshape(b, lp + t_len, -1)
            xp = xp + F.linear(ctx[:, :lp], vl.attn.o_weight)
            xs = xs + F.linear(ctx[:, lp:], el.attn.o_weight) * g1
            s2, sh2, g2 = el.post_attn_mod(cond)[:, None].chunk(3, -1)
            xp = xp + _mlp(vl.mlp, _rms(xp) * (1 + vl.post_attn_norm.weight))
            xs = xs + _mlp(el.mlp, _rms(xs) * (1 + s2) + sh2) * g2
        sf, shf, _ = m.expert_final_mod(cond)[:, None].chunk(3, -1)
        v = m.action_out_proj(_rms(xs) * (1 + sf) + shf)
        x_t = x_t + dt * v
    return x_t


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("pi05-tiny")
    model = init_random_(Pi05Model(cfg), seed=3)
    model.setup_caches(2)
    return model


def _inputs(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(batch, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_token_len), generator=g)
    mask = torch.zeros(batch, cfg.max_token_len, dtype=torch.bool)
    for i in range(batch):
        mask[i, : 5 + 4 * i] = True
    noise = torch.randn(batch, cfg.chunk_size, cfg.action_dim, generator=g)
    return images, torch.ones(batch, cfg.num_cameras, dtype=torch.bool), tokens, mask, noise


@torch.no_grad()
def test_matches_naive_reference_with_ragged_prompts(tiny):
    images, image_mask, tokens, token_mask, noise = _inputs(tiny.cfg)
    ours = tiny.sample_actions(images, image_mask, tokens, token_mask, noise)
    ref = reference_sample(tiny, images, image_mask, tokens, token_mask, noise)
    assert ours.shape == (2, tiny.cfg.chunk_size, tiny.cfg.action_dim)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert ours.abs().mean() > 0.1  # not a degenerate all-zero answer


@torch.no_grad()
def test_absent_camera_is_skipped_exactly(tiny):
    images, image_mask, tokens, token_mask, noise = _inputs(tiny.cfg, batch=1)
    image_mask[:, 1] = False
    ours = tiny.sample_actions(images, image_mask, tokens, token_mask, noise)
    ref = reference_sample(tiny, images, image_mask, tokens, token_mask, noise)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    # The masked camera's pixels must not matter at all.
    images2 = images.clone()
    images2[:, 1] = -1.0
    torch.testing.assert_close(tiny.sample_actions(images2, image_mask, tokens, token_mask, noise), ours)


@torch.no_grad()
def test_padding_tokens_do_not_matter(tiny):
    images, image_mask, tokens, token_mask, noise = _inputs(tiny.cfg, batch=1)
    a = tiny.sample_actions(images, image_mask, tokens, token_mask, noise)
    tokens2 = tokens.clone()
    tokens2[~token_mask] = 7
    torch.testing.assert_close(tiny.sample_actions(images, image_mask, tokens2, token_mask, noise), a)


@torch.no_grad()
def test_deterministic_for_fixed_noise_and_sensitive_to_it(tiny):
    images, image_mask, tokens, token_mask, noise = _inputs(tiny.cfg)
    a = tiny.sample_actions(images, image_mask, tokens, token_mask, noise)
    b = tiny.sample_actions(images, image_mask, tokens, token_mask, noise)
    assert torch.equal(a, b)
    c = tiny.sample_actions(images, image_mask, tokens, token_mask, noise + 0.5)
    assert (a - c).abs().max() > 1e-3


@torch.no_grad()
def test_batch_rows_are_independent(tiny):
    images, image_mask, tokens, token_mask, noise = _inputs(tiny.cfg)
    both = tiny.sample_actions(images, image_mask, tokens, token_mask, noise)
    second = tiny.sample_actions(images[1:], image_mask[1:], tokens[1:], token_mask[1:], noise[1:])
    torch.testing.assert_close(both[1:], second, atol=1e-5, rtol=1e-5)


def test_capacity_errors(tiny):
    images, image_mask, tokens, token_mask, noise = _inputs(tiny.cfg, batch=3)
    with pytest.raises(ValueError, match="exceeds the allocated capacity"):
        with torch.no_grad():
            tiny.sample_actions(images, image_mask, tokens, token_mask, noise)
    fresh = init_random_(Pi05Model(tiny.cfg))
    with pytest.raises(RuntimeError, match="setup_caches"):
        with torch.no_grad():
            fresh.sample_actions(*_inputs(tiny.cfg, batch=1))


@torch.no_grad()
def test_denoise_loop_allocates_no_activation_memory(tiny):
    """A denoising step writes into the static workspace: memory allocated during the whole loop
    stays far below what a single step's activations would need."""
    images, image_mask, tokens, token_mask, noise = _inputs(tiny.cfg, batch=2)
    image_tokens, _ = tiny.embed_images(images)
    prefix = tiny.build_prefix(image_tokens, image_mask, tokens, token_mask)
    tiny.prefill(prefix)
    tiny.denoise(prefix, noise)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        tiny.denoise(prefix, noise)
    allocated = sum(max(k.self_cpu_memory_usage, 0) for k in prof.key_averages())
    one_step = tiny.workspace.nbytes()
    assert 0 < allocated < one_step / 4, (allocated, one_step)
    # The same measure does see the prefill's activations (it is not blind).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        tiny.prefill(prefix)
    assert sum(max(k.self_cpu_memory_usage, 0) for k in prof.key_averages()) > 10 * one_step


@torch.no_grad()
def test_tapped_retrieval_features_are_row_major(tiny):
    """The tower's tapped state (the cache's retrieval query) comes out [B, N, patches, width] in
    row-major order, as it is stored and as selection reads it: a query in the patch embedding's
    transposed layout cost every selection a strided copy."""
    images = _inputs(tiny.cfg, batch=1)[0]
    seen = []
    _, tapped = tiny.embed_images(images, tiny.cfg.retrieval_layer, on_tap=seen.append)
    assert tapped.is_contiguous() and seen[0].is_contiguous()
    assert torch.equal(seen[0], tapped)
