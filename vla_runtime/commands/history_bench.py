"""``vla-runtime bench --history K``: incremental history prefill vs recomputing the whole window.

Each call adds one observation to a window of K frames. Incremental: vision and VLM work for the
newest frame only, the window merged from the FIFO, the prompt prefilled. Full: vision for all K
frames and one prefill over the whole window (same attention structure). Same inputs and noise;
the two answers are compared as well.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..engine.history import HistoryConfig, HistoryEngine, full_window_actions
from ..engine.dense import ModelInputs
from ..models.config import preset
from ..models.pi05 import Pi05Model, init_random_
from ..progress import Progress, silent


def run_history_bench(preset_name: str = "pi05-small", frames: int = 10, calls: int = 5, prompt_tokens: int = 64,
                      threads: int | None = None, seed: int = 0, log=print, progress: Progress = silent) -> dict:
    if threads:
        torch.set_num_threads(threads)
    load_before = os.getloadavg()
    cfg = preset(preset_name)
    model = init_random_(Pi05Model(cfg), seed=seed)
    engine = HistoryEngine(model, HistoryConfig(frames=frames, cameras=1))
    s = cfg.vision.image_size
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, cfg.vocab_size, (1, cfg.max_token_len), generator=g)
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :min(prompt_tokens, cfg.max_token_len)] = True
    noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=g)
    frames_seen = []
    inc, full, devs = [], [], []
    bar = progress(f"{frames} frames to fill the window, then {calls} timed", frames + calls, "call")
    for i in range(frames + calls):
        bar.update()
        f = torch.rand(1, 1, 3, s, s, generator=g) * 2 - 1
        frames_seen.append(f)
        t0 = time.perf_counter()
        out = engine.infer(ModelInputs(f, torch.ones(1, 1, dtype=torch.bool), tokens, mask), noise=noise)
        t_inc = time.perf_counter() - t0
        if i < frames:
            continue
        t0 = time.perf_counter()
        ref = full_window_actions(model, frames_seen[-frames:], tokens, mask, noise)
        t_full = time.perf_counter() - t0
        inc.append(t_inc)
        full.append(t_full)
        devs.append(float((out.actions - ref).abs().max()))
        bar.set_postfix_str(f"incremental {t_inc * 1e3:.0f} ms, full recompute {t_full * 1e3:.0f} ms", refresh=False)
    bar.close()
    return {"preset": preset_name, "frames": frames, "calls": calls, "prompt_tokens": prompt_tokens,
            "median_s": {"incremental": statistics.median(inc), "full_recompute": statistics.median(full)},
            "speedup": statistics.median(full) / statistics.median(inc),
            "max_abs_diff_vs_full": max(devs),
            "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "loadavg_before": load_before, "loadavg_after": os.getloadavg()}}
