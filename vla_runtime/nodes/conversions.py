"""Message conversions at the node boundary: the one place robot input is validated.

Everything a node receives goes through here before it reaches a worker: header stamps (from
the future, too old), camera freshness (a camera that stopped or froze), the instruction, and
action chunks out to ``trajectory_msgs/JointTrajectory``. Images (raw or compressed) to RGB
arrays and joint states to a state vector in the profile's joint order go through
``vla_runtime.io.messages`` (``image_from_msg``, ``JointStateAssembler``), which the bag reader
shares. A bad message raises ``InputError`` with a diagnostic; the node reports it and keeps
its last safe state, so the engine never sees malformed data. The functions only read
attributes of the message objects, so rclpy messages and rosbags messages (replay) go through
the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..io.messages import InputError, JointStateAssembler


MAX_INSTRUCTION_CHARS = 1000


def stamp_ns(msg: Any) -> int:
    """A message's ``header.stamp`` in nanoseconds; 0 for a message without a header or with a
    zero stamp (unstamped: the stamp checks below do not apply to it)."""
    header = getattr(msg, "header", None)
    stamp = getattr(header, "stamp", None)
    if stamp is None:
        return 0
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


@dataclass(frozen=True)
class StampCheck:
    """Header stamps against this node's clock: further ahead than ``max_future_s`` (a robot
    clock not synchronised with ours, a bug) or older than ``max_age_s`` (a backlog, a replayed
    message) is refused. 0 turns that check off; unstamped messages (stamp 0) are not checked."""

    max_age_s: float = 1.0
    max_future_s: float = 0.5

    def check(self, stamp: int, now_ns: int, what: str) -> None:
        if stamp == 0:
            return
        ahead = (stamp - now_ns) / 1e9
        if self.max_future_s and ahead > self.max_future_s:
            raise InputError(f"{what}: stamp {ahead:.3f} s in the future (clocks not synchronised?); limit "
                             f"{self.max_future_s} s")
        if self.max_age_s and -ahead > self.max_age_s:
            raise InputError(f"{what}: stamp {-ahead:.3f} s old, older than {self.max_age_s} s")


@dataclass
class CameraFeed:
    """The newest frame of one camera and how fresh it is (the vision node keeps one per camera).

    A frame whose stamp equals the previous one is a repeat: not decoded again, only counted.
    When a call wants the image, it is stale if no *new* frame arrived for ``max_age_s`` (the
    camera stopped, or keeps re-sending one frame) or the same non-zero stamp came
    ``frozen_after`` times in a row (a frozen driver); 0 turns either check off.
    """

    camera: str
    image: np.ndarray | None = None
    stamp_ns: int = 0
    new_frame_ns: int = 0      # arrival (monotonic clock) of the newest frame with a new stamp
    repeats: int = 0           # messages since then that carried the same stamp

    def offer(self, stamp: int, arrival_ns: int, decode: Callable[[], np.ndarray]) -> None:
        """A message arrived: a repeat of the current frame is counted, a new frame decoded
        (``decode`` raises InputError for a bad one, which leaves the feed unchanged)."""
        if stamp and stamp == self.stamp_ns and self.image is not None:
            self.repeats += 1
            return
        self.image = decode()
        self.stamp_ns, self.new_frame_ns, self.repeats = stamp, arrival_ns, 0

    def stale(self, now_ns: int, max_age_s: float, frozen_after: int) -> str:
        """Why the image must not be used now ('' when it may)."""
        if self.image is None:
            return f"camera {self.camera!r}: no image yet"
        if frozen_after and self.repeats + 1 >= frozen_after:
            return (f"camera {self.camera!r} frozen: the same frame (stamp {self.stamp_ns}) "
                    f"{self.repeats + 1} times in a row")
        age = (now_ns - self.new_frame_ns) / 1e9
        if max_age_s and age > max_age_s:
            return f"camera {self.camera!r}: no new frame for {age:.2f} s (limit {max_age_s} s)"
        return ""


def usable_images(feeds: dict[str, CameraFeed], now_ns: int, max_age_s: float,
                  frozen_after: int) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """(images to use, cameras with no image yet, why cameras are stale) for one call.

    A camera that never sent an image is left out (the model masks it, and the diagnostics say
    so); a camera that did and went stale makes the caller refuse the call, so the robot holds
    instead of acting on a view of the world that stopped updating."""
    images, missing, stale = {}, [], []
    for name, feed in feeds.items():
        if feed.image is None:
            missing.append(name)
        elif why := feed.stale(now_ns, max_age_s, frozen_after):
            stale.append(why)
        else:
            images[name] = feed.image
    return images, missing, stale


def instruction_from_msg(msg: Any) -> str:
    """The task text of a ``std_msgs/String`` instruction: stripped; empty, over-long or with
    control characters is refused (the current task continues)."""
    text = getattr(msg, "data", msg)
    if not isinstance(text, str):
        raise InputError(f"instruction must be text, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise InputError("empty instruction ignored: the current task continues")
    if len(text) > MAX_INSTRUCTION_CHARS:
        raise InputError(f"instruction of {len(text)} characters refused (at most {MAX_INSTRUCTION_CHARS})")
    bad = [(i, c) for i, c in enumerate(text) if not c.isprintable() and c not in "\t\n"]
    if bad:
        where = ", ".join(f"U+{ord(c):04X} at {i}" for i, c in bad[:3])
        raise InputError(f"instruction with control characters refused ({where}): the current task continues. "
                         "(A NUL never arrives: the publisher's own conversion ends the string there.)")
    return text


IMPLAUSIBLE_MARGIN = 0.5   # of a joint's limit range, beyond either limit


def implausible_joints(joints: JointStateAssembler, lower: Sequence[float], upper: Sequence[float]) -> list[str]:
    """The joints whose (finite) position lies further outside the profile's limits than half
    their range, as 'name = value (limits [lo, hi])': no arm gets there, so the reading is in
    other units (degrees), of another joint, or garbage. A position just past a limit (a joint
    resting on its stop, calibration offsets) is not reported: the safety filter handles it."""
    out = []
    for name, v, lo, hi in zip(joints.joint_names, joints.state, lower, upper):
        margin = IMPLAUSIBLE_MARGIN * (hi - lo)
        if math.isfinite(v) and not lo - margin <= v <= hi + margin:
            out.append(f"{name} = {v:g} (limits [{lo:g}, {hi:g}])")
    return out


def points_passed(first_ns: int, period_s: float, now_ns: int, points: int) -> int:
    """How many leading points of a plan whose point 0 is due at ``first_ns`` (one every
    ``period_s``) are already due by ``now_ns``: a trajectory must not start in the past."""
    if first_ns >= now_ns:
        return 0
    return min(points, math.ceil((now_ns - first_ns) / (period_s * 1e9)))


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
