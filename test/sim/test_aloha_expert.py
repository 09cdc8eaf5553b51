"""The scripted transfer-cube expert: joint targets from task-space waypoints through inverse
kinematics hand the cube over on gym-aloha's own success signal, wherever the cube starts."""

from __future__ import annotations

import numpy as np
import pytest

from vla_runtime.sim.aloha_env import STATE_DIM, AlohaSimConfig, AlohaTask
from vla_runtime.sim.aloha_expert import ArmIK, TransferCubeExpert, Waypoint, frame, interpolate


@pytest.fixture(scope="module")
def env():
    with AlohaTask(AlohaSimConfig(image_size=16)) as e:
        yield e


@pytest.mark.parametrize("seed", [0, 7, 31])
def test_the_expert_hands_the_cube_over(env, seed):
    env.reset(seed)
    expert = TransferCubeExpert(env)
    expert.reset()
    lifted, last = False, np.asarray(env.state(), np.float64)
    limit = np.array(([3.0] * 6 + [5.0]) * 2) * 0.02 + 1e-9       # the ALOHA profile's max_velocity, per step
    while True:
        action = expert.action()
        assert action.shape == (STATE_DIM,) and np.isfinite(action).all()
        assert 0.0 <= action[6] <= 1.0 and 0.0 <= action[13] <= 1.0
        assert (np.abs(action - last) <= limit).all()                # the safety filter would pass it unchanged
        last = action
        step = env.step(action)
        lifted = lifted or step.reward == 2          # the right arm alone holds it off the table
        if step.done:
            break
    assert step.success and lifted and env.steps < 350


def test_the_left_arm_waits_when_the_cube_was_not_lifted(env):
    """The robot holds still (a policy that never grasped, as in DAgger): at the hand-over the cube
    is still on the table, so the left arm's targets stay at its waiting point instead of
    reaching for it; the right arm's plan is unchanged."""
    held = np.asarray(env.reset(4), np.float64)
    expert = TransferCubeExpert(env)
    expert.reset()
    targets = []
    for _ in range(320):
        targets.append(expert.action())
        env.step(held)
    targets = np.array(targets)
    assert env.object_position()[2] < expert.plan.lifted_above
    wait = expert.plan.handover - 1
    np.testing.assert_allclose(targets[wait:, :7], np.tile(targets[wait, :7], (320 - wait, 1)), atol=1e-6)
    assert np.abs(np.diff(targets[wait:, 7:13], axis=0)).max() < 1e-6     # right arm: at the meeting point
    # with the cube lifted (the plan executed) the left arm does move after the hand-over
    env.reset(4)
    expert.reset()
    moving = []
    for _ in range(320):
        moving.append(expert.action())
        env.step(moving[-1])
    assert np.abs(np.array(moving)[-1, :6] - np.array(moving)[wait, :6]).max() > 0.1


def test_ik_reaches_a_reachable_pose_and_keeps_the_joint_ranges(env):
    env.reset(0)
    ik = ArmIK(env.physics)
    q0 = np.asarray(env.state()[7:13], np.float64)
    target, rot = np.array([0.1, 0.45, 0.1]), frame([-0.5, 0.0, -1.0], [0.0, -1.0, 0.0])
    q = ik.solve("right", q0, target, rot)
    point, got = ik.pose("right", q)
    # within millimetres (the pull towards zero forearm roll costs a little), on the unflipped branch
    assert np.linalg.norm(point - target) < 5e-3 and np.abs(got - rot).max() < 0.05 and abs(q[3]) < 0.3
    lo, hi = env.physics.model.jnt_range[8:14].T
    assert (q >= lo).all() and (q <= hi).all()


def test_every_demonstration_takes_the_same_wrist_branch(env):
    """The same pose with the same joint values in every episode: a policy learns one branch."""
    rolls = []
    for seed in (0, 2, 5):
        env.reset(seed)
        expert = TransferCubeExpert(env)
        expert.reset()
        actions = np.stack([expert.action() for _ in range(200)])   # the plan to the lift (no physics needed)
        rolls.append(actions[:, [3, 10]])
    assert np.abs(np.stack(rolls)).max() < 0.5          # no episode rolls a forearm towards +-pi


def test_waypoints_interpolate_in_time_and_hold_after_the_last():
    a = Waypoint(0, np.zeros(3), np.eye(3), 1.0)
    b = Waypoint(10, np.ones(3), frame([0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]), 0.0)
    p, r, g = interpolate([a, b], 5)
    np.testing.assert_allclose(p, 0.5)
    assert g == pytest.approx(0.5)
    np.testing.assert_allclose(r @ r.T, np.eye(3), atol=1e-9)       # a rotation, not a blend of two
    p, r, g = interpolate([a, b], 50)
    np.testing.assert_allclose(p, 1.0)
    assert g == 0.0


def test_the_expert_needs_its_task_and_a_reset():
    with AlohaTask(AlohaSimConfig(task="insertion", image_size=16)) as other:
        with pytest.raises(ValueError, match="transfer_cube"):
            TransferCubeExpert(other)
    with AlohaTask(AlohaSimConfig(image_size=16)) as e:
        with pytest.raises(RuntimeError, match="reset"):
            TransferCubeExpert(e).action()
