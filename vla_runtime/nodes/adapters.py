"""Robot adapters: one control tick's action -> the commands an Interbotix (ALOHA) arm takes.

Interbotix arms take a ``JointGroupCommand`` per group (the arm's joints) and a
``JointSingleCommand`` per single joint (the gripper) on every control tick. These functions say
what to send; the policy node builds the messages (the message package comes from the Interbotix
workspace, not PyPI, so the mapping is tested here without it).
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
