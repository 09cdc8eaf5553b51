"""Prepared reference entries (``vla_runtime.cache.entry``): what a rebuilt entry holds, in which
dtype, and the bytes the working set budgets for it.

That the recorded states are the true FFN rows is checked through the Context Cache in
test/cache/test_dual_cache.py (reusing an entry of the same observation is exact).
"""

from __future__ import annotations

import pytest
import torch

from vla_runtime.cache.entry import reconstruct_entry
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.testing.observations import random_inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_entry_keeps_the_model_dtype_and_counts_its_bytes(dtype):
    """A bfloat16 runtime keeps bfloat16 entries: the working set's memory budget
    (``CacheManager``, ``nodes/working_set.py``) is counted with ``nbytes()``, so float32 states
    would silently hold half the entries the budget promises. Masks stored as int32 in the
    repository come back as int64 indices (what ``index_select`` takes)."""
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=5).to(dtype)
    cfg = model.cfg
    model.setup_caches(1)
    x = random_inputs(cfg, 1)
    masks = torch.arange(2 * cfg.expert.depth * 3, dtype=torch.int32).reshape(2, cfg.expert.depth, 3)
    entry = reconstruct_entry(model, ("ep", 4), x.images[0].to(dtype), x.image_mask[0], x.tokens[0],
                              x.token_mask[0], masks)
    pv = int(x.image_mask[0].sum()) * cfg.num_image_tokens
    assert entry.key == ("ep", 4) and entry.visual_tokens == pv
    for states in (entry.ffn_in, entry.ffn_out):
        assert states.dtype == dtype and states.shape == (cfg.vlm.depth - 1, pv, cfg.vlm.width)
    assert entry.masks.dtype == torch.int64 and torch.equal(entry.masks, masks.long())
    size = torch.finfo(dtype).bits // 8
    state_bytes = 2 * (cfg.vlm.depth - 1) * pv * cfg.vlm.width * size
    mask_bytes = masks.numel() * 8
    assert entry.nbytes() == state_bytes + entry.image_mask.numel() + mask_bytes
    entry.masks = None                         # a dense-denoising entry: no mask bytes
    assert entry.nbytes() == state_bytes + entry.image_mask.numel()
