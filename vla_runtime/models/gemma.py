"""Gemma layers: the PaliGemma prefix model and the adaRMS-conditioned action expert.

Layer ``l`` of the expert attends to the keys/values that layer ``l`` of the VLM wrote for the
prefix, plus its own for the action tokens; both write into one ``KVCache`` per layer index.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import Tensor, nn

from .config import GemmaConfig
from .layers import KVCache, Rope, attend, gelu_tanh_, linear, rms_norm, RMSNorm


@dataclass
class Workspace:
    """Static activation buffers of one denoising step (fixed: B x chunk tokens).

    Shared by all expert layers (they run one after another). Allocated once by
    ``Pi05Model.setup_caches``; the denoising loop writes into these and nothing else.
    """

    h: Tensor          # residual stream [B, T, W]
    normed: Tensor     # norm output [B, T, W]
    qkv: Tensor        # fused projection [B, T, q + 2kv]
    q: Tensor          # rotated queries [B, T, H, D]
    scores: Tensor     # attention scores, flat, room for [B, Hkv, T*G, S_max]
    ctx: Tensor        # attention context [B, T, H*D]
    attn_out: Tensor   # o_proj output [B, T, W]
    gate_up: Tensor    # one MLP block's fused gate/up projection [B, T, 2*block]
    mlp_out: Tensor    # down projection [B, T, W]

    @staticmethod
    def allocate(cfg: GemmaConfig, batch: int, tokens: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> "Workspace":
        e = lambda *s: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
        w, t = cfg.width, tokens
        return Workspace(
            h=e(batch, t, w), normed=e(batch, t, w), qkv=e(batch, t, cfg.q_dim + 2 * cfg.kv_dim),
            q=e(batch, t, cfg.num_heads, cfg.head_dim), scores=e(batch * cfg.num_heads * t * max_len),
            ctx=e(batch, t, cfg.q_dim), attn_out=e(batch, t, w), gate_up=e(batch, t, 2 * mlp_block(cfg)),
            mlp_out=e(batch, t, w),
        )

    def narrow(self, batch: int) -> "Workspace":
        """Views of the first ``batch`` rows (a call smaller than the allocated capacity)."""
        if batch == self.h.shape[0]:
            return self
        return Workspace(**{f.name: getattr(self, f.name) if f.name == "scores" else getattr(self, f.name)[:batch]
                            for f in fields(self)})

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))


class GemmaAttention(nn.Module):
    """Fused-QKV attention writing its keys/values into the shared per-layer ``KVCache``."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_weight = nn.Parameter(torch.empty(cfg.q_dim + 2 * cfg.kv_dim, cfg.width))
        self.o_weight = nn.Parameter(torch.empty(cfg.width, cfg.q_dim))
        self.scale = cfg.head_dim ** -0.5
        self.cache: KVCache | None = None  # attached by Pi05Model.setup_caches

    def forward(self, x: Tensor, rope: Rope, start: int, bias: Tensor | None,
                ws: Workspace | None = None, kv_only: bool = False) -> Tensor | None:
        """Attend tokens at cache rows [start, start + T) to rows [0, start + T).

        With ``kv_only`` the layer only writes its keys/values: the last VLM layer's attention
        output feeds nothing, so neither its queries nor its output are computed.
        """
        cfg, cache = self.cfg, self.cache
        assert cache is not None, "call Pi05Model.setup_caches() first"
        b, t, _ = x.shape
        qd, kvd = cfg.q_dim, cfg.kv_dim
        if kv_only:
            kv = linear(x, self.qkv_weight[qd:])
            k, v = kv[..., :kvd], kv[..., kvd:]
        else:
            qkv = linear(x, self.qkv_weight, out=None if ws is None else ws.qkv)
            k, v = qkv[..., qd:qd + kvd], qkv[..., qd + kvd:]
        end = start + t
        rope.apply(k.view(b, t, cfg.num_kv_heads, cfg.head_dim), out=cache.k[:b, :, start:end].transpose(1, 2))
        cache.v[:b, :, start:end].copy_(v.view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2))
        if kv_only:
            return None
        q = rope.apply(qkv[..., :qd].view(b, t, cfg.num_heads, cfg.head_dim), out=None if ws is None else ws.q)
        ctx = attend(q, cache, end, self.scale, bias,
                     scores=None if ws is None else ws.scores, out=None if ws is None else ws.ctx)
        return linear(ctx, self.o_weight, out=None if ws is None else ws.attn_out)


def mlp_block(cfg: GemmaConfig) -> int:
    """Neurons per MLP block: ``cfg.mlp_block``, halved until it divides ``mlp_dim``."""
    b = min(cfg.mlp_block, cfg.mlp_dim)
    while cfg.mlp_dim % b:
        b //= 2
    return b


class GemmaMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, run over blocks of neurons.

    Gate and up are fused per block (``gate_up[c]`` holds the gate rows then the up rows of
    neurons ``[c*B, (c+1)*B)``) and the down projection is stored transposed (``down_t[n]`` is
    neuron ``n``'s output row). Each block's activations are consumed by the down projection
    while still in cache, which on a CPU runs the prefill MLP ~10% closer to the GEMM limit than
    one matmul over all 16384 neurons, and it makes any neuron's weights contiguous rows (what the
    Action Cache gathers). The layout is built from the public gate/up/down tensors at load.
    """

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.mlp_dim = cfg.mlp_dim
        self.block = mlp_block(cfg)
        self.gate_up = nn.Parameter(torch.empty(cfg.mlp_dim // self.block, 2 * self.block, cfg.width))
        self.down_t = nn.Parameter(torch.empty(cfg.mlp_dim, cfg.width))

    def forward(self, x: Tensor, ws: Workspace | None = None, act_out: Tensor | None = None) -> Tensor:
        """MLP of ``x``; with ``act_out`` [rows, mlp_dim] the activations are recorded too
        (what the Action Cache's anchors and the offline mask profiler need)."""
        b, w = self.block, x.shape[-1]
        x2 = x.reshape(-1, w)
        rows = x2.shape[0]
        gu = x2.new_empty(rows, 2 * b) if ws is None else ws.gate_up.view(-1, 2 * b)[:rows]
        out = x2.new_empty(rows, w) if ws is None else ws.mlp_out.view(-1, w)
        for c in range(self.gate_up.shape[0]):
            torch.mm(x2, self.gate_up[c].t(), out=gu)
            act = gelu_tanh_(gu[:, :b]).mul_(gu[:, b:])
            if act_out is not None:
                act_out[:, c * b:(c + 1) * b].copy_(act)
            down = self.down_t[c * b:(c + 1) * b]
            if c == 0:
                torch.mm(act, down, out=out)
            else:
                out.addmm_(act, down)
        return out.view(*x.shape[:-1], w)


class PrefillFFN(Protocol):
    """Replaces a VLM layer's MLP call (the Context Cache; recording reference states)."""

    def __call__(self, layer: int, mlp: GemmaMLP, x: Tensor) -> Tensor: ...


class DenoiseFFN(Protocol):
    """Replaces an expert layer's MLP call in a denoising step (the Action Cache; mask profiling)."""

    def __call__(self, layer: int, step: int, mlp: GemmaMLP, x: Tensor, ws: Workspace) -> Tensor: ...


class GemmaLayer(nn.Module):
    """A PaliGemma decoder layer (pre-norm, plain residual). Runs once per call, over the prefix."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.attn = GemmaAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.mlp = GemmaMLP(cfg)

    def forward(self, x: Tensor, rope: Rope, bias: Tensor | None, kv_only: bool = False,
                ffn: PrefillFFN | None = None, index: int = 0, start: int = 0) -> Tensor:
        a = self.attn(self.input_norm(x), rope, start, bias, kv_only=kv_only)
        if kv_only:
            return x
        x = x + a
        h = self.post_attn_norm(x)
        return x + (self.mlp(h) if ffn is None else ffn(index, self.mlp, h))


class ExpertLayer(nn.Module):
    """An action-expert layer: adaptive RMSNorm on the flow time and gated residuals.

    The modulation ``dense(cond(t))`` depends only on the step's time, which is fixed by the
    Euler schedule, so it is tabulated once after loading (``set_modulation``) rather than
    recomputed every step of every call.
    """

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.cfg = cfg
        self.input_mod = nn.Linear(cfg.width, 3 * cfg.width)      # input_layernorm.dense
        self.attn = GemmaAttention(cfg)
        self.post_attn_mod = nn.Linear(cfg.width, 3 * cfg.width)  # post_attention_layernorm.dense
        self.mlp = GemmaMLP(cfg)
        # [steps, 2 norms, (1 + scale, shift, gate), W]
        self.register_buffer("modulation", torch.zeros(0), persistent=False)

    def set_modulation(self, cond: Tensor) -> None:
        self.modulation = torch.stack([modulation_table(self.input_mod, cond),
                                       modulation_table(self.post_attn_mod, cond)], dim=1)

    def forward(self, step: int, rope: Rope, start: int, bias: Tensor | None, ws: Workspace,
                ffn: DenoiseFFN | None = None, index: int = 0) -> None:
        """Advance the residual stream ``ws.h`` in place by one layer."""
        m = self.modulation[step]
        eps = self.cfg.norm_eps
        n = rms_norm(ws.h, m[0, 0], eps, out=ws.normed).add_(m[0, 1])
        ws.h.addcmul_(self.attn(n, rope, start, bias, ws), m[0, 2])
        n = rms_norm(ws.h, m[1, 0], eps, out=ws.normed).add_(m[1, 1])
        y = self.mlp(n, ws) if ffn is None else ffn(index, step, self.mlp, n, ws)
        ws.h.addcmul_(y, m[1, 2])


def modulation_table(dense: nn.Linear, cond: Tensor) -> Tensor:
    """[steps, 3, W] of (1 + scale, shift, gate) from an adaRMS ``dense`` layer, in fp32."""
    scale, shift, gate = dense(cond.to(dense.weight.dtype)).float().chunk(3, dim=-1)
    return torch.stack([1.0 + scale, shift, gate], dim=1)
