"""Vision and policy workers split at the prefix K/V: together they equal the one-process engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.nodes.workers import PolicyWorker, PrefixSlotSpec, VisionWorker

CAMS = ["top", "wrist"]


@pytest.fixture(scope="module")
def policies(tiny_checkpoint_dir: Path) -> tuple[Pi05Policy, Pi05Policy, Pi05Policy]:
    # Three separately loaded copies: the reference, the vision side, the policy side.
    return tuple(Pi05Policy.from_checkpoint(tiny_checkpoint_dir, camera_names=CAMS) for _ in range(3))


def _obs(seed: int = 0, **over) -> Observation:
    rng = np.random.default_rng(seed)
    base = dict(images={"top": rng.integers(0, 255, (48, 64, 3), dtype=np.uint8),
                        "wrist": rng.integers(0, 255, (30, 30, 3), dtype=np.uint8)},
                state=np.array([0.1, -0.5, 0.3, 0.9], dtype=np.float32), task="pick up the red cube")
    base.update(over)
    return Observation(**base)


@pytest.mark.parametrize("obs", [_obs(0), _obs(1, images={"top": np.zeros((20, 20, 3), np.uint8)})])
def test_split_equals_one_process_engine(policies, obs):
    ref, vis, pol = policies
    noise = ref.engine.make_noise(1, torch.Generator().manual_seed(0))
    expected = ref.predict(obs, noise=noise).actions
    spec = PrefixSlotSpec.for_config(vis.engine.cfg)
    slot = spec.allocate()
    meta = VisionWorker(vis).encode(obs, slot, observation_seq=7, stamp_ns=123)
    assert meta.observation_seq == 7 and meta.length <= spec.max_prefix
    got = PolicyWorker(pol).act(slot, meta, noise=noise)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_policy_refuses_a_slot_outside_the_model(policies):
    _, vis, pol = policies
    slot = PrefixSlotSpec.for_config(vis.engine.cfg).allocate()
    meta = VisionWorker(vis).encode(_obs(), slot, 0, 0)
    meta.length = 10_000
    with pytest.raises(ValueError, match="outside the model's bounds"):
        PolicyWorker(pol).act(slot, meta)
