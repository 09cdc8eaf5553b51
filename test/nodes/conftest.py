"""Fixtures shared by the node-layer tests: one pi05-tiny demo robot (checkpoint, episode bags)
with a reference repository built from its episodes, made once per test session."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from vla_runtime.cache.builder import BuildConfig, build_repository
from vla_runtime.cache.entry import PreparedEntry
from vla_runtime.ipc.layout import SlotLayout
from vla_runtime.ipc.ring import RingBuffer
from vla_runtime.models.config import PRESETS
from vla_runtime.nodes.working_set import working_set_layout
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.bags import list_episode_bags, read_episode
from vla_runtime.commands.demo import DemoSpec, demo_topics, make_demo

CAMS = ("top", "wrist")

# working-set tests without a model: pi05-tiny's shapes, small retrieval features and histories
WS_CFG = PRESETS["pi05-tiny"]()
RETRIEVAL, HISTORY = (4, 6), (3, 2)


def ws_entry(key, cams: int, seed: int, masks: bool = True, k: int = 8, groups: int = 2, slots: int | None = None,
             retrieval: torch.Tensor | None = None) -> PreparedEntry:
    """An entry recorded with ``cams`` cameras present out of ``slots`` camera slots (the robot's);
    ``retrieval``: its retrieval features (else random)."""
    g = torch.Generator().manual_seed(seed)
    pv = cams * WS_CFG.num_image_tokens
    shape = (WS_CFG.vlm.depth - 1, pv, WS_CFG.vlm.width)
    slots = WS_CFG.num_cameras if slots is None else slots
    mask = torch.tensor([True] * cams + [False] * (slots - cams))
    m = torch.randint(0, WS_CFG.expert.mlp_dim, (groups, WS_CFG.expert.depth, k), generator=g) if masks else None
    feats = torch.randn(RETRIEVAL, generator=g) if retrieval is None else retrieval
    return PreparedEntry(key, torch.randn(shape, generator=g), torch.randn(shape, generator=g), mask, m,
                         feats, torch.randn(HISTORY, generator=g))


def ws_layout() -> SlotLayout:
    return working_set_layout(WS_CFG, mask_groups=2, mask_size=8, dtype=torch.float32, retrieval_shape=RETRIEVAL,
                              history_shape=HISTORY)


def new_ws_ring(slots: int) -> RingBuffer:
    return RingBuffer.create(f"vla_ws_{os.getpid()}_{uuid.uuid4().hex[:6]}", ws_layout(), slots=slots)


@pytest.fixture
def ws_ring():
    r = new_ws_ring(3)
    yield r
    r.close()


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline_demo")
    info = make_demo(root, DemoSpec(preset="pi05-tiny", episodes=4, held_out=1, steps_per_episode=30), log=lambda m: None)
    policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=list(CAMS))
    build_repository(policy, policy.checkpoint_hash, list_episode_bags(info["references"]), root / "repo",
                     demo_topics(CAMS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), log=lambda m: None)
    episode = read_episode(list_episode_bags(info["held_out"])[0], demo_topics(CAMS), call_period=0.5)
    return {**info, "repo": root / "repo", "episode": episode}


class ReferenceOracle:
    """What a pipeline call must return given the reference it reports, computed in this process.

    Which reference a call gets depends on how far the cache manager's window had slid when the
    vision process selected (three processes run asynchronously, by design); what the call
    computes from that reference does not. So the oracle reconstructs the reported entry from the
    repository itself (``reconstruct_entry`` on its own model) and runs the cached engine with
    the halves the call used; a call that read a stale or torn working set would differ.

    It runs the same ``CachedEngine`` the pipeline runs, so by itself it could not see a bug in
    the caches' arithmetic (both sides would share it): these tests check the processes, the
    hand-offs and the reference bookkeeping. The engine itself is checked independently first:
    test/engine/test_cached.py compares ``CachedEngine`` with the Context Cache's recompute rule
    and the Action Cache's Eq. 4 written directly in torch from the model's weights (pi05-tiny),
    so the comparison here rests on an engine verified against plain formulas.
    """

    def __init__(self, demo: dict, seed: int, rho_p: float = 0.4):
        from vla_runtime.cache.repository import ReferenceRepository

        self.policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
        self.repo = ReferenceRepository.open(demo["repo"])
        self.seed, self.rho_p = seed, rho_p
        self._engines: dict[tuple[bool, bool], object] = {}

    def _engine(self, context: bool, action: bool):
        from vla_runtime.engine.cached import CacheConfig, CachedEngine

        if (context, action) not in self._engines:
            self._engines[context, action] = CachedEngine(self.policy.engine.model, CacheConfig(
                rho_p=self.rho_p, rho_n=self.repo.meta.rho_n, groups=tuple(tuple(g) for g in self.repo.meta.mask_groups),
                context_cache=context, action_cache=action))
        return self._engines[context, action]

    def entry(self, key):
        import torch

        from vla_runtime.cache.entry import reconstruct_entry
        from vla_runtime.cache.manager import stored_images_to_model

        call = self.repo.load_call(*key)
        return reconstruct_entry(self.policy.engine.model, key, stored_images_to_model(call.images),
                                 call.image_mask, call.tokens, call.token_mask, call.masks.to(torch.int64))

    def expect(self, frame, task: str, noise_key: int, reference=None, context: bool = False,
               action: bool = False):
        """Actions (robot units) of one call: dense without ``reference`` (an entry key), else with
        the reference's states in the halves named."""
        import torch

        from vla_runtime.engine.policy import Observation

        obs = Observation(frame.images, frame.state, task)
        noise = self.policy.engine.make_noise(1, torch.Generator().manual_seed(self.seed * 1_000_003 + noise_key))
        if reference is None or not (context or action):
            return self.policy.predict(obs, noise=noise).actions
        entry = self.entry(reference)
        res = self._engine(context, action).infer(self.policy.prepare(obs), noise=noise,
                                                  select=lambda features, inputs=None: entry)
        return self.policy.action_norm.unnormalize(res.actions[0]).numpy()

    def check(self, result, choice, frame, task: str, atol: float = 1e-5) -> None:
        """The pipeline's ``ChunkResult`` (noise of its ``request_seq``) against the oracle, given the
        reference it reports.

        atol: the oracle runs the same operations in another process layout (the slot's K/V copy
        is exact, but a different torch thread count may reorder float32 reductions): actions of
        order 1, a few float32 ulps through 10 Euler steps stay far below 1e-5."""
        import numpy as np

        key = (choice.episode, choice.index) if choice is not None and choice.found else None
        want = self.expect(frame, task, result.request_seq, key, bool(result.meta.context_cache), result.used_reference)
        np.testing.assert_allclose(result.chunk, want, rtol=0, atol=atol)


@pytest.fixture(scope="session")
def oracle(demo) -> ReferenceOracle:
    """The reference oracle of the demo robot at the pipelines' noise seed (3)."""
    return ReferenceOracle(demo, seed=3)


@pytest.fixture(scope="session")
def oracle_for():
    """An oracle for another demo robot a test builds itself: ``oracle_for(demo_dict, seed)``."""
    return ReferenceOracle
