"""Building blocks shared by the vision tower, the VLM and the action expert.

Every primitive takes an optional ``out`` buffer. The prefill path calls them without one and
lets PyTorch allocate; the denoising loop passes preallocated buffers from its ``Workspace`` so
that a denoising step allocates no activation memory. One implementation serves both, so the
cached and uncached paths cannot drift apart numerically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` into ``out`` when given (weights are stored [out_features, in_features])."""
    if out is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    o2 = out.view(-1, weight.shape[0])
    if bias is None:
        torch.mm(x2, weight.t(), out=o2)
    else:
        torch.addmm(bias, x2, weight.t(), out=o2)
    return out


def rms_norm(x: Tensor, scale: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """Gemma RMSNorm with fp32 statistics: ``x * rsqrt(mean(x^2) + eps) * scale``.

    ``scale`` is the folded ``1 + weight`` (or ``1 + adaptive scale``), kept in fp32. For fp32
    activations this is bit-compatible with computing ``x.float()`` first; for bf16 the mean of
    squares is still accumulated in fp32, which is what keeps long bf16 runs from drifting.
    """
    if x.dtype != torch.float32:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale
        return y.to(x.dtype) if out is None else out.copy_(y)
    if out is None:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale
    torch.mul(x, x, out=out)
    rstd = out.mean(-1, keepdim=True).add_(eps).rsqrt_()
    torch.mul(x, rstd, out=out)
    return out.mul_(scale)


def gelu_tanh_(x: Tensor) -> Tensor:
    """In-place tanh-approximated GELU (Gemma's and SigLIP's activation)."""
    return torch.ops.aten.gelu_(x, approximate="tanh")


@dataclass
class Rope:
    """cos/sin tables for one set of positions, laid out [B, T, 1, D/2] to broadcast over heads."""

    cos: Tensor
    sin: Tensor

    @staticmethod
    def at(positions: Tensor, head_dim: int, base: float, dtype: torch.dtype) -> "Rope":
        # Frequencies and angles in fp32, as Gemma computes them, then cast to the activation dtype.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
        angles = positions.float()[..., None] * inv_freq
        return Rope(angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :])

    def apply(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """Rotate-half RoPE on [B, T, H, D]: ``x*cos + rotate_half(x)*sin``, written to ``out``."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        if out is None:
            out = torch.empty_like(x)
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, self.cos, out=o1)
        o1.addcmul_(x2, self.sin, value=-1.0)
        torch.mul(x2, self.cos, out=o2)
        o2.addcmul_(x1, self.sin)
        return out


class KVCache(nn.Module):
    """Preallocated keys/values of one layer, [B, H_kv, S_max, D].

    The prefix writes rows [0, P); each denoising step overwrites rows [P, P + chunk) in place,
    so the prefix is never copied and nothing is concatenated.
    """

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def attend(q: Tensor, cache: KVCache, length: int, scale: float, bias: Tensor | None,
           scores: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Grouped-query attention of q [B, T, H, D] over cache rows [0, length).

    Queries of one KV group are folded into the row dimension, so a single KV head (pi0.5) needs
    no head expansion. Softmax runs in fp32. ``bias`` is an additive key mask [B, 1, 1, length]
    or None when every key is valid. With a ``scores`` buffer (the denoising loop) the two
    matmuls and the softmax write into static memory; without one (the prefill) PyTorch's fused
    attention kernel runs.
    """
    b, t, h, d = q.shape
    hkv = cache.k.shape[1]
    g = h // hkv
    qg = q.view(b, t, hkv, g, d).transpose(1, 2).reshape(b, hkv, t * g, d)
    k = cache.k[:b, :, :length]
    v = cache.v[:b, :, :length]
    if scores is None:
        # Allocating path (the prefill): PyTorch's fused attention, fp32 softmax inside.
        ctx = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale)
        ctx = ctx.view(b, hkv, t, g, d).transpose(1, 2).reshape(b, t, h * d)
        return ctx if out is None else out.view(b, t, h * d).copy_(ctx)
    scores = scores.view(-1)[: b * hkv * t * g * length].view(b, hkv, t * g, length)
    torch.matmul(qg, k.transpose(-1, -2), out=scores)
    scores.mul_(scale)
    if bias is not None:
        scores.add_(bias)
    if scores.dtype == torch.float32:
        probs = torch.softmax(scores, dim=-1, out=scores)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    if out is not None and hkv == 1:
        torch.matmul(probs, v, out=out.view(b, 1, t * g, d))
        return out.view(b, t, h * d)
    ctx = torch.matmul(probs, v)  # [B, Hkv, T*G, D]
    ctx = ctx.view(b, hkv, t, g, d).transpose(1, 2).reshape(b, t, h * d)
    return ctx if out is None else out.view(b, t, h * d).copy_(ctx)


class RMSNorm(nn.Module):
    """Gemma RMSNorm. The public weight ``w`` is kept; ``1 + w`` is folded once after loading."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.register_buffer("scale", torch.ones(dim), persistent=False)

    def refresh(self) -> None:
        self.scale = (1.0 + self.weight.detach().float()).to(self.weight.device)

    def forward(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return rms_norm(x, self.scale, self.eps, out)


def sincos_time_embedding(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """Sine-cosine embedding of the flow time, computed in float64 as pi0.5 does."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = (2.0 * math.pi / period)[None, :] * t.to(torch.float64)[:, None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
