"""Observation -> action chunk through a checkpoint directory as users bring it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.engine.policy import Observation, Pi05Policy

CAMS = ["top", "wrist"]


@pytest.fixture(scope="module")
def policy(tiny_checkpoint_dir: Path) -> Pi05Policy:
    return Pi05Policy.from_checkpoint(tiny_checkpoint_dir, camera_names=CAMS)


def _obs(**over) -> Observation:
    rng = np.random.default_rng(0)
    base = dict(images={"top": rng.integers(0, 255, (48, 64, 3), dtype=np.uint8),
                        "wrist": rng.integers(0, 255, (30, 30, 3), dtype=np.uint8)},
                state=np.array([0.1, -0.5, 0.3, 0.9], dtype=np.float32), task="pick up the red cube")
    base.update(over)
    return Observation(**base)


def test_predicts_a_chunk_in_robot_units(policy: Pi05Policy):
    out = policy.predict(_obs(), generator=torch.Generator().manual_seed(0))
    assert out.actions.shape == (policy.engine.cfg.chunk_size, 5)
    assert np.isfinite(out.actions).all()
    again = policy.predict(_obs(), generator=torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(out.actions, again.actions)
    # Unnormalisation really applied: raw model output maps through the stats.
    raw = out.engine.actions[0, :, :5]
    np.testing.assert_allclose(out.actions, policy.action_norm.unnormalize(raw).numpy(), rtol=1e-6)


def test_state_reaches_the_prompt(policy: Pi05Policy):
    a = policy.prepare(_obs())
    b = policy.prepare(_obs(state=np.array([0.9, 0.9, -0.9, 0.0], dtype=np.float32)))
    assert not torch.equal(a.tokens, b.tokens)
    text = policy.tokenizer.decode(a.tokens[0][a.token_mask[0]])
    assert text.startswith("Task: pick up the red cube, State: ") and text.endswith(";\nAction: ")


def test_missing_camera_is_masked(policy: Pi05Policy):
    x = policy.prepare(_obs(images={"top": np.zeros((10, 10, 3), np.uint8)}))
    assert x.image_mask.tolist() == [[True, False]]
    assert torch.isfinite(torch.as_tensor(policy.predict(_obs(images={"top": np.zeros((10, 10, 3), np.uint8)})).actions)).all()


@pytest.mark.parametrize("over, message", [
    (dict(state=np.zeros(3, np.float32)), r"state must be a vector of 4 values, got shape \(3,\)"),
    (dict(state=np.zeros((2, 4), np.float32)), r"state must be a vector of 4 values"),
    (dict(state=np.array([0.0, np.nan, 0.0, 0.0])), "NaN or Inf"),
    (dict(state=np.array(["a", "b", "c", "d"])), "state must be a numeric vector"),
    (dict(images={"top": np.zeros((10, 10), np.float64) + 3.0}), "camera 'top'"),
    (dict(images={"top": np.zeros((0, 10, 3), np.uint8)}), "camera 'top'"),
    (dict(images={"left": np.zeros((10, 10, 3), np.uint8)}), r"unknown camera\(s\) \['left'\]"),
    (dict(images={}), "no camera image"),
    (dict(task="  "), "non-empty string"),
])
def test_bad_observations_are_refused(policy: Pi05Policy, over, message):
    with pytest.raises(ValueError, match=message):
        policy.predict(_obs(**over))
