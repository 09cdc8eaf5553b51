"""Meta-World v3 tasks as a headless, multi-camera robot for closed-loop evaluation and demos.

Why this module exists: a speed-up is only worth having if task success survives it, and the
check has to run on a benchmark nobody here wrote. Meta-World gives physics, success flags and a
scripted expert per task. This wrapper turns one task into what our policy sees on a robot:

* camera images, rendered with ``mujoco.Renderer`` **only when asked** (at the policy's call
  points): software rendering dominates the cost on a CPU, so shadows and multisampling are off,
  images are small and rendered at ``render_scale`` times the size then box-averaged (cheap
  anti-aliasing, since multisampling is off);
* a 4-dim robot state from the simulator (hand xyz and gripper opening), the vector a Sawyer
  driver would publish;
* a language instruction per task;
* Meta-World's own 4-dim action (hand xyz delta, gripper effort), in [-1, 1].

Object poses are drawn afresh for every seed (not from the 50 frozen configurations of
``MT1``), and the draw can be restricted to a band of the task's random range, in normalised
coordinates: ``pose_band=(0.0, 0.7)`` keeps to the inner 70 % of every randomised dimension
(e.g. what a reference repository is built from), ``(0.7, 1.0)`` only poses outside that inner
box (held-out variation).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any

# Headless software rendering: EGL through Mesa works here (osmesa is not installed). Must be set
# before mujoco is imported anywhere in the process.
os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

from ..io.bags import BagTopics  # noqa: E402

#: Tasks with large, fixed objects: learnable from small images (see the feasibility probe).
TASK_INSTRUCTIONS: dict[str, str] = {
    "button-press-topdown-v3": "press the button down from the top",
    "drawer-close-v3": "close the drawer",
    "door-open-v3": "open the door",
    "window-open-v3": "slide the window open",
    "handle-press-v3": "press the handle down",
    "faucet-open-v3": "turn the faucet on",
    "drawer-open-v3": "open the drawer",
    "window-close-v3": "slide the window closed",
}
DEFAULT_TASKS: tuple[str, ...] = ("button-press-topdown-v3", "drawer-close-v3", "door-open-v3",
                                  "window-open-v3", "handle-press-v3")
DEFAULT_CAMERAS: tuple[str, ...] = ("corner", "topview")
STATE_DIM = 4
#: Seconds per env step (MuJoCo timestep 2.5 ms x frame_skip 5): the control tick of recordings.
CONTROL_DT = 0.0125
ACTION_DIM = 4
STATE_NAMES: tuple[str, ...] = ("hand_x", "hand_y", "hand_z", "gripper_opening")
ACTION_NAMES: tuple[str, ...] = ("d_hand_x", "d_hand_y", "d_hand_z", "gripper_effort")


def bag_topics(cameras: tuple[str, ...]) -> BagTopics:
    """Topic names of the Meta-World bags (a Sawyer with fixed cameras): what
    ``training.metaworld_demos`` records and ``eval`` builds its references from."""
    return BagTopics(cameras={c: f"/cameras/{c}/image_raw" for c in cameras}, joint_states="/joint_states",
                     instruction="/instruction", outcome="/episode_outcome", joint_names=STATE_NAMES)


@dataclass(frozen=True)
class MetaWorldConfig:
    """One task's harness settings (validated: a wrong name fails here, not mid-episode)."""

    task: str
    cameras: tuple[str, ...] = DEFAULT_CAMERAS
    image_size: int = 64
    render_scale: int = 2
    max_steps: int = 500
    # Normalised band (inner, outer) of each randomised dimension that object poses are drawn
    # from: |u| <= outer on every dimension and |u| > inner on at least one (u in [-1, 1]).
    pose_band: tuple[float, float] = (0.0, 1.0)

    def validate(self) -> "MetaWorldConfig":
        import metaworld

        if self.task not in metaworld.ALL_V3_ENVIRONMENTS:
            raise ValueError(f"unknown Meta-World task {self.task!r}")
        if self.task not in TASK_INSTRUCTIONS:
            raise ValueError(f"task {self.task!r} has no instruction; known: {sorted(TASK_INSTRUCTIONS)}")
        if not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"cameras must be distinct and non-empty, got {self.cameras}")
        if self.image_size < 8 or self.render_scale < 1:
            raise ValueError("image_size must be >= 8 and render_scale >= 1")
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        lo, hi = self.pose_band
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"pose_band must satisfy 0 <= inner < outer <= 1, got {self.pose_band}")
        return self

    @property
    def instruction(self) -> str:
        return TASK_INSTRUCTIONS[self.task]


@dataclass
class StepResult:
    """What one env step reports (no images: those are rendered on request)."""

    state: np.ndarray
    success: bool
    done: bool
    info: dict[str, Any]


def sample_pose_vector(low: np.ndarray, high: np.ndarray, band: tuple[float, float],
                       rng: np.random.Generator) -> np.ndarray:
    """Draw a task's random vector from the normalised band ``(inner, outer]`` of its box.

    Dimensions with no range (fixed coordinates) stay at their value. Rejection sampling for a
    ring (inner > 0) takes a few draws at most for the bands we use.
    """
    low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
    centre, half = (low + high) / 2.0, (high - low) / 2.0
    varying = half > 0
    inner, outer = band
    for _ in range(10_000):
        u = rng.uniform(-outer, outer, size=low.shape)
        if inner == 0.0 or np.abs(u[varying]).max(initial=0.0) > inner:
            return centre + u * half
    raise RuntimeError(f"could not draw a pose in band {band}")


class MetaWorldTask:
    """One Meta-World v3 task with fresh object poses per seed and on-demand camera images."""

    def __init__(self, cfg: MetaWorldConfig):
        import metaworld
        import mujoco

        self.cfg = cfg.validate()
        env = metaworld.ALL_V3_ENVIRONMENTS[cfg.task]()
        env._partially_observable = False   # the scripted expert needs the goal in its observation
        env._freeze_rand_vec = False
        env.seeded_rand_vec = True
        env._set_task_called = True         # we set the pose vector ourselves instead of set_task
        env.max_path_length = max(env.max_path_length, cfg.max_steps)
        if abs(float(env.dt) - CONTROL_DT) > 1e-9:
            raise RuntimeError(f"{cfg.task}: env step is {env.dt} s, recordings assume {CONTROL_DT} s")
        self.env = env
        model = env.model
        model.vis.quality.shadowsize = 0
        model.vis.quality.offsamples = 0
        names = {model.camera(i).name for i in range(model.ncam)}
        missing = [c for c in cfg.cameras if c not in names]
        if missing:
            raise ValueError(f"cameras {missing} not in the scene; it has {sorted(names)}")
        px = cfg.image_size * cfg.render_scale
        self._renderer = mujoco.Renderer(model, px, px)
        self._obs: np.ndarray | None = None
        self.steps = 0
        self.seed: int | None = None
        self.pose: np.ndarray | None = None

    @property
    def instruction(self) -> str:
        return self.cfg.instruction

    def reset(self, seed: int) -> np.ndarray:
        """Start an episode with the object pose of ``seed``; returns the robot state."""
        env = self.env
        env.seed(seed)
        space = env._random_reset_space
        # Pose stream independent of the env's own and different per task for one seed.
        rng = np.random.default_rng([seed, zlib.crc32(self.cfg.task.encode())])
        self.pose = sample_pose_vector(space.low, space.high, self.cfg.pose_band, rng)
        env._last_rand_vec = self.pose
        env._freeze_rand_vec = True          # reset_model reads _last_rand_vec, our draw
        self._obs, _ = env.reset()
        self.steps = 0
        self.seed = seed
        return self.state()

    def state(self) -> np.ndarray:
        """Hand xyz and gripper opening (0 closed .. 1 open), float32 [4]."""
        assert self._obs is not None, "call reset() first"
        return self._obs[:STATE_DIM].astype(np.float32)

    @property
    def full_observation(self) -> np.ndarray:
        """Meta-World's 39-dim observation (objects, goal): for the scripted expert only."""
        assert self._obs is not None, "call reset() first"
        return self._obs

    def step(self, action: np.ndarray) -> StepResult:
        a = np.clip(np.asarray(action, dtype=np.float32).reshape(-1), -1.0, 1.0)
        if a.shape != (ACTION_DIM,):
            raise ValueError(f"action must have {ACTION_DIM} values, got shape {np.shape(action)}")
        self._obs, _, _, truncated, info = self.env.step(a)
        self.steps += 1
        success = bool(info.get("success", 0.0) >= 1.0)
        done = success or truncated or self.steps >= self.cfg.max_steps
        return StepResult(self.state(), success, done, info)

    def render(self) -> dict[str, np.ndarray]:
        """Every configured camera as uint8 RGB [S, S, 3] (box-downsampled from the render size)."""
        out: dict[str, np.ndarray] = {}
        s, k = self.cfg.image_size, self.cfg.render_scale
        for cam in self.cfg.cameras:
            self._renderer.update_scene(self.env.data, camera=cam)
            img = self._renderer.render()
            if k > 1:
                img = img.reshape(s, k, s, k, 3).mean(axis=(1, 3)).round().astype(np.uint8)
            out[cam] = np.ascontiguousarray(img)
        return out

    def close(self) -> None:
        self._renderer.close()
        self.env.close()


def scripted_expert(task: str) -> Any:
    """Meta-World's hand-written policy for ``task`` (sees the full observation)."""
    import warnings

    from metaworld.policies import ENV_POLICY_MAP

    warnings.filterwarnings("ignore", message="Constant\\(s\\) may be too high")
    return ENV_POLICY_MAP[task]()
