"""A planar kinematic chain seen from above: the "robot arm" of the synthetic scenes.

The joint angles are the robot state, and the images are drawn from the same forward
kinematics, so state and pixels always agree (a policy or cache that relates them sees a
consistent world). Trajectories are smooth in joint space (minimum-jerk between keyframes
solved by inverse kinematics), like a real controller's joint streams.

World coordinates are the top camera's normalised image plane: ``x`` to the right, ``y``
down, both in ``[0, 1]``. Link ``i`` points along the heading ``theta_i = q_0 + ... + q_i``,
measured from "up" (``-y``) and turning clockwise on screen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N_JOINTS = 6


@dataclass(frozen=True)
class PlanarArm:
    """A 6-joint planar chain fixed at ``base`` with the given link lengths."""

    base: tuple[float, float]
    link_lengths: tuple[float, ...] = (0.24, 0.20, 0.14, 0.10, 0.07, 0.05)
    home: tuple[float, ...] = (0.0, 0.5, 0.45, 0.35, 0.25, 0.15)

    def __post_init__(self) -> None:
        if len(self.base) != 2:
            raise ValueError(f"base must be (x, y), got {self.base}")
        if len(self.link_lengths) != N_JOINTS or any(l <= 0 for l in self.link_lengths):
            raise ValueError(f"need {N_JOINTS} positive link lengths, got {self.link_lengths}")
        if len(self.home) != N_JOINTS:
            raise ValueError(f"home posture needs {N_JOINTS} angles, got {self.home}")

    @property
    def reach(self) -> float:
        return float(sum(self.link_lengths))

    def headings(self, q: np.ndarray) -> np.ndarray:
        """Absolute heading of every link, ``[6]``."""
        return np.cumsum(np.asarray(q, dtype=np.float64)[:N_JOINTS])

    def joint_positions(self, q: np.ndarray) -> np.ndarray:
        """Base, every joint and the end effector (tip of the last link): ``[7, 2]``."""
        th = self.headings(q)
        steps = np.asarray(self.link_lengths)[:, None] * np.stack([np.sin(th), -np.cos(th)], axis=1)
        return np.vstack([np.asarray(self.base, dtype=np.float64), np.asarray(self.base) + np.cumsum(steps, axis=0)])

    def end_effector(self, q: np.ndarray) -> np.ndarray:
        return self.joint_positions(q)[-1]

    def jacobian(self, q: np.ndarray) -> np.ndarray:
        """d(end effector)/dq, ``[2, 6]``: joint j moves every link from j on."""
        th = self.headings(q)
        lengths = np.asarray(self.link_lengths)
        dx = lengths * np.cos(th)  # d x_i / d theta_i
        dy = lengths * np.sin(th)  # d y_i / d theta_i
        # Joint j rotates links j..5: sum the contributions from j on.
        return np.stack([np.cumsum(dx[::-1])[::-1], np.cumsum(dy[::-1])[::-1]])

    def inverse_kinematics(self, target: np.ndarray, q_start: np.ndarray, heading: float | None = None,
                           iters: int = 60, posture_gain: float = 0.1) -> np.ndarray:
        """Joint angles whose end effector reaches ``target`` (and, if given, whose last link
        points along ``heading``), starting from ``q_start``.

        Damped least squares for the task, plus a pull toward the home posture in the chain's
        null space, so the redundant joints settle on a natural, repeatable pose that varies
        smoothly with the target (similar targets give similar postures). The heading matters
        for grasping: the gripper must face the object for it to sit between the fingers.
        """
        q = np.asarray(q_start, dtype=np.float64).copy()
        target = np.asarray(target, dtype=np.float64)
        home = np.asarray(self.home)
        damping = 1e-4
        rows = 2 if heading is None else 3
        for _ in range(iters):
            err = target - self.end_effector(q)
            jac = self.jacobian(q)
            if heading is not None:
                # Heading error in the wrapped sense; the heading row weighs 0.1 world units per radian.
                dth = (heading - self.headings(q)[-1] + np.pi) % (2 * np.pi) - np.pi
                err = np.append(err, 0.1 * dth)
                jac = np.vstack([jac, np.full(N_JOINTS, 0.1)])
            pinv = jac.T @ np.linalg.inv(jac @ jac.T + damping * np.eye(rows))
            null = np.eye(N_JOINTS) - pinv @ jac
            q += pinv @ err + null @ (posture_gain * (home - q))
        return q


def heading_towards(direction: np.ndarray) -> float:
    """The link heading (see module docstring) that points along ``direction``."""
    return float(np.arctan2(direction[0], -direction[1]))


def min_jerk(tau: np.ndarray) -> np.ndarray:
    """Minimum-jerk blend 0 -> 1 with zero velocity and acceleration at both ends."""
    tau = np.clip(tau, 0.0, 1.0)
    return tau**3 * (10 - 15 * tau + 6 * tau**2)


def keyframe_trajectory(keyframes: list[np.ndarray], durations: list[int]) -> np.ndarray:
    """Interpolate ``keyframes`` (each ``[D]``) with minimum jerk; segment ``i`` takes
    ``durations[i]`` steps. Returns ``[sum(durations) + 1, D]`` including both ends."""
    if len(durations) != len(keyframes) - 1:
        raise ValueError(f"{len(keyframes)} keyframes need {len(keyframes) - 1} durations, got {len(durations)}")
    if any(d < 1 for d in durations):
        raise ValueError(f"every segment needs at least one step, got {durations}")
    out = [np.asarray(keyframes[0], dtype=np.float64)[None]]
    for a, b, n in zip(keyframes[:-1], keyframes[1:], durations):
        s = min_jerk(np.arange(1, n + 1) / n)[:, None]
        out.append(np.asarray(a) + s * (np.asarray(b) - np.asarray(a)))
    return np.concatenate(out)
