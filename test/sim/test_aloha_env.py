"""gym-aloha harness: seeded object poses, joint-space stepping in the profile's units, cameras
rendered on demand under the profile's names, bad actions refused."""

from __future__ import annotations

import numpy as np
import pytest

from vla_runtime.sim.aloha_env import STATE_DIM, AlohaSimConfig, AlohaTask


@pytest.fixture(scope="module")
def env():
    with AlohaTask(AlohaSimConfig(image_size=32, max_steps=30)) as e:
        yield e


def _object_pose(env: AlohaTask) -> np.ndarray:
    return env._env.physics.named.data.qpos[-7:].copy()


def test_seed_sets_the_object_pose(env):
    env.reset(0)
    a = _object_pose(env)
    env.reset(1)
    b = _object_pose(env)
    env.reset(0)
    np.testing.assert_array_equal(_object_pose(env), a)
    assert not np.allclose(a[:3], b[:3])


def test_holding_the_home_pose_keeps_the_arms_still_until_the_episode_ends(env):
    home = env.reset(0)
    assert home.shape == (STATE_DIM,) and home.dtype == np.float32
    assert 0.0 <= home[6] <= 1.0 and 0.0 <= home[13] <= 1.0      # grippers normalised
    for i in range(30):
        step = env.step(home)
        assert step.done == (i == 29) and not step.success and step.reward == 0
    np.testing.assert_allclose(step.state, home, atol=0.02)


def test_a_joint_target_moves_that_joint(env):
    home = env.reset(0)
    target = home.copy()
    target[0] += 0.3                       # left waist
    for _ in range(25):
        state = env.step(target).state
    assert state[0] - home[0] > 0.2 and abs(state[7] - home[7]) < 0.02


def test_cameras_are_rendered_under_the_profile_names(env):
    env.reset(0)
    images = env.render()
    assert sorted(images) == ["cam_high", "cam_left_wrist", "cam_right_wrist"]
    for img in images.values():
        assert img.shape == (32, 32, 3) and img.dtype == np.uint8 and img.std() > 1.0   # not blank


def test_bad_actions_and_cameras_are_refused(env):
    env.reset(0)
    with pytest.raises(ValueError, match="14 finite"):
        env.step(np.zeros(7))
    with pytest.raises(ValueError, match="14 finite"):
        env.step(np.full(STATE_DIM, np.nan))
    with pytest.raises(ValueError, match="no camera"):
        AlohaTask(AlohaSimConfig(cameras={"cam_high": "ceiling"}))
    with pytest.raises(ValueError, match="unknown gym-aloha task"):
        AlohaSimConfig(task="laundry").validate()
