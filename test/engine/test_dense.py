"""The dense engine: input validation, phase timing, determinism."""

from __future__ import annotations

import pytest
import torch

from vla_runtime.engine.dense import DenseEngine, ModelInputs
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_


@pytest.fixture(scope="module")
def engine() -> DenseEngine:
    return DenseEngine(init_random_(Pi05Model(preset("pi05-tiny")), seed=2), max_batch=2,
                       tap_retrieval_features=True)


def _inputs(cfg, batch: int = 1) -> ModelInputs:
    s = cfg.vision.image_size
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(batch, cfg.max_token_len, dtype=torch.bool)
    mask[:, :6] = True
    return ModelInputs(images=torch.rand(batch, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1,
                       image_mask=torch.ones(batch, cfg.num_cameras, dtype=torch.bool),
                       tokens=torch.randint(0, cfg.vocab_size, (batch, cfg.max_token_len), generator=g),
                       token_mask=mask)


def test_phases_are_timed_and_output_is_finite(engine: DenseEngine):
    out = engine.infer(_inputs(engine.cfg), generator=torch.Generator().manual_seed(0))
    assert set(out.times.seconds) == {"vision", "prefill", "denoise"}
    assert all(v > 0 for v in out.times.seconds.values())
    assert out.times.total == pytest.approx(sum(out.times.seconds.values()))
    assert out.actions.shape == (1, engine.cfg.chunk_size, engine.cfg.action_dim)
    assert torch.isfinite(out.actions).all()
    cfg = engine.cfg
    assert out.retrieval_features.shape == (1, cfg.num_cameras, cfg.num_image_tokens, cfg.vision.width)


def test_fixed_noise_is_deterministic_and_generator_reproducible(engine: DenseEngine):
    x = _inputs(engine.cfg)
    noise = engine.make_noise(1, torch.Generator().manual_seed(5))
    a = engine.infer(x, noise=noise).actions
    assert torch.equal(a, engine.infer(x, noise=noise).actions)
    b = engine.infer(x, generator=torch.Generator().manual_seed(5)).actions
    assert torch.equal(a, b)
    c = engine.infer(x, generator=torch.Generator().manual_seed(6)).actions
    assert not torch.equal(a, c)


def _bad(engine, **changes) -> ModelInputs:
    x = _inputs(engine.cfg)
    for k, v in changes.items():
        setattr(x, k, v(getattr(x, k)) if callable(v) else v)
    return x


@pytest.mark.parametrize("change, message", [
    (dict(images=lambda t: t[..., :-1]), r"images must be \[B, N, 3, 56, 56\]"),
    (dict(images=lambda t: t[:, :, :1]), r"images must be \[B, N, 3, 56, 56\]"),
    (dict(images=lambda t: (t * 100).to(torch.uint8)), "floating point"),
    (dict(images=lambda t: t.masked_fill(torch.zeros_like(t, dtype=torch.bool).index_fill_(-1, torch.tensor([0]), True), float("nan"))), "NaN"),
    (dict(images=lambda t: torch.cat([t, t], 1)), "cameras given"),
    (dict(image_mask=lambda t: t.long()), "image_mask must be bool"),
    (dict(tokens=lambda t: t.int()), "tokens must be int64"),
    (dict(tokens=lambda t: t + 10_000), "token ids must lie in"),
    (dict(token_mask=lambda t: t[:, :-1]), "token_mask must be"),
])
def test_bad_inputs_are_refused_with_a_clear_error(engine: DenseEngine, change, message):
    with pytest.raises(ValueError, match=message):
        engine.infer(_bad(engine, **change))


def test_bad_noise_and_batch(engine: DenseEngine):
    with pytest.raises(ValueError, match="noise must be"):
        engine.infer(_inputs(engine.cfg), noise=torch.zeros(1, 3, 3))
    with pytest.raises(ValueError, match="exceeds the engine's max_batch"):
        engine.infer(_inputs(engine.cfg, batch=3))


def test_bfloat16_engine_tracks_float32():
    """bf16 weights and activations (the GPU setting) with fp32 norm statistics and softmax stay
    close to the fp32 answer on the same noise."""
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=2)
    x = _inputs(model.cfg)
    noise = torch.randn(1, model.cfg.chunk_size, model.cfg.action_dim, generator=torch.Generator().manual_seed(0))
    ref = DenseEngine(model).infer(x, noise=noise).actions
    model_bf16 = init_random_(Pi05Model(preset("pi05-tiny")), seed=2).to(torch.bfloat16)
    model_bf16.refresh_derived()
    out = DenseEngine(model_bf16).infer(x, noise=noise).actions
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.05, float(rel)
