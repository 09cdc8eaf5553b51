"""Synthetic repeated-task scenes: determinism, state/image agreement, similarity structure."""

from __future__ import annotations

import numpy as np
import pytest

from vla_runtime.io.bags import Episode
from vla_runtime.sim.arm import PlanarArm, keyframe_trajectory
from vla_runtime.sim.scenes import SceneConfig, end_effector_pixel, make_episode, make_episodes, task_layout

SHORT = SceneConfig(steps_per_episode=40)
OTHER_TASK = "put the green ball on the plate"


def _cos(a: np.ndarray, b: np.ndarray, centred: bool = False) -> float:
    a, b = a.astype(np.float32).ravel(), b.astype(np.float32).ravel()
    if centred:  # remove the mean so the shared brightness does not dominate
        a, b = a - a.mean(), b - b.mean()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _episode_similarity(x: Episode, y: Episode, camera: str, centred: bool = False) -> float:
    pairs = list(zip(x.frames, y.frames))[::4]  # every 4th frame covers all phases of the motion
    return float(np.mean([_cos(fx.images[camera], fy.images[camera], centred) for fx, fy in pairs]))


def _gripper_mask(img: np.ndarray) -> np.ndarray:
    """Pixels of the cyan gripper (no other scene colour has red < 40 with green, blue > 180)."""
    r, g, b = (img[..., c].astype(int) for c in range(3))
    return (r < 40) & (g > 180) & (b > 180)


def test_shapes_dtypes_and_timing_of_default_episode():
    cfg = SceneConfig()
    ep = make_episode(cfg, episode_seed=0)
    assert len(ep.frames) == 120 and ep.cameras == ("top", "wrist") and ep.state_dim == 7
    assert ep.task == cfg.task and ep.success is True and ep.episode_id and ep.source.startswith("sim:")
    for f in ep.frames:
        assert all(img.shape == (224, 224, 3) and img.dtype == np.uint8 for img in f.images.values())
        assert f.state.shape == (7,) and f.state.dtype == np.float32
    assert [f.t for f in ep.frames[:3]] == pytest.approx([0.0, 1 / 30, 2 / 30])
    grip = np.array([f.state[6] for f in ep.frames])
    assert grip[0] == 1.0 and grip.min() == pytest.approx(0.5)  # open, closes on the object, opens again
    assert grip[-1] == 1.0


def test_dual_arm_and_custom_size():
    cfg = SceneConfig(arms=2, cameras=("top", "wrist_left", "wrist_right"), image_size=96, steps_per_episode=30)
    ep = make_episode(cfg, episode_seed=5)
    assert cfg.state_dim == 14 and ep.state_dim == 14
    assert set(ep.cameras) == {"top", "wrist_left", "wrist_right"}
    assert ep.frames[0].images["wrist_right"].shape == (96, 96, 3)
    assert not np.array_equal(ep.frames[0].images["wrist_left"], ep.frames[0].images["wrist_right"])


def test_config_validation():
    with pytest.raises(ValueError, match="state_dim must be 14"):
        SceneConfig(arms=2, state_dim=7)
    with pytest.raises(ValueError, match="unknown camera 'wrist_right'"):
        SceneConfig(cameras=("top", "wrist_right"))
    with pytest.raises(ValueError, match="jitter"):
        SceneConfig(jitter=0.5)


def test_deterministic_per_seed():
    a, b = make_episode(SHORT, 7), make_episode(SHORT, 7)
    c = make_episode(SHORT, 8)
    for fa, fb in zip(a.frames, b.frames):
        assert np.array_equal(fa.state, fb.state)
        assert all(np.array_equal(fa.images[k], fb.images[k]) for k in fa.images)
    assert not np.array_equal(a.frames[20].images["top"], c.frames[20].images["top"])
    assert not np.array_equal(a.frames[20].state, c.frames[20].state)
    many, again = make_episodes(SHORT, 2, seed=3), make_episodes(SHORT, 2, seed=3)
    assert [e.episode_id for e in many] == [e.episode_id for e in again]
    assert many[0].episode_id != many[1].episode_id
    assert np.array_equal(many[1].frames[-1].images["wrist"], again[1].frames[-1].images["wrist"])


def test_joint_states_are_smooth():
    states = np.stack([f.state for f in make_episode(SceneConfig(), 1).frames])
    step = np.abs(np.diff(states, axis=0))
    assert step[:, :6].max() < 0.15  # radians per step at 30 Hz
    accel = np.abs(np.diff(states[:, :6], n=2, axis=0))  # joints; the gripper snaps faster
    assert accel.max() < 0.02


def test_images_agree_with_state():
    """The gripper is drawn where forward kinematics of the recorded joints puts it, in the top
    view; the wrist camera rides on it."""
    cfg = SceneConfig(noise=3.0)
    ep = make_episode(cfg, 2)
    positions = []
    for f in ep.frames[::10]:
        x, y = end_effector_pixel(cfg, f.state)
        mask = _gripper_mask(f.images["top"])
        ys, xs = np.nonzero(mask)
        assert xs.size > 10
        dist = np.hypot(xs - x, ys - y)
        assert dist.min() < 2.0  # the end effector itself is drawn
        assert dist.max() < 0.07 * cfg.image_size  # and nothing cyan far from it
        wrist = _gripper_mask(f.images["wrist"])
        assert wrist[int(0.7 * cfg.image_size):int(0.8 * cfg.image_size)].any()  # gripper fixed in the wrist view
        positions.append((x, y))
    travel = np.hypot(*np.diff(np.array(positions), axis=0).T).sum()
    assert travel > 0.5 * cfg.image_size  # the arm really moves


def test_end_effector_follows_single_joint():
    cfg = SceneConfig()
    state = make_episode(SHORT, 0).frames[0].state.copy()
    before = end_effector_pixel(cfg, state)
    state[0] += 0.2  # shoulder turns clockwise: the arm swings right on screen
    after = end_effector_pixel(cfg, state)
    assert after[0] > before[0] + 5


def test_same_task_more_similar_than_different_task():
    a1, a2 = make_episodes(SHORT, 2, seed=0)
    b = make_episode(SceneConfig(steps_per_episode=40, task=OTHER_TASK), 0)
    assert task_layout(SHORT.task).object_color != task_layout(OTHER_TASK).object_color
    for cam in ("top", "wrist"):
        same = _episode_similarity(a1, a2, cam)
        assert 0.95 < same < 0.9999  # alike, not identical
        assert same > _episode_similarity(a1, b, cam)
        assert _episode_similarity(a1, a2, cam, centred=True) > _episode_similarity(a1, b, cam, centred=True) + 0.03


def test_failure_differs_only_after_the_slip():
    ok, bad = make_episode(SHORT, 4, success=True), make_episode(SHORT, 4, success=False)
    assert ok.success is True and bad.success is False
    assert np.array_equal(ok.frames[5].images["top"], bad.frames[5].images["top"])
    assert not np.array_equal(ok.frames[-1].images["top"], bad.frames[-1].images["top"])
    assert all(np.array_equal(f.state, g.state) for f, g in zip(ok.frames, bad.frames))  # same arm motion


def test_arm_inverse_kinematics_and_trajectory():
    arm = PlanarArm(base=(0.5, 0.97))
    target = np.array([0.4, 0.45])
    q = arm.inverse_kinematics(target, np.asarray(arm.home), heading=0.3)
    assert np.allclose(arm.end_effector(q), target, atol=1e-3)
    assert arm.headings(q)[-1] == pytest.approx(0.3, abs=1e-2)
    traj = keyframe_trajectory([np.zeros(2), np.ones(2)], [10])
    assert traj.shape == (11, 2) and np.allclose(traj[[0, -1]], [[0, 0], [1, 1]])
    assert np.all(np.diff(traj[:, 0]) >= 0)


def test_render_observation_follows_any_state_and_matches_the_episode_scene():
    from vla_runtime.sim.scenes import ObservationRenderer, render_observation

    ep = make_episode(SHORT, episode_seed=3)
    first = ep.frames[0]
    imgs = render_observation(SHORT, 3, first.state)
    assert set(imgs) == set(SHORT.cameras)
    for cam in SHORT.cameras:
        assert imgs[cam].shape == first.images[cam].shape and imgs[cam].dtype == np.uint8
        # Same scene and pose; only the sensor noise differs.
        assert np.abs(imgs[cam].astype(int) - first.images[cam].astype(int)).mean() < 4.0
    renderer = ObservationRenderer(SHORT, episode_seed=3)
    moved = first.state.copy()
    moved[0] -= 0.3
    top = renderer.render(moved)["top"]
    ys, xs = np.nonzero(_gripper_mask(top))
    x, y = end_effector_pixel(SHORT, moved)
    assert abs(xs.mean() - x) < 8 and abs(ys.mean() - y) < 8
    # Deterministic, and another episode seed moves the scene (a new task target).
    np.testing.assert_array_equal(renderer.render(moved)["top"], top)
    assert np.abs(renderer.render(moved, episode_seed=4)["top"].astype(int) - top.astype(int)).mean() > 0.5
    with pytest.raises(ValueError, match="state must have shape"):
        renderer.render(np.zeros(3))
