"""Synthetic episodes of a robot repeating one task at a fixed station (no physics).

Real deployments repeat the same task at the same station many times: the background, table
and objects stay; only object placement and the arm's path vary a little between episodes.
That repetition is what makes caching policy computations worthwhile, so tests and benchmarks
need data with the same similarity structure, cheaply and deterministically:

* one *station* (``SceneConfig.seed``): textured floor, table and clutter, drawn once;
* one *task* (``SceneConfig.task``): object colour/shape and goal kind come from the words of
  the instruction ("red block", "bowl"), nominal positions from a hash of it, so two tasks
  look clearly different while episodes of one task look alike;
* one *episode* (``episode_seed``): object and goal jitter, slight lighting change, sensor
  noise; the arm (a planar chain, see :mod:`vla_runtime.sim.arm`) moves to the object with a
  minimum-jerk joint trajectory, grasps it, carries it to the goal and releases it.

Cameras: ``"top"`` is the overhead view of the whole station; ``"wrist"`` (``"wrist_left"``)
and, for two arms, ``"wrist_right"`` are zoomed views that move and turn with an end
effector, as a camera on the gripper would. Images are drawn from the state (joint angles
plus gripper opening), so the two always agree.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import cv2
import numpy as np

from vla_runtime.io.bags import Episode, EpisodeFrame
from vla_runtime.sim.arm import N_JOINTS, PlanarArm, heading_towards, keyframe_trajectory

JOINTS_PER_ARM = N_JOINTS + 1  # six joints and the gripper opening (1 open, 0 closed)

#: Recognised object colours (RGB), looked up in the task text.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (205, 35, 35), "green": (40, 165, 60), "blue": (40, 75, 205),
    "yellow": (235, 205, 40), "orange": (245, 135, 30), "purple": (135, 55, 170),
}
_ROUND_OBJECTS = ("ball", "apple", "orange", "sphere", "puck")
_GOALS = ("bowl", "plate", "box", "basket", "bin", "tray")
_GRIPPER_COLOR = (0, 225, 225)  # cyan: no object colour is near it, so tests can find the gripper
_ARM_COLOR = (205, 205, 215)
_ARM_EDGE = (45, 45, 55)
_OBJECT_SIZE = 0.05  # world units (fraction of the top view's width)
_GRASP_OFFSET = 0.022  # object centre ahead of the end effector when held
_WRIST_FOV = 0.32  # world units across the wrist image
_STATIC_OVERSAMPLE = 2  # static layer resolution relative to the images (wrist views zoom into it)

# (fraction of the episode, phase) for the picking arm; the fractions sum to 1.
_PHASES = ((0.24, "approach"), (0.10, "reach"), (0.08, "close"), (0.30, "carry"), (0.08, "open"), (0.20, "retreat"))


@dataclass(frozen=True)
class SceneConfig:
    """What is constant across the episodes of one task at one station.

    ``state_dim`` is ``7 * arms`` (6 joints + gripper per arm) and may be left ``None``.
    ``jitter`` is the standard deviation of the object's position between episodes, in
    fractions of the table view (0.03 is about 7 px at 224). ``noise`` is the per-pixel sensor
    noise amplitude in 8-bit levels. ``seed`` picks the station (textures, clutter); episodes
    are chosen by the ``episode_seed`` of :func:`make_episode`.
    """

    image_size: int = 224
    cameras: tuple[str, ...] = ("top", "wrist")
    arms: int = 1
    state_dim: int | None = None
    steps_per_episode: int = 120
    rate_hz: float = 30.0
    task: str = "pick up the red block and put it in the bowl"
    jitter: float = 0.03
    noise: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or not 32 <= self.image_size <= 2048:
            raise ValueError(f"image_size must be an int in [32, 2048], got {self.image_size!r}")
        if self.arms not in (1, 2):
            raise ValueError(f"arms must be 1 or 2, got {self.arms!r}")
        if self.state_dim is None:
            object.__setattr__(self, "state_dim", JOINTS_PER_ARM * self.arms)
        elif self.state_dim != JOINTS_PER_ARM * self.arms:
            raise ValueError(f"state_dim must be {JOINTS_PER_ARM * self.arms} for {self.arms} arm(s) "
                             f"({N_JOINTS} joints + gripper each), got {self.state_dim}")
        object.__setattr__(self, "cameras", tuple(self.cameras))
        if not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"cameras must be non-empty and unique, got {self.cameras}")
        valid = camera_names(self.arms)
        for cam in self.cameras:
            if cam not in valid:
                raise ValueError(f"unknown camera {cam!r} for {self.arms} arm(s); choose from {valid}")
        if not isinstance(self.steps_per_episode, int) or self.steps_per_episode < 20:
            raise ValueError(f"steps_per_episode must be an int >= 20, got {self.steps_per_episode!r}")
        if not self.rate_hz > 0:
            raise ValueError(f"rate_hz must be positive, got {self.rate_hz}")
        if not isinstance(self.task, str) or not self.task.strip():
            raise ValueError("task must be a non-empty instruction")
        if not 0 <= self.jitter <= 0.1:
            raise ValueError(f"jitter must be in [0, 0.1] (fraction of the view), got {self.jitter}")
        if not 0 <= self.noise <= 50:
            raise ValueError(f"noise must be in [0, 50] 8-bit levels, got {self.noise}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")


def camera_names(arms: int) -> tuple[str, ...]:
    """Cameras the scenes can render for this many arms."""
    return ("top", "wrist", "wrist_left") + (("wrist_right",) if arms == 2 else ())


def joint_names(arms: int) -> tuple[str, ...]:
    """The simulated robot's joint names, in state order (``config/sim.yaml`` uses the one-arm set)."""
    one = tuple(f"joint_{i}" for i in range(N_JOINTS)) + ("gripper",)
    return one if arms == 1 else tuple(f"{side}_{n}" for side in ("left", "right") for n in one)


def _camera_arm(camera: str) -> int | None:
    """Which arm a camera rides on (``None`` for the fixed top camera)."""
    return {"top": None, "wrist": 0, "wrist_left": 0, "wrist_right": 1}[camera]


def arms_for(arms: int) -> list[PlanarArm]:
    """The arms of a scene: one centred at the table's near edge, or a left and right one."""
    if arms == 1:
        return [PlanarArm(base=(0.5, 0.97))]
    return [PlanarArm(base=(0.34, 0.97)), PlanarArm(base=(0.66, 0.97), home=(0.0, -0.5, -0.45, -0.35, -0.25, -0.15))]


def end_effector_pixel(cfg: SceneConfig, state: np.ndarray, arm: int = 0) -> tuple[float, float]:
    """Where arm ``arm``'s end effector appears in the top image, ``(x, y)`` in pixels."""
    q = np.asarray(state, dtype=np.float64)[arm * JOINTS_PER_ARM: arm * JOINTS_PER_ARM + N_JOINTS]
    x, y = arms_for(cfg.arms)[arm].end_effector(q) * cfg.image_size
    return float(x), float(y)


# --------------------------------------------------------------------------------------------
# Task and station layout
# --------------------------------------------------------------------------------------------


def _stable_seed(*parts: object) -> int:
    """A seed from strings/ints that is the same in every process (``hash()`` is not)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass(frozen=True)
class TaskLayout:
    """How one task looks: object colour and shape, goal kind, nominal positions (world units)."""

    object_color: tuple[int, int, int]
    round_object: bool
    goal_kind: str
    goal_color: tuple[int, int, int]
    object_xy: tuple[float, float]
    goal_xy: tuple[float, float]


def task_layout(task: str, arms: int = 1) -> TaskLayout:
    """Derive a task's look from its instruction: named colour/shape/goal words win, the rest
    (and the nominal positions) come from a stable hash of the text."""
    words = re.findall(r"[a-z]+", task.lower())
    rng = np.random.default_rng(_stable_seed("task", task))
    color_name = next((w for w in words if w in COLORS), None)
    if color_name is None:
        color_name = sorted(COLORS)[int(rng.integers(len(COLORS)))]
    round_object = any(w in _ROUND_OBJECTS for w in words if w != color_name)
    goal_kind = next((w for w in words if w in _GOALS), None) or _GOALS[int(rng.integers(len(_GOALS)))]
    goal_color = tuple(int(c) for c in rng.integers(120, 230, size=3))
    picker = arms_for(arms)[0]
    base = np.asarray(picker.base)
    for _ in range(1000):  # rejection sampling: both places well inside the picking arm's reach
        obj = np.array([rng.uniform(0.28, 0.72), rng.uniform(0.32, 0.55)])
        goal = np.array([rng.uniform(0.25, 0.75), rng.uniform(0.30, 0.60)])
        far_enough = np.linalg.norm(obj - goal) >= 0.24
        reachable = max(np.linalg.norm(obj - base), np.linalg.norm(goal - base)) <= 0.78 * picker.reach
        if far_enough and reachable:
            break
    else:  # pragma: no cover - the regions above always admit a layout
        raise RuntimeError(f"could not place the objects of task {task!r}")
    return TaskLayout(object_color=COLORS[color_name], round_object=round_object, goal_kind=goal_kind,
                      goal_color=goal_color, object_xy=(float(obj[0]), float(obj[1])),
                      goal_xy=(float(goal[0]), float(goal[1])))


def _noise_texture(rng: np.random.Generator, size: int, cells: int, amplitude: float) -> np.ndarray:
    """Smooth random field (bicubic-upsampled coarse noise) plus fine grain, ``[size, size]``."""
    coarse = rng.standard_normal((cells, cells)).astype(np.float32)
    smooth = cv2.resize(coarse, (size, size), interpolation=cv2.INTER_CUBIC)
    grain = rng.standard_normal((size, size)).astype(np.float32) * 0.35
    return (smooth + grain) * amplitude


def _station_background(seed: int, size: int) -> np.ndarray:
    """Floor, table and clutter of a station, float32 RGB ``[size, size, 3]``."""
    rng = np.random.default_rng(_stable_seed("station", seed))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    floor = np.array([88, 90, 98], np.float32) + _noise_texture(rng, size, 12, 10)[..., None]
    wood = np.array([156, 116, 76], np.float32) + rng.uniform(-12, 12, size=3).astype(np.float32)
    stripes = 7 * np.sin(2 * np.pi * (yy * 9 + 0.6 * _noise_texture(rng, size, 6, 1.0)))
    table = wood + (stripes + _noise_texture(rng, size, 24, 6))[..., None]
    on_table = ((xx > 0.07) & (xx < 0.93) & (yy > 0.13))[..., None]
    img = np.where(on_table, table, floor)
    s = size
    # Table edge shading and clutter that never moves (a mug, a tape roll, a cloth).
    cv2.rectangle(img, (int(0.07 * s), int(0.13 * s)), (int(0.93 * s), s + 5), (60, 45, 30), max(1, s // 150))
    for _ in range(3):
        cx, cy = rng.choice([rng.uniform(0.1, 0.2), rng.uniform(0.8, 0.9)]), rng.uniform(0.18, 0.85)
        color = tuple(float(c) for c in rng.integers(40, 220, size=3))
        r = int(rng.uniform(0.025, 0.045) * s)
        if rng.random() < 0.5:
            cv2.circle(img, (int(cx * s), int(cy * s)), r, color, -1, cv2.LINE_AA)
            cv2.circle(img, (int(cx * s), int(cy * s)), r // 2, (40, 40, 40), -1, cv2.LINE_AA)
        else:
            x0, y0 = int(cx * s), int(cy * s)
            cv2.rectangle(img, (x0 - r, y0 - 2 * r), (x0 + r, y0 + 2 * r), color, -1)
    return img


def _draw_goal(img: np.ndarray, layout: TaskLayout, goal_xy: np.ndarray, scale: float) -> None:
    c = (int(round(goal_xy[0] * scale)), int(round(goal_xy[1] * scale)))
    r = int(round(0.065 * scale))
    col = tuple(float(v) for v in layout.goal_color)
    dark = tuple(0.6 * v for v in col)
    if layout.goal_kind in ("bowl", "basket", "bin"):
        cv2.circle(img, c, r, dark, -1, cv2.LINE_AA)
        cv2.circle(img, c, r, col, max(2, r // 4), cv2.LINE_AA)
    elif layout.goal_kind == "plate":
        cv2.circle(img, c, r, col, -1, cv2.LINE_AA)
        cv2.circle(img, c, int(r * 0.7), dark, max(1, r // 10), cv2.LINE_AA)
    else:  # box, tray
        cv2.rectangle(img, (c[0] - r, c[1] - r), (c[0] + r, c[1] + r), dark, -1)
        cv2.rectangle(img, (c[0] - r, c[1] - r), (c[0] + r, c[1] + r), col, max(2, r // 4))


# --------------------------------------------------------------------------------------------
# Episode plan (state trajectory and object motion)
# --------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Per-step state and object pose of one episode."""

    states: np.ndarray  # [T, state_dim] float32
    object_xy: np.ndarray  # [T, 2]
    object_angle: np.ndarray  # [T] radians
    held: np.ndarray  # [T] bool, object in the gripper (drawn lifted)
    goal_xy: np.ndarray  # [2] where this episode's goal container stands


def _phase_steps(total: int) -> list[int]:
    """Split ``total`` steps over the phases, every phase at least one step."""
    fractions = np.array([f for f, _ in _PHASES])
    steps = np.maximum(1, np.floor(fractions * total).astype(int))
    steps[np.argmax(steps)] += total - steps.sum()
    return [int(s) for s in steps]


def _plan_episode(cfg: SceneConfig, layout: TaskLayout, rng: np.random.Generator, success: bool) -> _Plan:
    arms = arms_for(cfg.arms)
    picker = arms[0]
    obj0 = np.asarray(layout.object_xy) + rng.normal(0, cfg.jitter, 2).clip(-2 * cfg.jitter, 2 * cfg.jitter)
    goal = np.asarray(layout.goal_xy) + rng.normal(0, cfg.jitter / 3, 2)
    angle0 = float(rng.normal(0, 0.15))
    base = np.asarray(picker.base)
    to_obj = (obj0 - base) / np.linalg.norm(obj0 - base)
    to_goal = (goal - base) / np.linalg.norm(goal - base)

    home = np.asarray(picker.home)
    # The gripper faces away from the base when it grasps and when it releases.
    q_approach = picker.inverse_kinematics(obj0 - to_obj * (_GRASP_OFFSET + 0.07), home, heading_towards(to_obj))
    q_grasp = picker.inverse_kinematics(obj0 - to_obj * _GRASP_OFFSET, q_approach, heading_towards(to_obj))
    q_goal = picker.inverse_kinematics(goal - to_goal * _GRASP_OFFSET, q_grasp, heading_towards(to_goal))
    q_retreat = 0.7 * home + 0.3 * q_goal
    hold = 0.5  # gripper opening that holds the object
    keys = [np.append(home, 1.0), np.append(q_approach, 1.0), np.append(q_grasp, 1.0), np.append(q_grasp, hold),
            np.append(q_goal, hold), np.append(q_goal, 1.0), np.append(q_retreat, 1.0)]
    steps = _phase_steps(cfg.steps_per_episode - 1)
    traj = keyframe_trajectory(keys, steps)  # [T, 7]
    t_close_end, t_open_start = sum(steps[:3]), sum(steps[:4])
    t_slip = t_close_end + steps[3] // 2  # failure: the object slips halfway through the carry

    states = [traj]
    if cfg.arms == 2:  # the second arm steadies the goal container while the first one works
        helper = arms[1]
        toward_helper = np.asarray(helper.base) - goal
        rim = goal + 0.075 * toward_helper / np.linalg.norm(toward_helper)  # the rim nearest to it
        q_rim = helper.inverse_kinematics(rim, np.asarray(helper.home))
        h_home, h_rim = np.append(helper.home, 1.0), np.append(q_rim, 1.0)
        h_hold = np.append(q_rim, 0.3)
        n = cfg.steps_per_episode - 1
        h_steps = [max(1, int(0.3 * n)), max(1, int(0.08 * n)), max(1, int(0.4 * n))]
        h_steps.append(n - sum(h_steps))
        states.append(keyframe_trajectory([h_home, h_rim, h_hold, h_rim, h_home], h_steps))
    state = np.concatenate(states, axis=1).astype(np.float32)

    # Object pose follows the gripper rigidly while held, computed from the float32 state so
    # the drawing agrees exactly with the recorded joints.
    T = state.shape[0]
    obj_xy = np.tile(obj0, (T, 1))
    obj_angle = np.full(T, angle0)
    held = np.zeros(T, dtype=bool)
    q_at_grasp = state[t_close_end, :N_JOINTS].astype(np.float64)
    ee_grasp = picker.end_effector(q_at_grasp)
    heading_grasp = picker.headings(q_at_grasp)[-1]
    release = t_slip if not success else t_open_start
    for k in range(t_close_end, T):
        if k <= release:
            q = state[k, :N_JOINTS].astype(np.float64)
            dth = picker.headings(q)[-1] - heading_grasp
            rot = np.array([[np.cos(dth), -np.sin(dth)], [np.sin(dth), np.cos(dth)]])
            obj_xy[k] = picker.end_effector(q) + rot @ (obj0 - ee_grasp)
            obj_angle[k] = angle0 + dth
            held[k] = k < release
        else:
            obj_xy[k], obj_angle[k] = obj_xy[k - 1], obj_angle[k - 1]
    if not success:  # the slipped object tumbles a little where it lands
        obj_xy[release + 1:] += np.array([0.015, 0.02])
        obj_angle[release + 1:] += 0.6
    return _Plan(states=state, object_xy=obj_xy, object_angle=obj_angle, held=held, goal_xy=goal)


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _to_px(m: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Apply a 2x3 affine (world -> pixels) to ``[N, 2]`` points."""
    return np.asarray(pts, dtype=np.float64) @ m[:, :2].T + m[:, 2]


def _wrist_affine(arm: PlanarArm, q: np.ndarray, size: int) -> np.ndarray:
    """World -> wrist-image affine: the view looks ahead of the gripper, turned with the last
    link so the approach direction is always "up" in the image."""
    ee = arm.end_effector(q)
    th = arm.headings(q)[-1]
    s = size / _WRIST_FOV
    c, si = np.cos(th), np.sin(th)
    rot = np.array([[c, si], [-si, c]]) * s  # rotates heading (sin th, -cos th) onto (0, -1)
    offset = np.array([0.5 * size, 0.78 * size]) - rot @ ee
    return np.hstack([rot, offset[:, None]])


def _draw_dynamic(img: np.ndarray, m: np.ndarray, arms: list[PlanarArm], state: np.ndarray,
                  layout: TaskLayout, obj_xy: np.ndarray, obj_angle: float, held: bool) -> None:
    """Object, arms and grippers under the world -> pixel affine ``m`` (drawn in place)."""
    scale = float(np.hypot(m[0, 0], m[0, 1]))
    shift = 4  # sub-pixel precision bits for OpenCV drawing

    def p(pt: np.ndarray) -> tuple[int, int]:
        v = _to_px(m, pt[None])[0] * (1 << shift)
        return int(round(v[0])), int(round(v[1]))

    def draw_object() -> None:
        half = _OBJECT_SIZE / 2 * (1.12 if held else 1.0)  # lifted: closer to the camera
        color = tuple(float(c) for c in layout.object_color)
        edge = tuple(0.55 * c for c in color)
        if layout.round_object:
            radius = int(half * scale * (1 << shift))
            cv2.circle(img, p(obj_xy), radius, color, -1, cv2.LINE_AA, shift)
            cv2.circle(img, p(obj_xy), radius, edge, max(1, int(scale / 250)), cv2.LINE_AA, shift)
        else:
            c, s = np.cos(obj_angle), np.sin(obj_angle)
            corners = obj_xy + half * np.array([[c - s, s + c], [-c - s, -s + c], [-c + s, -s - c], [c + s, s - c]])
            px = np.round(_to_px(m, corners) * (1 << shift)).astype(np.int32)
            cv2.fillConvexPoly(img, px, color, cv2.LINE_AA, shift)
            cv2.polylines(img, [px], True, edge, max(1, int(scale / 250)), cv2.LINE_AA, shift)

    if not held:
        draw_object()
    link_w = max(2, int(round(0.028 * scale)))
    for a, arm in enumerate(arms):
        q = state[a * JOINTS_PER_ARM: a * JOINTS_PER_ARM + N_JOINTS].astype(np.float64)
        grip = float(state[a * JOINTS_PER_ARM + N_JOINTS])
        joints = arm.joint_positions(q)
        pts = [p(j) for j in joints]
        cv2.circle(img, pts[0], int(0.05 * scale * (1 << shift)), _ARM_EDGE, -1, cv2.LINE_AA, shift)
        for i in range(N_JOINTS):
            w = max(1, int(link_w * (1.0 - 0.1 * i)))
            cv2.line(img, pts[i], pts[i + 1], _ARM_EDGE, w + 2, cv2.LINE_AA, shift)
            cv2.line(img, pts[i], pts[i + 1], _ARM_COLOR, w, cv2.LINE_AA, shift)
        for j in pts[1:-1]:
            cv2.circle(img, j, int(0.3 * link_w * (1 << shift)), _ARM_EDGE, -1, cv2.LINE_AA, shift)
        if a == 0 and held:
            draw_object()
        th = arm.headings(q)[-1]
        fwd, side = np.array([np.sin(th), -np.cos(th)]), np.array([np.cos(th), np.sin(th)])
        spread = 0.012 + 0.03 * grip
        finger_w = max(1, int(round(0.01 * scale)))
        for sign in (-1.0, 1.0):
            root = joints[-1] + sign * spread * side
            cv2.line(img, p(joints[-1]), p(root), _GRIPPER_COLOR, finger_w, cv2.LINE_AA, shift)
            cv2.line(img, p(root), p(root + 0.04 * fwd), _GRIPPER_COLOR, finger_w, cv2.LINE_AA, shift)


class _Station:
    """Static, per-station and per-task rendering state, built once and reused by episodes."""

    def __init__(self, cfg: SceneConfig):
        self.cfg = cfg
        self.layout = task_layout(cfg.task, cfg.arms)
        self.arms = arms_for(cfg.arms)
        self.hi_size = cfg.image_size * _STATIC_OVERSAMPLE
        self.background = _station_background(cfg.seed, self.hi_size)  # float32, shared by episodes

    def static_layer(self, goal_xy: np.ndarray, gain: float) -> np.ndarray:
        """Background with this episode's goal container and lighting, uint8 at ``hi_size``."""
        img = self.background.copy()
        _draw_goal(img, self.layout, goal_xy, float(self.hi_size))
        return np.clip(img * gain, 0, 255).astype(np.uint8)


def _add_noise(img: np.ndarray, rng: np.random.Generator, amplitude: float) -> np.ndarray:
    """Uniform integer sensor noise in ``[-amplitude, amplitude]`` with saturation (fast path:
    OpenCV's saturating uint8 add/subtract, no float round trip)."""
    k = int(round(amplitude))
    if k == 0:
        return img
    noise = rng.integers(0, 2 * k + 1, size=img.shape, dtype=np.uint8)
    return cv2.subtract(cv2.add(img, noise), np.full_like(img, k))


def _render_episode(station: _Station, episode_seed: int, success: bool) -> Episode:
    cfg, layout = station.cfg, station.layout
    rng = np.random.default_rng(_stable_seed("episode", cfg.seed, cfg.task, episode_seed))
    plan = _plan_episode(cfg, layout, rng, success)
    static_hi = station.static_layer(plan.goal_xy, gain=float(1.0 + rng.normal(0, 0.02)))
    size = cfg.image_size
    top_static = cv2.resize(static_hi, (size, size), interpolation=cv2.INTER_AREA)
    top_m = np.array([[size, 0.0, 0.0], [0.0, size, 0.0]])
    hi_from_world = float(station.hi_size)

    frames: list[EpisodeFrame] = []
    for k, state in enumerate(plan.states):
        images: dict[str, np.ndarray] = {}
        for cam in cfg.cameras:
            arm_index = _camera_arm(cam)
            if arm_index is None:
                img, m = top_static.copy(), top_m
            else:
                q = state[arm_index * JOINTS_PER_ARM: arm_index * JOINTS_PER_ARM + N_JOINTS].astype(np.float64)
                m = _wrist_affine(station.arms[arm_index], q, size)
                # Static layer is in hi-res pixels: world = hi_px / hi_size.
                m_hi = np.hstack([m[:, :2] / hi_from_world, m[:, 2:]])
                img = cv2.warpAffine(static_hi, m_hi, (size, size), flags=cv2.INTER_LINEAR,
                                     borderMode=cv2.BORDER_REFLECT_101)
            _draw_dynamic(img, m, station.arms, state, layout, plan.object_xy[k],
                          float(plan.object_angle[k]), bool(plan.held[k]))
            images[cam] = _add_noise(img, rng, cfg.noise)
        frames.append(EpisodeFrame(t=k / cfg.rate_hz, images=images, state=state))
    return Episode(episode_id=f"sim-s{cfg.seed}-e{episode_seed}", task=cfg.task, success=success,
                   frames=frames, source=f"sim:scenes seed={cfg.seed} episode_seed={episode_seed}")


def make_episode(cfg: SceneConfig, episode_seed: int, success: bool = True) -> Episode:
    """One synthetic episode of ``cfg.task`` at station ``cfg.seed``; deterministic in
    ``(cfg, episode_seed, success)``. ``success=False`` makes the object slip out of the
    gripper halfway to the goal (the arm carries on, as a scripted controller would)."""
    if not isinstance(episode_seed, int) or episode_seed < 0:
        raise ValueError(f"episode_seed must be an int >= 0, got {episode_seed!r}")
    return _render_episode(_Station(cfg), episode_seed, bool(success))


def make_episodes(cfg: SceneConfig, n: int, seed: int, success_rate: float = 1.0) -> list[Episode]:
    """``n`` episodes of one task at one station; episode seeds and outcomes are derived from
    ``seed`` (a fraction ``success_rate`` of them, chosen deterministically, succeed)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not 0.0 <= success_rate <= 1.0:
        raise ValueError(f"success_rate must be in [0, 1], got {success_rate}")
    rng = np.random.default_rng(_stable_seed("episodes", seed))
    episode_seeds = rng.integers(0, 2**31 - 1, size=n)
    outcomes = rng.random(n) < success_rate
    station = _Station(cfg)
    return [_render_episode(station, int(s), bool(ok)) for s, ok in zip(episode_seeds, outcomes)]


# --------------------------------------------------------------------------------------------
# Rendering an arbitrary state (closed loop)
# --------------------------------------------------------------------------------------------


class ObservationRenderer:
    """Camera images for *any* arm state, for closed-loop simulation.

    Recorded episodes draw states from a scripted plan; a controller under test drives the arm
    wherever its commands take it, so the images must follow the state instead. The scene
    (station, goal container, object resting at its start pose) is that of episode
    ``episode_seed`` of :func:`make_episode`; changing the seed moves object and goal, which
    is how a simulation can change the task target mid-run. The station is built once per
    renderer, because rebuilding its textures per frame would dominate a control loop.
    """

    def __init__(self, cfg: SceneConfig, episode_seed: int = 0):
        if not isinstance(episode_seed, int) or episode_seed < 0:
            raise ValueError(f"episode_seed must be an int >= 0, got {episode_seed!r}")
        self.cfg = cfg
        self._station = _Station(cfg)
        self._scenes: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, float]] = {}
        self.episode_seed = episode_seed

    def _scene(self, episode_seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """(hi-res static layer, top static layer, object xy, object angle) of one episode."""
        if episode_seed not in self._scenes:
            cfg = self.cfg
            rng = np.random.default_rng(_stable_seed("episode", cfg.seed, cfg.task, episode_seed))
            plan = _plan_episode(cfg, self._station.layout, rng, True)
            static_hi = self._station.static_layer(plan.goal_xy, gain=float(1.0 + rng.normal(0, 0.02)))
            size = cfg.image_size
            top = cv2.resize(static_hi, (size, size), interpolation=cv2.INTER_AREA)
            self._scenes[episode_seed] = (static_hi, top, plan.object_xy[0].copy(), float(plan.object_angle[0]))
        return self._scenes[episode_seed]

    def render(self, state: np.ndarray, episode_seed: int | None = None, noise_seed: int = 0) -> dict[str, np.ndarray]:
        """``{camera: HxWx3 uint8}`` showing the arm at ``state`` (object not held)."""
        cfg = self.cfg
        seed = self.episode_seed if episode_seed is None else episode_seed
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"episode_seed must be an int >= 0, got {seed!r}")
        state = np.asarray(state, dtype=np.float32)
        if state.shape != (cfg.state_dim,):
            raise ValueError(f"state must have shape ({cfg.state_dim},), got {state.shape}")
        if not np.isfinite(state).all():
            raise ValueError("state contains NaN or Inf")
        static_hi, top_static, obj_xy, obj_angle = self._scene(seed)
        rng = np.random.default_rng(_stable_seed("frame", cfg.seed, cfg.task, seed, noise_seed))
        size = cfg.image_size
        hi = float(self._station.hi_size)
        images: dict[str, np.ndarray] = {}
        for cam in cfg.cameras:
            arm_index = _camera_arm(cam)
            if arm_index is None:
                img, m = top_static.copy(), np.array([[size, 0.0, 0.0], [0.0, size, 0.0]])
            else:
                q = state[arm_index * JOINTS_PER_ARM: arm_index * JOINTS_PER_ARM + N_JOINTS].astype(np.float64)
                m = _wrist_affine(self._station.arms[arm_index], q, size)
                m_hi = np.hstack([m[:, :2] / hi, m[:, 2:]])
                img = cv2.warpAffine(static_hi, m_hi, (size, size), flags=cv2.INTER_LINEAR,
                                     borderMode=cv2.BORDER_REFLECT_101)
            _draw_dynamic(img, m, self._station.arms, state, self._station.layout, obj_xy, obj_angle, False)
            images[cam] = _add_noise(img, rng, cfg.noise)
        return images


def render_observation(cfg: SceneConfig, episode_seed: int, state: np.ndarray, noise_seed: int = 0) -> dict[str, np.ndarray]:
    """One-off :meth:`ObservationRenderer.render` (builds the station each time; keep an
    :class:`ObservationRenderer` for repeated frames)."""
    return ObservationRenderer(cfg, episode_seed).render(state, noise_seed=noise_seed)
