"""``vla-runtime soak``: many consecutive calls in bf16 against fp32, looking for NaN/Inf and drift.

A streaming robot calls the policy tens of times a second for hours, with fresh noise every call
and, with a history window, state carried from call to call. This replays a synthetic episode
over and over through a bf16 engine and an fp32 engine on the same inputs and noise and records
the deviation of every call; drift means the deviation grows with the number of calls.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from ..engine.dense import DenseEngine, ModelInputs
from ..engine.history import HistoryConfig, HistoryEngine
from ..models.config import preset
from ..models.pi05 import Pi05Model, init_random_
from ..models.preprocess import ImagePreprocessor
from ..sim.scenes import SceneConfig, make_episode


def _engine(model: Pi05Model, history: int):
    return HistoryEngine(model, HistoryConfig(frames=history)) if history else DenseEngine(model)


def run_soak(preset_name: str = "pi05-tiny", calls: int = 2000, history: int = 4, seed: int = 0,
             dtype: str = "bfloat16", log=print, log_every: int = 200) -> dict:
    cfg = preset(preset_name)
    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ref_model = init_random_(Pi05Model(cfg), seed=seed)
    low_model = init_random_(Pi05Model(cfg), seed=seed).to(low)
    low_model.refresh_derived()
    ref, test = _engine(ref_model, history), _engine(low_model, history)
    cams = 1 if history else min(2, cfg.num_cameras)
    scene = SceneConfig(image_size=cfg.vision.image_size, cameras=("top", "wrist")[:cams], steps_per_episode=60)
    episode = make_episode(scene, seed)
    pre = ImagePreprocessor(size=(cfg.vision.image_size, cfg.vision.image_size))
    frames = [torch.stack([pre(f.images[c]) for c in scene.cameras])[None] for f in episode.frames]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, cfg.vocab_size, (1, cfg.max_token_len), generator=g)
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :min(40, cfg.max_token_len)] = True
    devs, nonfinite = [], 0
    t0 = time.perf_counter()
    for i in range(calls):
        x = ModelInputs(frames[i % len(frames)], torch.ones(1, cams, dtype=torch.bool), tokens, mask)
        noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=g)
        a = ref.infer(x, noise=noise).actions
        b = test.infer(x, noise=noise).actions
        if not bool(torch.isfinite(b).all()):
            nonfinite += 1
            continue
        devs.append(float((b - a).norm() / a.norm().clamp_min(1e-12)))
        if log_every and (i + 1) % log_every == 0:
            log(f"{i + 1}/{calls} calls, relative deviation mean {statistics.fmean(devs):.4f} max {max(devs):.4f}")
    tenth = max(1, len(devs) // 10)
    first, last = devs[:tenth], devs[-tenth:]
    slope = float(np.polyfit(np.arange(len(devs)), np.asarray(devs), 1)[0]) if len(devs) > 1 else 0.0
    return {"preset": preset_name, "dtype": dtype, "calls": calls, "history_frames": history,
            "nonfinite_calls": nonfinite,
            "relative_deviation": {"mean": statistics.fmean(devs) if devs else math.nan, "max": max(devs, default=math.nan),
                                   "first_tenth_mean": statistics.fmean(first) if first else math.nan,
                                   "last_tenth_mean": statistics.fmean(last) if last else math.nan,
                                   "slope_per_call": slope},
            "seconds": time.perf_counter() - t0}
