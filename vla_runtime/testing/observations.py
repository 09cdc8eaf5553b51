"""Seeded model inputs for the cache tests: a random scene, or a jittered copy of one (what a
nearby observation of the same scene looks like to the caches)."""

from __future__ import annotations

import torch

from ..engine.dense import ModelInputs
from ..models.config import Pi05Config


def random_inputs(cfg: Pi05Config, seed: int, base: torch.Tensor | None = None, jitter: float = 0.0) -> ModelInputs:
    """Batch-of-one inputs: images uniform in [-1, 1] (or ``base`` plus ``jitter`` * N(0, 1),
    clipped), every camera present, a fixed 12-token prompt (the same for every seed, so only the
    images differ between a reference and a current observation)."""
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(1, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1 if base is None else \
        (base + jitter * torch.randn(base.shape, generator=g)).clamp(-1, 1)
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :12] = True
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_token_len), generator=torch.Generator().manual_seed(0))
    return ModelInputs(images, torch.ones(1, cfg.num_cameras, dtype=torch.bool), tokens, mask)
