"""ALOHA demonstrations recorded as an ALOHA records them: the profile's camera and per-arm
joint-state topics, the expert's 14 joint targets at every 50 Hz step, successes only, and read
back by the profile's own topic map into the state the policy node would assemble."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vla_runtime.io.bags import list_episode_bags, profile_topics, read_episode, read_joint_series
from vla_runtime.nodes.profile import load_profile
from vla_runtime.training.aloha_demos import AlohaDemoConfig, joint_layout, main, record_aloha_demos
from vla_runtime.training.recording import ACTION_TOPIC

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "config" / "aloha.yaml"


def test_recorded_episodes_read_back_through_the_profile(tmp_path):
    cfg = AlohaDemoConfig(episodes=2, profile=str(PROFILE), image_size=16, call_every=10, tail_steps=5)
    manifest = record_aloha_demos(cfg, tmp_path, log=lambda m: None)
    assert manifest["saved"] == 2 and manifest["failed_seeds"] == [] and manifest["labels"] == "expert"
    assert json.loads((tmp_path / "demos.json").read_text())["call_period"] == pytest.approx(0.2)
    profile = load_profile(PROFILE)
    assert manifest["topics"]["joint_states"] == {"/follower_left/joint_states": list(profile.joint_names[:7]),
                                                  "/follower_right/joint_states": list(profile.joint_names[7:])}
    bags = list_episode_bags(tmp_path)
    assert len(bags) == 2
    for bag in bags:
        ep = read_episode(bag, profile_topics(profile, outcome="/episode_outcome"), call_period=0.2)
        assert ep.success is True and ep.task.startswith("pick up the cube")
        assert sorted(ep.frames[0].images) == ["cam_high", "cam_left_wrist", "cam_right_wrist"]
        assert ep.frames[0].images["cam_high"].shape == (16, 16, 3)
        assert np.asarray(ep.frames[0].state).shape == (14,)
        actions = read_joint_series(bag, ACTION_TOPIC)
        steps = len(actions.values)
        assert actions.values.shape == (steps, 14) and np.isfinite(actions.values).all()
        np.testing.assert_allclose(np.diff(actions.t), 0.02, atol=1e-6)             # every 50 Hz step
        # a frame every 10 steps until the success, then 5 tail steps of actions only
        assert len(ep.frames) == -(-(steps - 5) // 10)
        # the frames' state moves: the arm that lifts the cube (right) ends far from home
        assert np.abs(np.asarray(ep.frames[-1].state)[7:13] - np.asarray(ep.frames[0].state)[7:13]).max() > 0.3


def test_joint_layout_follows_the_profile_arms():
    profile = load_profile(PROFILE)
    layout = joint_layout(profile)
    assert [len(v) for v in layout.values()] == [7, 7]


def test_a_profile_that_is_not_aloha_is_refused(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--episodes", "1", "--profile", str(ROOT / "config" / "franka.yaml")]) == 2
    assert "joints" in capsys.readouterr().err


def test_a_dagger_round_drives_through_the_safety_filter_and_keeps_failures(tmp_path, monkeypatch):
    """A driver that asks every joint for its upper limit at once: the executed commands move no
    faster than the profile's max_velocity, the expert still labels every step (its first target
    is the home pose), and the failed episode is kept under DAgger labels."""
    import vla_runtime.training.aloha_demos as demos

    profile = load_profile(PROFILE)
    upper, speed = np.asarray(profile.joint_upper), np.asarray(profile.max_velocity)
    states: list[np.ndarray] = []

    def fake_driver(checkpoint, cameras, *, threads, seed, arm_slices, state_dim):
        assert list(cameras) == [c.name for c in profile.cameras] and state_dim == 14
        assert arm_slices == tuple(tuple(s) for s in profile.arm_slices)

        def drive(images, state, instruction):
            states.append(np.asarray(state, np.float64))
            return np.tile(upper, (20, 1))
        return drive, lambda: None

    monkeypatch.setattr(demos, "pipeline_driver", fake_driver)
    (tmp_path / "ckpt").mkdir()
    cfg = AlohaDemoConfig(episodes=1, profile=str(PROFILE), image_size=16, max_steps=30, policy=str(tmp_path / "ckpt"),
                          beta=0.0)
    manifest = record_aloha_demos(cfg, tmp_path / "out", log=lambda m: None)
    assert manifest["labels"] == "dagger" and manifest["saved"] == 1 and manifest["failed_seeds"] == [0]
    assert len(states) == 3                                            # a call every 10 of the 30 steps
    # the arm joints (grippers are normalised differently) follow commands that move at most
    # max_velocity over the 10 steps (0.2 s), plus what the position servos overshoot; unfiltered,
    # some would have jumped to their upper limit
    arm = np.r_[0:6, 7:13]
    moved, asked = np.abs(states[1] - states[0])[arm], np.abs(upper - states[0])[arm]
    assert asked.max() > 2 * speed[arm].max() * 0.2
    assert moved.max() > 0.05 and (moved <= speed[arm] * 0.2 * 1.2).all()
    bag = list_episode_bags(tmp_path / "out")[0]
    ep = read_episode(bag, profile_topics(profile, outcome="/episode_outcome"), call_period=0.2)
    assert ep.success is False and "dagger" in ep.source
    labels = read_joint_series(bag, ACTION_TOPIC).values
    assert labels.shape == (30, 14)
    np.testing.assert_allclose(labels[0, arm], states[0][arm], atol=0.07)   # the expert's first target: near home
    with pytest.raises(ValueError, match="beta"):
        AlohaDemoConfig(beta=-0.1).validate()
    with pytest.raises(FileNotFoundError, match="--policy"):
        AlohaDemoConfig(policy=str(tmp_path / "none")).validate()
