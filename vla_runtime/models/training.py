"""A differentiable forward of ``Pi05Model`` for training with flow matching.

Why a second forward: the inference path (``pi05.py``) is built for speed, not gradients. It
writes keys/values into preallocated caches with ``out=`` kernels, folds the norm scales into
detached buffers at load, tabulates the expert's time modulation at the 10 Euler times and
advances the residual stream in place. None of that carries gradients. This module computes the
same function from the **same parameters** (reading each module's weights), over a padded
batch, without caches:

* vision tower + projector per camera, prompt embeddings scaled by sqrt(width);
* the VLM over the prefix, bidirectional, padding masked as keys (so padded and compacted
  prefixes give the same result: a masked key contributes exactly zero);
* the expert over the noisy action chunk: at layer ``l`` it attends to the prefix keys/values
  of VLM layer ``l`` and to its own chunk (bidirectionally), the prefix never to the chunk;
  positions continue after the valid prefix tokens, as in ``Pi05Model.denoise``;
* adaRMS modulation computed from ``time_condition(t)`` for any t (training may sample the 10
  schedule times only, see ``flow_matching_loss``).

Flow convention, identical to the sampler (``Pi05Model.denoise`` integrates from t=1 to t=0 with
``x <- x + dt * v``, dt = -1/steps): ``x_t = t * noise + (1 - t) * actions`` and the velocity
target is ``noise - actions``.

``test/models/test_training_forward.py`` checks the velocity against the inference path at every
schedule time for random weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import GemmaConfig
from .gemma import ExpertLayer, GemmaAttention, GemmaLayer, GemmaMLP
from .layers import Rope, rms_norm
from .pi05 import Pi05Model, euler_times
from .siglip import SiglipLayer


@dataclass
class PrefixKV:
    """Per-VLM-layer keys/values of the prefix (RoPE applied), what the expert attends to."""

    keys: list[Tensor]      # each [B, Hkv, P, D]
    values: list[Tensor]    # each [B, Hkv, P, D]
    key_mask: Tensor        # [B, P] bool, True on valid tokens
    valid_len: Tensor       # [B] valid prefix tokens (where the chunk's positions start)

    def repeat(self, n: int) -> "PrefixKV":
        """Each row ``n`` times (``repeat_interleave``): several noise/time draws per prefix."""
        if n == 1:
            return self
        r = lambda t: t.repeat_interleave(n, dim=0)  # noqa: E731
        return PrefixKV([r(k) for k in self.keys], [r(v) for v in self.values], r(self.key_mask), r(self.valid_len))


def _rotate(x: Tensor, rope: Rope) -> Tensor:
    """Rotate-half RoPE on [B, T, H, D], out of place (``Rope.apply`` writes into buffers)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin], dim=-1)


def _mlp(mlp: GemmaMLP, x: Tensor) -> Tensor:
    """``down(gelu_tanh(gate x) * up x)`` from the blocked gate/up layout (see ``GemmaMLP``)."""
    nb, two_b, w = mlp.gate_up.shape
    b = two_b // 2
    gate = mlp.gate_up[:, :b].reshape(nb * b, w)
    up = mlp.gate_up[:, b:].reshape(nb * b, w)
    return (F.gelu(F.linear(x, gate), approximate="tanh") * F.linear(x, up)) @ mlp.down_t


def _qkv(attn: GemmaAttention, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
    """Queries [B, H, T, D], keys and values [B, Hkv, T, D], RoPE applied to q and k."""
    cfg: GemmaConfig = attn.cfg
    b, t, _ = x.shape
    qd, kvd = cfg.q_dim, cfg.kv_dim
    qkv = F.linear(x, attn.qkv_weight)
    q = _rotate(qkv[..., :qd].view(b, t, cfg.num_heads, cfg.head_dim), rope)
    k = _rotate(qkv[..., qd:qd + kvd].view(b, t, cfg.num_kv_heads, cfg.head_dim), rope)
    v = qkv[..., qd + kvd:].view(b, t, cfg.num_kv_heads, cfg.head_dim)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _attend(attn: GemmaAttention, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None) -> Tensor:
    """Grouped-query attention [B, H, T, D] x [B, Hkv, S, D] -> o_proj output [B, T, W]."""
    cfg: GemmaConfig = attn.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    if g > 1:
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
    b, h, t, d = ctx.shape
    return F.linear(ctx.transpose(1, 2).reshape(b, t, h * d), attn.o_weight)


def _siglip_layer(layer: SiglipLayer, x: Tensor) -> Tensor:
    b, n, w = x.shape
    h, d = layer.cfg.num_heads, layer.cfg.head_dim
    qkv = F.linear(layer.ln1(x), layer.qkv_weight, layer.qkv_bias).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    ctx = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
    x = x + layer.out_proj(ctx.transpose(1, 2).reshape(b, n, w))
    return x + layer.fc2(F.gelu(layer.fc1(layer.ln2(x)), approximate="tanh"))


def _norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma RMSNorm with the public weight ``w`` (scale ``1 + w``), differentiable."""
    return rms_norm(x, 1.0 + weight.float(), eps)


class TrainingForward:
    """Differentiable prefix and velocity computations over a ``Pi05Model``'s own parameters."""

    def __init__(self, model: Pi05Model):
        self.model = model
        self.cfg = model.cfg

    # ------------------------------------------------------------------ prefix
    def embed_images(self, images: Tensor) -> Tensor:
        """images [B, N, 3, H, W] in [-1, 1] -> [B, N * patches, W_vlm]."""
        m = self.model
        b, n = images.shape[:2]
        vt = m.vision
        x = vt.patch_embedding(images.flatten(0, 1)).flatten(2).transpose(1, 2) + vt.position_embedding
        for layer in vt.layers:
            x = _siglip_layer(layer, x)
        tokens = m.projector(vt.post_layernorm(x))
        return tokens.reshape(b, n * tokens.shape[1], tokens.shape[2])

    def prefix(self, images: Tensor, image_mask: Tensor, tokens: Tensor, token_mask: Tensor) -> PrefixKV:
        """Run the VLM over [camera tokens..., prompt tokens] (padded) and keep every layer's K/V.

        The last layer's attention output and MLP feed nothing (only its K/V are read by the
        expert), so they are skipped, as in ``Pi05Model.prefill``.
        """
        m, cfg = self.model, self.cfg
        img = self.embed_images(images)
        w = img.shape[-1]
        txt = m.embed_tokens(tokens) * math.sqrt(w)
        x = torch.cat([img, txt.to(img.dtype)], dim=1)
        per_cam = cfg.num_image_tokens
        mask = torch.cat([image_mask.bool().repeat_interleave(per_cam, dim=1), token_mask.bool()], dim=1)
        positions = mask.long().cumsum(-1) - 1
        rope = Rope.at(positions, cfg.vlm.head_dim, cfg.vlm.rope_base, x.dtype)
        keys, values = [], []
        last = len(m.vlm_layers) - 1
        for i, layer in enumerate(m.vlm_layers):
            layer: GemmaLayer
            q, k, v = _qkv(layer.attn, _norm(x, layer.input_norm.weight, layer.input_norm.eps), rope)
            keys.append(k)
            values.append(v)
            if i == last:
                break
            x = x + _attend(layer.attn, q, k, v, mask)
            x = x + _mlp(layer.mlp, _norm(x, layer.post_attn_norm.weight, layer.post_attn_norm.eps))
        return PrefixKV(keys, values, mask, mask.long().sum(-1))

    # ------------------------------------------------------------------ suffix
    def velocity(self, kv: PrefixKV, x_t: Tensor, t: Tensor) -> Tensor:
        """Expert velocity at flow times ``t`` [B] for noisy chunks ``x_t`` [B, chunk, action_dim]."""
        m, cfg = self.model, self.cfg
        ecfg = cfg.expert
        b, chunk, _ = x_t.shape
        cond = m.time_condition(t.to(x_t.device))                   # [B, W_e]
        h = m.action_in_proj(x_t.to(m.action_in_proj.weight.dtype))
        positions = kv.valid_len[:, None] + torch.arange(chunk, device=x_t.device)
        rope = Rope.at(positions, ecfg.head_dim, ecfg.rope_base, h.dtype)
        key_mask = torch.cat([kv.key_mask, kv.key_mask.new_ones(b, chunk)], dim=1)
        for i, layer in enumerate(m.expert_layers):
            layer: ExpertLayer
            scale, shift, gate = layer.input_mod(cond).float()[:, None].chunk(3, dim=-1)
            n = rms_norm(h, 1.0 + scale, ecfg.norm_eps) + shift
            q, k, v = _qkv(layer.attn, n, rope)
            k = torch.cat([kv.keys[i], k], dim=2)
            v = torch.cat([kv.values[i], v], dim=2)
            h = h + _attend(layer.attn, q, k, v, key_mask) * gate
            scale, shift, gate = layer.post_attn_mod(cond).float()[:, None].chunk(3, dim=-1)
            n = rms_norm(h, 1.0 + scale, ecfg.norm_eps) + shift
            h = h + _mlp(layer.mlp, n) * gate
        scale, shift, _ = m.expert_final_mod(cond).float()[:, None].chunk(3, dim=-1)
        return m.action_out_proj(rms_norm(h, 1.0 + scale, ecfg.norm_eps) + shift)


def schedule_times(num_steps: int) -> Tensor:
    """The flow times the Euler sampler evaluates (t = 1, 0.9, ..., 1/steps), fp32."""
    return torch.tensor(euler_times(num_steps), dtype=torch.float32)


def sample_times(batch: int, num_steps: int, mode: str, generator: torch.Generator | None = None) -> Tensor:
    """Training flow times: ``"schedule"`` draws among the sampler's times (the only ones it ever
    evaluates: all capacity goes where inference looks), ``"uniform"`` draws t ~ U(0, 1]."""
    if mode == "schedule":
        idx = torch.randint(0, num_steps, (batch,), generator=generator)
        return schedule_times(num_steps)[idx]
    if mode == "uniform":
        return 1.0 - torch.rand(batch, generator=generator)
    raise ValueError(f"time sampling must be 'schedule' or 'uniform', got {mode!r}")


def flow_matching_loss(fwd: TrainingForward, images: Tensor, image_mask: Tensor, tokens: Tensor,
                       token_mask: Tensor, actions: Tensor, *, draws: int = 1, time_mode: str = "schedule",
                       generator: torch.Generator | None = None) -> Tensor:
    """Mean squared error between predicted and target velocity (normalised, padded actions).

    ``draws`` noise/time samples share one prefix computation: the prefix (vision + VLM) is
    most of the cost and the chunk is cheap, so several draws per image give more supervision
    of the expert for little extra time.
    """
    kv = fwd.prefix(images, image_mask, tokens, token_mask).repeat(draws)
    target_actions = actions.repeat_interleave(draws, dim=0)
    b = target_actions.shape[0]
    noise = torch.randn(target_actions.shape, generator=generator, dtype=target_actions.dtype)
    t = sample_times(b, fwd.cfg.num_steps, time_mode, generator)
    tt = t[:, None, None].to(target_actions.dtype)
    x_t = tt * noise + (1.0 - tt) * target_actions
    v = fwd.velocity(kv, x_t, t)
    return F.mse_loss(v.float(), (noise - target_actions).float())
