"""Useful FLOPs of each pi0.5 phase, checked against a hand count at full size."""

from __future__ import annotations

from vla_runtime.models.config import preset
from vla_runtime.models.flops import denoise_flops, prefill_flops, vision_flops


def test_useful_flops_of_full_size_match_hand_count():
    cfg = preset("pi05")
    # Gemma-2B layer, one token: q 2048x2048, k/v 2x 2048x256, o 2048x2048, MLP 3x 2048x16384.
    per_tok = 2 * (2048 * 2560 + 2048 * 2048 + 3 * 2048 * 16384)
    p = 3 * 256 + 48
    assert prefill_flops(cfg, p) == 17 * (p * per_tok + 4 * p * p * 2048) + p * 2 * 2048 * 512
    assert vision_flops(cfg, 2) == 2 * vision_flops(cfg, 1)
    assert denoise_flops(cfg, p) > 0 and denoise_flops(cfg, p + 100) > denoise_flops(cfg, p)
