"""SigLIP vision tower (so400m/14 at full size) with fused QKV."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import SiglipConfig
from .layers import gelu_tanh_, linear


class SiglipLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        w = cfg.width
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(w, eps=cfg.norm_eps)
        self.ln2 = nn.LayerNorm(w, eps=cfg.norm_eps)
        self.qkv_weight = nn.Parameter(torch.empty(3 * w, w))  # fused q, k, v at load
        self.qkv_bias = nn.Parameter(torch.empty(3 * w))
        self.out_proj = nn.Linear(w, w)
        self.fc1 = nn.Linear(w, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, w)

    def forward(self, x: Tensor) -> Tensor:
        b, n, w = x.shape
        h, d = self.cfg.num_heads, self.cfg.head_dim
        qkv = linear(self.ln1(x), self.qkv_weight, self.qkv_bias).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.out_proj(ctx.transpose(1, 2).reshape(b, n, w))
        return x + self.fc2(gelu_tanh_(self.fc1(self.ln2(x))))


class SiglipVisionTower(nn.Module):
    """Patch embedding, ``depth`` encoder layers and the post layer norm.

    ``forward`` can also hand back the hidden state after an intermediate layer: the cache
    manager uses it as the retrieval query (rMuscle uses layer 15 of 27), and computing it here
    costs nothing extra.
    """

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Parameter(torch.empty(cfg.num_patches, cfg.width))
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.depth))
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)

    def forward(self, images: Tensor, tap_layer: int | None = None,
                on_tap: Callable[[Tensor], None] | None = None) -> tuple[Tensor, Tensor | None]:
        """images [B, 3, H, W] in [-1, 1] -> ([B, patches, width], tapped hidden state or None).

        ``on_tap`` is called with the tapped state as soon as layer ``tap_layer`` produced it,
        before the layers after it run (reference selection starts there: rMuscle §5). No layer
        writes into its input, so the tapped state stays as it was."""
        # contiguous once here: the transposed patch layout would otherwise carry through every
        # residual add (elementwise results keep their input's strides), so each layer norm and the
        # tapped features would run over rows with a stride (the features' selection copied them)
        x = (self.patch_embedding(images).flatten(2).transpose(1, 2) + self.position_embedding).contiguous()
        tapped = None
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if i == tap_layer:
                tapped = x
                if on_tap is not None:
                    on_tap(tapped)
        return self.post_layernorm(x), tapped
