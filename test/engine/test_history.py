"""Observation history window: incremental prefill equals recomputing the whole window."""

from __future__ import annotations

import pytest
import torch

from vla_runtime.engine.dense import ModelInputs
from vla_runtime.engine.history import HistoryConfig, HistoryEngine, full_window_actions
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    return init_random_(Pi05Model(preset("pi05-tiny")), seed=11)


def _frame(cfg, seed):
    s = cfg.vision.image_size
    return torch.rand(1, 1, 3, s, s, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _prompt(cfg, n=9):
    tokens = torch.randint(4, cfg.vocab_size, (1, cfg.max_token_len), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :n] = True
    return tokens, mask


@pytest.mark.parametrize("pushes", [1, 2, 5])   # window not full, full, and wrapped around twice
def test_incremental_equals_full_recompute(model, pushes):
    cfg = model.cfg
    engine = HistoryEngine(model, HistoryConfig(frames=2, cameras=1))
    tokens, mask = _prompt(cfg)
    noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(1))
    frames = [_frame(cfg, 100 + i) for i in range(pushes)]
    for f in frames:
        out = engine.infer(ModelInputs(f, torch.ones(1, 1, dtype=torch.bool), tokens, mask), noise=noise)
    window = frames[-2:]
    ref = full_window_actions(model, window, tokens, mask, noise)
    torch.testing.assert_close(out.actions, ref, atol=1e-5, rtol=1e-5)
    assert out.actions.abs().mean() > 0.05


def test_window_sees_old_frames_and_forgets_evicted_ones(model):
    cfg = model.cfg
    tokens, mask = _prompt(cfg)
    noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(2))
    x = lambda f: ModelInputs(f, torch.ones(1, 1, dtype=torch.bool), tokens, mask)  # noqa: E731
    a, b, c = (_frame(cfg, s) for s in (1, 2, 3))
    e1 = HistoryEngine(model, HistoryConfig(frames=2))
    e1.infer(x(a)); e1.infer(x(b)); r1 = e1.infer(x(c), noise=noise).actions
    e2 = HistoryEngine(model, HistoryConfig(frames=2))
    e2.infer(x(_frame(cfg, 99))); e2.infer(x(b)); r2 = e2.infer(x(c), noise=noise).actions
    torch.testing.assert_close(r1, r2, atol=1e-6, rtol=1e-6)   # frame a was evicted: it no longer matters
    e3 = HistoryEngine(model, HistoryConfig(frames=2))
    e3.infer(x(a)); e3.infer(x(_frame(cfg, 98))); r3 = e3.infer(x(c), noise=noise).actions
    assert (r3 - r1).abs().max() > 1e-6                      # frame b is in the window: it matters


def test_history_config_is_validated(model):
    with pytest.raises(ValueError, match="cameras per frame"):
        HistoryEngine(model, HistoryConfig(frames=2, cameras=5))
    with pytest.raises(ValueError, match=">= 1"):
        HistoryEngine(model, HistoryConfig(frames=0))
    engine = HistoryEngine(model, HistoryConfig(frames=2, cameras=1))
    tokens, mask = _prompt(model.cfg)
    two = torch.cat([_frame(model.cfg, 1)] * 2, dim=1)
    with pytest.raises(ValueError, match="one frame of 1"):
        engine.infer(ModelInputs(two, torch.ones(1, 2, dtype=torch.bool), tokens, mask))


def test_history_bench_reports_exact_incremental_answers():
    from vla_runtime.commands.history_bench import run_history_bench

    r = run_history_bench("pi05-tiny", frames=3, calls=2, prompt_tokens=10, log=lambda m: None)
    assert r["max_abs_diff_vs_full"] < 1e-4
    assert r["median_s"]["incremental"] > 0 and r["median_s"]["full_recompute"] > 0


def test_bf16_soak_short():
    """CI-sized soak (the benchmark runs 2,000 calls): no NaN/Inf, deviation bounded, no upward drift."""
    from vla_runtime.commands.soak import run_soak

    r = run_soak("pi05-tiny", calls=60, history=2, log=lambda m: None)
    assert r["nonfinite_calls"] == 0
    dev = r["relative_deviation"]
    assert dev["max"] < 0.1
    assert dev["last_tenth_mean"] < 2 * dev["first_tenth_mean"] + 0.01
