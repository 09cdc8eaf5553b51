"""Useful floating-point work of each pi0.5 phase, for efficiency figures.

"Useful" means what the answer needs: valid tokens only (no padding, no absent cameras), no
outputs nobody reads (the last VLM layer's attention output, MLP and final norm). Comparing a
phase's useful FLOPs per second with the GEMM throughput of the machine says how close to the
limit it runs, whichever engine runs it. The cached variants count what the Context and Action
Caches leave to compute.
"""

from __future__ import annotations

import math

from .config import GemmaConfig, Pi05Config


def _projection_flops(c: GemmaConfig) -> int:
    """Q/K/V and output projections of one token through one layer (multiply-add = 2 FLOPs)."""
    return 2 * (c.width * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.width)


def _mlp_flops(c: GemmaConfig, neurons: int | None = None) -> int:
    """Gate, up and down of one token over ``neurons`` (all by default)."""
    return 2 * 3 * c.width * (c.mlp_dim if neurons is None else neurons)


def vision_flops(cfg: Pi05Config, cameras: int) -> int:
    v = cfg.vision
    n = v.num_patches
    per_layer = 2 * n * (4 * v.width * v.width + 2 * v.width * v.mlp_dim) + 4 * n * n * v.width
    patch = 2 * n * 3 * v.patch_size ** 2 * v.width
    projector = 2 * n * v.width * cfg.vlm.width
    return cameras * (patch + v.depth * per_layer + projector)


def prefill_flops(cfg: Pi05Config, prefix_tokens: int, mlp_rows: int | None = None) -> int:
    """VLM prefill; ``mlp_rows`` = tokens whose FFN runs per layer (all of them when dense)."""
    c, p = cfg.vlm, prefix_tokens
    rows = p if mlp_rows is None else mlp_rows
    full = (c.depth - 1) * (p * _projection_flops(c) + rows * _mlp_flops(c) + 4 * p * p * c.q_dim)
    last_kv = p * 2 * c.width * 2 * c.kv_dim
    return full + last_kv


def denoise_flops(cfg: Pi05Config, prefix_tokens: int, rho_n: float = 1.0, anchors: int | None = None) -> int:
    """Denoising loop; with ``rho_n`` < 1 the non-anchor steps run ceil(rho_n * H) neurons."""
    c, t = cfg.expert, cfg.chunk_size
    anchors = cfg.num_steps if anchors is None else anchors
    k = min(c.mlp_dim, math.ceil(rho_n * c.mlp_dim))
    attn = 4 * t * (prefix_tokens + t) * c.q_dim
    base = c.depth * (t * _projection_flops(c) + attn) + 2 * t * 2 * cfg.action_dim * c.width
    mlp = c.depth * t * (anchors * _mlp_flops(c) + (cfg.num_steps - anchors) * _mlp_flops(c, k))
    return cfg.num_steps * base + mlp


def dense_flops(cfg: Pi05Config, prefix_tokens: int, cameras: int) -> int:
    return vision_flops(cfg, cameras) + prefill_flops(cfg, prefix_tokens) + denoise_flops(cfg, prefix_tokens)


def cached_flops(cfg: Pi05Config, prefix_tokens: int, visual_tokens: int, rho_p: float, rho_n: float,
                 anchors: int) -> int:
    """A call with the Context Cache (rho_p of the visual rows) and the Action Cache (rho_n)."""
    rows = math.ceil(rho_p * visual_tokens) + (prefix_tokens - visual_tokens)
    cameras = visual_tokens // cfg.num_image_tokens
    return (vision_flops(cfg, cameras) + prefill_flops(cfg, prefix_tokens, rows)
            + denoise_flops(cfg, prefix_tokens, rho_n, anchors))
