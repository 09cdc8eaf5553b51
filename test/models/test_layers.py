"""Building blocks (``vla_runtime.models.layers``) against plain formulas written out here, in
float64 where the block computes in float32, on both of their paths (allocating, and into a
preallocated ``out`` buffer). The model-level checks are in test/models/test_pi05.py.

Tolerances: a float32 block against its float64 formula differs by float32 rounding of a few
sums of at most 64 terms of magnitude ~1: relative ~64 * 6e-8 ~ 4e-6, so rtol/atol 1e-5. A
bfloat16 result is rounded once to 8 mantissa bits at the end: relative 2^-8 ~ 4e-3, so 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch

from vla_runtime.models.layers import KVCache, RMSNorm, Rope, attend, gelu_tanh_, linear, rms_norm, sincos_time_embedding

F32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=1e-2, atol=1e-2)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_x_w_transposed_plus_bias_with_and_without_out(bias):
    g = gen()
    x, w = torch.randn(2, 3, 5, generator=g), torch.randn(4, 5, generator=g)
    b = torch.randn(4, generator=g) if bias else None
    want = torch.einsum("bti,oi->bto", x.double(), w.double()) + (b.double() if bias else 0.0)
    torch.testing.assert_close(linear(x, w, b).double(), want, **F32)
    out = torch.full((2, 3, 4), float("nan"))
    assert linear(x, w, b, out=out) is out
    torch.testing.assert_close(out.double(), want, **F32)


def plain_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * scale.double()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, F32), (torch.bfloat16, BF16)])
def test_rms_norm_is_the_gemma_formula_on_both_paths(dtype, tol):
    """eps 0.5 is large on purpose: adding it anywhere but inside the root shows."""
    g = gen(1)
    x = (torch.randn(2, 3, 8, generator=g) * torch.tensor([[0.1], [1.0], [4.0]])).to(dtype)   # [B, T, W]
    scale = 1.0 + torch.randn(8, generator=g)
    want = plain_rms_norm(x, scale, 0.5)
    got = rms_norm(x, scale, 0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **tol)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, scale, 0.5, out=out) is out
    torch.testing.assert_close(out.double(), want, **tol)


def test_rms_norm_module_folds_one_plus_weight_and_saves_only_the_weight():
    """Before any ``refresh`` the scale is 1 (``1 + w`` of the zero weight); after it, 1 + w.
    The folded scale is derived, never saved: a state dict holds the public weight alone, so it
    loads back into a checkpoint layout that has no ``scale``. ``out`` is filled in place."""
    norm = RMSNorm(6, eps=1e-6)
    x = torch.randn(2, 6, generator=gen(2))
    torch.testing.assert_close(norm(x).double(), plain_rms_norm(x, torch.ones(6), 1e-6), **F32)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 6))
    norm.refresh()
    torch.testing.assert_close(norm.scale, 1.0 + torch.linspace(-0.5, 0.5, 6))
    torch.testing.assert_close(norm(x).double(), plain_rms_norm(x, norm.scale, 1e-6), **F32)
    out = torch.full_like(x, float("nan"))
    assert norm(x, out=out) is out
    torch.testing.assert_close(out.double(), plain_rms_norm(x, norm.scale, 1e-6), **F32)
    assert list(norm.state_dict()) == ["weight"] and norm.eps == 1e-6


def test_gelu_tanh_is_the_tanh_approximation_in_place():
    x = torch.linspace(-4, 4, 33)
    xd = x.double()
    want = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    y = gelu_tanh_(x)
    assert y.data_ptr() == x.data_ptr()
    torch.testing.assert_close(y.double(), want, **F32)


def plain_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE, float64: pair (i, i + D/2) rotated by position * base^(-2i/D)."""
    d = x.shape[-1]
    half = d // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = positions.double()[..., None, None] * inv                   # [B, T, 1, D/2]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, F32), (torch.bfloat16, BF16)])
def test_rope_rotates_each_half_pair_by_its_frequency(dtype, tol):
    positions = torch.tensor([[0, 1, 5, 40], [3, 3, 100, 7]])
    x = torch.randn(2, 4, 3, 8, generator=gen(3)).to(dtype)
    rope = Rope.at(positions, 8, 10_000.0, dtype)
    assert rope.cos.shape == (2, 4, 1, 4) and rope.cos.dtype == dtype and rope.sin.dtype == dtype
    want = plain_rope(x, positions, 10_000.0)
    torch.testing.assert_close(rope.apply(x).double(), want, **tol)
    out = torch.full_like(x, float("nan"))
    assert rope.apply(x, out=out) is out
    torch.testing.assert_close(out.double(), want, **tol)


def test_kv_cache_is_zeroed_of_the_given_shape_and_dtype_and_not_saved():
    c = KVCache(2, 1, 9, 4, torch.bfloat16)
    assert c.k.shape == c.v.shape == (2, 1, 9, 4) and c.max_len == 9
    assert c.k.dtype == c.v.dtype == torch.bfloat16 and not c.k.any() and not c.v.any()
    assert c.state_dict() == {}


def plain_attention(q, k, v, scale, bias):
    """Every query head h attends with KV head h // (H / H_kv), float64 softmax."""
    b, t, h, d = q.shape
    g = h // k.shape[1]
    out = torch.empty(b, t, h, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi].double() @ k[bi, hi // g].double().T * scale
            if bias is not None:
                s = s + bias[bi, 0, 0].double()
            out[bi, :, hi] = torch.softmax(s, -1) @ v[bi, hi // g].double()
    return out.reshape(b, t, h * d)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("path", ["fused", "scores", "scores+out"])
@pytest.mark.parametrize("masked", [False, True])
def test_attend_is_grouped_query_softmax_attention(kv_heads, path, masked):
    """Four query heads over one or two KV heads, over the first 5 of 7 cache rows (rows past
    ``length`` hold large values that must not be read), with and without a key mask."""
    b, t, h, d, length = 2, 3, 4, 8, 5
    g = gen(4)
    cache = KVCache(b, kv_heads, 7, d, torch.float32)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.k[:, :, length:] = 1e4
    cache.v[:, :, length:] = 1e4
    q = torch.randn(b, t, h, d, generator=g)
    bias = None
    if masked:
        bias = torch.zeros(b, 1, 1, length)
        bias[0, ..., 1] = -math.inf
        bias[1, ..., 3:] = -math.inf
    scale = 0.3                      # not the 1/sqrt(D) default of the fused kernel: must be passed on
    want = plain_attention(q, cache.k[:, :, :length], cache.v[:, :, :length], scale, bias)
    scores = None if path == "fused" else torch.full((b * h * t * 7,), float("nan"))
    out = torch.full((b, t, h * d), float("nan")) if path != "scores" else None
    got = attend(q, cache, length, scale, bias, scores=scores, out=out)
    assert got.shape == (b, t, h * d)
    torch.testing.assert_close(got.double(), want, **F32)
    if out is not None:
        torch.testing.assert_close(out.double(), want, **F32)


def test_attend_in_bfloat16_follows_the_formula_to_bf16_rounding():
    """The bf16 path of the scores buffer (softmax asked for in float32, cast back): the result
    follows the float64 formula to bf16 rounding of the scores, the weights and the output (three
    roundings of 2^-8 relative: 2e-2). On the CPU PyTorch's bf16 softmax already accumulates in
    float32 (bit-identical results), so this cannot tell the two softmax calls apart there."""
    b, t, h, d, length = 1, 2, 2, 8, 6
    g = gen(5)
    cache = KVCache(b, 1, length, d, torch.bfloat16)
    cache.k.copy_(torch.randn(b, 1, length, d, generator=g))
    cache.v.copy_(torch.randn(b, 1, length, d, generator=g))
    q = (3 * torch.randn(b, t, h, d, generator=g)).bfloat16()
    want = plain_attention(q, cache.k, cache.v, 0.5, None)
    scores = torch.empty(b * h * t * length, dtype=torch.bfloat16)
    got = attend(q, cache, length, 0.5, None, scores=scores, out=torch.empty(b, t, h * d, dtype=torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_sincos_time_embedding_is_pi05s_in_float64():
    t = torch.tensor([0.0, 0.25, 1.0])
    emb = sincos_time_embedding(t, 8, 4e-3, 4.0)
    assert emb.dtype == torch.float64 and emb.shape == (3, 8)
    period = torch.tensor([4e-3 * (4.0 / 4e-3) ** (i / 3) for i in range(4)], dtype=torch.float64)
    ang = 2 * math.pi / period[None, :] * t.double()[:, None]
    torch.testing.assert_close(emb, torch.cat([ang.sin(), ang.cos()], -1), rtol=1e-12, atol=1e-12)
