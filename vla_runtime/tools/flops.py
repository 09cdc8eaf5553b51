"""Useful floating-point work of each pi0.5 phase, for efficiency figures.

"Useful" means what the answer needs: valid tokens only (no padding, no absent cameras), no
outputs nobody reads (the last VLM layer's attention output, MLP and final norm). Comparing a
phase's useful FLOPs per second with the GEMM throughput of the machine says how close to the
limit it runs, whichever engine runs it.
"""

from __future__ import annotations

from ..models.config import GemmaConfig, Pi05Config


def _gemma_token_flops(c: GemmaConfig) -> int:
    """Projections and MLP of one token through one layer (multiply-add = 2 FLOPs)."""
    return 2 * (c.width * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.width + 3 * c.width * c.mlp_dim)


def vision_flops(cfg: Pi05Config, cameras: int) -> int:
    v = cfg.vision
    n = v.num_patches
    per_layer = 2 * n * (4 * v.width * v.width + 2 * v.width * v.mlp_dim) + 4 * n * n * v.width
    patch = 2 * n * 3 * v.patch_size ** 2 * v.width
    projector = 2 * n * v.width * cfg.vlm.width
    return cameras * (patch + v.depth * per_layer + projector)


def prefill_flops(cfg: Pi05Config, prefix_tokens: int) -> int:
    c = cfg.vlm
    full = (c.depth - 1) * (prefix_tokens * _gemma_token_flops(c) + 4 * prefix_tokens * prefix_tokens * c.q_dim)
    last_kv = prefix_tokens * 2 * c.width * 2 * c.kv_dim
    return full + last_kv


def denoise_flops(cfg: Pi05Config, prefix_tokens: int) -> int:
    c, t = cfg.expert, cfg.chunk_size
    attn = 4 * t * (prefix_tokens + t) * c.q_dim
    per_step = c.depth * (t * _gemma_token_flops(c) + attn) + 2 * t * 2 * cfg.action_dim * c.width
    return cfg.num_steps * per_step
