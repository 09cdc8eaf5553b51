"""Captured phases (``engine.graphs``): every input goes through the static buffers.

On a CPU the ``eager`` backend keeps the capture discipline of a CUDA graph (the closure and the
objects it built are made once, replays only refill static tensors), so a call whose input
bypassed those buffers would return the captured call's result. Every call below changes what
the previous one captured with (images, prompt length, camera layout, reference, masks, noise)
and must still equal the uncaptured engine exactly.
"""

from __future__ import annotations

import pytest
import torch

from vla_runtime.cache.entry import PreparedEntry, reconstruct_entry
from vla_runtime.cache.masks import profile_masks
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.dense import DenseEngine, ModelInputs
from vla_runtime.engine.graphs import GraphCache, StaticPhase
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    return init_random_(Pi05Model(preset("pi05-tiny")), seed=11)


def _inputs(cfg, seed: int, n_text: int = 12, cams: tuple[bool, ...] | None = None) -> ModelInputs:
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(1, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :n_text] = True
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_token_len), generator=g)
    cams = cams or (True,) * cfg.num_cameras
    return ModelInputs(images, torch.tensor([cams]), tokens, mask)


def _noise(cfg, seed: int) -> torch.Tensor:
    return torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(seed))


def _entry(model: Pi05Model, x: ModelInputs, seed: int) -> PreparedEntry:
    model.setup_caches(1)
    entry = reconstruct_entry(model, ("ep", seed), x.images[0], x.image_mask[0], x.tokens[0], x.token_mask[0], None)
    image_tokens, _ = model.embed_images(x.images)
    prefix = model.build_prefix(image_tokens, x.image_mask, x.tokens, x.token_mask)
    with torch.no_grad():
        model.prefill(prefix)
        groups = CacheConfig().validate(model.cfg.num_steps).groups
        entry.masks = profile_masks(model, prefix, _noise(model.cfg, seed), groups, 0.5)
    return entry


def test_dense_phases_replay_with_every_new_input(model):
    cfg = model.cfg
    plain, captured = DenseEngine(model, cuda_graphs=False), DenseEngine(model, cuda_graphs=True)
    assert captured.graphs is not None and captured.graphs.backend == "eager"
    calls = [_inputs(cfg, 0), _inputs(cfg, 1), _inputs(cfg, 2, n_text=20), _inputs(cfg, 3, cams=(True, False)),
             _inputs(cfg, 4)]
    for i, x in enumerate(calls):
        noise = _noise(cfg, 10 + i)
        want = plain.infer(x, noise=noise).actions
        got = captured.infer(x, noise=noise).actions
        assert torch.equal(got, want), f"call {i}"
    # vision once (same camera count), prefill and denoise once per prefix layout (3 layouts)
    assert captured.graphs.captures == 1 + 3 + 3


def test_cached_phases_replay_with_every_new_reference(model):
    cfg = model.cfg
    refs = [_entry(model, _inputs(cfg, 20 + k), seed=k) for k in range(3)]
    assert not torch.equal(refs[0].masks, refs[1].masks)
    plain = CachedEngine(model, CacheConfig(rho_p=0.4, rho_n=0.5), cuda_graphs=False)
    captured = CachedEngine(model, CacheConfig(rho_p=0.4, rho_n=0.5), cuda_graphs=True)
    sequence = [(0, 30), (1, 31), (2, 32), (None, 33), (1, 34)]     # the last reuses the captured phases
    for ref, seed in sequence:
        x = _inputs(cfg, seed)
        select = None if ref is None else (lambda f, i, e=refs[ref]: e)
        want = plain.infer(x, noise=_noise(cfg, seed), select=select)
        got = captured.infer(x, noise=_noise(cfg, seed), select=select)
        assert torch.equal(got.actions, want.actions), f"reference {ref}"
        assert (captured.last_context is None) == (ref is None)
        assert torch.equal(got.retrieval_features, want.retrieval_features)
    # vision 1; prefill: with context cache, dense; denoise: with action cache, dense
    assert captured.graphs.captures == 1 + 2 + 2


def test_graph_cache_keeps_the_most_recent_and_eager_replays_the_closure():
    calls = []
    cache = GraphCache("eager", torch.device("cpu"), capacity=2)
    box = torch.zeros(1)

    def make(tag):
        return lambda: (calls.append(tag), box + len(calls))[1]
    a = cache.get("a", lambda: make("a"))
    cache.get("b", lambda: make("b"))
    assert cache.get("a", lambda: make("a2")) is a            # hit: not rebuilt
    cache.get("c", lambda: make("c"))                          # evicts b, the least recently used
    assert len(cache) == 2 and cache.captures == 3
    box.fill_(100)
    assert float(a.replay()) == 100 + len(calls)               # replays read the static tensors
    with pytest.raises(ValueError, match="CUDA device"):
        StaticPhase(lambda: box, "cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match="capacity"):
        GraphCache("eager", torch.device("cpu"), capacity=0)
    with pytest.raises(ValueError, match="graph backend"):
        StaticPhase(lambda: box, "triton", torch.device("cpu"))  # type: ignore[arg-type]
