"""Message conversions at the node boundary: the one place robot input is validated.

Everything a node receives goes through here before it reaches a worker: images (raw or
compressed) to RGB arrays, joint states to a state vector in the profile's joint order, and
action chunks out to ``trajectory_msgs/JointTrajectory``. A bad message raises
``InputError`` with a diagnostic; the node reports it and keeps its last safe state, so the
engine never sees malformed data. The functions only read attributes of the message objects,
so rclpy messages and rosbags messages (replay) go through the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..io.bags import COMPRESSED_IMAGE_TYPE, IMAGE_TYPE, decode_image_message


class InputError(ValueError):
    """A message that must not reach the engine; the text is the diagnostic."""


def image_from_msg(msg: Any, compressed: bool, camera: str, max_side: int = 4096) -> np.ndarray:
    """uint8 RGB [H, W, 3] from ``sensor_msgs/Image`` or ``CompressedImage``."""
    try:
        img = decode_image_message(msg, COMPRESSED_IMAGE_TYPE if compressed else IMAGE_TYPE)
    except (ValueError, AttributeError, TypeError) as e:
        raise InputError(f"camera {camera!r}: {e}") from None
    if max(img.shape[:2]) > max_side:
        raise InputError(f"camera {camera!r}: image {img.shape[1]}x{img.shape[0]} exceeds {max_side} pixels a side")
    return img


@dataclass
class JointStateAssembler:
    """Joint states (possibly several topics, e.g. one per arm) -> one vector in profile order.

    Bag reading (``vla_runtime.io.bags.read_episode`` with joint names, hence replay and the
    cache builder) feeds recorded messages through this same class, so a recording is
    assembled and refused exactly as the policy node does it live.
    """

    joint_names: Sequence[str]

    def __post_init__(self) -> None:
        self.index = {n: i for i, n in enumerate(self.joint_names)}
        self.state = np.full(len(self.joint_names), np.nan)
        self.stamp_ns = np.zeros(len(self.joint_names), dtype=np.int64)

    def update(self, msg: Any, stamp_ns: int) -> None:
        names, pos = list(msg.name), list(msg.position)
        if len(names) != len(pos):
            raise InputError(f"JointState has {len(names)} names but {len(pos)} positions")
        known = [(self.index[n], p) for n, p in zip(names, pos) if n in self.index]
        if not known:
            raise InputError(f"JointState names {names[:8]} match none of the profile's joints {list(self.joint_names)[:8]}")
        bad = [n for n, p in zip(names, pos) if n in self.index and not math.isfinite(p)]
        if bad:
            raise InputError(f"JointState has non-finite positions for {bad}")
        for i, p in known:
            self.state[i] = p
            self.stamp_ns[i] = stamp_ns

    def complete(self) -> bool:
        return bool(np.isfinite(self.state).all())

    def missing(self) -> list[str]:
        """The profile's joints no accepted message has named yet, in profile order: what
        keeps the state incomplete (replay names them when a recording never has them)."""
        return [n for n, v in zip(self.joint_names, self.state) if not math.isfinite(v)]

    def vector(self) -> np.ndarray:
        missing = self.missing()
        if missing:
            raise InputError(f"no joint state received yet for {missing}")
        return self.state.astype(np.float32)

    def oldest_stamp_ns(self) -> int:
        return int(self.stamp_ns.min())


def chunk_to_trajectory(actions: np.ndarray, joint_names: Sequence[str], first_action_time_ns: int, period_s: float,
                        make_trajectory: Callable[[], Any], make_point: Callable[[], Any],
                        make_duration: Callable[[int, int], Any], make_time: Callable[[int, int], Any],
                        frame_id: str = "") -> Any:
    """A ``JointTrajectory``: header stamp = when the first action takes effect (future), point i
    at ``time_from_start = i * period``. Refuses non-finite actions (they must never be sent)."""
    actions = np.asarray(actions, dtype=np.float64)
    if actions.ndim != 2 or actions.shape[1] != len(joint_names):
        raise InputError(f"chunk must be [C, {len(joint_names)}], got {actions.shape}")
    if not np.isfinite(actions).all():
        raise InputError("refusing to publish a chunk with NaN/Inf")
    traj = make_trajectory()
    sec, nsec = divmod(int(first_action_time_ns), 1_000_000_000)
    traj.header.stamp = make_time(sec, nsec)
    traj.header.frame_id = frame_id
    traj.joint_names = list(joint_names)
    points = []
    for i, row in enumerate(actions):
        pt = make_point()
        pt.positions = [float(x) for x in row]
        s, ns = divmod(int(round(i * period_s * 1e9)), 1_000_000_000)
        pt.time_from_start = make_duration(s, ns)
        points.append(pt)
    traj.points = points
    return traj
