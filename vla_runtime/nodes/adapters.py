"""Robot adapters: actions -> what each of the robot's controllers takes.

Interbotix arms take a ``JointGroupCommand`` per group (the arm's joints) and a
``JointSingleCommand`` per single joint (the gripper) on every control tick. A ros2_control arm
takes a JointTrajectory of exactly the joints its controller owns (``trajectory_parts``), and a
gripper on its own controller the gripper column mapped to its finger joints
(``gripper_positions``). These functions say what to send; the policy node builds the messages
(the mapping is tested here without ROS).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .profile import OutputSpec


@dataclass(frozen=True)
class JointCommand:
    topic_index: int      # index into the output's topics (groups) or single_topics (singles)
    name: str             # Interbotix group or joint name ("arm", "gripper")
    values: tuple[float, ...]


def group_commands(out: OutputSpec, action: np.ndarray) -> list[JointCommand]:
    """One group command per output topic, with that topic's slice of the action."""
    slices = out.joint_slices or ((0, len(action)),)
    return [JointCommand(i, group, tuple(float(x) for x in action[a:b]))
            for i, (group, (a, b)) in enumerate(zip(out.groups, slices))]


def single_commands(out: OutputSpec, action: np.ndarray) -> list[JointCommand]:
    """One single-joint command per ``single_topics`` entry (ALOHA: each arm's gripper)."""
    return [JointCommand(i, name, (float(action[j]),))
            for i, (name, j) in enumerate(zip(out.single_names, out.single_joints))]


def trajectory_parts(out: OutputSpec, joint_names: tuple[str, ...], actions: np.ndarray) -> list[tuple[int, tuple[str, ...], np.ndarray]]:
    """(topic index, joint names, [points, joints] positions) per trajectory topic: each arm
    topic its slice of the joints (default: all of them to the first topic)."""
    slices = out.joint_slices or ((0, len(joint_names)),)
    return [(i, tuple(joint_names[a:b]), actions[:, a:b]) for i, (a, b) in enumerate(slices[:len(out.topics)])]


def gripper_positions(out: OutputSpec, actions: np.ndarray) -> np.ndarray:
    """[points, fingers]: the gripper column times ``gripper_scale`` for each finger joint."""
    col = np.asarray(actions, dtype=np.float64)[:, out.gripper_joint] * out.gripper_scale
    return np.repeat(col[:, None], len(out.gripper_joint_names), axis=1)
