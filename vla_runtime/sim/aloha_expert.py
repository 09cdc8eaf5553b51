"""A scripted expert for gym-aloha's transfer-cube task, in joint space.

gym-aloha's joint-space tasks come without an expert, and the policy acts in joint space (14 joint
targets, the ALOHA profile's units), so the demonstrations must be joint targets too. The expert
plans in task space and converts with inverse kinematics every step:

* each arm follows waypoints of its *grasp point* (a point between the fingers, ``GRASP_OFFSET``
  ahead of the gripper link along its approach axis), of its gripper orientation and of its
  gripper opening, interpolated linearly in time (orientations: the nearest rotation to the
  blend);
* damped least squares on the arm's six joints (MuJoCo's Jacobian, on a scratch copy of the
  state so the simulation is not disturbed) turns the waypoint into joint targets, warm-started
  from the previous step's solution, within the joint ranges.

The plan: the right arm comes down on the cube tilted towards the table (fingers closing across
y), grips it and lifts it to a meeting point between the arms; the left arm waits beside it, and
once the cube is up it comes in horizontally from the left with its fingers across z (the right
fingers hold the cube's y faces) and closes on the cube's left half. gym-aloha counts the
transfer when the left gripper touches the cube and the cube is off the table.

The targets never change faster than ``max_velocity`` (rad/s, the ALOHA profile's limits by
default), so the safety filter a policy's commands go through would pass the demonstrated
motion unchanged. The expert reads the cube's position from the simulator (privileged, as
Meta-World's experts do); where the right arm actually lifted it is read again before the left
arm's approach.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .aloha_env import CONTROL_DT, STATE_DIM, AlohaTask

GRASP_OFFSET = 0.095          # m ahead of the gripper link along its x (approach) axis: between the fingers
ARM_JOINTS = {"left": slice(0, 6), "right": slice(8, 14)}      # in MuJoCo's qpos
ARM_ACTIONS = {"left": 0, "right": 7}                          # first index of each arm in a 14-dim action
OPEN, CLOSED = 1.0, 0.0       # normalised gripper targets
# Forearm roll and wrist rotate (arm joints 3 and 5) reach most orientations twice (the wrist
# flipped, both rolled by pi), and near a straight wrist their axes line up, where a plain
# solver picks either branch by rounding. The forearm roll is pulled gently towards zero
# (``ROLL_PULL``), which leaves one branch, so every demonstration holds a pose with the same
# joint values: a policy cannot learn the average of two branches.
ROLL_JOINTS = np.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
ROLL_PULL = 0.02


def frame(approach: np.ndarray | list[float], across: np.ndarray | list[float]) -> np.ndarray:
    """A gripper orientation: x along ``approach``, y (the fingers' closing axis) along ``across``
    made orthogonal to it."""
    x = np.asarray(approach, np.float64)
    x = x / np.linalg.norm(x)
    y = np.asarray(across, np.float64)
    y = y - x * (x @ y)
    y = y / np.linalg.norm(y)
    return np.stack([x, y, np.cross(x, y)], axis=1)


@dataclass(frozen=True)
class Waypoint:
    step: int                 # control step (50 Hz) at which the arm is there
    point: np.ndarray         # grasp point, world frame (m)
    rotation: np.ndarray      # gripper orientation, 3x3
    gripper: float            # normalised opening, 0 closed .. 1 open


@dataclass(frozen=True)
class TransferCubePlan:
    """Timings (control steps) and geometry of the hand-over; the defaults succeed on gym-aloha's
    whole cube range."""

    reach: int = 80               # right arm above the cube
    descend: int = 130            # at the cube
    grip: int = 160               # right gripper closed
    lift: int = 230               # cube at the meeting point
    handover: int = 240           # left arm starts its approach (the cube's position is read here)
    approach: int = 40            # steps of the left arm's approach
    close: int = 20               # steps closing the left gripper
    meet: tuple[float, float, float] = (0.03, 0.5, 0.22)      # right grasp point when lifted
    above: tuple[float, float, float] = (0.06, 0.0, 0.12)     # pre-grasp, relative to the cube
    left_wait: tuple[float, float, float] = (-0.13, 0.0, -0.05)    # left arm while the cube is lifted, relative to meet
    left_start: tuple[float, float, float] = (-0.1, 0.0, -0.005)   # left approach start, relative to the cube
    left_grip: tuple[float, float, float] = (0.02, 0.0, 0.0)       # left grasp point, relative to the cube
    lifted_above: float = 0.1     # m: the cube's centre at least this high at the hand-over, or the left arm waits


class ArmIK:
    """Damped least-squares IK of one arm's grasp point and orientation on a scratch MuJoCo state."""

    def __init__(self, physics, damping: float = 1e-4, rotation_weight: float = 0.3, iterations: int = 60):
        import mujoco

        self._mj = mujoco
        self.model = physics.model.ptr
        self.data = mujoco.MjData(self.model)
        self.data.qpos[:] = physics.data.qpos
        self.damping, self.w_rot, self.iterations = damping, rotation_weight, iterations
        self.body = {side: mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, f"vx300s_{side}/gripper_link")
                     for side in ARM_JOINTS}
        self._jp = np.zeros((3, self.model.nv))
        self._jr = np.zeros((3, self.model.nv))

    def pose(self, side: str, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(grasp point, rotation) of ``side``'s gripper at joint positions ``q`` (6)."""
        self.data.qpos[ARM_JOINTS[side]] = q
        self._mj.mj_kinematics(self.model, self.data)
        self._mj.mj_comPos(self.model, self.data)
        b = self.body[side]
        rot = self.data.xmat[b].reshape(3, 3).copy()
        return self.data.xpos[b] + rot[:, 0] * GRASP_OFFSET, rot

    def solve(self, side: str, q0: np.ndarray, point: np.ndarray, rotation: np.ndarray) -> np.ndarray:
        """Joint positions (6) putting the grasp point at ``point`` with ``rotation``, from ``q0``."""
        sl = ARM_JOINTS[side]
        lo, hi = self.model.jnt_range[sl, 0], self.model.jnt_range[sl, 1]
        pull = ROLL_PULL * np.diag(ROLL_JOINTS)
        q = np.array(q0, np.float64)
        for _ in range(self.iterations):
            p, rot = self.pose(side, q)
            e_pos = point - p
            e_rot = 0.5 * sum(np.cross(rot[:, k], rotation[:, k]) for k in range(3))
            if np.linalg.norm(e_pos) < 1e-4 and np.linalg.norm(e_rot) < 1e-3:
                break
            self._mj.mj_jac(self.model, self.data, self._jp, self._jr, p, self.body[side])
            jac = np.vstack([self._jp[:, sl], self.w_rot * self._jr[:, sl]])
            err = np.concatenate([e_pos, self.w_rot * e_rot])
            # damped least squares, plus the pull of the roll joints towards zero
            dq = np.linalg.solve(jac.T @ jac + self.damping * np.eye(6) + pull, jac.T @ err - pull @ q)
            q = np.clip(q + np.clip(dq, -0.2, 0.2), lo, hi)
        return q


def interpolate(waypoints: list[Waypoint], step: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Grasp point, orientation and gripper at ``step`` (held after the last waypoint)."""
    if step <= waypoints[0].step:
        w = waypoints[0]
        return w.point, w.rotation, w.gripper
    for a, b in zip(waypoints, waypoints[1:]):
        if a.step <= step <= b.step:
            u = (step - a.step) / max(1, b.step - a.step)
            u_, _, vt = np.linalg.svd(a.rotation + u * (b.rotation - a.rotation))
            return a.point + u * (b.point - a.point), u_ @ vt, a.gripper + u * (b.gripper - a.gripper)
    w = waypoints[-1]
    return w.point, w.rotation, w.gripper


class TransferCubeExpert:
    """Joint targets for ``env`` (an ``AlohaTask`` on ``transfer_cube``), one per control step.

    Call :meth:`reset` after ``env.reset(seed)``, then :meth:`action` once per step."""

    DOWN_RIGHT = frame([-0.5, 0.0, -1.0], [0.0, -1.0, 0.0])   # right: tilted down towards -x, fingers across y
    LEFT_IN = frame([1.0, 0.0, 0.0], [0.0, 0.0, 1.0])         # left: horizontal towards +x, fingers across z

    def __init__(self, env: AlohaTask, plan: TransferCubePlan = TransferCubePlan(),
                 max_velocity: tuple[float, float] = (3.0, 5.0)):
        if env.cfg.task != "transfer_cube":
            raise ValueError(f"the scripted expert does transfer_cube, not {env.cfg.task!r}")
        self.env, self.plan = env, plan
        arm, gripper = max_velocity
        self.max_step = np.array(([arm] * 6 + [gripper]) * 2) * CONTROL_DT     # per-step change of a target
        self.last: np.ndarray | None = None
        self.step = 0
        self.waypoints: dict[str, list[Waypoint]] = {}
        self.q: dict[str, np.ndarray] = {}
        self.ik: ArmIK | None = None

    def reset(self) -> None:
        """Plan for the cube where it lies now (call after ``env.reset``)."""
        p = self.plan
        self.ik = ArmIK(self.env.physics)
        state = np.asarray(self.env.state(), np.float64)
        self.last = state.copy()
        self.q = {side: state[ARM_ACTIONS[side]:ARM_ACTIONS[side] + 6].copy() for side in ARM_JOINTS}
        cube = self.env.object_position()
        meet = np.asarray(p.meet)
        # start from where each arm is (no jump at the first step), gripper opening
        here = {side: Waypoint(0, *self.ik.pose(side, self.q[side]), OPEN) for side in ARM_JOINTS}
        self.waypoints = {
            "right": [here["right"],
                      Waypoint(p.reach, cube + p.above, self.DOWN_RIGHT, OPEN),
                      Waypoint(p.descend, cube, self.DOWN_RIGHT, OPEN),
                      Waypoint(p.grip, cube, self.DOWN_RIGHT, CLOSED),
                      Waypoint(p.lift, meet, self.DOWN_RIGHT, CLOSED)],
            # the left arm waits beside the meeting point; its approach is planned at the hand-over
            "left": [here["left"],
                     Waypoint(p.lift - 30, meet + p.left_wait, self.LEFT_IN, OPEN)],
        }
        self.step = 0

    def _plan_handover(self) -> None:
        """The left arm's approach to where the right arm holds the cube. When the cube is not up
        (a policy drove the right arm and missed it: DAgger), the left arm keeps waiting: reaching
        for a cube on the table or off it is nothing to demonstrate."""
        p = self.plan
        cube = self.env.object_position()          # where the right arm actually holds it
        if cube[2] < p.lifted_above:
            return
        start, grip = cube + p.left_start, cube + p.left_grip
        self.waypoints["left"] += [Waypoint(p.handover, start, self.LEFT_IN, OPEN),
                                   Waypoint(p.handover + p.approach, grip, self.LEFT_IN, OPEN),
                                   Waypoint(p.handover + p.approach + p.close, grip, self.LEFT_IN, CLOSED)]

    def action(self) -> np.ndarray:
        """The 14 joint targets for this step (grippers normalised), then advance a step."""
        if self.ik is None:
            raise RuntimeError("call reset() after env.reset(seed) before the first action")
        if self.step == self.plan.handover:
            self._plan_handover()
        out = np.zeros(STATE_DIM)
        for side, first in ARM_ACTIONS.items():
            point, rotation, gripper = interpolate(self.waypoints[side], self.step)
            solved = self.ik.solve(side, self.q[side], point, rotation)
            out[first:first + 6] = solved
            out[first + 6] = gripper
        out = self.last + np.clip(out - self.last, -self.max_step, self.max_step)
        for side, first in ARM_ACTIONS.items():
            self.q[side] = out[first:first + 6].copy()      # the next solve starts from what was commanded
        self.last = out
        self.step += 1
        return out
